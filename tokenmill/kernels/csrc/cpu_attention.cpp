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
//   k/v scales:    [num_blocks, num_kv_heads, block_size] float16, for 8-bit caches
// The cache may be float32, bfloat16 or float16, or int8 / fp8 e4m3 codes with a scale per
// (token, head) (tokenmill/attention/kv_quant.py); arithmetic is float32 (but bf16 dot products
// for a bf16 cache on AVX-512 BF16: block_dots / block_axpy below). An 8-bit row is
// never dequantized: q . codes is multiplied by the K row's scale, and each softmax weight
// by the V row's scale before the weighted sum of codes, so the kernel streams half the
// bytes of a bf16 cache with the same inner loops.

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
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

// The block-tiled fast path, for groups of up to kMaxTiledGroup query heads and head_dim
// a multiple of 32. Row by row (group_dots/group_axpy above) a token-head cost ~170
// cycles: a horizontal sum per score and the accumulators going through memory for
// every V row. Here four K rows are scored at once into 4G register accumulators,
// reduced together (hsum4), and V is summed a block at a time into accumulators that
// stay in registers: ~5x less work, so the kernel becomes bound by reading the cache.
constexpr int64_t kMaxTiledGroup = 3;  // 4G + G + 1 <= 16 ymm registers
constexpr int64_t kTiledDimStep = 32;  // pass 2 holds G x 32 accumulator lanes

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// scores[g * score_stride + j] = q_g . row_j for the n rows of one cache block.
template <int G, typename T>
inline void block_dots(const float* q, const T* block, int64_t n, int64_t token_stride, int64_t d, float* scores,
                       int64_t score_stride) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
    const T* row = block + j * token_stride;
    for (int64_t i = 0; i < d; i += 8) {
      __m256 qv[G];
      for (int g = 0; g < G; ++g) qv[g] = _mm256_loadu_ps(q + g * d + i);
      for (int r = 0; r < 4; ++r) {
        const __m256 kv = load8(row + r * token_stride + i);
        for (int g = 0; g < G; ++g) acc[g][r] = _mm256_fmadd_ps(qv[g], kv, acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) _mm_storeu_ps(scores + g * score_stride + j, hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (; j < n; ++j) group_dots(q, block + j * token_stride, G, d, scores + j, score_stride);
}

// acc[g] += sum_j w[g * w_stride + j] * row_j over the n rows of one cache block.
template <int G, typename T>
inline void block_axpy(float* acc, const float* w, int64_t w_stride, const T* block, int64_t n, int64_t token_stride,
                       int64_t d) {
  constexpr int C = kTiledDimStep / 8;
  for (int64_t i0 = 0; i0 < d; i0 += kTiledDimStep) {
    __m256 a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * d + i0 + 8 * c);
    for (int64_t j = 0; j < n; ++j) {
      const T* row = block + j * token_stride + i0;
      __m256 wv[G];
      for (int g = 0; g < G; ++g) wv[g] = _mm256_broadcast_ss(w + g * w_stride + j);
      for (int c = 0; c < C; ++c) {
        const __m256 vv = load8(row + 8 * c);
        for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(wv[g], vv, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * d + i0 + 8 * c, a[g][c]);
  }
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

constexpr int64_t kMaxTiledGroup = 0;  // no tiled path without AVX2
constexpr int64_t kTiledDimStep = 32;
template <int G, typename T>
inline void block_dots(const float*, const T*, int64_t, int64_t, int64_t, float*, int64_t) {}
template <int G, typename T>
inline void block_axpy(float*, const float*, int64_t, const T*, int64_t, int64_t, int64_t) {}
#endif

// A bf16 cache on AVX-512 BF16: both passes on bf16 dot products (vdpbf16ps), as the prefill
// kernel (cpu_prefill_attention.cpp) and torch's flash attention compute bf16 inputs: q
// rounded to bf16 for the scores, the softmax weights rounded to bf16 for the value sum,
// products exact and sums in float32. Per token and KV head the float32 path spends
// d / 8 conversions and 2 G d / 8 FMAs; here 2 G d / 32 dot products read the cache as
// stored. These overloads replace block_dots / block_axpy for bf16 caches wherever they
// are called (decode items, runs, the fused layer), so a row's arithmetic still does not
// depend on what shares its call. Groups up to kMaxBf16Group query heads per KV head are
// tiled (the float32 path: 3). Measured on the 2-core Zen 4 EPYC, 64 sequences of ~400
// tokens, 2 threads: 9/3 heads of 64 (SmolLM2) 1.05 -> 0.97 ms a layer with 30 layers'
// caches (memory-bound), 0.51 -> 0.47 ms with one (in L3); 32/8 heads (Llama 3.2 1B and 8B,
// untiled before) 10.4 -> 3.5 ms.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <typename T>
constexpr bool kBf16Dots = std::is_same_v<T, c10::BFloat16>;
constexpr int64_t kMaxBf16Group = 8;

// [sum(a), sum(b), sum(c), sum(d)] of four 16-lane accumulators; each output sums its
// own lanes in one fixed order, whichever other accumulators share the call.
inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u));
}

// q (float [G][d]) -> bf16 [G][d], d a multiple of 32.
template <int G>
inline void to_bf16_rows(const float* q, int64_t d, uint16_t* out) {
  for (int64_t i = 0; i < G * d; i += 32)
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(q + i)));
}

