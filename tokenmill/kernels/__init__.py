"""Native CPU kernels, compiled on this machine with `torch.utils.cpp_extension`.

The sources live in `csrc/`. `make setup` builds them once (`python -m tokenmill.kernels`)
into torch's extension cache (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions),
so an engine start only loads the built library. They are compiled with
`-march=native`: the cache is per machine, and a build for this CPU's vector units is
the point.

Every kernel has a pure-PyTorch fallback that the tests compare it against; the engine
uses the fallback when the build fails (no compiler) or when `TOKENMILL_KERNELS=0`.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("cpu_attention.cpp", "cpu_linear.cpp")]
SKINNY_MAX_ROWS = 16  # skinny_linear's limit; beyond it BLAS does better
_NAME = "tokenmill_cpu_kernels"


def kernels_enabled() -> bool:
    return os.environ.get("TOKENMILL_KERNELS", "1") not in ("0", "false", "no")


@functools.cache
def cpu_kernels_available() -> bool:
    """Builds (first time) or loads the CPU kernels; False, with a warning, if that fails."""
    if not kernels_enabled():
        return False
    try:
        build_cpu_kernels()
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("native CPU kernels unavailable, using the PyTorch fallback: %s", exc)
        return False
    return True


def build_cpu_kernels(verbose: bool = False) -> None:
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    load(
        name=_NAME,
        sources=[str(s) for s in _SOURCES],
        # -fopenmp: at::parallel_for is OpenMP in the header, so without it the kernels run
        # on one thread. The libgomp.so.1 they need is the one torch already loaded.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
        extra_include_paths=[str(_CSRC)],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=verbose,
    )
    assert hasattr(torch.ops.tokenmill, "paged_decode_attention") and hasattr(torch.ops.tokenmill, "skinny_linear")
    logger.info("native CPU kernels ready in %.1f s", time.perf_counter() - start)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> None:
    """out[s] = softmax(q[s] K_s^T * scale) V_s over sequence s's first context_lens[s]
    cached tokens, read through its block table (int32 [num_seqs, max_blocks])."""
    torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M <= 16, K] float32 (contiguous) @ weight[N, K]^T, weight float32 or bfloat16."""
    return torch.ops.tokenmill.skinny_linear(x, weight)
