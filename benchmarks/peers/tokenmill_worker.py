"""Worker: tokenmill's offline `LLM`, through `tokenmill.bench.offline.TokenmillSystem`.

Runs in the project's environment. See `protocol.py` for the JSON-lines exchange.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from protocol import Request, claim_stdout, log, serve

NAME = "tokenmill"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-caching", choices=["on", "off"], required=True)
    args = parser.parse_args()
    channel = claim_stdout()

    from tokenmill.bench.offline import TokenmillSystem
    from tokenmill.llm import LLM

    import tokenmill

    log(NAME, f"loading (dtype {args.dtype}, {args.threads} threads, prefix caching {args.prefix_caching}) "
              f"from {Path(tokenmill.__file__).parent.parent}")
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads,
              enable_prefix_caching=args.prefix_caching == "on")
    system = TokenmillSystem(llm)
    info = {
        "load_s": time.perf_counter() - t0,
        "dtype": llm.engine.facts.compute_dtype,
        "weight_dtype": llm.engine.facts.weight_format,
        "requested_dtype": args.dtype,
        "threads": args.threads,
        "prefix_caching": args.prefix_caching == "on",
        "model": llm.engine.model_name,
    }

    def run(workload: str, requests: list[Request], options: dict[str, Any]) -> dict[str, Any]:
        return dataclasses.asdict(system.run(requests))

    return serve(channel, NAME, info, run)


if __name__ == "__main__":
    sys.exit(main())