// scores[g * score_stride + j] = bf16(q_g) . row_j, four rows at a time (a tail padded with
// zero accumulators, so every row takes the same reduction).
template <int G>
inline void block_dots_bf16(const uint16_t* qb, const c10::BFloat16* block, int64_t n, int64_t token_stride, int64_t d,
                            float* scores, int64_t score_stride) {
  for (int64_t j = 0; j < n; j += 4) {
    const int64_t m = std::min<int64_t>(4, n - j);
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_setzero_ps();
    const c10::BFloat16* row = block + j * token_stride;
    for (int64_t i = 0; i < d; i += 32) {
      __m512bh kv[4];
      for (int r = 0; r < 4; ++r)
        kv[r] = r < m ? (__m512bh)_mm512_loadu_si512(row + r * token_stride + i) : (__m512bh)_mm512_setzero_si512();
      for (int g = 0; g < G; ++g) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + g * d + i);
        for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], kv[r], qv);
      }
    }
    for (int g = 0; g < G; ++g) {
      alignas(16) float four[4];
      _mm_store_ps(four, hsum4x16(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
      for (int64_t r = 0; r < m; ++r) scores[g * score_stride + j + r] = four[r];
    }
  }
}

template <int G>
inline void block_dots(const float* q, const c10::BFloat16* block, int64_t n, int64_t token_stride, int64_t d,
                       float* scores, int64_t score_stride) {
  alignas(64) uint16_t qb[G * 256];
  to_bf16_rows<G>(q, d, qb);
  constexpr int G1 = G > 4 ? 4 : G;  // at most 4 x 4 accumulators at a time
  block_dots_bf16<G1>(qb, block, n, token_stride, d, scores, score_stride);
  if constexpr (G > 4) block_dots_bf16<G - 4>(qb + 4 * d, block, n, token_stride, d, scores + 4 * score_stride, score_stride);
}

// The lane order of a token pair's unpacked rows: unpacklo_epi16 of 32 columns holds columns
// {0-3, 8-11, 16-19, 24-27}, unpackhi the others.
inline __m512i pair_lo_index() { return _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27); }
inline __m512i pair_hi_index() { return _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31); }
inline __m512i natural_lo_index() { return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23); }
inline __m512i natural_hi_index() { return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31); }

// acc[g] += sum_j bf16(w[g * w_stride + j]) * row_j over the n rows of one cache block: rows
// taken in pairs (t, t + 1) whose columns are interleaved, so one dot product adds two
// tokens' weighted values; up to 16 rows' weights converted at a time.
template <int G>
inline void block_axpy(float* acc, const float* w, int64_t w_stride, const c10::BFloat16* block, int64_t n,
                       int64_t token_stride, int64_t d) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << m) - 1);
    alignas(64) uint16_t wb[G][16];
    for (int g = 0; g < G; ++g)
      _mm256_store_si256(reinterpret_cast<__m256i*>(wb[g]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, w + g * w_stride + j0)));
    for (int64_t i0 = 0; i0 < d; i0 += 32) {
      __m512 lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        const __m512 n0 = _mm512_loadu_ps(acc + g * d + i0), n1 = _mm512_loadu_ps(acc + g * d + i0 + 16);
        lo[g] = _mm512_permutex2var_ps(n0, pair_lo_index(), n1);
        hi[g] = _mm512_permutex2var_ps(n0, pair_hi_index(), n1);
      }
      for (int64_t p = 0; p < m; p += 2) {
        const c10::BFloat16* row = block + (j0 + p) * token_stride + i0;
        const __m512i a = _mm512_loadu_si512(row);
        const __m512i b = p + 1 < m ? _mm512_loadu_si512(row + token_stride) : _mm512_setzero_si512();
        const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < G; ++g) {
          uint32_t pair;
          std::memcpy(&pair, wb[g] + p, 4);
          const __m512bh wp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
          lo[g] = _mm512_dpbf16_ps(lo[g], vlo, wp);
          hi[g] = _mm512_dpbf16_ps(hi[g], vhi, wp);
        }
      }
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(acc + g * d + i0, _mm512_permutex2var_ps(lo[g], natural_lo_index(), hi[g]));
        _mm512_storeu_ps(acc + g * d + i0 + 16, _mm512_permutex2var_ps(lo[g], natural_hi_index(), hi[g]));
      }
    }
  }
}
#else
template <typename T>
constexpr bool kBf16Dots = false;
constexpr int64_t kMaxBf16Group = 0;
#endif

// The largest group the tiled path takes for this cache type.
template <typename cache_t>
constexpr int64_t max_tiled_group() {
  return kBf16Dots<cache_t> ? kMaxBf16Group : kMaxTiledGroup;
}

// row[0:n] = softmax(row[0:n]) in place. Vectorised exp: with a scalar std::exp the
// softmax took about as long as both passes over K and V together.
inline void softmax_(float* row, int64_t n) {
  if (n == 0) return;
  const float m = *std::max_element(row, row + n);
  float sum = 0.f;
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = tokenmill::exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), vm));
    _mm256_storeu_ps(row + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; t < n; ++t) {
    row[t] = std::exp(row[t] - m);
    sum += row[t];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (t = 0; t < n; ++t) row[t] *= inv;
}

