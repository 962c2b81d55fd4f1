"""Sampling: request-level parameters (torch-free) and the batched sampler (torch).

Only `SamplingParams` is imported here so that the torch-free engine can use it;
import the sampler from `tokenmill.sampling.sampler`.
"""

from tokenmill.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
