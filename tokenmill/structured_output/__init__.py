"""Structured output: constrain what a request may generate to a JSON schema, a regex, a
choice of strings or a grammar.

The room's parts:
- `backends.py`: the grammar libraries, xgrammar and llguidance (vLLM's `guidance`),
  behind one interface (compile a constraint; a compiled grammar makes matchers).
- `compiler.py`: `--structured-outputs-backend`'s choice. A `GrammarCompiler` per tokenizer turns a
  request's `StructuredOutputsParams` into a compiled grammar, once per constraint text (an
  LRU cache), with errors as `StructuredOutputError` naming what is wrong. The server
  compiles a request's constraint before admission, off the engine thread and bounded in
  time (`compile_with_timeout`), so the engine only ever finds it in the cache.
- `manager.py`: the model runner's side. One matcher per sequence, advanced on every
  accepted token (rolled back over rejected proposals, rebuilt by replaying the output
  after a preemption); the next token's bitmask is filled on a helper thread while the
  forward pass runs, and applied to the logits before sampling.

The constraint itself (`tokenmill.sampling.structured_outputs.StructuredOutputsParams`)
is plain data in `SamplingParams`; the scheduler never sees a tensor or a matcher.
"""

from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.structured_output.compiler import (
    BACKENDS,
    GrammarCompiler,
    StructuredOutputError,
    compiler_for,
)

__all__ = ["BACKENDS", "GrammarCompiler", "StructuredOutputError", "StructuredOutputsParams", "compiler_for"]
