"""Decode speed with and without a JSON-schema constraint, at batch 1 or N (offline engine).

Not part of CI. Both runs generate exactly the same number of tokens after the same
prompt: the unconstrained one ignores EOS, the constrained one is held to a schema that
needs many tokens (an array of at least `--tokens` small integers, so the grammar itself
keeps it going and its mask is live at every step). Decode tokens/s is taken from the
engine's own first/last token times (prefill excluded); runs alternate so drift in the
machine's load hits both alike; medians reported.

    .venv/bin/python benchmarks/structured_output.py --tokens 128 --repeats 5 [--batch 32] \
        [--structured-outputs-backend guidance]
"""

from __future__ import annotations

import argparse
import statistics

from tokenmill import LLM, SamplingParams, StructuredOutputsParams


def decode_rate(llm: LLM, prompt: list[int], params: SamplingParams, batch: int = 1) -> tuple[float, int]:
    """Output tokens per second from the batch's first first-token to its last token (the
    decode phase: prefill excluded), and the tokens of one sequence."""
    outputs = llm.generate([prompt] * batch, params)
    start = min(o.metrics.first_token_time for o in outputs)
    end = max(o.metrics.last_token_time for o in outputs)
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    return (sum(tokens) - batch) / (end - start), tokens[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (the same prompt each)")
    parser.add_argument("--structured-outputs-backend", default="auto", choices=["auto", "xgrammar", "guidance"])
    args = parser.parse_args()
    settings = {"num_threads": args.num_threads} if args.num_threads else {}
    llm = LLM(max_model_len=2048, kv_cache_memory="256MiB", structured_outputs_backend=args.structured_outputs_backend,
              **settings)
    prompt = llm.encode_chat([{"role": "user", "content": "List many small numbers as a JSON array."}])
    # Each item is at least 2 tokens ("7", ","): an array of tokens/2 items fills the run.
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": args.tokens // 2, "maxItems": args.tokens // 2}
    free = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.tokens + 8, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    decode_rate(llm, prompt, free, args.batch), decode_rate(llm, prompt, constrained, args.batch)  # warm-up, compile
    rates: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    lengths: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, params in (("unconstrained", free), ("json schema", constrained)):
            rate, tokens = decode_rate(llm, prompt, params, args.batch)
            rates[name].append(rate)
            lengths[name] = tokens
    base = statistics.median(rates["unconstrained"])
    print(f"batch {args.batch}, {llm.engine.facts.num_threads} threads, {args.structured_outputs_backend}, "
          f"median of {args.repeats}")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:>14}: {median:6.1f} tok/s decode ({lengths[name]} tokens; runs {', '.join(f'{v:.1f}' for v in values)})"
              f"  {median / base:.1%} of unconstrained")


if __name__ == "__main__":
    main()