// Asks for a block's rows of this head a block ahead of their use: blocks sit anywhere in
// the cache, so the hardware prefetcher cannot guess them. Into L2 (T1), not L1: on the
// 2-core Zen 4 EPYC, with the caches of 30 layers out of L3, T0 prefetches left the kernel
// at 10 GB/s and T1 at 14.5 GB/s (64 sequences of ~400 tokens; prefetching 2-4 blocks ahead
// instead of 1 changed nothing).
template <typename T>
inline void prefetch_block(const T* block, int64_t rows, int64_t row_stride, int64_t row_bytes) {
#if defined(__x86_64__)
  // As an asm statement: GCC -O3 dropped this loop of __builtin_prefetch (_mm_prefetch) calls
  // from the kernel once it sat behind the bounds lambda below (no prefetch in the object).
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64)
      asm volatile("prefetcht1 %0" : : "m"(*(reinterpret_cast<const char*>(block + j * row_stride) + b)));
#endif
}

// Calls visit(t0, block, offset, rows, n) for the cached rows [first, ctx) of one head, a
// block's part at a time (n rows from `offset` in block table[block], the first of them at
// index t0 = position - first) through the block table, prefetching the first block and
// then each next one. `head` points at the head's row in block 0. `first` > 0: a sliding
// window's start.
template <typename T, typename Visit>
inline void for_each_cached_block(const T* head, const int32_t* table, int64_t first, int64_t ctx, int64_t block_size,
                                  int64_t block_stride, int64_t token_stride, int64_t row_bytes, Visit visit) {
  if (first >= ctx) return;
  const int64_t last_block = (ctx - 1) / block_size;
  auto prefetch = [&](int64_t b) {  // the rows of block b in [first, ctx)
    if (b > last_block) return;
    const int64_t lo = std::max(b * block_size, first), hi = std::min((b + 1) * block_size, ctx);
    prefetch_block(head + table[b] * block_stride + (lo - b * block_size) * token_stride, hi - lo, token_stride, row_bytes);
  };
  prefetch(first / block_size);
  for (int64_t pos = first; pos < ctx;) {
    const int64_t b = pos / block_size, offset = pos % block_size;
    const int64_t n = std::min(block_size - offset, ctx - pos);
    prefetch(b + 1);
    visit(pos - first, table[b], offset, head + table[b] * block_stride + offset * token_stride, n);
    pos += n;
  }
}

// One work item: KV heads [0, nh) from `k_heads`/`v_heads` (pointers at the first head's row
// in block 0) of one sequence, each with its group of query rows (qf, scaled float32,
// [nh * group, head_dim]); leaves the output rows in acc ([nh * group, head_dim]).
// G > 0: the block-tiled path for groups of G heads; G == 0: row by row, any group.
// All heads of a block are done together: their rows share cache lines and pages, which
// read block by block stream well, where one head at a time reads a third of each.
// Scales of an 8-bit cache (null otherwise): per (token, head), pointing at the item's first
// head in block 0. A block's scales of one head are contiguous ([blocks, heads, block_size]),
// so they are applied eight at a time.
struct RowScales {
  const at::Half* k = nullptr;
  const at::Half* v = nullptr;
  int64_t block_stride = 0, head_stride = 0;

  // rows[(h * group + g) * ctx + t0 + j] *= scale of (the block's token offset + j, head h)
  // for n rows of one block.
  void apply(const at::Half* scales, int64_t block, int64_t offset, int64_t nh, int64_t group, int64_t ctx, int64_t t0,
             int64_t n, float* rows) const {
    for (int64_t h = 0; h < nh; ++h) {
      const at::Half* s = scales + block * block_stride + h * head_stride + offset;
      for (int64_t g = 0; g < group; ++g) {
        float* r = rows + (h * group + g) * ctx + t0;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__F16C__)
        for (; j + 8 <= n; j += 8)
          _mm256_storeu_ps(r + j, _mm256_mul_ps(_mm256_loadu_ps(r + j), tokenmill::load8(s + j)));
#endif
        for (; j < n; ++j) r[j] *= static_cast<float>(s[j]);
      }
    }
  }
};

