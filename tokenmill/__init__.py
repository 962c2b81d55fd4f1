"""tokenmill: an LLM inference engine and OpenAI-compatible server.

Names are imported lazily so that torch-free parts (the engine's scheduler and
block manager) can be imported without loading torch.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from tokenmill.llm import LLM
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling.params import SamplingParams


def __getattr__(name: str):
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.sampling.params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from tokenmill import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
