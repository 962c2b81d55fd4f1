"""Weight formats: how a linear layer's weight is stored, loaded and multiplied.

Every format is a `WeightFormat` (chosen once for a model at load) that turns a
checkpoint weight into `LinearWeights` (what a `Linear` layer delegates its matmul to):
dense float weights laid out for the CPU's kernels today; GGUF blocks as stored,
INT8/INT4 and GPTQ/AWQ beside them as peers.

The quantized ones share one representation, `QuantizedTensor` (qtensor.py: codes, scales
and mins in the stream the native kernels read), built by the converters gguf_blocks.py
(GGUF blocks as stored), rtn.py (int8/int4 from float weights) and checkpoints.py (GPTQ,
AWQ); reference.py holds the kernels' PyTorch references.
"""

from tokenmill.quantization.base import LinearWeights, WeightFormat
from tokenmill.quantization.column_parts import ColumnParts, split_in_columns
from tokenmill.quantization.dense import CPUDenseWeights, DenseFormat, PlainWeights
from tokenmill.quantization.qtensor import QuantizedTensor

__all__ = ["CPUDenseWeights", "ColumnParts", "DenseFormat", "LinearWeights", "PlainWeights", "QuantizedTensor", "WeightFormat",
           "split_in_columns"]
