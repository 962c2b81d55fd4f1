// Prefill attention in bf16 on AVX-512 BF16 dot products (vdpbf16ps): a chunk of n query
// rows over L >= n keys, bottom-right causal (row i sees keys 0 .. L - n + i), grouped-query
// heads. What torch's CPU flash attention computes for bf16 inputs (scores and softmax in
// float32, probabilities rounded to bf16 for the value product, float32 accumulation, bf16
// out), organised for a small head_dim: on a 2-core Zen 4 EPYC torch's kernel ran a
// 1024-token causal layer of 9 heads of 64 in 22-30 ms at one thread, about 45 GFLOP/s, bf16
// no faster than float32, 36-40% of a bf16 prefill.
//
// Per KV head, K and V are repacked once per call so the dot products read them in order
// (a step's chunks in one call: a key block that several hold in the same cache slots, a shared
// prefix, is repacked once for all of them):
// K as [key block of 32][d / 2 pairs][32 keys] of bf16 pairs (a vector = 16 keys' pair p), V
// as [key pair][d] of (v[2m][c], v[2m + 1][c]) pairs. A task is 4 query rows of one head: for
// each block of 32 keys up to the causal limit, the 4 rows' scores (d / 2 dot products per 16
// keys, each K load shared by the 4 rows, each q broadcast by 2 vectors of keys), an online
// softmax per row (running max and sum, the accumulator rescaled when the max moved), the
// probabilities to bf16, and the value product (16 key pairs x d / 16 vectors, one V load
// shared by the 4 rows). 32 keys a block ran 1.2x 16 (3 alternated pairs of runs, medians).
// Tasks are split over threads by head, then rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TM_PREFILL_BF16 1
#endif

