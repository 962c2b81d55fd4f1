"""The workload library: what a load is and how it is measured, shared by the front doors
`bench/` and `simulator/` (peers: neither imports the other) and by `benchmarks/`.

- `datasets`, `grounded`: prompts (random, shared-prefix, JSONL, input-grounded);
- `offline`: the offline workloads W1-W6 and their per-run records;
- `metrics`: arrival processes and the serving metrics, computed as `vllm bench serve` does;
- `load_client`: the HTTP load client of `bench serve` and its result (table, JSON);
- `sweep`: a series of offered loads; `plots`, `report`: figures and tables;
- `trace`: requests with send times, to replay (synthetic, a recorded result, JSONL);
- `local_server`: `tokenmill serve` as a subprocess to measure;
- `args`: the command-line flags of a workload (dataset, load, report) and their types.

May import: the ground floor (`tokenizer`, `hardware`, `config`, `outputs`), `engine/`, and
`model.loader` inside a function (the default model's path for `--tokenizer default`);
never `bench/`, `simulator/`, `serve/`, `llm.py` or `builder.py` (the local server is a
subprocess, not an import; whoever needs an engine makes it and passes it in).
"""
