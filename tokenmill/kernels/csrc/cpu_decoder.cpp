// One Llama decoder layer for a batch of decode tokens, as one op.
//
// Why: with the weights streamed at memory speed, a batch-1 decode step of the default
// model spent about as long again in Python and op dispatch as in arithmetic: a layer is
// a dozen ops on 576-wide rows plus ten module calls, thirty layers a step. This op runs
// the same kernels in the same order (the Python layer path stays the reference), from
// C++: norm (+ residual add), QKV, rotary, KV-cache write, paged attention, O, norm
// (+ residual add), gate/up, SiLU-and-mul, down.
//
// Decode only (one query token per sequence), float32 activations, a float32 or bfloat16
// KV cache, no biases. Each of the four weights is either tiled for skinny_linear (float32
// or bfloat16; its format row starts with N and has bits 0) or a weight-only quantized
// QuantizedTensor for quant_linear (its `.format` row, and its act-order permutation).

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>


#include "cpu_kernels.h"

namespace tokenmill {

namespace {

constexpr int64_t kFormatLen = 6;  // QuantizedTensor.format: N, K, bits, group, scale bytes, offset

// x . W^T for one of the layer's weights, by its kind (see the header comment).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, at::IntArrayRef format,
                  const std::optional<at::Tensor>& perm) {
  if (format[2] == 0) return skinny_linear(x, weight, format[0]);
  return quant_linear(x, QuantWeight::from_format(weight, format, perm));
}

}  // namespace

// As DecoderLayer.forward: h (the previous layer's MLP output) is added into `residual`
// (updated in place, twice: + h, then + attention output), and the layer's MLP output is
// returned, to be added by the next layer's norm. The first layer passes zeros as h and
// the embeddings as the residual.
at::Tensor llama_decode_layer(
    const at::Tensor& h, at::Tensor residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, at::TensorList weights, at::IntArrayRef formats,
    const c10::List<std::optional<at::Tensor>>& perms, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    double scale) {
  const int64_t tokens = h.size(0), hidden = h.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16) &&
                  v_cache.scalar_type() == k_cache.scalar_type() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) * k_cache.size(3) == kv_size,
              "k/v cache: contiguous float32 or bfloat16 [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == tokens,
              "slots: int64, one per token");
  TORCH_CHECK(weights.size() == 4 && formats.size() == 4 * kFormatLen && perms.size() == 4,
              "four weights (qkv, o, gate_up, down), a format row of 6 and a permutation (or None) each");
  auto apply = [&](int64_t i, const at::Tensor& x) {
    return linear(x, weights[i], formats.slice(i * kFormatLen, kFormatLen), perms.get(i));
  };

  at::Tensor x = add_rms_norm(h, residual, input_norm, eps);

  at::Tensor qkv = apply(0, x);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "the qkv weight has ", qkv.size(1), " rows, expected ",
              q_size + 2 * kv_size);
  rotary_(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim}), cos, sin);
  // K and V rows into their cache slots (rounded to nearest even when the cache is bf16).
  const int64_t num_slots = k_cache.numel() / kv_size;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* qkv_p = qkv.data_ptr<float>();
  const int64_t row = qkv.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "KV slot out of range");
  AT_DISPATCH_V2(k_cache.scalar_type(), "llama_decode_layer_kv_write", AT_WRAP([&] {
    scalar_t *k_p = k_cache.data_ptr<scalar_t>(), *v_p = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      const float* k_src = qkv_p + t * row + q_size;
      const float* v_src = k_src + kv_size;
      scalar_t *k_dst = k_p + slot[t] * kv_size, *v_dst = v_p + slot[t] * kv_size;
      for (int64_t i = 0; i < kv_size; ++i) {
        k_dst[i] = static_cast<scalar_t>(k_src[i]);
        v_dst[i] = static_cast<scalar_t>(v_src[i]);
      }
    }
  }), at::kFloat, at::kBFloat16);

  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, h.options());
  paged_decode_attention(attn, qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim}), k_cache, v_cache,
                         block_tables, context_lens, scale);
  at::Tensor o = apply(1, attn.view({tokens, q_size}));
  x = add_rms_norm(o, residual, post_norm, eps);
  return apply(3, silu_and_mul(apply(2, x)));
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def(
      "llama_decode_layer(Tensor h, Tensor(a!) residual, Tensor input_norm, Tensor post_norm, float eps, "
      "Tensor[] weights, int[] formats, Tensor?[] perms, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slots, Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, "
      "int head_dim, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("llama_decode_layer", &tokenmill::llama_decode_layer);
}