namespace {

#if defined(TM_PREFILL_BF16)
constexpr int64_t kKeys = 32;  // keys per block: two vectors of scores
constexpr int64_t kRows = 4;   // query rows per task
// prefetcht1 of p's line, as an asm statement (GCC may drop __builtin_prefetch in loops;
// cpu_attention.cpp's prefetch_block).
inline void prefetch_line(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// e^x on 16 float32 lanes (cpu_vec.h's exp8, 16 wide): x = n ln2 + r, e^r by a degree-6
// polynomial, 2^n through the exponent bits.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

inline uint32_t pair_at(const uint16_t* row, int64_t c) {
  uint32_t v;
  std::memcpy(&v, row + c, 4);
  return v;
}

// A key block (32 keys) as attend_rows reads it, in two halves of 16 keys: half x's K pair p
// (its 16 keys' bf16 pairs 2p, 2p + 1: one vector) at k[x] + 16 p, its V key pair m (keys 2m,
// 2m + 1 of the half, each column's two values a u32) at v[x] + m d. The layout of a packed
// block (pack_block) and of a bf16 cache kept packed (LayerKVCache's packed layout) alike.
struct KeyBlock {
  const uint32_t* k[2];
  const uint32_t* v[2];
};

// One task: query rows [r0, r0 + NR) (NR <= 4) of one head, row r seeing keys 0 .. offset + r
// x row_step (1: a chunk's rows, bottom-right causal; 0: rows that all see the same keys, a
// decode token's heads of one KV head). ND = head_dim / 16; a key block is KV vectors of 16 keys.
// `blocks(kb)`: key block kb (its keys 32 kb .. 32 kb + 31), from the step's packed blocks
// (PackedBlocks) or read where a packed cache holds it (CacheGroups).
// Each row's arithmetic is its own: the same bits whatever rows share the task, and whichever
// source holds the same K and V. The output rows are bf16, or (out_t float) the bf16 widened.
template <int ND, int NR, typename Blocks, typename out_t>
void attend_rows_of(const uint16_t* q, int64_t q_row, int64_t r0, int64_t offset, int64_t row_step,
                    const Blocks& blocks, float scale, out_t* out, int64_t out_row) {
  constexpr int64_t d = ND * 16, pairs = d / 2, KV = kKeys / 16;
  __m512 acc[NR][ND];
  __m512 l[NR];  // each row's running sum of probabilities, lane by lane (added across at the end)
  float m[NR];
  for (int64_t r = 0; r < NR; ++r) {
    for (int j = 0; j < ND; ++j) acc[r][j] = _mm512_setzero_ps();
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = _mm512_setzero_ps();
  }
  const int64_t last = offset + (r0 + NR - 1) * row_step;  // the last row's last key
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) uint16_t pb[NR][kKeys];  // each row's probabilities of the block, in bf16
  for (int64_t kb = 0; kb * kKeys <= last; ++kb) {
    __m512 s[NR][KV];
    for (int64_t r = 0; r < NR; ++r)
      for (int64_t x = 0; x < KV; ++x) s[r][x] = _mm512_setzero_ps();
    const KeyBlock block = blocks(kb);
    // The next block's K and V lines (4 x d / 2 of them): one line of each of the four
    // half-blocks with every pair of columns.
    KeyBlock next{};
    if constexpr (Blocks::kPrefetch)
      if (blocks.ahead && (kb + 1) * kKeys <= last) next = blocks.locate(kb + 1);
    for (int64_t p = 0; p < pairs; ++p) {
      if constexpr (Blocks::kPrefetch)
        if (next.k[0] != nullptr)
          for (const uint32_t* line : {next.k[0], next.k[1], next.v[0], next.v[1]}) prefetch_line(line + p * 16);
      __m512bh kv[KV];
      for (int64_t x = 0; x < KV; ++x) kv[x] = (__m512bh)_mm512_loadu_si512(block.k[x] + p * 16);
      for (int64_t r = 0; r < NR; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair_at(q + (r0 + r) * q_row, 2 * p));
        for (int64_t x = 0; x < KV; ++x) s[r][x] = _mm512_dpbf16_ps(s[r][x], kv[x], qv);
      }
    }
#pragma GCC unroll 4
    for (int64_t r = 0; r < NR; ++r) {
      // The block's scores (invisible keys at -inf), their max in one reduction, the
      // probabilities, and the running sum kept lane by lane: the horizontal sums and a
      // libm exp per row and block were a third of a decode row's instructions.
      __m512 sc[KV];
      __mmask16 valid[KV];
      __m512 bmv = minus_inf;
      for (int64_t x = 0; x < KV; ++x) {
        const int64_t limit = offset + (r0 + r) * row_step - kb * kKeys - x * 16;  // lanes 0..limit are visible
        valid[x] = limit >= 15 ? __mmask16(0xFFFF) : limit < 0 ? __mmask16(0) : __mmask16((1u << (limit + 1)) - 1);
        sc[x] = _mm512_mask_mov_ps(minus_inf, valid[x], _mm512_mul_ps(s[r][x], vscale));
        bmv = _mm512_max_ps(bmv, sc[x]);
      }
      const float bm = _mm512_reduce_max_ps(bmv);
      if (bm == -std::numeric_limits<float>::infinity()) {  // no key of this block is visible to the row
        std::memset(pb[r], 0, sizeof(pb[r]));
        continue;
      }
      __m512 sum = _mm512_setzero_ps();
      const float new_m = std::max(m[r], bm);
      const __m512 vm = _mm512_set1_ps(new_m);
      for (int64_t x = 0; x < KV; ++x) {
        const __m512 pr = _mm512_maskz_mov_ps(valid[x], exp16(_mm512_sub_ps(sc[x], vm)));
        sum = _mm512_add_ps(sum, pr);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb[r] + x * 16), (__m256i)_mm512_cvtneps_pbh(pr));
      }
      if (new_m != m[r]) {  // the max moved: what was summed so far is rescaled (e^0 = 1 otherwise)
        const __m512 va = _mm512_set1_ps(std::exp(m[r] - new_m));
        l[r] = _mm512_mul_ps(l[r], va);
        for (int j = 0; j < ND; ++j) acc[r][j] = _mm512_mul_ps(acc[r][j], va);
      }
      l[r] = _mm512_add_ps(l[r], sum);
      m[r] = new_m;
    }
    for (int64_t mp = 0; mp < kKeys / 2; ++mp) {
      __m512bh pv[NR];
      for (int64_t r = 0; r < NR; ++r) pv[r] = (__m512bh)_mm512_set1_epi32(pair_at(pb[r], 2 * mp));
      const uint32_t* vrow = block.v[mp / 8] + (mp % 8) * d;
      for (int j = 0; j < ND; ++j) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(vrow + j * 16);
        for (int64_t r = 0; r < NR; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], vv, pv[r]);
      }
    }
  }
  for (int64_t r = 0; r < NR; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
    out_t* o = out + (r0 + r) * out_row;
    for (int j = 0; j < ND; ++j) {
      const __m256i bf = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][j], inv));
      if constexpr (std::is_same_v<out_t, float>)
        _mm512_storeu_ps(o + j * 16, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16)));
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j * 16), bf);
    }
  }
}

