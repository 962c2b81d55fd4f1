"""Attention backends (peers behind `backend.py`: PyTorch SDPA, paged SDPA, the native CPU
decode kernel) and the paged KV cache with its formats (`kv_cache.py`, 8-bit scales and
rotation in `kv_quant.py`).

May import: `kernels/`, `parallel/` and the ground floor. Knows no requests and no model.
"""