template <int G, typename cache_t>
inline void attend(const float* qf, const cache_t* k_heads, const cache_t* v_heads, int64_t nh, const int32_t* table,
                   int64_t first, int64_t end, int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride,
                   int64_t token_stride, int64_t head_stride, const RowScales& row_scales, float* scores,
                   float* acc) {
  const int64_t row_bytes = ((nh - 1) * head_stride + head_dim) * static_cast<int64_t>(sizeof(cache_t));
  const int64_t rows = nh * group;  // query rows of the item; scores are [rows, ctx]
  const int64_t ctx = end - first;  // keys attended: positions [first, end)
  // Pass 1: scores, each K row read once for the whole group.
  for_each_cached_block(k_heads, table, first, end, block_size, block_stride, token_stride, row_bytes,
                        [&](int64_t t0, int64_t block_id, int64_t offset, const cache_t* block, int64_t n) {
                          for (int64_t h = 0; h < nh; ++h) {
                            const float* qh = qf + h * group * head_dim;
                            float* sh = scores + h * group * ctx + t0;
                            const cache_t* bh = block + h * head_stride;
                            if constexpr (G > 0) {
                              block_dots<G>(qh, bh, n, token_stride, head_dim, sh, ctx);
                            } else {
                              for (int64_t j = 0; j < n; ++j)
                                group_dots(qh, bh + j * token_stride, group, head_dim, sh + j, ctx);
                            }
                          }
                          if (row_scales.k != nullptr)  // q . (codes * s) = (q . codes) * s
                            row_scales.apply(row_scales.k, block_id, offset, nh, group, ctx, t0, n, scores);
                        });
  for (int64_t r = 0; r < rows; ++r) softmax_(scores + r * ctx, ctx);
  // Pass 2: weighted sum of V, each V row read once for the whole group.
  std::fill(acc, acc + rows * head_dim, 0.f);
  for_each_cached_block(v_heads, table, first, end, block_size, block_stride, token_stride, row_bytes,
                        [&](int64_t t0, int64_t block_id, int64_t offset, const cache_t* block, int64_t n) {
                          if (row_scales.v != nullptr)  // sum w (codes * s) = sum (w * s) codes
                            row_scales.apply(row_scales.v, block_id, offset, nh, group, ctx, t0, n, scores);
                          for (int64_t h = 0; h < nh; ++h) {
                            float* ah = acc + h * group * head_dim;
                            const float* sh = scores + h * group * ctx + t0;
                            const cache_t* bh = block + h * head_stride;
                            if constexpr (G > 0) {
                              block_axpy<G>(ah, sh, ctx, bh, n, token_stride, head_dim);
                            } else {
                              for (int64_t j = 0; j < n; ++j)
                                group_axpy(ah, sh + j, ctx, bh + j * token_stride, group, head_dim);
                            }
                          }
                        });
}

// Several query rows of one sequence (deterministic inference lays a prompt out as one-token
// rows over one block table): each row's arithmetic is attend's, call for call (the same block
// visits, the same block_dots / block_axpy on the same cache rows with the same row counts,
// the same softmax), so its output is bit for bit what it is alone; but each K and V block is
// taken from memory once for all the rows, which then find it in L1, instead of once per row
// (a 1024-token prompt's rows each streamed up to 0.8 MB of K and V per layer). rows_ctx[i]:
// row i's context length; qf, scores, acc: per row as attend's. The whole context (no
// sliding window).
template <int G, typename cache_t>
void attend_rows(int64_t R, const int64_t* rows_ctx, float* const* qf, const cache_t* k_heads, const cache_t* v_heads,
                 int64_t nh, const int32_t* table, int64_t group, int64_t head_dim, int64_t block_size,
                 int64_t block_stride, int64_t token_stride, int64_t head_stride, const RowScales& row_scales,
                 float* const* scores, float* const* acc) {
  const int64_t rows = nh * group;
  int64_t end = 0;
  for (int64_t i = 0; i < R; ++i) end = std::max(end, rows_ctx[i]);
  const int64_t row_bytes = ((nh - 1) * head_stride + head_dim) * static_cast<int64_t>(sizeof(cache_t));
  // Pass 1: scores.
  for_each_cached_block(k_heads, table, 0, end, block_size, block_stride, token_stride, row_bytes,
                        [&](int64_t t0, int64_t block_id, int64_t offset, const cache_t* block, int64_t n) {
                          for (int64_t i = 0; i < R; ++i) {
                            const int64_t ctx = rows_ctx[i], ni = std::min(n, ctx - t0);
                            if (ni <= 0) continue;
                            for (int64_t h = 0; h < nh; ++h) {
                              const float* qh = qf[i] + h * group * head_dim;
                              float* sh = scores[i] + h * group * ctx + t0;
                              const cache_t* bh = block + h * head_stride;
                              if constexpr (G > 0) {
                                block_dots<G>(qh, bh, ni, token_stride, head_dim, sh, ctx);
                              } else {
                                for (int64_t j = 0; j < ni; ++j)
                                  group_dots(qh, bh + j * token_stride, group, head_dim, sh + j, ctx);
                              }
                            }
                            if (row_scales.k != nullptr)
                              row_scales.apply(row_scales.k, block_id, offset, nh, group, ctx, t0, ni, scores[i]);
                          }
                        });
  for (int64_t i = 0; i < R; ++i)
    for (int64_t r = 0; r < rows; ++r) softmax_(scores[i] + r * rows_ctx[i], rows_ctx[i]);
  // Pass 2: weighted sums of V.
  for (int64_t i = 0; i < R; ++i) std::fill(acc[i], acc[i] + rows * head_dim, 0.f);
  for_each_cached_block(v_heads, table, 0, end, block_size, block_stride, token_stride, row_bytes,
                        [&](int64_t t0, int64_t block_id, int64_t offset, const cache_t* block, int64_t n) {
                          for (int64_t i = 0; i < R; ++i) {
                            const int64_t ctx = rows_ctx[i], ni = std::min(n, ctx - t0);
                            if (ni <= 0) continue;
                            if (row_scales.v != nullptr)
                              row_scales.apply(row_scales.v, block_id, offset, nh, group, ctx, t0, ni, scores[i]);
                            for (int64_t h = 0; h < nh; ++h) {
                              float* ah = acc[i] + h * group * head_dim;
                              const float* sh = scores[i] + h * group * ctx + t0;
                              const cache_t* bh = block + h * head_stride;
                              if constexpr (G > 0) {
                                block_axpy<G>(ah, sh, ctx, bh, ni, token_stride, head_dim);
                              } else {
                                for (int64_t j = 0; j < ni; ++j)
                                  group_axpy(ah, sh + j, ctx, bh + j * token_stride, group, head_dim);
                              }
                            }
                          }
                        });
}

