"""Speculative decoding: cheap proposals, verified by the target model in one step.

- `proposer.py` (torch-free): the interface the engine calls after every step, with the
  running requests that may be verified next; a proposer sets `Request.spec_token_ids`.
- `ngram.py` (numpy): prompt lookup, vLLM's n-gram proposer.
- `draft.py` (torch): a second, smaller model run by the same `ModelRunner` code over its
  own paged KV cache, which follows its requests' lifetimes.

This room holds proposers only; the verifier (greedy and lossless rejection sampling) is
`sampling/rejection.py`, as vLLM keeps its rejection sampler with sampling. It may import
engine (the `Proposer` seam), runner, model and sampling; nothing above (builder, serve).
The engine never imports this package's torch modules: the builder builds a proposer
and hands it to the engine.
"""
