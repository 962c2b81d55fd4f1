"""The core, torch-free: the input processor (the one admission path: tokenize, render
chat, check lengths and limits, make the requests, for the server and `LLM` alike),
requests, the KV block manager (paged, prefix caching), the scheduler, the step loop, the
detokenizer and the output processor, and the step contract (`batch.py`) that crosses to
the runner as plain data.

May import: the ground floor only (`sampling.params`, `config`, `tokenizer`,
`chat_template`, `outputs`, `gguf_file`, `hardware`). Never torch or numpy-heavy rooms:
the simulator runs this code on a cost model (the import-rule test enforces it).
"""
