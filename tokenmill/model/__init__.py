"""Model definitions (the Llama family's layers and model) and checkpoint loading (GGUF,
safetensors). The model knows no requests: `model(input_ids, positions)` with attention
metadata handed down by the runner.

May import: `attention/`, `quantization/`, `parallel/`, `kernels/` and the ground floor.
"""
