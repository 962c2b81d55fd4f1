"""tokenmill: an LLM inference engine and OpenAI-compatible server.

Names are imported lazily so that torch-free parts (the engine's scheduler and
block manager) can be imported without loading torch.
"""

import os
from typing import TYPE_CHECKING

# OpenMP workers wait for each other at the end of every parallel region: spinning (GNU
# OpenMP's default: 300,000 spins, ~0.1-1 ms) keeps a decode step fast when the cores are
# ours, but a worker spinning for a descheduled peer holds its core against the peer. A
# shorter spin (then a sleep) lets the peer run there; 30,000 spins measured as fast as the
# default uncontended (batch-1 decode within noise; 3,000 cost 18%). It must be set before
# torch loads libgomp, so it is set here (a value you set yourself wins). The compute
# thread count follows the free cores too (tokenmill/runner/threads.py).
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput"]

if TYPE_CHECKING:
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling.params import SamplingParams
    from tokenmill.sampling.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.sampling.params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from tokenmill.sampling.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "PoolingParams":
        from tokenmill.pooling_params import PoolingParams

        return PoolingParams
    if name in ("RequestOutput", "CompletionOutput", "EmbeddingRequestOutput"):
        from tokenmill import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