constexpr int64_t kMaxRunRows = 16;  // query rows per attend_rows call

template <typename scalar_t, typename cache_t>
void decode_kernel(
    at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t window) {
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
  // A work item is a sequence with all its KV heads, or, with too few sequences to keep
  // every thread busy (batch-1 decode), one KV head of a sequence.
  const int64_t heads_per_item = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  const bool tiled = group <= max_tiled_group<cache_t>() && head_dim % kTiledDimStep == 0 &&
                     (!kBf16Dots<cache_t> || head_dim <= 256);
  const int64_t variant = tiled ? group : 0;
  RowScales scales_0;  // of head 0; an item offsets them by its first head
  if (k_scale.has_value()) {
    scales_0 = {k_scale->data_ptr<at::Half>(), v_scale->data_ptr<at::Half>(), k_scale->stride(0), k_scale->stride(1)};
    TORCH_CHECK(k_scale->stride(2) == 1, "a block's scales of one head must be contiguous");
  }

  // Consecutive rows over one block table (a prompt laid out as one-token rows: deterministic
  // inference; a verification's rows) are runs: attend_rows reads each K/V block once for up
  // to kMaxRunRows of them, each row's arithmetic unchanged.
  std::vector<int64_t> run_items;  // item i: rows [run_items[i], run_items[i + 1])
  if (window == 0 && num_seqs >= 2) {
    bool any = false;
    std::vector<int64_t> runs{0};
    for (int64_t e = 1; e < num_seqs; ++e) {
      const int64_t s0 = runs.back(), nb = (static_cast<int64_t>(lens[e]) + block_size - 1) / block_size;
      const bool same = nb <= max_blocks && std::equal(tables + e * max_blocks, tables + e * max_blocks + nb,
                                                       tables + s0 * max_blocks);
      if (same) {
        any = true;
      } else {
        runs.push_back(e);
      }
    }
    runs.push_back(num_seqs);
    if (any) {
      const int64_t threads = at::get_num_threads();
      for (size_t r = 0; r + 1 < runs.size(); ++r) {
        const int64_t len = runs[r + 1] - runs[r];
        const int64_t per = std::clamp<int64_t>((len + 4 * threads - 1) / (4 * threads), 1, kMaxRunRows);
        for (int64_t s = runs[r]; s < runs[r + 1]; s += per) run_items.push_back(s);
      }
      run_items.push_back(num_seqs);
    }
  }
  if (!run_items.empty()) {
    const int64_t num_runs = static_cast<int64_t>(run_items.size()) - 1;
    std::atomic<int64_t> next_run{0};
    at::parallel_for(0, std::min<int64_t>(num_runs, at::get_num_threads()), 1, [&](int64_t, int64_t) {
      const int64_t rows = num_kv_heads * group;
      std::vector<std::vector<float>> qf(kMaxRunRows), acc(kMaxRunRows), scores(kMaxRunRows);
      std::vector<float*> qp(kMaxRunRows), ap(kMaxRunRows), sp(kMaxRunRows);
      std::vector<int64_t> ctxs(kMaxRunRows);
      for (int64_t work = next_run++; work < num_runs; work = next_run++) {
        const int64_t s0 = run_items[work], R = run_items[work + 1] - s0;
        for (int64_t i = 0; i < R; ++i) {
          const int64_t s = s0 + i;
          ctxs[i] = lens[s];
          TORCH_CHECK(ctxs[i] <= max_blocks * block_size, "context longer than its block table");
          qf[i].resize(rows * head_dim), acc[i].resize(rows * head_dim), scores[i].resize(rows * ctxs[i]);
          qp[i] = qf[i].data(), ap[i] = acc[i].data(), sp[i] = scores[i].data();
          for (int64_t r = 0; r < rows; ++r) {
            const scalar_t* src = q_ptr + s * q_seq_stride + r * q_head_stride;
            for (int64_t d = 0; d < head_dim; ++d) qf[i][r * head_dim + d] = to_float(src[d]) * fscale;
          }
        }
        const int32_t* table = tables + s0 * max_blocks;
#define TOKENMILL_ATTEND_ROWS(G)                                                                                     \
  attend_rows<G>(R, ctxs.data(), qp.data(), k_ptr, v_ptr, num_kv_heads, table, group, head_dim, block_size,          \
                 kv_block_stride, kv_token_stride, kv_head_stride, scales_0, sp.data(), ap.data())
        switch (variant) {
          case 1: TOKENMILL_ATTEND_ROWS(1); break;
          case 2: TOKENMILL_ATTEND_ROWS(2); break;
          case 3: TOKENMILL_ATTEND_ROWS(3); break;
          case 4: if constexpr (max_tiled_group<cache_t>() >= 4) TOKENMILL_ATTEND_ROWS(4); break;
          case 5: if constexpr (max_tiled_group<cache_t>() >= 5) TOKENMILL_ATTEND_ROWS(5); break;
          case 6: if constexpr (max_tiled_group<cache_t>() >= 6) TOKENMILL_ATTEND_ROWS(6); break;
          case 7: if constexpr (max_tiled_group<cache_t>() >= 7) TOKENMILL_ATTEND_ROWS(7); break;
          case 8: if constexpr (max_tiled_group<cache_t>() >= 8) TOKENMILL_ATTEND_ROWS(8); break;
          default: TOKENMILL_ATTEND_ROWS(0); break;
        }
#undef TOKENMILL_ATTEND_ROWS
        for (int64_t i = 0; i < R; ++i)
          for (int64_t r = 0; r < rows; ++r) {
            scalar_t* dst = o_ptr + (s0 + i) * o_seq_stride + r * o_head_stride;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[i][r * head_dim + d]);
          }
      }
    });
    return;
  }

  // Items differ in cost (context lengths are ragged) and at::parallel_for splits a range
  // statically, so threads take the next item from a shared counter instead.
  const int64_t num_items = num_seqs * items_per_seq;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, std::min<int64_t>(num_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    const int64_t rows = heads_per_item * group;
    std::vector<float> qf(rows * head_dim), acc(rows * head_dim), scores;
    for (int64_t work = next_item++; work < num_items; work = next_item++) {
      const int64_t s = work / items_per_seq, h0 = (work % items_per_seq) * heads_per_item;
      const int64_t ctx = lens[s];
      TORCH_CHECK(ctx <= max_blocks * block_size, "context longer than its block table");
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;  // a sliding window's first key
      const int32_t* table = tables + s * max_blocks;
      // The item's query rows (heads h0 * group onwards), scaled, in float.
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* src = q_ptr + s * q_seq_stride + (h0 * group + r) * q_head_stride;
        for (int64_t i = 0; i < head_dim; ++i) qf[r * head_dim + i] = to_float(src[i]) * fscale;
      }
      scores.resize(rows * (ctx - first));
      const cache_t* k_heads = k_ptr + h0 * kv_head_stride;
      const cache_t* v_heads = v_ptr + h0 * kv_head_stride;
      RowScales row_scales = scales_0;
      if (row_scales.k != nullptr) row_scales.k += h0 * row_scales.head_stride, row_scales.v += h0 * row_scales.head_stride;
#define TOKENMILL_ATTEND(G)                                                                                     \
  attend<G>(qf.data(), k_heads, v_heads, heads_per_item, table, first, ctx, group, head_dim, block_size, kv_block_stride, \
            kv_token_stride, kv_head_stride, row_scales, scores.data(), acc.data())
      switch (variant) {
        case 1: TOKENMILL_ATTEND(1); break;
        case 2: TOKENMILL_ATTEND(2); break;
        case 3: TOKENMILL_ATTEND(3); break;
        case 4: if constexpr (max_tiled_group<cache_t>() >= 4) TOKENMILL_ATTEND(4); break;
        case 5: if constexpr (max_tiled_group<cache_t>() >= 5) TOKENMILL_ATTEND(5); break;
        case 6: if constexpr (max_tiled_group<cache_t>() >= 6) TOKENMILL_ATTEND(6); break;
        case 7: if constexpr (max_tiled_group<cache_t>() >= 7) TOKENMILL_ATTEND(7); break;
        case 8: if constexpr (max_tiled_group<cache_t>() >= 8) TOKENMILL_ATTEND(8); break;
        default: TOKENMILL_ATTEND(0); break;
      }
#undef TOKENMILL_ATTEND
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* dst = o_ptr + s * o_seq_stride + (h0 * group + r) * o_head_stride;
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[r * head_dim + i]);
      }
    }
  });
}

}  // namespace