// attend_rows_of for nr = 1 .. kRows rows: the row count a compile-time constant, so every row
// loop unrolls with its scores and accumulators in registers and no row is computed for nothing
// (a decode's 3 query heads of a KV head used to run the value product for 4).
template <int ND, typename Blocks, typename out_t = uint16_t>
void attend_rows(const uint16_t* q, int64_t q_row, int64_t r0, int64_t nr, int64_t offset, int64_t row_step,
                 const Blocks& blocks, float scale, out_t* out, int64_t out_row) {
  static_assert(kRows == 4);
  switch (nr) {
    case 1: return attend_rows_of<ND, 1>(q, q_row, r0, offset, row_step, blocks, scale, out, out_row);
    case 2: return attend_rows_of<ND, 2>(q, q_row, r0, offset, row_step, blocks, scale, out, out_row);
    case 3: return attend_rows_of<ND, 3>(q, q_row, r0, offset, row_step, blocks, scale, out, out_row);
    default: return attend_rows_of<ND, 4>(q, q_row, r0, offset, row_step, blocks, scale, out, out_row);
  }
}

// r[i] <- column i of the 16 x 16 matrix of 32-bit lanes whose rows are r[0..15].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] now holds, in its 128-bit lane L, column 4L + b of rows 4a .. 4a + 3.
  for (int b = 0; b < 4; ++b) {
    t[b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);      // lanes 0, 2 of rows 0-3, then of rows 4-7
    t[4 + b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xDD);  // lanes 1, 3
    t[8 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
    t[12 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xDD);
  }
  for (int b = 0; b < 4; ++b) {
    r[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);           // column b
    r[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xDD);       // column 8 + b
    r[4 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0x88);  // column 4 + b
    r[12 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0xDD);  // column 12 + b
  }
}

// Packs one block of `keys` <= 32 keys as attend_rows reads them: K as [2 halves][d / 2 pairs][16
// keys] of bf16 pairs, V as [16 key pairs][d] of (v[2m][c], v[2m + 1][c]) pairs, zeros past the last
// key; key j's K and V rows (d bf16 each) at k_row(j) and v_row(j). K by 16 x 16 transposes of
// pairs, V by interleaving two rows' words: data movement only, the bytes of the scalar copy it
// replaced (a single-row chunk over 640 keys: 82-114 -> 53-58 us, one layer of 9 heads).
template <typename KRow, typename VRow>
void pack_block(uint32_t* kdst, uint32_t* vdst, int64_t d, int64_t keys, KRow k_row, VRow v_row) {
  const int64_t pairs = d / 2;
  for (int64_t x = 0; x < kKeys / 16; ++x)
    for (int64_t c = 0; c < pairs; c += 16) {  // pairs c .. c + 15 of keys 16 x .. 16 x + 15
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t key = x * 16 + j;
        r[j] = key < keys ? _mm512_loadu_si512(k_row(key) + 2 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kdst + (x * pairs + c + p) * 16, r[p]);
    }
  const __m512i lo_words = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                            6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_words = _mm512_add_epi16(lo_words, _mm512_set1_epi16(16));
  for (int64_t mp = 0; mp < kKeys / 2; ++mp) {
    const int64_t j = 2 * mp;
    if (j >= keys) {  // past the last key: zeros (their probabilities are 0; 0 x garbage could be NaN)
      std::memset(vdst + mp * d, 0, (kKeys / 2 - mp) * d * sizeof(uint32_t));
      break;
    }
    const uint16_t* lo = v_row(j);
    const uint16_t* hi = j + 1 < keys ? v_row(j + 1) : nullptr;
    for (int64_t c = 0; c < d; c += 32) {  // 32 columns of both rows -> 32 pairs
      const __m512i a = _mm512_loadu_si512(lo + c), b = hi ? _mm512_loadu_si512(hi + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vdst + mp * d + c, _mm512_permutex2var_epi16(a, lo_words, b));
      _mm512_storeu_si512(vdst + mp * d + c + 16, _mm512_permutex2var_epi16(a, hi_words, b));
    }
  }
}

// A chunk's key blocks among the step's packed ones: chunks that share a block (a prefix held
// by the same cache slots) read one copy.
struct PackedBlocks {
  static constexpr bool kPrefetch = false;  // packed by this call: in the core's caches already
  const uint32_t* kp;
  const uint32_t* vp;
  const int32_t* table;  // the chunk's block kb is packed block table[kb]
  int64_t d;
  KeyBlock operator()(int64_t kb) const {
    const uint32_t* k = kp + table[kb] * (d / 2) * kKeys;
    const uint32_t* v = vp + table[kb] * (kKeys / 2) * d;
    return {{k, k + (d / 2) * 16}, {v, v + 8 * d}};
  }
};

alignas(64) const uint32_t kZeros[8 * 128] = {};  // a half block past the last key (d <= 128)

