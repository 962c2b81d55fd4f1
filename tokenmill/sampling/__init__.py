"""Sampling: request-level parameters (torch-free), the batched sampler (torch) and the
verifier of speculative proposals (`rejection.py`, torch: greedy longest agreeing prefix and
the lossless rejection rule for sampled requests; called by the runner's step).

A ground-floor room: it imports nothing from tokenmill but itself.

Only `SamplingParams` is imported here so that the torch-free engine can use it;
import the sampler from `tokenmill.sampling.sampler`.
"""

from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