// Entry points, also called directly by the fused decoder layer (cpu_kernels.h).
namespace tokenmill {

namespace {

bool is_8bit(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn; }

// One (token, head) row of K or V quantized as kv_quant.quantize does, to the same bytes:
// scale = amax * (1 / qmax) rounded to float16 (capped at its largest finite value), codes =
// x * (1 / scale) rounded to nearest even (int8) or converted to e4m3 (nearest even,
// saturating), both within +-qmax.
template <typename code_t>
void quantize_kv_row(const float* x, int64_t n, code_t* codes, at::Half* scale) {
  constexpr float qmax = std::is_same_v<code_t, int8_t> ? 127.0f : 448.0f;
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const at::Half s(std::min(amax * (1.0f / qmax), 65504.0f));
  *scale = s;
  const float sf = static_cast<float>(s);
  const float inv = sf > 0.f ? 1.0f / sf : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::clamp(x[i] * inv, -qmax, qmax);
    if constexpr (std::is_same_v<code_t, int8_t>) {
      codes[i] = static_cast<int8_t>(std::nearbyint(y));
    } else {
      codes[i] = code_t(y);
    }
  }
}

void check_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& k_scale,
                  const c10::optional<at::Tensor>& v_scale) {
  if (!is_8bit(cache.scalar_type())) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales belong to int8/fp8 caches only");
    return;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8/fp8 KV cache needs its k and v scales");
  for (const at::Tensor* s : {&*k_scale, &*v_scale}) {
    TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 3 && s->size(0) == cache.size(0) &&
                    s->size(1) == cache.size(2) && s->size(2) == cache.size(1) && s->stride(2) == 1,
                "KV scales: float16 [blocks, kv_heads, block_size], a block's scales of a head contiguous");
  }
  TORCH_CHECK(v_scale->strides() == k_scale->strides(), "k and v scales must have the same strides");
}

}  // namespace