// Key blocks read where a packed bf16 cache holds them (LayerKVCache's packed layout: per cache
// block and KV head, K as [block_size / 16 groups][d / 2 pairs][16 keys] of bf16 pairs, V as
// [block_size / 2 key pairs][d] pairs): a half block is one group of a cache block, read in
// place, no packing. Key j is at position j; `slot_of(j)` its cache slot (a multiple of 16 at
// each group's first key). The last group's V past the last key is staged as zeros (a probability
// of 0 times a stale value could be NaN); its K lanes past the key are masked out anyway.
template <typename SlotOf>
struct CacheGroups {
  const uint32_t* kc;
  const uint32_t* vc;
  int64_t block_size, block_words, head_words, d, keys;  // block_words: a cache block's, all heads
  SlotOf slot_of;
  uint32_t* vstage;  // 8 d words
  // Whether attend_rows asks for the next block ahead: decode rows (each task streams one
  // sequence's whole context once, from memory); not a prompt's chunks, whose tasks find
  // their keys in the core's caches (written by this step or read by the task before:
  // the prefetches cost a 1,024-token prompt ~5% and bought nothing).
  bool ahead = false;

  // A cache's blocks sit anywhere, so the hardware prefetchers lose the stream at every block:
  // attend_rows asks for the next block's lines (into L2) while it computes on this one
  // (where `ahead`, above).
  static constexpr bool kPrefetch = true;

  // Where key block kb's halves are (a half past the last key: its other half's lines again).
  KeyBlock locate(int64_t kb) const {
    KeyBlock block;
    for (int x = 0; x < 2; ++x) {
      const int64_t first = std::min(kb * kKeys + x * 16, (keys - 1) / 16 * 16);
      const int64_t slot = slot_of(first);
      const int64_t at = (slot / block_size) * block_words + head_words + (slot % block_size) / 16 * 8 * d;
      block.k[x] = kc + at;
      block.v[x] = vc + at;
    }
    return block;
  }

  KeyBlock operator()(int64_t kb) const {
    KeyBlock block;
    for (int x = 0; x < 2; ++x) {
      const int64_t first = kb * kKeys + x * 16;
      if (first >= keys) {
        block.k[x] = block.v[x] = kZeros;
        continue;
      }
      const int64_t slot = slot_of(first);
      const int64_t at = (slot / block_size) * block_words + head_words + (slot % block_size) / 16 * 8 * d;
      block.k[x] = kc + at;
      block.v[x] = vc + at;
      const int64_t n = keys - first;
      if (n >= 16) continue;
      for (int64_t m = 0; m < 8; ++m) {
        const uint32_t keep = 2 * m + 1 < n ? 0xFFFFFFFFu : 2 * m < n ? 0x0000FFFFu : 0u;
        for (int64_t c = 0; c < d; ++c) vstage[m * d + c] = vc[at + m * d + c] & keep;
      }
      block.v[x] = vstage;
    }
    return block;
  }
};

template <typename Blocks, typename out_t = uint16_t>
using AttendFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const Blocks&, float,
                          out_t*, int64_t);

template <typename Blocks, typename out_t = uint16_t>
AttendFn<Blocks, out_t> attend_fn(int64_t d) {
  switch (d) {
    case 32: return attend_rows<2, Blocks, out_t>;
    case 64: return attend_rows<4, Blocks, out_t>;
    case 96: return attend_rows<6, Blocks, out_t>;
    case 128: return attend_rows<8, Blocks, out_t>;
    default: return nullptr;
  }
}

// n floats -> bf16 as torch's .to(torch.bfloat16) rounds them: to nearest even, NaN to 0x7FC0,
// denormals kept (vcvtneps2bf16 would flush them). n a multiple of 16.
inline void floats_to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm512_cvtepi32_epi16(r));
  }
}
#endif

}  // namespace

