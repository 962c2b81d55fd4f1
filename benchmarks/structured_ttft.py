"""First-token latency with a new (never compiled) JSON schema vs without one, through a
running `tokenmill serve` and the official openai client (streamed: time to the first
content chunk). Not part of CI.

Each round sends, in turn: no constraint; a new small schema (an object of integers);
a new schema with length-bounded strings (`maxLength`, what pydantic's `Field(max_length=)`
gives, the costliest common shape to compile); and the first of those again (cached).
"New" means a property name never sent before, so the server's grammar cache misses.
Also reported: each backend's compile time of each shape on the server's own tokenizer
(the same schemas compiled offline), and the tokenizer set-up the server pays once at
start-up.

    tokenmill serve --port 8011 [--structured-outputs-backend guidance] &
    .venv/bin/python benchmarks/structured_ttft.py --url http://127.0.0.1:8011/v1 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from openai import OpenAI



def small_schema() -> dict:
    key = f"n{uuid.uuid4().hex[:8]}"
    return {"type": "object", "properties": {key: {"type": "integer"}, "count": {"type": "integer"}},
            "required": [key, "count"], "additionalProperties": False}


def bounded_strings_schema() -> dict:
    key = f"s{uuid.uuid4().hex[:8]}"
    return {"type": "object", "properties": {key: {"type": "string", "minLength": 1, "maxLength": 24},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 130}},
            "required": [key, "age"], "additionalProperties": False}


def first_token_seconds(client: OpenAI, model: str, schema: dict | None) -> float:
    kwargs = {}
    if schema is not None:
        kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    start = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a person."}],
                                            max_tokens=4, temperature=0, stream=True, **kwargs)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
    return first if first is not None else float("nan")


def compile_times(rounds: int, backend: str) -> dict[str, list[float]]:
    """A backend's compile time of each shape on the default model's tokenizer (offline)."""
    from tokenmill import StructuredOutputsParams
    from tokenmill.config import default_model_path
    from tokenmill.structured_output.compiler import GrammarCompiler
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(default_model_path())
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, backend)
    times = {"tokenizer set-up (once, at start-up)": [time.perf_counter() - start], "small schema": [],
             "bounded strings": []}
    for _ in range(rounds):
        for name, make in (("small schema", small_schema), ("bounded strings", bounded_strings_schema)):
            start = time.perf_counter()
            compiler.compile(StructuredOutputsParams(json=make()))
            times[name].append(time.perf_counter() - start)
    return times


def _summary(values: list[float]) -> str:
    ms = sorted(1000 * v for v in values)
    return f"median {statistics.median(ms):7.1f} ms (min {ms[0]:.1f}, max {ms[-1]:.1f}, n={len(ms)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="skip the offline compile-time table")
    args = parser.parse_args()
    if not args.no_compile:
        for backend in ("xgrammar", "guidance"):
            print(f"{backend} compile time on the default model's tokenizer (offline, 1 thread):")
            for name, values in compile_times(args.rounds, backend).items():
                print(f"  {name:>36}: {_summary(values)}")
    client = OpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    first_token_seconds(client, model, None)  # warm-up
    cached = small_schema()
    first_token_seconds(client, model, cached)
    ttft: dict[str, list[float]] = {"no schema": [], "new small schema": [], "new bounded-strings schema": [],
                                    "cached schema": []}
    for _ in range(args.rounds):  # interleaved, so drift in the machine's load hits each alike
        ttft["no schema"].append(first_token_seconds(client, model, None))
        ttft["new small schema"].append(first_token_seconds(client, model, small_schema()))
        ttft["new bounded-strings schema"].append(first_token_seconds(client, model, bounded_strings_schema()))
        ttft["cached schema"].append(first_token_seconds(client, model, cached))
    base = statistics.median(ttft["no schema"])
    print("time to first token through the server (streamed):")
    for name, values in ttft.items():
        print(f"  {name:>36}: {_summary(values)}  {statistics.median(values) / base:.2f}x of no schema")


if __name__ == "__main__":
    main()
