"""Worker: Hugging Face transformers' `generate`, through `tokenmill.bench.hf_baseline.HFBaseline`.

Runs in the project's environment, on the default GGUF dequantized to float32. Padded
batches of `options["batch_size"]` requests (the coordinator sends Sizes.hf_batch_size
for W3 and the whole batch for W4, as `tokenmill bench offline --baseline hf` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

from protocol import Request, claim_stdout, log, serve

NAME = "hf"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-caching", choices=["on", "off"], default="off", help="ignored: no prefix cache")
    args = parser.parse_args()
    channel = claim_stdout()

    import torch

    torch.set_num_threads(args.threads)
    from tokenmill.bench.hf_baseline import HFBaseline
    from tokenmill.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    log(NAME, f"loading {path} ({args.dtype}, {args.threads} threads)")
    t0 = time.perf_counter()
    baseline = HFBaseline(path, args.dtype)
    info = {**baseline.describe(), "load_s": time.perf_counter() - t0, "dtype": args.dtype,
            "threads": torch.get_num_threads()}

    def run(workload: str, requests: list[Request], options: dict[str, Any]) -> dict[str, Any]:
        batch_size = int(options.get("batch_size") or len(requests))
        return dataclasses.asdict(baseline.run(requests, batch_size=batch_size))

    return serve(channel, NAME, info, run)


if __name__ == "__main__":
    sys.exit(main())