namespace tokenmill {

bool has_prefill_attention(int64_t head_dim) {
#if defined(TM_PREFILL_BF16)
  return attend_fn<PackedBlocks>(head_dim) != nullptr;
#else
  (void)head_dim;
  return false;
#endif
}

#if defined(TM_PREFILL_BF16)
namespace {

// The step's chunks: chunk c is query rows [row_start[c], row_start[c + 1]) over keys
// [key_start[c], key_start[c + 1]) of `slot` (rows of k and v; nullptr: keys 0 .. L - 1 of
// one chunk), query row i seeing its first L - n + i + 1 keys (bottom-right causal).
struct Chunks {
  int64_t count;
  const int64_t* row_start;
  const int64_t* key_start;
  const int64_t* slot;
};

// Runs the chunks' tasks: 4 query rows of one head of one chunk each, chunk c's key blocks of KV
// head g from make_blocks(c, g, stage) (stage: 8 * 128 words the thread may lend the source).
template <typename MakeBlocks>
void run_chunk_tasks(uint16_t* oraw, int64_t os0, int64_t os1, const uint16_t* qraw, int64_t qs0, int64_t qs1,
                     int64_t H, int64_t d, int64_t KVH, const Chunks& chunks, float scale, MakeBlocks make_blocks) {
  using Blocks = decltype(make_blocks(0, 0, nullptr));
  std::vector<int64_t> task_start(chunks.count + 1, 0);
  for (int64_t c = 0; c < chunks.count; ++c) {
    const int64_t n = chunks.row_start[c + 1] - chunks.row_start[c];
    task_start[c + 1] = task_start[c] + H * ((n + kRows - 1) / kRows);
  }
  const AttendFn<Blocks> fn = attend_fn<Blocks>(d);
  const int64_t group = H / KVH;
  // Taken one at a time from a shared counter: the tasks' costs differ (a chunk's rows see
  // from 1 to L keys), and an even split of them left one thread a fifth more work.
  const int64_t total = task_start[chunks.count];
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) {
    alignas(64) uint32_t stage[8 * 128];
    for (int64_t t = next.fetch_add(1); t < total; t = next.fetch_add(1)) {
      const int64_t c = std::upper_bound(task_start.begin(), task_start.end(), t) - task_start.begin() - 1;
      const int64_t row0 = chunks.row_start[c], n = chunks.row_start[c + 1] - row0;
      const int64_t L = chunks.key_start[c + 1] - chunks.key_start[c], row_blocks = (n + kRows - 1) / kRows;
      const int64_t local = t - task_start[c], h = local / row_blocks, rb = local % row_blocks, g = h / group;
      const int64_t r0 = rb * kRows, nr = std::min(kRows, n - r0);
      const Blocks blocks = make_blocks(c, g, stage);
      fn(qraw + row0 * qs0 + h * qs1, qs0, r0, nr, L - n, 1, blocks, scale, oraw + row0 * os0 + h * os1, os0);
    }
  });
}

// Packs every distinct key block of the chunks once per KV head (K as [block][d / 2 pairs][32
// keys] of bf16 pairs, V as [block][16 key pairs][d] pairs, zero past the last key) and runs
// the tasks: 4 query rows of one head of one chunk each. Two chunks' blocks are one when they
// hold the same cache slots (the same tokens at the same positions: a shared prefix), so a
// prefix is packed once for all the chunks that read it; each row's arithmetic is the one a
// chunk alone gets.
void attend_chunks(uint16_t* oraw, int64_t os0, int64_t os1, const uint16_t* qraw, int64_t qs0, int64_t qs1,
                   int64_t H, int64_t d, const uint16_t* kraw, int64_t ks0, int64_t ks1, const uint16_t* vraw,
                   int64_t vs0, int64_t vs1, int64_t KVH, const Chunks& chunks, float scale,
                   const at::TensorOptions& options) {
  const int64_t pairs = d / 2;
  // Each chunk's key blocks -> packed block index; a block's keys: (first key in `slot`, count).
  std::vector<int64_t> table_start(chunks.count + 1, 0);
  for (int64_t c = 0; c < chunks.count; ++c) {
    const int64_t L = chunks.key_start[c + 1] - chunks.key_start[c];
    table_start[c + 1] = table_start[c] + (L + kKeys - 1) / kKeys;
  }
  std::vector<int32_t> table(table_start[chunks.count]);
  std::vector<std::pair<int64_t, int64_t>> unique;  // (first key, keys)
  std::unordered_map<int64_t, std::vector<int32_t>> by_first_slot;
  for (int64_t c = 0; c < chunks.count; ++c) {
    const int64_t k0 = chunks.key_start[c], L = chunks.key_start[c + 1] - k0;
    for (int64_t b = 0; b * kKeys < L; ++b) {
      const int64_t first = k0 + b * kKeys, keys = std::min(kKeys, L - b * kKeys);
      int32_t found = -1;
      if (chunks.slot != nullptr) {
        auto& same_start = by_first_slot[chunks.slot[first]];
        for (int32_t u : same_start)
          if (unique[u].second == keys &&
              std::memcmp(chunks.slot + unique[u].first, chunks.slot + first, keys * sizeof(int64_t)) == 0) {
            found = u;
            break;
          }
        if (found < 0) same_start.push_back(static_cast<int32_t>(unique.size()));
      }
      if (found < 0) {
        found = static_cast<int32_t>(unique.size());
        unique.emplace_back(first, keys);
      }
      table[table_start[c] + b] = found;
    }
  }
  const int64_t U = static_cast<int64_t>(unique.size());
  at::Tensor kp = at::empty({KVH, U * pairs * kKeys}, options.dtype(at::kInt));
  at::Tensor vp = at::empty({KVH, U * (kKeys / 2) * d}, options.dtype(at::kInt));
  uint32_t* kpp = reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>());
  uint32_t* vpp = reinterpret_cast<uint32_t*>(vp.data_ptr<int32_t>());
  const int64_t* slot = chunks.slot;
  auto row_of = [slot](int64_t key) { return slot ? slot[key] : key; };
  at::parallel_for(0, KVH * U, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / U, u = t % U, first = unique[u].first, keys = unique[u].second;
      pack_block(kpp + (g * U + u) * pairs * kKeys, vpp + (g * U + u) * (kKeys / 2) * d, d, keys,
                 [&](int64_t j) { return kraw + row_of(first + j) * ks0 + g * ks1; },
                 [&](int64_t j) { return vraw + row_of(first + j) * vs0 + g * vs1; });
    }
  });
  run_chunk_tasks(oraw, os0, os1, qraw, qs0, qs1, H, d, KVH, chunks, scale, [&](int64_t c, int64_t g, uint32_t*) {
    return PackedBlocks{kpp + g * U * pairs * kKeys, vpp + g * U * (kKeys / 2) * d, table.data() + table_start[c], d};
  });
}

