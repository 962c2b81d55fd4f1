// One Llama decoder layer for a batch of decode tokens, as one op.
//
// Why: with the weights streamed at memory speed, a batch-1 decode step of the default
// model spent about as long again in Python and op dispatch as in arithmetic: a layer is
// a dozen ops on 576-wide rows plus ten module calls, thirty layers a step. This op runs
// the same kernels in the same order (the Python layer path stays the reference), from
// C++: norm (+ residual add), QKV, rotary, KV-cache write, paged attention, O, norm
// (+ residual add), gate/up, SiLU-and-mul, down.
//
// Decode only (one query token per sequence), float32 activations, no biases. The KV
// cache is float32, bfloat16 or float16, or int8/fp8 with its scales (then K and V may be
// stored Hadamard-rotated: kv_rotation is the block, and Q and the attention output are
// rotated to match). Each of the four weights is either tiled for skinny_linear or in
// panels for panel_linear (float32 or bfloat16; its format row starts with N and has bits
// 0; the two told apart by shape) or a weight-only quantized
// QuantizedTensor for quant_linear (its `.format` row, and its act-order permutation).
// Quantized weights run quant_linear with the plan's `integer_rows` (one per weight; empty: the
// op's default) and `integer_gemm`, as the op-by-op path runs them, so a step of any row count
// gets the same kernels (and bits) either way: with the whole-block integer GEMM the plan runs
// decode steps of any size here (runner/plan.py), not only those of the integer kernel's rows.
// `gemm_panels` (empty, or one per weight, None where absent): a quantized weight's panels for
// the integer GEMM unpacked at load (quant_gemm_panels), which quant_linear reads instead of
// unpacking the weight per call.
// `parts` (empty: one weight each) gives how many weights each of the four linears has:
// a linear of several is the sum, in order, of each part times its own consecutive input
// columns (deterministic inference's row-parallel linears, as a 2-rank tensor-parallel
// split computes and all-reduces them: tokenmill/parallel/model_parallel.py).
// `column_splits` (empty: none) the same sum in one quantized weight, where the block-order
// kernels run (QuantWeight::column_splits): per weight a count, then its columns.

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>


#include "cpu_kernels.h"

namespace tokenmill {

namespace {

constexpr int64_t kFormatLen = 6;  // QuantizedTensor.format: N, K, bits, group, scale bytes, offset

// x . W^T for one of the layer's weights, by its kind (see the header comment).
// `max_integer_rows` / `integer_gemm`: quant_linear's (-1 / false: its built-in switch,
// what the fused layer runs).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef format,
                  const std::optional<at::Tensor>& perm, int64_t max_integer_rows = -1, bool integer_gemm = false,
                  const std::optional<at::Tensor>& gemm_panels = std::nullopt, at::IntArrayRef column_splits = {}) {
  if (format[2] == 0) {  // dense: panels [P, K, 64] / [P, K/2, 64, 2], or skinny tiles [T, K/16, 4, 16]
    TORCH_CHECK(column_splits.empty(), "column_splits are for quantized weights (the block-order kernels)");
    return weight.size(2) == 64 ? panel_linear(x, weight, format[0]) : skinny_linear(x, weight, format[0]);
  }
  return quant_linear(x, QuantWeight::from_format(weight, format, perm, gemm_panels, column_splits), max_integer_rows,
                      -1, integer_gemm);
}

// Each weight's column splits out of the op's `column_splits` (per weight: a count, then that
// many columns; empty: none for any).
std::vector<at::IntArrayRef> splits_per_weight(at::IntArrayRef column_splits, int64_t weights) {
  std::vector<at::IntArrayRef> out(weights);
  int64_t at = 0;
  for (int64_t w = 0; w < weights && !column_splits.empty(); ++w) {
    TORCH_CHECK(at < static_cast<int64_t>(column_splits.size()) && column_splits[at] >= 0 &&
                    at + 1 + column_splits[at] <= static_cast<int64_t>(column_splits.size()),
                "column_splits: per weight a count, then that many columns");
    out[w] = column_splits.slice(at + 1, column_splits[at]);
    at += 1 + column_splits[at];
  }
  TORCH_CHECK(at == static_cast<int64_t>(column_splits.size()), "column_splits: entries past the last weight's");
  return out;
}

// Entry i of a per-weight list of optional tensors that may be empty (none given).
std::optional<at::Tensor> entry(const c10::List<std::optional<at::Tensor>>& list, int64_t i) {
  return list.empty() ? std::nullopt : list.get(i);
}

// x . W^T for a weight in consecutive column parts (`weights[i]` with format row i and
// permutation i): each part times its own input columns, the products added in order, as
// the ranks of a tensor-parallel split and their all-reduce add them.
at::Tensor linear_parts(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                        const c10::List<std::optional<at::Tensor>>& perms, int64_t max_integer_rows = -1,
                        bool integer_gemm = false,
                        const c10::List<std::optional<at::Tensor>>& gemm_panels = c10::List<std::optional<at::Tensor>>()) {
  const int64_t parts = static_cast<int64_t>(weights.size());
  if (parts == 1)
    return linear(x, weights[0], formats.slice(0, kFormatLen), perms.get(0), max_integer_rows, integer_gemm,
                  entry(gemm_panels, 0));
  at::Tensor y;
  int64_t col = 0;
  for (int64_t w = 0; w < parts; ++w) {
    const at::IntArrayRef format = formats.slice(w * kFormatLen, kFormatLen);
    const int64_t k = format[1];
    TORCH_CHECK(k > 0 && col + k <= x.size(1), "a column part's K does not fit the input");
    at::Tensor product =
        linear(x.narrow(1, col, k).contiguous(), weights[w], format, perms.get(w), max_integer_rows, integer_gemm,
               entry(gemm_panels, w));
    y = y.defined() ? at::add(y, product) : product;  // in order, as the all-reduce adds the ranks' products
    col += k;
  }
  TORCH_CHECK(col == x.size(1), "the column parts do not cover the input");
  return y;
}

}  // namespace

