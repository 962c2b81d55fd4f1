"""Perplexity of the same GGUF on the same tokens: tokenmill against llama.cpp.

The text is tokenized once (tokenmill's tokenizer, the GGUF's own vocabulary) and cut into
the windows of `tokenmill eval perplexity` (`tokenmill.eval.perplexity.sliding_windows`);
llama.cpp (llama-cpp-python, `logits_all=True`, in the peers venv that
`benchmarks/compare.py install` makes) evaluates every window from an empty cache and scores
the same tokens. tokenmill's figure comes from its engine on the same token ids (prompt
logprobs through the paged path). Not part of CI.

    .venv/bin/python benchmarks/perplexity_llamacpp.py --output ppl.json
    .venv/bin/python benchmarks/perplexity_llamacpp.py --tokenmill-args "--dtype float32"
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.hardware import cpu_info

DEFAULT_PEERS_DIR = Path.home() / ".cache" / "tokenmill" / "peers"

# Runs in llama.cpp's venv: reads {"model", "threads", "context_len", "tokens", "windows"},
# prints the NLL of every scored token, in text order, as JSON.
LLAMACPP_WORKER = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["model"], n_ctx=job["context_len"], n_batch=job["context_len"],
            n_ubatch=job["context_len"], logits_all=True, n_threads=job["threads"],
            n_threads_batch=job["threads"], verbose=False)
tokens, nlls = job["tokens"], []
for start, end, num_scored in job["windows"]:
    llm.reset()
    llm.eval(tokens[start:end])
    logits = np.asarray(llm.scores[: end - start], dtype=np.float64)
    for p in range(end - start - num_scored, end - start):
        row = logits[p - 1]  # position p-1 predicts token p
        top = row.max()
        nlls.append(float(top + np.log(np.exp(row - top).sum()) - row[tokens[start + p]]))
    print(f"{len(nlls)} tokens", file=sys.stderr, flush=True)
json.dump(nlls, sys.stdout)
"""


def llamacpp_nlls(model: str, tokens: list[int], windows, context_len: int, threads: int, python: str) -> list[float]:
    job = {"model": model, "threads": threads, "context_len": context_len, "tokens": tokens,
           "windows": [(w.start, w.end, w.num_scored) for w in windows]}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, worker_path = Path(tmp) / "job.json", Path(tmp) / "worker.py"
        job_path.write_text(json.dumps(job))
        worker_path.write_text(LLAMACPP_WORKER)
        done = subprocess.run([python, str(worker_path), str(job_path)], check=True, stdout=subprocess.PIPE)
    return json.loads(done.stdout)


def tokenmill_nlls(model: str, tokens: list[int], windows, context_len: int, threads: int,
                   extra_args: list[str]) -> tuple[list[float], dict]:
    from tokenmill.config import add_engine_args, config_from_args
    from tokenmill.eval.perplexity import token_nlls
    from tokenmill.llm import LLM

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", model, "--num-threads", str(threads), "--max-model-len",
                              str(context_len + 1), *extra_args])
    llm = LLM(**config_from_args(args).flat())
    facts = llm.engine.facts
    return token_nlls(llm, tokens, windows), {"weight_format": facts.weight_format,
                                              "kv_cache_dtype": facts.kv_cache_dtype}


def main() -> int:
    from tokenmill.eval.perplexity import default_text_path, sliding_windows
    from tokenmill.config import default_model_path
    from tokenmill.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model's Q4_1 file)")
    parser.add_argument("--text", default=None, help="UTF-8 text (default: the shipped text)")
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokenmill-args", default="", help="extra engine flags, e.g. '--dtype float32'")
    parser.add_argument("--peers-dir", default=str(DEFAULT_PEERS_DIR))
    parser.add_argument("--output", default=None, help="write the result as JSON")
    args = parser.parse_args()

    model = args.model or default_model_path()
    text = Path(args.text or default_text_path()).read_text(encoding="utf-8")
    tokens = Tokenizer.from_gguf(model).encode(text, add_special_tokens=False)[: args.max_tokens]
    windows = sliding_windows(len(tokens), args.context_len, args.stride)
    print(f"{len(tokens):,} tokens, {len(windows)} windows of {args.context_len} every {args.stride}", file=sys.stderr)

    python = str(Path(args.peers_dir) / "llamacpp" / "bin" / "python")
    ours, facts = tokenmill_nlls(model, tokens, windows, args.context_len, args.threads,
                                 shlex.split(args.tokenmill_args))
    theirs = llamacpp_nlls(model, tokens, windows, args.context_len, args.threads, python)
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    ppl = {name: math.exp(math.fsum(n) / len(n)) for name, n in (("tokenmill", ours), ("llama.cpp", theirs))}
    cpu = cpu_info()
    result = {"model": model, "tokens_scored": len(ours), "context_len": args.context_len, "stride": args.stride,
              "perplexity": ppl, "ratio": ppl["tokenmill"] / ppl["llama.cpp"], "tokenmill": facts,
              "tokenmill_args": args.tokenmill_args, "cpu": cpu.model_name, "cpu_flags": cpu.simd_flags}
    print(f"| system | weights | perplexity |\n|---|---|---|\n"
          f"| tokenmill | {facts['weight_format']} | {ppl['tokenmill']:.4f} |\n"
          f"| llama.cpp | as stored | {ppl['llama.cpp']:.4f} |\n"
          f"tokenmill / llama.cpp = {result['ratio']:.5f} over {len(ours):,} tokens")
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