// The step's chunks over a packed bf16 cache (k, v: the cache as words [blocks, KVH, block_size
// d / 2]): each key block read where the cache holds it, nothing packed.
void attend_chunks_in_cache(uint16_t* oraw, int64_t os0, int64_t os1, const uint16_t* qraw, int64_t qs0, int64_t qs1,
                            int64_t H, int64_t d, const uint32_t* kc, const uint32_t* vc, int64_t KVH,
                            int64_t block_size, const Chunks& chunks, float scale) {
  const int64_t head_words = block_size * d / 2;
  run_chunk_tasks(oraw, os0, os1, qraw, qs0, qs1, H, d, KVH, chunks, scale, [&](int64_t c, int64_t g, uint32_t* stage) {
    const int64_t* slots = chunks.slot + chunks.key_start[c];
    auto slot_of = [slots](int64_t key) { return slots[key]; };
    return CacheGroups<decltype(slot_of)>{kc, vc, block_size, KVH * head_words, g * head_words, d,
                                          chunks.key_start[c + 1] - chunks.key_start[c], slot_of, stage};
  });
}

// Decode rows over a packed bf16 cache with the bits the prefill kernel gives the same token as
// the last row of a chunk: a task is one sequence's KV head, the group's query heads its rows
// (all seeing every key, row_step 0), each key block read in place. q and out are bf16
// (uint16_t), or float32: q rounded to bf16 here as torch rounds it, out the bf16 results
// widened (the bits of casting around a bf16 call, without the casts' tensors).
template <typename io_t>
void decode_in_cache(io_t* oraw, int64_t os0, int64_t os1, const io_t* qraw, int64_t qs0, int64_t qs1, int64_t B,
                     int64_t H, int64_t d, const uint32_t* kc, const uint32_t* vc, int64_t KVH, int64_t block_size,
                     const int32_t* tables, int64_t max_blocks, const int32_t* lens, float scale) {
  const int64_t group = H / KVH, total = B * KVH, head_words = block_size * d / 2;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) {
    alignas(64) uint32_t stage[8 * 128];
    std::vector<uint16_t> qb(std::is_same_v<io_t, float> ? group * d : 0);  // the group's q rows in bf16
    for (int64_t t = next.fetch_add(1); t < total; t = next.fetch_add(1)) {
      const int64_t s = t / KVH, g = t % KVH;
      const int32_t* table = tables + s * max_blocks;
      auto slot_of = [table, block_size](int64_t key) {
        return static_cast<int64_t>(table[key / block_size]) * block_size + key % block_size;
      };
      using Blocks = CacheGroups<decltype(slot_of)>;
      const Blocks blocks{kc, vc, block_size, KVH * head_words, g * head_words, d, lens[s], slot_of, stage, true};
      const uint16_t* qg;
      int64_t q_row;
      if constexpr (std::is_same_v<io_t, float>) {
        for (int64_t r = 0; r < group; ++r) floats_to_bf16(qraw + s * qs0 + (g * group + r) * qs1, d, qb.data() + r * d);
        qg = qb.data(), q_row = d;
      } else {
        qg = qraw + s * qs0 + g * group * qs1, q_row = qs1;
      }
      const AttendFn<Blocks, io_t> fn = attend_fn<Blocks, io_t>(d);
      for (int64_t h0 = 0; h0 < group; h0 += kRows)
        fn(qg + h0 * q_row, q_row, 0, std::min(kRows, group - h0), lens[s] - 1, 0, blocks, scale,
           oraw + s * os0 + (g * group + h0) * os1, os1);
    }
  });
}

void check_bf16_rows(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->stride(2) == 1,
                "bf16 tensors [rows, heads, d] with contiguous rows");
}

}  // namespace
#endif