// One linear in column parts (ColumnParts.apply on the native kernels): float32 x [M, K].
at::Tensor column_parts_linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef formats,
                               const c10::List<std::optional<at::Tensor>>& perms,
                               const c10::List<std::optional<at::Tensor>>& gemm_panels, int64_t max_integer_rows,
                               bool integer_gemm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(!weights.empty() && formats.size() == weights.size() * kFormatLen && perms.size() == weights.size(),
              "a format row of 6 and a permutation (or None) per part");
  TORCH_CHECK(gemm_panels.empty() || gemm_panels.size() == weights.size(), "gemm_panels: empty or one (or None) per part");
  return linear_parts(x, weights, formats, perms, max_integer_rows, integer_gemm, gemm_panels);
}

// As DecoderLayer.forward: h (the previous layer's MLP output) is added into `residual`
// (updated in place, twice: + h, then + attention output), and the layer's MLP output is
// returned, to be added by the next layer's norm. The first layer passes zeros as h and
// the embeddings as the residual.
at::Tensor llama_decode_layer(
    const at::Tensor& h, at::Tensor residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, at::TensorList weights, at::IntArrayRef formats,
    const c10::List<std::optional<at::Tensor>>& perms, const c10::List<std::optional<at::Tensor>>& gemm_panels,
    const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double scale, const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
    int64_t kv_rotation, at::IntArrayRef parts, at::IntArrayRef integer_rows, bool integer_gemm,
    at::IntArrayRef column_splits) {
  const int64_t tokens = h.size(0), hidden = h.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  if (k_cache.dim() == 6) {  // a packed bf16 cache (kv_cache.py)
    const PackedCacheShape shape = packed_cache_shape(k_cache, v_cache);
    TORCH_CHECK(shape.kv_heads * shape.d == kv_size, "the packed KV cache's heads do not match the layer's");
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type() &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) * k_cache.size(3) == kv_size,
                "k/v cache: contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == tokens,
              "slots: int64, one per token");
  TORCH_CHECK(parts.empty() || parts.size() == 4, "parts: empty or one count per linear");
  int64_t first[5] = {0, 1, 2, 3, 4};  // each linear's first weight
  for (int64_t i = 0; i < 4 && !parts.empty(); ++i) {
    TORCH_CHECK(parts[i] >= 1, "every linear has at least one part");
    first[i + 1] = first[i] + parts[i];
  }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == first[4] && static_cast<int64_t>(formats.size()) == first[4] * kFormatLen &&
                  static_cast<int64_t>(perms.size()) == first[4],
              "four linears (qkv, o, gate_up, down) of `parts` weights each, a format row of 6 and a permutation (or None) "
              "per weight");
  TORCH_CHECK(integer_rows.empty() || static_cast<int64_t>(integer_rows.size()) == first[4],
              "integer_rows: empty or one per weight");
  TORCH_CHECK(gemm_panels.empty() || static_cast<int64_t>(gemm_panels.size()) == first[4],
              "gemm_panels: empty or one (or None) per weight");
  const std::vector<at::IntArrayRef> splits = splits_per_weight(column_splits, first[4]);
  auto apply = [&](int64_t i, const at::Tensor& x) {
    // The plan's integer rows of the linear's weights (its parts share them); -1: quant_linear's default.
    const int64_t rows = integer_rows.empty() ? -1 : integer_rows[first[i]];
    if (first[i + 1] - first[i] == 1)
      return linear(x, weights[first[i]], formats.slice(first[i] * kFormatLen, kFormatLen), perms.get(first[i]), rows,
                    integer_gemm, entry(gemm_panels, first[i]), splits[first[i]]);
    c10::List<std::optional<at::Tensor>> part_perms, part_panels;
    for (int64_t w = first[i]; w < first[i + 1]; ++w) {
      TORCH_CHECK(splits[w].empty(), "a linear in column parts has no column splits besides");
      part_perms.push_back(perms.get(w));
      part_panels.push_back(entry(gemm_panels, w));
    }
    return linear_parts(x, weights.slice(first[i], first[i + 1] - first[i]),
                        formats.slice(first[i] * kFormatLen, (first[i + 1] - first[i]) * kFormatLen), part_perms, rows,
                        integer_gemm, part_panels);
  };
  TORCH_CHECK(kv_rotation == 0 || k_scale.has_value(), "only an int8/fp8 KV cache is stored rotated");

  at::Tensor x = add_rms_norm(h, residual, input_norm, eps);

  at::Tensor qkv = apply(0, x);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "the qkv weight has ", qkv.size(1), " rows, expected ",
              q_size + 2 * kv_size);
  rotary_(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim}), cos, sin);
  float* qkv_p = qkv.data_ptr<float>();
  const int64_t row = qkv.size(1);
  // Q, K and V heads all rotated in one pass over each row (every head spans whole blocks).
  if (kv_rotation) hadamard_rows_(qkv_p, tokens, row, row, kv_rotation);
  // K and V rows into their cache slots (cast, or quantized per (token, head)); the slots
  // are checked before anything is written.
  const int64_t strides[2] = {row, head_dim};
  write_kv_rows(qkv_p + q_size, qkv_p + q_size + kv_size, tokens, strides, strides, k_cache, v_cache, k_scale, v_scale,
                slots.data_ptr<int64_t>());

  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, h.options());
  paged_decode_attention(attn, qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim}), k_cache, v_cache,
                         block_tables, context_lens, scale, k_scale, v_scale);
  if (kv_rotation) hadamard_rows_(attn.data_ptr<float>(), tokens, q_size, q_size, kv_rotation);
  at::Tensor o = apply(1, attn.view({tokens, q_size}));
  x = add_rms_norm(o, residual, post_norm, eps);
  return apply(3, silu_and_mul(apply(2, x)));
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "llama_decode_layer(Tensor h, Tensor(a!) residual, Tensor input_norm, Tensor post_norm, float eps, "
      "Tensor[] weights, int[] formats, Tensor?[] perms, Tensor?[] gemm_panels, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slots, Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float scale, Tensor(d!)? k_scale=None, Tensor(e!)? v_scale=None, int kv_rotation=0, "
      "int[] parts=[], int[] integer_rows=[], bool integer_gemm=False, int[] column_splits=[]) -> Tensor");
  m.def("column_parts_linear(Tensor x, Tensor[] weights, int[] formats, Tensor?[] perms, Tensor?[] gemm_panels, "
        "int max_integer_rows=-1, bool integer_gemm=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("llama_decode_layer", &tokenmill::llama_decode_layer);
  m.impl("column_parts_linear", &tokenmill::column_parts_linear);
}
