"""Weight formats: how a linear layer's weight is stored, loaded and multiplied.

Every format is a `WeightFormat` (chosen once for a model at load) that turns a
checkpoint weight into `LinearWeights` (what a `Linear` layer delegates its matmul to):
dense float weights laid out for the CPU's kernels today; GGUF blocks as stored,
INT8/INT4 and GPTQ/AWQ beside them as peers.
"""

from tokenmill.quantization.base import LinearWeights, WeightFormat
from tokenmill.quantization.dense import CPUDenseWeights, DenseFormat, PlainWeights

__all__ = ["LinearWeights", "WeightFormat", "DenseFormat", "CPUDenseWeights", "PlainWeights"]
