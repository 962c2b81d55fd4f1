// tokenmill's CPU kernels as C++ functions (each is also a torch op, registered where it
// is defined), so that one native op can chain them without going back to Python.

#pragma once

#include <ATen/ATen.h>

namespace tokenmill {

// y = x . W^T with W tiled by tile_for_skinny (cpu_linear.cpp).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t N);

// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

// cpu_attention.cpp
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

}  // namespace tokenmill