namespace {

#if defined(__AVX2__)
// The butterflies of distance 1, 2 and 4 inside eight lanes: lanes of the lower index get
// a + b, their partners b - a (b the lower one), as the scalar loop does.
inline __m256 hadamard8(__m256 r) {
  __m256 t = _mm256_permute_ps(r, _MM_SHUFFLE(2, 3, 0, 1));
  r = _mm256_blend_ps(_mm256_add_ps(r, t), _mm256_sub_ps(t, r), 0b10101010);
  t = _mm256_permute_ps(r, _MM_SHUFFLE(1, 0, 3, 2));
  r = _mm256_blend_ps(_mm256_add_ps(r, t), _mm256_sub_ps(t, r), 0b11001100);
  t = _mm256_permute2f128_ps(r, r, 0x01);
  return _mm256_blend_ps(_mm256_add_ps(r, t), _mm256_sub_ps(t, r), 0b11110000);
}
#endif

// v <- v H_n / sqrt(n) in place (fast Walsh-Hadamard transform, Sylvester order: H_2n =
// [[H_n, H_n], [H_n, -H_n]]); distances 1, 2, 4 in registers, longer ones across them.
inline void hadamard_block(float* v, int64_t n, float norm) {
  int64_t len = 1;
#if defined(__AVX2__)
  if (n % 8 == 0) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(v + i, hadamard8(_mm256_loadu_ps(v + i)));
    for (len = 8; len < n; len <<= 1)
      for (int64_t i = 0; i < n; i += 2 * len)
        for (int64_t j = i; j < i + len; j += 8) {
          const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + j + len);
          _mm256_storeu_ps(v + j, _mm256_add_ps(a, b));
          _mm256_storeu_ps(v + j + len, _mm256_sub_ps(a, b));
        }
  }
#endif
  for (; len < n; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; ++j) {
        const float a = v[j], b = v[j + len];
        v[j] = a + b, v[j + len] = a - b;
      }
  for (int64_t i = 0; i < n; ++i) v[i] *= norm;
}

}  // namespace

void hadamard_rows_(float* x, int64_t rows, int64_t row_stride, int64_t dim, int64_t block) {
  TORCH_CHECK(block >= 2 && (block & (block - 1)) == 0 && dim % block == 0,
              "the Hadamard block must be a power of two dividing head_dim");
  const float norm = 1.0f / std::sqrt(static_cast<float>(block));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b0 = 0; b0 < dim; b0 += block) hadamard_block(x + r * row_stride + b0, block, norm);
}

namespace {

// K and V rows (float32, rounded to bf16 as a cast rounds them, or bf16) into a packed bf16 cache
// (kv_cache.py's packed layout): per block and head, column c of key j in K at group j / 16, pair
// c / 2, lane j % 16, half c % 2; in V at key pair j / 2, column c, half j % 2.
template <typename src_t>
void write_packed_rows(const src_t* k, const src_t* v, int64_t tokens, const int64_t k_strides[2],
                       const int64_t v_strides[2], at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots) {
  const tokenmill::PackedCacheShape shape = tokenmill::packed_cache_shape(k_cache, v_cache);
  const int64_t bs = shape.block_size, d = shape.d, heads = shape.kv_heads;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < shape.blocks * bs, "KV slot out of range");
  auto* kc = k_cache.data_ptr<at::BFloat16>();
  auto* vc = v_cache.data_ptr<at::BFloat16>();
  // Tokens split over threads (a prompt chunk's thousands; each token's values land in their own bytes).
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / bs, j = slots[t] % bs;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t head = (block * heads + h) * bs * d;
        const src_t* kr = k + t * k_strides[0] + h * k_strides[1];
        const src_t* vr = v + t * v_strides[0] + h * v_strides[1];
        at::BFloat16* kd = kc + head + (j / 16) * 16 * d + (j % 16) * 2;
        at::BFloat16* vd = vc + head + (j / 2) * 2 * d + j % 2;
        for (int64_t c = 0; c < d; ++c) {
          kd[(c / 2) * 32 + c % 2] = static_cast<at::BFloat16>(kr[c]);
          vd[c * 2] = static_cast<at::BFloat16>(vr[c]);
        }
      }
    }
  });
}

}  // namespace