PackedCacheShape packed_cache_shape(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 6 && v.dim() == 5 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  k.is_contiguous() && v.is_contiguous(),
              "a packed KV cache is contiguous bf16: K [blocks, kv_heads, block_size / 16, head_dim / 2, 16, 2], "
              "V [blocks, kv_heads, block_size / 2, head_dim, 2]");
  const PackedCacheShape shape{k.size(0), k.size(1), k.size(2) * 16, k.size(3) * 2};
  TORCH_CHECK(k.size(4) == 16 && k.size(5) == 2 && v.size(0) == shape.blocks && v.size(1) == shape.kv_heads &&
                  v.size(2) * 2 == shape.block_size && v.size(3) == shape.d && v.size(4) == 2,
              "the packed K and V caches' shapes do not match");
  return shape;
}

void packed_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  const PackedCacheShape shape = packed_cache_shape(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.size(2) == shape.d && q.size(1) % shape.kv_heads == 0,
              "q, out [decodes, heads, head_dim] matching the cache");
  TORCH_CHECK(q.scalar_type() == out.scalar_type() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  q.stride(2) == 1 && out.stride(2) == 1,
              "q and out: float32 or bf16 of one dtype, rows contiguous");
  TORCH_CHECK(has_prefill_attention(shape.d), "a packed KV cache needs AVX-512 BF16 and head_dim 32, 64, 96 or 128");
  const int64_t B = q.size(0), max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t s = 0; s < B; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= max_blocks * shape.block_size, "context_lens[", s, "] = ", lens[s],
                " does not fit its block table");
    for (int64_t b = 0; b * shape.block_size < lens[s]; ++b)
      TORCH_CHECK(tables[s * max_blocks + b] >= 0 && tables[s * max_blocks + b] < shape.blocks, "block_tables[", s,
                  "][", b, "] is outside the cache");
  }
#if defined(TM_PREFILL_BF16)
  const auto* kc = reinterpret_cast<const uint32_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vc = reinterpret_cast<const uint32_t*>(v_cache.data_ptr<c10::BFloat16>());
  if (q.scalar_type() == at::kFloat)
    decode_in_cache<float>(out.data_ptr<float>(), out.stride(0), out.stride(1), q.data_ptr<float>(), q.stride(0),
                           q.stride(1), B, q.size(1), shape.d, kc, vc, shape.kv_heads, shape.block_size, tables,
                           max_blocks, lens, static_cast<float>(scale));
  else
    decode_in_cache<uint16_t>(reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out.stride(0), out.stride(1),
                              reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()), q.stride(0), q.stride(1),
                              B, q.size(1), shape.d, kc, vc, shape.kv_heads, shape.block_size, tables, max_blocks, lens,
                              static_cast<float>(scale));
#else
  (void)scale;
#endif
}

// out [n, H, d] bf16 = attention of q [n, H, d] over k, v [L, KVH, d] (all bf16, rows of d
// contiguous, any token/head strides), query row i seeing keys 0 .. L - n + i. With
// `key_slots` (int64 [L]), k and v are a whole paged cache viewed as [slots, KVH, d] and key j
// is row key_slots[j]: the keys are read where they are stored while they are packed, with
// no gathered copy (the same values, so the same bits as gathering them first).
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       const std::optional<at::Tensor>& key_slots) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "q, out [n, heads, d]; k, v [L, kv_heads, d]");
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1, "bf16 tensors with contiguous rows");
  const int64_t* slot = nullptr;
  if (key_slots.has_value()) {
    TORCH_CHECK(key_slots->scalar_type() == at::kLong && key_slots->dim() == 1 && key_slots->is_contiguous(),
                "key_slots: contiguous int64 [L]");
    slot = key_slots->data_ptr<int64_t>();
    const int64_t rows = k.size(0);
    for (int64_t j = 0; j < key_slots->size(0); ++j)
      TORCH_CHECK(slot[j] >= 0 && slot[j] < rows, "key_slots[", j, "] = ", slot[j], " is outside the cache's ", rows,
                  " slots");
  }
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), KVH = k.size(1);
  const int64_t L = slot ? key_slots->size(0) : k.size(0);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == d && H % KVH == 0 && L >= n, "shapes do not match");
  TORCH_CHECK(has_prefill_attention(d), "prefill_attention: needs AVX-512 BF16 and head_dim 32, 64, 96 or 128");
#if defined(TM_PREFILL_BF16)
  const int64_t rows[2] = {0, n}, keys[2] = {0, L};
  attend_chunks(reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out.stride(0), out.stride(1),
                reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()), q.stride(0), q.stride(1), H, d,
                reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>()), k.stride(0), k.stride(1),
                reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>()), v.stride(0), v.stride(1), KVH,
                Chunks{1, rows, keys, slot}, static_cast<float>(scale), q.options());
