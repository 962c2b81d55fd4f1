// tokenmill's CPU kernels as C++ functions (each is also a torch op, registered where it
// is defined), so that one native op can chain them without going back to Python.

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace tokenmill {

// A weight-only quantized weight W [N, K] as the kernels read it: a QuantizedTensor
// (tokenmill/quantization/qtensor.py; its `.packed`, `.format` and `.col_perm`).
struct QuantWeight {
  at::Tensor packed;  // uint8 [tiles, spans, span_bytes]: 4-row tiles of [scales][mins][codes] spans
  int64_t N, K;
  int64_t bits;         // 4 or 8 (codes of 5/6-bit formats are stored in 8)
  int64_t group_size;   // the kernel group: 16, 32 or a multiple of 64 (QuantizedTensor.format)
  int64_t scale_bytes;  // 2: float16 scales/mins, 4: float32
  int64_t code_offset;  // symmetric: w = scale * (u - code_offset); -1: w = scale * u + min, mins stored
  std::optional<at::Tensor> col_perm;  // int64 [K] (GPTQ act-order): y = x[:, col_perm] . W_stored^T
  // The block GEMM's panels of W, unpacked at load (quant_gemm_panels), or none: unpacked per call.
  std::optional<at::Tensor> gemm_panels = std::nullopt;
  // Columns (multiples of 32 and of the group, increasing) where each output's float sum
  // starts again from zero; the parts' sums are added in order at the end: the products of
  // consecutive column parts, as the ranks of a tensor-parallel split and their all-reduce
  // add them (deterministic inference's row-parallel linears, in one call). Empty: none.
  // The block-order kernels only (AVX512-VNNI builds, groups of 32 or more, no col_perm).
  std::vector<int64_t> column_splits = {};

  // format = QuantizedTensor.format = [N, K, bits, group_size, scale_bytes, code_offset]
  static QuantWeight from_format(at::Tensor packed, at::IntArrayRef format, std::optional<at::Tensor> col_perm,
                                 std::optional<at::Tensor> gemm_panels = std::nullopt,
                                 at::IntArrayRef column_splits = {});
};

// cpu_activations.cpp. An uninitialised tensor for a kernel's output; from 1 MiB on its
// buffer comes from a cache that keeps freed buffers' pages resident (glibc maps outputs of
// 32 MiB or more afresh, and writing them faulted in every page at every call).
at::Tensor activation_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// cpu_quant.cpp. y [M, N] = x [M, K] . W^T for any M, x contiguous float32 or bfloat16 (y in
// x's dtype; bf16 x saves the GEMM path two conversions, the integer path takes float32).
// Up to max_integer_rows rows (-1: the measured default, 8 for 4-bit codes, 12 for 8-bit)
// x is quantized to int8 per 32 columns (d = max|x| / 127, llama.cpp's Q8_1) and multiplied
// with integer dot products, W read once per 16 rows; each row's result is then bit for bit
// the same whatever M and the thread count. Beyond, W is dequantized to bf16 in chunks of up
// to 4 MiB for oneDNN's bf16 GEMM. Pass a large max_integer_rows to keep every row count on
// the integer arithmetic (e.g. so that speculative verification computes exactly what
// one-token decoding computes).
// From many_rows rows on (-1: the built-in 16) the integer path runs its many-row kernel
// (activation rows in the vector lanes, AVX512-VNNI builds), which gives every output the
// row kernel's bits; a large many_rows keeps the row kernel (tests compare the two).
// integer_gemm: past max_integer_rows, the whole-block integer GEMM instead of the bf16 GEMM
// (AVX512-VNNI builds, weight groups of 32 or more; other bits than the row kernel's).
at::Tensor quant_linear(const at::Tensor& x, const QuantWeight& w, int64_t max_integer_rows = -1,
                        int64_t many_rows = -1, bool integer_gemm = false);
// W's panels for the block GEMM (integer_gemm), unpacked once: quant_linear reads them instead of
// unpacking W per call. uint8, ~1.25 bytes per weight (groups of 32 with mins). AVX512-VNNI builds.
at::Tensor quant_gemm_panels(const QuantWeight& w);
// W (or its rows `rows`, e.g. embedding lookups) as float32 or bfloat16 [rows, K], in the
// stored column order (col_perm not undone).
at::Tensor quant_dequantize(const QuantWeight& w, at::ScalarType dtype, const std::optional<at::Tensor>& rows = std::nullopt);
// x [M, K] (K % 32 == 0) -> int8 q [M, K] and float32 d [M, K / 32], as quant_linear quantizes.
std::tuple<at::Tensor, at::Tensor> quantize_activations_q8(const at::Tensor& x);
// Which integer dot product this build uses: avx512_vnni, avx_vnni, avx2 or scalar.
const char* quant_isa();

// y = x . W^T with W tiled by tile_for_skinny (cpu_linear.cpp).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t N);
at::Tensor grouped_skinny_linear(const at::Tensor& x, at::IntArrayRef offsets, at::TensorList tiled, int64_t N);
// y = x . W^T with W in panels by pack_panels, the same arithmetic at every row count.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N);
bool panel_linear_built(at::ScalarType dtype);

// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    std::optional<at::ScalarType> out_dtype = std::nullopt);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps,
                        std::optional<at::ScalarType> out_dtype = std::nullopt);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin);

// cpu_attention.cpp
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                            int64_t window = 0);
// K and V rows (float32; head h of token t at k + t * k_strides[0] + h * k_strides[1]) into
// their cache slots: cast, or quantized with a scale per (token, head) for int8/fp8 caches.
void write_kv_rows(const float* k, const float* v, int64_t tokens, const int64_t k_strides[2],
                   const int64_t v_strides[2], at::Tensor& k_cache, at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                   const c10::optional<at::Tensor>& v_scale, const int64_t* slots);
// cpu_prefill_attention.cpp. A bf16 KV cache in LayerKVCache's packed layout (kv_cache.py):
// K [blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2], V [blocks, kv_heads, block_size / 2,
// head_dim, 2]; packed_cache_shape checks the two tensors and reads their shape.
struct PackedCacheShape {
  int64_t blocks, kv_heads, block_size, d;
};
PackedCacheShape packed_cache_shape(const at::Tensor& k, const at::Tensor& v);
// Decode rows (q [decodes, heads, d], float32 or bf16; out alike) over a packed cache, each with
// the bits the prefill kernel gives the same token as the last row of a prompt chunk.
void packed_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
// x <- x H for `rows` rows of `dim` floats, H block-diagonal orthonormal Sylvester-Hadamard.
void hadamard_rows_(float* x, int64_t rows, int64_t row_stride, int64_t dim, int64_t block);

}  // namespace tokenmill