void write_kv_rows(const float* k, const float* v, int64_t tokens, const int64_t k_strides[2],
                   const int64_t v_strides[2], at::Tensor& k_cache, at::Tensor& v_cache, const c10::optional<at::Tensor>& k_scale,
                   const c10::optional<at::Tensor>& v_scale, const int64_t* slots) {
  if (k_cache.dim() == 6) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "a packed KV cache is bf16, without scales");
    write_packed_rows(k, v, tokens, k_strides, v_strides, k_cache, v_cache, slots);
    return;
  }
  const int64_t heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "KV slot out of range");
  check_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  AT_DISPATCH_V2(k_cache.scalar_type(), "write_kv_rows", AT_WRAP([&] {
    for (int pass = 0; pass < 2; ++pass) {
      const float* src = pass == 0 ? k : v;
      const int64_t* strides = pass == 0 ? k_strides : v_strides;
      scalar_t* cache = (pass == 0 ? k_cache : v_cache).data_ptr<scalar_t>();
      at::Half* scales = nullptr;
      int64_t s_block = 0, s_head = 0;
      if (k_scale.has_value()) {
        const at::Tensor& st = pass == 0 ? *k_scale : *v_scale;
        scales = st.data_ptr<at::Half>(), s_block = st.stride(0), s_head = st.stride(1);
      }
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t slot = slots[t], block = slot / k_cache.size(1), offset = slot % k_cache.size(1);
        for (int64_t h = 0; h < heads; ++h) {
          const float* row = src + t * strides[0] + h * strides[1];
          scalar_t* dst = cache + (slot * heads + h) * dim;
          if constexpr (std::is_same_v<scalar_t, int8_t> || std::is_same_v<scalar_t, c10::Float8_e4m3fn>) {
            quantize_kv_row(row, dim, dst, scales + block * s_block + h * s_head + offset);
          } else {  // a plain cast (round to nearest even for bf16/fp16)
            for (int64_t i = 0; i < dim; ++i) dst[i] = static_cast<scalar_t>(row[i]);
          }
        }
      }
    }
  }), at::kFloat, at::kBFloat16, at::kHalf, at::kChar, at::kFloat8_e4m3fn);
}

void hadamard_(at::Tensor x, int64_t block) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x: float32 [tokens, heads, head_dim] with contiguous rows");
  float* p = x.data_ptr<float>();
  const int64_t heads = x.size(1), s0 = x.stride(0), s1 = x.stride(1);
  for (int64_t t = 0; t < x.size(0); ++t) hadamard_rows_(p + t * s0, heads, s1, x.size(2), block);
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                    const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v: [tokens, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) == k.size(0),
              "slots: int64, one per token");
  const int64_t k_strides[2] = {k.stride(0), k.stride(1)}, v_strides[2] = {v.stride(0), v.stride(1)};
  if (k_cache.dim() == 6) {  // a packed bf16 cache: float32 or bf16 rows
    const tokenmill::PackedCacheShape shape = packed_cache_shape(k_cache, v_cache);
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "a packed KV cache is bf16, without scales");
    TORCH_CHECK(k.size(1) == shape.kv_heads && k.size(2) == shape.d, "k/v rows do not match the cache's heads");
    TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
                "k and v rows must be float32 or bf16 of one dtype");
    if (k.scalar_type() == at::kFloat)
      write_packed_rows(k.data_ptr<float>(), v.data_ptr<float>(), k.size(0), k_strides, v_strides, k_cache, v_cache,
                        slots.data_ptr<int64_t>());
    else
      write_packed_rows(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), k.size(0), k_strides, v_strides,
                        k_cache, v_cache, slots.data_ptr<int64_t>());
    return;
  }
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "k and v rows must be float32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k/v cache must be [blocks, block_size, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k/v rows do not match the cache's heads");
  write_kv_rows(k.data_ptr<float>(), v.data_ptr<float>(), k.size(0), k_strides, v_strides, k_cache, v_cache, k_scale,
                v_scale, slots.data_ptr<int64_t>());
}

void paged_decode_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be 0 (the whole context) or positive");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables: contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: contiguous int32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one block table and length per sequence");
  if (k_cache.dim() == 6) {  // a packed bf16 cache: the prefill kernel's arithmetic (cpu_prefill_attention.cpp)
    TORCH_CHECK(window == 0, "a packed KV cache has no sliding-window attention");
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "a packed KV cache is bf16, without scales");
    packed_decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, scale);
    return;
  }
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.strides() == k_cache.strides(), "cache rows must be contiguous");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v caches must have one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out rows must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim of q and cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: contiguous int32");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens: contiguous int32");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "one block table and length per sequence");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "out and q dtypes differ");
  check_scales(k_cache, k_scale, v_scale);
  AT_DISPATCH_V2(q.scalar_type(), "paged_decode_attention_q", AT_WRAP([&] {
    using q_t = scalar_t;
    AT_DISPATCH_V2(k_cache.scalar_type(), "paged_decode_attention_kv", AT_WRAP([&] {
      decode_kernel<q_t, scalar_t>(out, q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                                   window);
    }), at::kFloat, at::kBFloat16, at::kHalf, at::kChar, at::kFloat8_e4m3fn);
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace tokenmill

TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int window=0) -> ()");
  m.def(
      "write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, "
      "Tensor(d!)? v_scale, Tensor slots) -> ()");
  m.def("hadamard_(Tensor(a!) x, int block) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &tokenmill::paged_decode_attention);
  m.impl("write_kv_cache", &tokenmill::write_kv_cache);
  m.impl("hadamard_", &tokenmill::hadamard_);
}
