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
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
// K and V rows (float32; head h of token t at k + t * k_strides[0] + h * k_strides[1]) into
// their cache slots: cast, or quantized with a scale per (token, head) for int8/fp8 caches.
void write_kv_rows(const float* k, const float* v, int64_t tokens, const int64_t k_strides[2],
                   const int64_t v_strides[2], at::Tensor& k_cache, at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                   const c10::optional<at::Tensor>& v_scale, const int64_t* slots);
// x <- x H for `rows` rows of `dim` floats, H block-diagonal orthonormal Sylvester-Hadamard.
void hadamard_rows_(float* x, int64_t rows, int64_t row_stride, int64_t dim, int64_t block);

}  // namespace tokenmill
