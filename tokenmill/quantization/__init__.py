"""Weight quantization: one representation (`QuantizedTensor`, qtensor.py) for every
weight-only format, and converters into it (gguf_blocks.py, rtn.py, checkpoints.py)."""
