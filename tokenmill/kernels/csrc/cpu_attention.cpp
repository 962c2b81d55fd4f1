// Paged decode attention for the CPU: one query token per sequence, attending over
// the sequence's KV history read in place from the paged cache.
//
// Why a native kernel: the pure-PyTorch path first gathers every decode sequence's
// whole history (padded to the longest) into a new tensor, per layer per step, and
// then runs SDPA with a mask over it. With 32 sequences of ~530 tokens that gather
// plus the masked SDPA took ~65% of a decode step. Here each (sequence, KV head)
// pair streams its K and V blocks once, straight from the cache.
//
// Layouts (as tokenmill's runner allocates them):
//   q, out:        [num_seqs, num_heads, head_dim]
//   k/v cache:     [num_blocks, block_size, num_kv_heads, head_dim]
//   block_tables:  [num_seqs, max_blocks] int32 (entries past a sequence's length unused)
//   context_lens:  [num_seqs] int32
// The cache may be float32, bfloat16 or float16; arithmetic is float32.

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace {

using tokenmill::to_float;

#if defined(__AVX2__) && defined(__FMA__)
using tokenmill::hsum;
using tokenmill::load8;

// scores[g] = q_g . k for the group's query rows (q_g float, contiguous per head).
template <typename T>
inline void group_dots(const float* q, const T* k, int64_t group, int64_t d, float* scores, int64_t score_stride) {
  if (group == 3 && d % 8 == 0) {  // the common GQA shapes: three independent FMA chains
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 kv = load8(k + i);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), kv, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + i), kv, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * d + i), kv, a2);
    }
    scores[0] = hsum(a0), scores[score_stride] = hsum(a1), scores[2 * score_stride] = hsum(a2);
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    __m256 a = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), load8(k + i), a);
    float acc = hsum(a);
    for (; i < d; ++i) acc += q[g * d + i] * to_float(k[i]);
    scores[g * score_stride] = acc;
  }
}

// acc[g] += w[g] * v for the group's accumulators (float, contiguous per head).
template <typename T>
inline void group_axpy(float* acc, const float* w, int64_t w_stride, const T* v, int64_t group, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const __m256 vv = load8(v + i);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * d + i;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(w[g * w_stride]), vv, _mm256_loadu_ps(a)));
    }
  }
  for (; i < d; ++i)
    for (int64_t g = 0; g < group; ++g) acc[g * d + i] += w[g * w_stride] * to_float(v[i]);
}
#else
template <typename T>
inline void group_dots(const float* q, const T* k, int64_t group, int64_t d, float* scores, int64_t score_stride) {
  for (int64_t g = 0; g < group; ++g) {
    float acc = 0.f;
    for (int64_t i = 0; i < d; ++i) acc += q[g * d + i] * to_float(k[i]);
    scores[g * score_stride] = acc;
  }
}

template <typename T>
inline void group_axpy(float* acc, const float* w, int64_t w_stride, const T* v, int64_t group, int64_t d) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) acc[g * d + i] += w[g * w_stride] * to_float(v[i]);
}
#endif

// Asks for the next block's rows of this head while the current block is computed:
// blocks sit anywhere in the cache, so the hardware prefetcher cannot guess them.
template <typename T>
inline void prefetch_block(const T* block, int64_t rows, int64_t row_stride, int64_t row_bytes) {
#if defined(__SSE__)
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + j * row_stride) + b, _MM_HINT_T0);
#endif
}

// Calls visit(t, row) for the first ctx cached rows of one head, block by block through
// the block table, prefetching each next block. `head` points at the head's row in block 0.
template <typename T, typename Visit>
inline void for_each_cached_row(const T* head, const int32_t* table, int64_t ctx, int64_t block_size,
                                int64_t block_stride, int64_t token_stride, int64_t row_bytes, Visit visit) {
  for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
    const T* block = head + table[t0 / block_size] * block_stride;
    if (t0 + block_size < ctx)
      prefetch_block(head + table[t0 / block_size + 1] * block_stride, std::min(block_size, ctx - t0 - block_size),
                     token_stride, row_bytes);
    const int64_t n = std::min(block_size, ctx - t0);
    for (int64_t j = 0; j < n; ++j) visit(t0 + j, block + j * token_stride);
  }
}

template <typename scalar_t, typename cache_t>
void decode_kernel(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;  // query heads sharing one KV head
  const int64_t max_blocks = block_tables.size(1);
  // Strides in elements; the cache rows of one token/head are contiguous.
  const int64_t kv_block_stride = k_cache.stride(0), kv_token_stride = k_cache.stride(1),
                kv_head_stride = k_cache.stride(2);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t o_seq_stride = out.stride(0), o_head_stride = out.stride(1);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t s = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t ctx = lens[s];
      TORCH_CHECK(ctx <= max_blocks * block_size, "context longer than its block table");
      const int32_t* table = tables + s * max_blocks;
      // The group's query rows, scaled, in float.
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + s * q_seq_stride + (h * group + g) * q_head_stride;
        for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] = to_float(src[i]) * fscale;
      }
      scores.resize(group * ctx);
      // Pass 1: scores, each K row read once for the whole group.
      for_each_cached_row(k_ptr + h * kv_head_stride, table, ctx, block_size, kv_block_stride, kv_token_stride,
                          row_bytes, [&](int64_t t, const cache_t* k_row) {
                            group_dots(qf.data(), k_row, group, head_dim, &scores[t], ctx);
                          });
      // Softmax per query head.
      for (int64_t g = 0; g < group; ++g) {
        float* row = &scores[g * ctx];
        const float m = ctx > 0 ? *std::max_element(row, row + ctx) : 0.f;
        float sum = 0.f;
        for (int64_t t = 0; t < ctx; ++t) {
          row[t] = std::exp(row[t] - m);
          sum += row[t];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t t = 0; t < ctx; ++t) row[t] *= inv;
      }
      // Pass 2: weighted sum of V, each V row read once for the whole group.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_cached_row(v_ptr + h * kv_head_stride, table, ctx, block_size, kv_block_stride, kv_token_stride,
                          row_bytes, [&](int64_t t, const cache_t* v_row) {
                            group_axpy(acc.data(), &scores[t], ctx, v_row, group, head_dim);
                          });
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = o_ptr + s * o_seq_stride + (h * group + g) * o_head_stride;
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[g * head_dim + i]);
      }
    }
  });
}

void paged_decode_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(), "cache rows must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out rows must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: contiguous int32");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: contiguous int32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one block table and length per sequence");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q dtypes differ");
  AT_DISPATCH_V2(q.scalar_type(), "paged_decode_attention_q", AT_WRAP([&] {
    using q_t = scalar_t;
    AT_DISPATCH_V2(k_cache.scalar_type(), "paged_decode_attention_kv", AT_WRAP([&] {
      decode_kernel<q_t, scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale);
    }), at::kFloat, at::kBFloat16, at::kHalf);
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