#else
  (void)scale;
#endif
}

// Every prompt chunk of a step in one call: chunk c is rows [row_starts[c], row_starts[c + 1])
// of q and out [N, H, d], over the keys in cache rows key_slots[key_starts[c] ..
// key_starts[c + 1]) of k, v [slots, KVH, d] (its context and itself, in position order).
// Each row gets the bits `prefill_attention` gives its chunk alone; a key block that several
// chunks hold in the same slots (a shared prefix) is packed once for all of them.
void prefill_attention_chunks(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              double scale, const at::Tensor& row_starts, const at::Tensor& key_slots,
                              const at::Tensor& key_starts) {
  for (const at::Tensor* t : {&row_starts, &key_slots, &key_starts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(), "row_starts, key_slots, "
                "key_starts: contiguous int64 vectors");
  const int64_t count = row_starts.size(0) - 1;
  TORCH_CHECK(count >= 0 && key_starts.size(0) == count + 1, "row_starts and key_starts: one more than the chunks");
  const bool packed = k.dim() == 6;  // a bf16 cache in the packed layout (kv_cache.py)
  const PackedCacheShape shape = packed ? packed_cache_shape(k, v) : PackedCacheShape{k.size(0), k.size(1), 1, k.size(2)};
  TORCH_CHECK(out.sizes() == q.sizes() && (packed || k.sizes() == v.sizes()) && shape.d == q.size(2) &&
              q.size(1) % shape.kv_heads == 0, "q, out [N, heads, d]; k, v [slots, kv_heads, d] or a packed cache");
  const int64_t N = q.size(0), H = q.size(1), d = q.size(2), KVH = shape.kv_heads, slots = shape.blocks * shape.block_size;
  TORCH_CHECK(has_prefill_attention(d), "prefill_attention: needs AVX-512 BF16 and head_dim 32, 64, 96 or 128");
  const int64_t* rs = row_starts.data_ptr<int64_t>();
  const int64_t* ks = key_starts.data_ptr<int64_t>();
  const int64_t* slot = key_slots.data_ptr<int64_t>();
  TORCH_CHECK(rs[0] >= 0 && rs[count] <= N && ks[0] == 0 && ks[count] == key_slots.size(0), "starts out of range");
  for (int64_t c = 0; c < count; ++c)
    TORCH_CHECK(rs[c + 1] >= rs[c] && ks[c + 1] - ks[c] >= rs[c + 1] - rs[c],
                "chunk ", c, ": its keys must include its own rows");
  for (int64_t j = 0; j < key_slots.size(0); ++j)
    TORCH_CHECK(slot[j] >= 0 && slot[j] < slots, "key_slots[", j, "] = ", slot[j], " is outside the cache's ",
                slots, " slots");
  for (int64_t c = 0; c < count && packed; ++c)  // each 16 keys from position 0 one group of a cache block
    for (int64_t j = ks[c]; j < ks[c + 1]; ++j) {
      const int64_t first = ks[c] + (j - ks[c]) / 16 * 16;
      TORCH_CHECK(slot[first] % 16 == 0 && slot[j] == slot[first] + (j - first), "chunk ", c,
                  ": a packed cache's keys must be in position order from position 0 (key_slots[", j, "] = ", slot[j],
                  ")");
    }
#if defined(TM_PREFILL_BF16)
  if (packed) {
    check_bf16_rows({&out, &q});
    attend_chunks_in_cache(reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out.stride(0), out.stride(1),
                           reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()), q.stride(0), q.stride(1), H,
                           d, reinterpret_cast<const uint32_t*>(k.data_ptr<c10::BFloat16>()),
                           reinterpret_cast<const uint32_t*>(v.data_ptr<c10::BFloat16>()), KVH, shape.block_size,
                           Chunks{count, rs, ks, slot}, static_cast<float>(scale));
    return;
  }
  check_bf16_rows({&out, &q, &k, &v});
  attend_chunks(reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), out.stride(0), out.stride(1),
                reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>()), q.stride(0), q.stride(1), H, d,
                reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>()), k.stride(0), k.stride(1),
                reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>()), v.stride(0), v.stride(1), KVH,
                Chunks{count, rs, ks, slot}, static_cast<float>(scale), q.options());
#else
  (void)scale;
  (void)H;
  (void)KVH;
#endif
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, Tensor? key_slots=None) -> ()");
  m.def("prefill_attention_chunks(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, Tensor row_starts, "
        "Tensor key_slots, Tensor key_starts) -> ()");
  m.def("has_prefill_attention(int head_dim) -> bool", &tokenmill::has_prefill_attention);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("prefill_attention", &tokenmill::prefill_attention);
  m.impl("prefill_attention_chunks", &tokenmill::prefill_attention_chunks);
}
