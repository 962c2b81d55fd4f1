// Matrix multiply with weight-only quantized weights on the CPU: y[M, N] = x[M, K] . W^T,
// W a QuantizedTensor (tokenmill/quantization/qtensor.py): unsigned codes u with
// w = scale * u + min per (row, group), or scale * (u - code_offset) for symmetric formats.
//
// Few rows (decode; up to 8 rows for 4-bit codes, 12 for 8-bit): the activations are
// quantized on the fly, per 32 values, to int8 with d = max|x| / 127 (llama.cpp's Q8_1
// form, q = round(x / d)), and the products run on integers: per 4 columns an int32 lane
// gets the dot product of the codes with q (AVX512-VNNI vpdpbusd on 64 columns at a time;
// AVX-VNNI, or AVX2 maddubs + madd, on 32; plain C otherwise: chosen by the compiler's
// target macros, the build being -march=native), then lane * (scale * d) is accumulated in
// float32. The min term sum_g min[g] * sum_{k in g} d q_k is one fused multiply-add per span
// for all four rows of a tile; a symmetric format's -code_offset * scale * sum(q) is folded
// into the integer dot as its starting value. Why: decode reads every weight once per
// token, so its speed is bytes per weight (Q4_1: 5 bits, bf16: 16), and the integer dot
// products keep the arithmetic near the memory time.
//
// The weight is one byte stream (qtensor.py's `packed`): tiles of 4 rows, each a run of
// spans [scales][mins][codes], read strictly in memory order: the hardware prefetchers
// follow one stream well and several interleaved ones badly (see cpu_linear.cpp). A tile is
// read from memory once per 16 activation rows; it is unpacked once per 4 rows (from L1
// after the first). From 16 rows on (deterministic inference's prompts: integer arithmetic at
// every row count) the same products run with 16 activation rows in the vector lanes
// (lane_rows below): every output bit for bit the row kernel's, 1.3-3x faster at 16-512 rows.
//
// AVX512-VNNI builds, weight groups of 32 or more (every GGUF type but Q6_K's 16): the block
// order instead. Each 32-column block's dot product is summed in int32 first (exact), then
// converted once: acc += fma(dot, scale * d, t), t the group's mins term on its last block
// (else 0); the row kernel (tile_rows_blocked, 1-16 rows) and the whole-block integer GEMM
// (panels, 16 rows on, and past the integer rows where the plan measured it faster than the
// bf16 GEMM) perform exactly that sequence per output, so a row's bits depend on neither the
// row count nor the kernel it picks. Q6_K's groups of 16 keep their own integer order, and
// with the integer GEMM on they stay on the integer kernel past the integer rows (its
// many-row form) rather than the bf16 GEMM, for the same reason (Gemma 3's *_K_M files hold
// Q6_K tensors beside Q4_K and Q5_0 ones).
// In the block order a weight may have column splits (QuantWeight::column_splits): each
// output's sum starts again from zero at every split and the parts' sums are added in order
// at the end, which is what the parts computed apart (each padded to its own span: the
// padding adds exact zeros) and then added give, in one call: deterministic inference's
// row-parallel linears, as the ranks of a 2-way tensor-parallel split and their all-reduce sum
// them (one activation quantization and one pass instead of one per part).
//
// Many rows (prefill, large batches): W is dequantized to bf16 in chunks of up to 4 MiB
// (4-bit codes through a 16-entry table per group) and multiplied by oneDNN's bf16 GEMM,
// AMX where the CPU has it. Past 8-12 rows that beats the integer kernel, whose cost grows
// by about half its one-row time with every row (benchmarks/kernels.py --only quant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

// Which integer dot product: TOKENMILL_QUANT_FORCE_* pick a narrower one for tests.
#if defined(TOKENMILL_QUANT_FORCE_SCALAR)
#define TM_QUANT_SCALAR 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(TOKENMILL_QUANT_FORCE_AVX2)
#define TM_QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_QUANT_AVX2 1
#if defined(__AVXVNNI__) && !defined(TOKENMILL_QUANT_NO_VNNI)
#define TM_QUANT_AVX_VNNI 1
#endif
#else
#define TM_QUANT_SCALAR 1
#endif

#ifndef TOKENMILL_OPS_NS
#define TOKENMILL_OPS_NS tokenmill
#endif

namespace {

constexpr int64_t kRows = 4;     // rows of W per tile
constexpr int64_t kStep = 64;    // columns per kernel step
constexpr int64_t kBlock = 32;   // columns per activation scale
constexpr int64_t kMaxSplits = 7;  // QuantWeight::column_splits (a 2-rank split needs one; room for 8)
constexpr int64_t kLanes = 16;   // int32 lanes per step (4 columns each)
constexpr int64_t kMaxIntegerRows = 16;  // rows per pass of the integer kernel over W
// From this many rows on the integer path runs the lane-rows kernel (the same bits, faster at
// many rows; AVX512-VNNI builds).
constexpr int64_t kManyRows = 16;
// Up to this many rows quant_linear uses the integer kernel by default, beyond it the bf16
// GEMM on dequantized weights. Measured crossover (1 thread, 960x576 .. 3072x576): 4-bit
// codes at 8 rows (integer 128 us vs GEMM 113 us at 8 rows of 960x576), 8-bit at ~12 (their
// dequantization has no table, so the GEMM path costs ~40% more).
int64_t default_integer_rows(int64_t bits) { return bits == 4 ? 8 : 12; }
// Up to this many rows the GEMM path computes y^T = W x^T: oneDNN then packs the small x^T
// rather than W (half the time at 17-64 rows); beyond, y = x W^T saves the transpose.
constexpr int64_t kTransposedGemmRows = 64;
// Software prefetch distance in the weight stream: one core's hardware prefetchers alone
// left the Q4_1 stream at ~6.5 GB/s where a plain read gets ~15 (measured: 2 KiB ahead
// took a 960x576 matrix from 55 to 40 us; 1 and 4 KiB did as well).
#ifndef TM_PREFETCH_BYTES
#define TM_PREFETCH_BYTES 2048
#endif
constexpr int64_t kPrefetchBytes = TM_PREFETCH_BYTES;
#ifndef TM_PREFETCH_HINT
#define TM_PREFETCH_HINT _MM_HINT_T0
#endif

// Where things sit in `packed` (qtensor.py's _Layout, the same arithmetic).
struct Layout {
  int64_t N, K, bits, group, scale_bytes, offset;
  bool has_mins;
  int64_t span, gps, spans, tiles, Kp, scale_block, code_bytes, span_bytes, step_bytes, row_step_bytes;
  // Which of a span's scales each int32 lane takes: row r, lane l of a 64-column step ->
  // r * gps + 4 l / group (lane16); lane l of a 32-column half h -> (32 h + 4 l) / group,
  // to be offset by the row's first scale (lane8). One scale per row when group >= 64.
  alignas(64) int32_t lane16[kRows][kLanes];
  alignas(32) int32_t lane8[2][8];
  // AVX-512 4-bit vectors (load_step_codes): vector 2p + h holds columns 32h..32h+31 of rows
  // 2p (lanes 0-7) and 2p + 1 (lanes 8-15).
  alignas(64) int32_t pair16[kRows][kLanes];
  // mins_lanes[j][r] = r * gps + j: the lane of row r's group j in a span's mins (r < 4).
  alignas(64) int32_t mins_lanes[4][kLanes];
  // QuantWeight::column_splits as 32-column block indices (the block-order kernels' part sums).
  int64_t split_blocks[kMaxSplits];
  int64_t splits = 0;
  // Per 64-column step, with splits: bit h set where a part ends before the step's block h.
  std::vector<uint8_t> step_cuts;

  explicit Layout(const tokenmill::QuantWeight& w)
      : N(w.N), K(w.K), bits(w.bits), group(w.group_size), scale_bytes(w.scale_bytes), offset(w.code_offset),
        has_mins(w.code_offset < 0) {
    TORCH_CHECK(N > 0 && K > 0, "quantized weight: N and K must be positive");
    TORCH_CHECK(bits == 4 || bits == 8, "quantized weight: bits must be 4 or 8, got ", bits);
    TORCH_CHECK(scale_bytes == 2 || scale_bytes == 4, "quantized weight: scales must be float16 or float32");
    TORCH_CHECK(offset >= -1 && offset < (int64_t{1} << bits), "quantized weight: code_offset out of range");
    TORCH_CHECK(group > 0 && (group % kStep == 0 || kStep % group == 0) && group % 4 == 0,
                "quantized weight: kernel group size must be 16, 32 or a multiple of 64, got ", group);
    span = std::max(group, kStep);
    gps = span / group;
    spans = (K + span - 1) / span;
    tiles = (N + kRows - 1) / kRows;
    Kp = spans * span;
    scale_block = kRows * gps * scale_bytes;
    row_step_bytes = kStep * bits / 8;
    step_bytes = kRows * row_step_bytes;
    code_bytes = (span / kStep) * step_bytes;
    span_bytes = scale_block * (has_mins ? 2 : 1) + code_bytes;
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t l = 0; l < kLanes; ++l) lane16[r][l] = static_cast<int32_t>(r * gps + (gps > 1 ? 4 * l / group : 0));
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t l = 0; l < 8; ++l) lane8[h][l] = static_cast<int32_t>(gps > 1 ? (32 * h + 4 * l) / group : 0);
    for (int64_t v = 0; v < kRows; ++v)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t row = 2 * (v / 2) + l / 8, col = 32 * (v % 2) + 4 * (l % 8);
        pair16[v][l] = static_cast<int32_t>(row * gps + (gps > 1 ? col / group : 0));
      }
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t l = 0; l < kLanes; ++l) mins_lanes[j][l] = static_cast<int32_t>(l < kRows ? l * gps + std::min(j, gps - 1) : 0);
    TORCH_CHECK(static_cast<int64_t>(w.column_splits.size()) <= kMaxSplits, "column_splits: at most ", kMaxSplits);
    for (const int64_t c : w.column_splits) {
      TORCH_CHECK(c > (splits ? split_blocks[splits - 1] * kBlock : 0) && c < K && c % kBlock == 0 && c % group == 0,
                  "column_splits: increasing columns inside K, multiples of 32 and of the group (", group, "); got ", c);
      split_blocks[splits++] = c / kBlock;
    }
    if (splits) {
      step_cuts.assign(Kp / kStep, 0);
      for (int64_t i = 0; i < splits; ++i) step_cuts[split_blocks[i] / 2] |= 1 << (split_blocks[i] % 2);
    }
    const at::Tensor& p = w.packed;
    TORCH_CHECK(p.scalar_type() == at::kByte && p.is_contiguous() && p.numel() == tiles * spans * span_bytes,
                "quantized weight: packed must be contiguous uint8 holding ", tiles, " tiles x ", spans, " spans x ",
                span_bytes, " bytes for this format, got ", p.numel(), " bytes");
  }
  const uint8_t* tile(const uint8_t* base, int64_t t) const { return base + t * spans * span_bytes; }
};

inline float load_scale(const uint8_t* p, int64_t i, int64_t scale_bytes) {
  if (scale_bytes == 2) {
    c10::Half h;
    std::memcpy(&h, p + 2 * i, 2);
    return static_cast<float>(h);
  }
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// ----- activations -> int8 per 32 -----------------------------------------------------------

// Quantized activation rows, as the tile kernels read them (all per row m, Kp columns):
// q int8, the scale d of each 4-column lane, the lane's starting value for the integer dot
// (init_mult * sum of its 4 q's: folds a symmetric code offset in), and per span the sums
// d * sum(q) of each group, laid out as the tile's scale lanes (row r, group j at r*gps + j).
struct ActRows {
  int64_t M = 0, Kp = 0, lanes = 0, spans = 0;
  int8_t* q = nullptr;
  float* d = nullptr;
  int32_t* init = nullptr;
  float* gsum = nullptr;
  const int8_t* q_row(int64_t m) const { return q + m * Kp; }
  const float* d_row(int64_t m) const { return d + m * lanes; }
  const int32_t* init_row(int64_t m) const { return init + m * lanes; }
  const float* gsum_span(int64_t m, int64_t s) const { return gsum + (m * spans + s) * kLanes; }
  // by_block layout: group j of a span's gps groups, one of 4 equal lanes (the last group's in
  // lanes 4-7, so a 64-column step's two blocks read [first 4 | last 4]).
  float by_block_gsum(int64_t m, int64_t s, int64_t j, int64_t gps) const { return gsum_span(m, s)[4 * (j + 2 - gps)]; }
};

// Scratch reused across calls on the calling thread (the workers only read it).
struct Scratch {
  std::vector<uint8_t> bytes;
  uint8_t* take(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bytes.data()) + 63) & ~uintptr_t{63});
  }
};

inline size_t round64(size_t n) { return (n + 63) & ~size_t{63}; }

// One block of 32 values: d and q as the PyTorch reference computes them. d and 1/d are
// formed in double and rounded once, which is the correctly rounded float32 quotient
// whatever -ffast-math does to the division (the quotient is never within 2^-49 of a
// float32 rounding boundary); q = round-half-even(x * (127 / amax)).
inline float block_scales(float amax, float* inv) {
  if (!(amax > 1e-30f)) {  // zero (or tiny, whose inverse overflows) blocks quantize to 0
    *inv = 0.f;
    return 0.f;
  }
  *inv = static_cast<float>(127.0 / static_cast<double>(amax));
  return static_cast<float>(static_cast<double>(amax) / 127.0);
}

#if defined(TM_QUANT_AVX512)
// A block's codes by its 1 / d (block_scales'); returns the sum of q.
inline int32_t quantize_block_with(const float* x, int8_t* q, float inv) {
  const __m512 vi = _mm512_set1_ps(inv);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), vi));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));  // |x * inv| <= 127: no saturation
}
#endif

// Returns the block's sum of q.
int32_t quantize_block(const float* x, int8_t* q, float* d_out) {
  float inv;
#if defined(TM_QUANT_AVX512)
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  *d_out = block_scales(amax, &inv);
  const __m512 vi = _mm512_set1_ps(inv);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, vi)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, vi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));  // |x * inv| <= 127: no saturation
#else
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  *d_out = block_scales(amax, &inv);
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const float v = std::nearbyint(x[i] * inv);
    q[i] = static_cast<int8_t>(std::max(-128.f, std::min(127.f, v)));
    sum += q[i];
  }
  return sum;
#endif
}

#if defined(TM_QUANT_AVX512)
// The scales of `n` blocks at once from their max |x| (block_scales' arithmetic, 8 in a
// vector: the same correctly rounded quotients, without a chain of scalar divisions).
void blocks_scales(const float* amax, int64_t n, float* d, float* inv) {
  const __m512d num = _mm512_set1_pd(127.0);
  for (int64_t b = 0; b < n; b += 8) {
    const __mmask8 in = static_cast<__mmask8>(n - b >= 8 ? 0xFF : (1u << (n - b)) - 1);
    const __m256 a = _mm256_maskz_loadu_ps(in, amax + b);
    const __mmask8 live = _mm256_mask_cmp_ps_mask(in, a, _mm256_set1_ps(1e-30f), _CMP_GT_OQ);
    const __m512d ad = _mm512_cvtps_pd(a);
    _mm256_mask_storeu_ps(inv + b, in, _mm256_maskz_mov_ps(live, _mm512_cvtpd_ps(_mm512_div_pd(num, _mm512_mask_blend_pd(live, num, ad)))));
    _mm256_mask_storeu_ps(d + b, in, _mm256_maskz_mov_ps(live, _mm512_cvtpd_ps(_mm512_div_pd(ad, num))));
  }
}
#endif

// x [M, K] float32 (columns gathered through perm when given) -> ActRows in `scratch`.
// init_mult: see ActRows; group_sums: fill gsum (the weight has mins, or the block kernel).
// by_block (the block-order kernels): gsum as d * (the block's sum of q), added block by
// block, laid out per span as by_block_gsum() says, and each lane's init the block's
// init_mult * sum(q) (a symmetric format's -offset: the block's integer dot starts there);
// otherwise lane by lane, in the order the lane-order row kernel's bits depend on.
ActRows quantize_activations(const float* x, int64_t M, int64_t K, const int64_t* perm, const Layout& L,
                             int32_t init_mult, Scratch& scratch, bool group_sums, bool by_block = false) {
  ActRows a;
  a.M = M, a.Kp = L.Kp, a.lanes = L.Kp / 4, a.spans = L.spans;
  const size_t q_bytes = round64(M * a.Kp), d_bytes = round64(M * a.lanes * 4);
  const size_t init_bytes = init_mult ? d_bytes : 0, gsum_bytes = group_sums ? round64(M * a.spans * kLanes * 4) : 0;
  // a gathered / padded row, one per thread, and its blocks' max |x|, d and 1 / d
  const size_t row_bytes = round64(a.Kp * 4 + 3 * (a.Kp / kBlock) * 4);
  uint8_t* base = scratch.take(q_bytes + d_bytes + init_bytes + gsum_bytes + row_bytes * at::get_num_threads());
  a.q = reinterpret_cast<int8_t*>(base);
  a.d = reinterpret_cast<float*>(base + q_bytes);
  a.init = init_mult ? reinterpret_cast<int32_t*>(base + q_bytes + d_bytes) : nullptr;
  a.gsum = group_sums ? reinterpret_cast<float*>(base + q_bytes + d_bytes + init_bytes) : nullptr;
  uint8_t* rows_base = base + q_bytes + d_bytes + init_bytes + gsum_bytes;
  const bool copy = perm != nullptr || a.Kp != K;
  // Each row alone (the same bits on any thread); rows spread over the threads when many.
  auto quantize_rows = [&](int64_t m0, int64_t m1) {
  float* row = reinterpret_cast<float*>(rows_base + row_bytes * at::get_thread_num());
  for (int64_t m = m0; m < m1; ++m) {
    const float* xr = x + m * K;
    if (copy) {  // gathered and zero-padded to whole spans
      if (perm)
        for (int64_t k = 0; k < K; ++k) row[k] = xr[perm[k]];
      else
        std::memcpy(row, xr, K * sizeof(float));
      std::fill(row + K, row + a.Kp, 0.f);
      xr = row;
    }
    int8_t* q = a.q + m * a.Kp;
    float* d = a.d + m * a.lanes;
    if (by_block) {
      const int64_t blocks_per_group = L.group / kBlock, blocks = a.Kp / kBlock;
      int32_t* init = a.init ? a.init + m * a.lanes : nullptr;
#if defined(TM_QUANT_AVX512)
      // Every block's scale first, then its codes: the blocks' divisions in vectors.
      float* scales = reinterpret_cast<float*>(row + a.Kp);  // 3 x blocks floats past the row
      for (int64_t b = 0; b < blocks; ++b) {
        const __m512 lo = _mm512_loadu_ps(xr + b * kBlock), hi = _mm512_loadu_ps(xr + b * kBlock + 16);
        scales[b] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      }
      blocks_scales(scales, blocks, scales + blocks, scales + 2 * blocks);
#endif
      for (int64_t b = 0, g = 0; b < blocks; ++g) {
        float sum = 0.f;
        for (int64_t e = b + blocks_per_group; b < e; ++b) {
          float db;
#if defined(TM_QUANT_AVX512)
          db = scales[blocks + b];
          const int32_t qs = quantize_block_with(xr + b * kBlock, q + b * kBlock, scales[2 * blocks + b]);
#else
          const int32_t qs = quantize_block(xr + b * kBlock, q + b * kBlock, &db);
#endif
          for (int l = 0; l < kBlock / 4; ++l) d[b * (kBlock / 4) + l] = db;
          if (init) std::fill(init + b * (kBlock / 4), init + (b + 1) * (kBlock / 4), init_mult * qs);
          sum += db * static_cast<float>(qs);
        }
        if (!a.gsum) continue;
        // a span's lanes 0-7: its groups' sums, each 4 times, the last group in lanes 4-7
        float* gs = a.gsum + m * a.spans * kLanes + (g / L.gps) * kLanes;
        const int64_t first = 4 * (g % L.gps + 2 - L.gps);
        if (L.gps == 1) std::fill(gs, gs + 4, 0.f);
        std::fill(gs + first, gs + first + 4, sum);
      }
      continue;
    }
    for (int64_t b = 0; b < a.Kp / kBlock; ++b) {
      float db;
      quantize_block(xr + b * kBlock, q + b * kBlock, &db);
      for (int l = 0; l < kBlock / 4; ++l) d[b * (kBlock / 4) + l] = db;
    }
    // Lane sums of q: the symmetric offset's start values, and the group sums d * sum(q).
    int32_t* init = a.init ? a.init + m * a.lanes : nullptr;
    float* gsum = a.gsum ? a.gsum + m * a.spans * kLanes : nullptr;
    const int64_t lanes_per_group = L.group / 4;
    for (int64_t s = 0; s < a.spans; ++s) {
      float groups[4] = {0.f, 0.f, 0.f, 0.f};
      const int64_t first = s * L.span / 4;
      for (int64_t j = 0; j < L.gps; ++j) {
        float g = 0.f;
        for (int64_t lane = first + j * lanes_per_group; lane < first + (j + 1) * lanes_per_group; ++lane) {
          const int8_t* ql = q + 4 * lane;
          const int32_t sum = int32_t{ql[0]} + ql[1] + ql[2] + ql[3];
          if (init) init[lane] = init_mult * sum;
          g += d[lane] * static_cast<float>(sum);
        }
        groups[j] = g;
      }
      if (gsum)
        for (int64_t r = 0; r < kLanes; ++r) gsum[s * kLanes + r] = r < kRows * L.gps ? groups[r % L.gps] : 0.f;
    }
  }
  };
  if (M >= kMaxIntegerRows)
    at::parallel_for(0, M, 4, quantize_rows);
  else
    quantize_rows(0, M);
  return a;
}

// ----- tile kernels: 4 rows of W against MB rows of quantized x --------------------------------

#if defined(TM_QUANT_AVX512)

template <bool HALF>
inline __m512 load_scale_lanes(const uint8_t* p, __mmask16 mask) {
  if (HALF) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_maskz_loadu_ps(mask, p);
}

// A step's codes as four vectors of 64 bytes. 8-bit: vector v is row v. 4-bit: rows 2p and
// 2p + 1 are loaded together (64 bytes) and split into their low nibbles, columns 0-31 of
// both rows (vector 2p), and high nibbles, columns 32-63 (vector 2p + 1): three
// operations per two rows, matched by activations broadcast from 32 columns.
template <int BITS>
inline void load_step_codes(const uint8_t* c, __m512i w[kRows]) {
  if (BITS == 8) {
    for (int v = 0; v < kRows; ++v) w[v] = _mm512_loadu_si512(c + v * kStep);
    return;
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int pair = 0; pair < 2; ++pair) {
    const __m512i t = _mm512_loadu_si512(c + pair * kStep);
    w[2 * pair] = _mm512_and_si512(t, nibble);
    w[2 * pair + 1] = _mm512_and_si512(_mm512_srli_epi16(t, 4), nibble);
  }
}

template <int MB, int BITS, bool MINS, bool HALF>
__attribute__((always_inline)) inline void tile_rows(const uint8_t* tile, const Layout& L, const ActRows& a, int64_t m0, float* y, int64_t N,
               int64_t valid) {
  constexpr int kHalves = BITS == 8 ? 1 : 2;  // activation vectors per step
  __m512 acc[kRows][MB], macc[MB];
  for (int m = 0; m < MB; ++m) {
    macc[m] = _mm512_setzero_ps();
    for (int v = 0; v < kRows; ++v) acc[v][m] = _mm512_setzero_ps();
  }
  __m512i idx[kRows];
  for (int v = 0; v < kRows; ++v) idx[v] = _mm512_load_si512(BITS == 8 ? L.lane16[v] : L.pair16[v]);
  const bool has_init = a.init != nullptr;
  const __mmask16 smask = static_cast<__mmask16>((1u << (kRows * L.gps)) - 1);
  const int64_t steps = L.span / kStep;
  const uint8_t* p = tile;
  for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
    for (int64_t o = 0; o < L.span_bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + o), TM_PREFETCH_HINT);
    const __m512 sv = load_scale_lanes<HALF>(p, smask);
    __m512 sw[kRows];
    for (int v = 0; v < kRows; ++v) sw[v] = _mm512_permutexvar_ps(idx[v], sv);
    if (MINS) {
      const __m512 mv = load_scale_lanes<HALF>(p + L.scale_block, smask);
      for (int m = 0; m < MB; ++m) macc[m] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(a.gsum_span(m0 + m, s)), macc[m]);
    }
    const uint8_t* c = p + L.scale_block * (MINS ? 2 : 1);
    for (int64_t j = 0; j < steps; ++j, c += L.step_bytes) {
      const int64_t col = s * L.span + j * kStep;
      __m512i w[kRows];
      load_step_codes<BITS>(c, w);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = a.q_row(m0 + m) + col;
        const float* dx = a.d_row(m0 + m) + col / 4;
        const int32_t* init = has_init ? a.init_row(m0 + m) + col / 4 : nullptr;
        __m512i xv[kHalves], iv[kHalves];
        __m512 dv[kHalves];
        for (int h = 0; h < kHalves; ++h) {
          if (BITS == 8) {
            xv[h] = _mm512_loadu_si512(xq);
            dv[h] = _mm512_loadu_ps(dx);
            iv[h] = init ? _mm512_loadu_si512(init) : _mm512_setzero_si512();
          } else {  // columns 32h..32h+31, for both rows of a pair
            xv[h] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * h)));
            dv[h] = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(reinterpret_cast<const double*>(dx + 8 * h))));
            iv[h] = init ? _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + 8 * h)))
                         : _mm512_setzero_si512();
          }
        }
        for (int v = 0; v < kRows; ++v) {
          const int h = BITS == 8 ? 0 : v % 2;
          const __m512i dot = _mm512_dpbusd_epi32(iv[h], w[v], xv[h]);
          acc[v][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw[v], dv[h]), acc[v][m]);
        }
      }
    }
  }
  // Each row's lanes summed, four rows at a time into one 128-bit vector.
  for (int m = 0; m < MB; ++m) {
    __m128 out;
    if (BITS == 8) {  // acc[r]: row r's 16 lanes
      const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0][m], acc[1][m]), _mm512_unpackhi_ps(acc[0][m], acc[1][m]));
      const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2][m], acc[3][m]), _mm512_unpackhi_ps(acc[2][m], acc[3][m]));
      // per 128-bit chunk [r0 r1 r0 r1] + ... -> [r0 r1 r2 r3], then the four chunks added
      const __m512 c = _mm512_add_ps(_mm512_shuffle_ps(t01, t23, 0x44), _mm512_shuffle_ps(t01, t23, 0xEE));
      const __m512 c2 = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, 0x4E));
      out = _mm512_castps512_ps128(_mm512_add_ps(c2, _mm512_shuffle_f32x4(c2, c2, 0xB1)));
    } else {  // acc[2p + h]: lanes 0-7 row 2p, lanes 8-15 row 2p + 1
      const __m512 t0 = _mm512_add_ps(acc[0][m], acc[1][m]), t1 = _mm512_add_ps(acc[2][m], acc[3][m]);
      // chunks [r0a r0b r1a r1b], [r2a r2b r3a r3b] -> [r0a r1a r2a r3a] + [r0b r1b r2b r3b]
      __m512 rows = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
      rows = _mm512_add_ps(rows, _mm512_permute_ps(rows, 0xB1));  // chunk r: its 4 lanes summed into lane 0
      rows = _mm512_add_ps(rows, _mm512_permute_ps(rows, 0x4E));
      out = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), rows));
    }
    if (MINS) {  // lane r * gps + j of macc: row r, group j
      __m512 msum = _mm512_permutexvar_ps(_mm512_load_si512(L.mins_lanes[0]), macc[m]);
      for (int64_t j = 1; j < L.gps; ++j)
        msum = _mm512_add_ps(msum, _mm512_permutexvar_ps(_mm512_load_si512(L.mins_lanes[j]), macc[m]));
      out = _mm_add_ps(out, _mm512_castps512_ps128(msum));
    }
    _mm_mask_storeu_ps(y + (m0 + m) * N, static_cast<__mmask8>((1u << valid) - 1), out);
  }
}
constexpr int kMaxBlockRows = 4;  // activation rows per pass over a tile

#elif defined(TM_QUANT_AVX2)

inline __m256 load_row_scales(const uint8_t* p, int64_t i, bool half) {  // scales i..i+3 in lanes 0..3
  const __m128 v = half ? _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 * i)))
                        : _mm_loadu_ps(reinterpret_cast<const float*>(p + 4 * i));
  return _mm256_castps128_ps256(v);
}

inline __m256 load8_scales(const uint8_t* p, int64_t i, bool half) {  // scales i..i+7
  if (half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p + 4 * i));
}

// dot of 32 u8 codes with 32 s8 activations, 8 int32 lanes of 4, added to init.
template <int BITS>
inline __m256i dot32(__m256i init, __m256i w, __m256i xq) {
#if defined(TM_QUANT_AVX_VNNI)
  return _mm256_dpbusd_avx_epi32(init, w, xq);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if (BITS == 4)  // u4 * s8 pairs: at most 2 * 15 * 127, no saturation
    return _mm256_add_epi32(init, _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones));
  // 8-bit codes would saturate maddubs: multiply u - 128 (signed) by the sign trick,
  // |u - 128| * sign(x, u - 128); the caller's init adds 128 * sum(q) back.
  const __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(xq, s));
  return _mm256_add_epi32(init, _mm256_madd_epi16(p, ones));
#endif
}

template <int MB, int BITS, bool MINS, bool HALF>
inline void tile_rows(const uint8_t* tile, const Layout& L, const ActRows& a, int64_t m0, float* y, int64_t N,
               int64_t valid) {
  __m256 acc[kRows][MB], macc[MB][2];
  for (int m = 0; m < MB; ++m) {
    macc[m][0] = macc[m][1] = _mm256_setzero_ps();
    for (int r = 0; r < kRows; ++r) acc[r][m] = _mm256_setzero_ps();
  }
  const __m256i idx[2] = {_mm256_load_si256(reinterpret_cast<const __m256i*>(L.lane8[0])),
                          _mm256_load_si256(reinterpret_cast<const __m256i*>(L.lane8[1]))};
  const bool has_init = a.init != nullptr;
  const int64_t steps = L.span / kStep;
  const uint8_t* p = tile;
  for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
    __m256 rs[kRows];
    for (int r = 0; r < kRows; ++r) rs[r] = load_row_scales(p, r * L.gps, HALF);
    if (MINS) {
      const uint8_t* mp = p + L.scale_block;
      const __m256 m0v = load8_scales(mp, 0, HALF);
      const __m256 m1v = kRows * L.gps > 8 ? load8_scales(mp, 8, HALF) : _mm256_setzero_ps();
      for (int m = 0; m < MB; ++m) {
        const float* g = a.gsum_span(m0 + m, s);
        macc[m][0] = _mm256_fmadd_ps(m0v, _mm256_loadu_ps(g), macc[m][0]);
        macc[m][1] = _mm256_fmadd_ps(m1v, _mm256_loadu_ps(g + 8), macc[m][1]);
      }
    }
    const uint8_t* c = p + L.scale_block * (MINS ? 2 : 1);
    for (int64_t j = 0; j < steps; ++j, c += L.step_bytes) {
      for (int h = 0; h < 2; ++h) {
        const int64_t col = s * L.span + j * kStep + 32 * h;
        __m256i w[kRows];
        for (int r = 0; r < kRows; ++r) {
          const uint8_t* cr = c + r * L.row_step_bytes;
          if (BITS == 8) {
            w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr + 32 * h));
          } else {
            const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr));
            w[r] = _mm256_and_si256(h ? _mm256_srli_epi16(t, 4) : t, _mm256_set1_epi8(0x0F));
          }
        }
        for (int m = 0; m < MB; ++m) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q_row(m0 + m) + col));
          const __m256 dx = _mm256_loadu_ps(a.d_row(m0 + m) + col / 4);
          const __m256i init = has_init ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.init_row(m0 + m) + col / 4))
                                        : _mm256_setzero_si256();
          for (int r = 0; r < kRows; ++r) {
            const __m256 sw = _mm256_permutevar8x32_ps(rs[r], idx[h]);
            const __m256i dot = dot32<BITS>(init, w[r], xq);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sw, dx), acc[r][m]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float mins[kLanes];
    if (MINS) {
      _mm256_store_ps(mins, macc[m][0]);
      _mm256_store_ps(mins + 8, macc[m][1]);
    }
    for (int r = 0; r < valid; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r][m]);
      float v = 0.f;
      for (int l = 0; l < 8; ++l) v += lanes[l];
      if (MINS)
        for (int64_t j = 0; j < L.gps; ++j) v += mins[r * L.gps + j];
      y[(m0 + m) * N + r] = v;
    }
  }
}
constexpr int kMaxBlockRows = 2;  // 16 ymm registers: 4 x 2 accumulators

#else  // plain C: the same arithmetic lane by lane

template <int MB, int BITS, bool MINS, bool HALF>
inline void tile_rows(const uint8_t* tile, const Layout& L, const ActRows& a, int64_t m0, float* y, int64_t N,
               int64_t valid) {
  float acc[kRows][MB] = {}, macc[kRows][MB] = {};
  const int64_t steps = L.span / kStep;
  const uint8_t* p = tile;
  float sc[kLanes], mn[kLanes];  // the span's scales and mins, converted once
  for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
    const uint8_t* c = p + L.scale_block * (MINS ? 2 : 1);
    for (int64_t i = 0; i < kRows * L.gps; ++i) {
      sc[i] = load_scale(p, i, L.scale_bytes);
      if (MINS) mn[i] = load_scale(p + L.scale_block, i, L.scale_bytes);
    }
    for (int r = 0; r < kRows; ++r)
      for (int m = 0; m < MB; ++m)
        if (MINS)
          for (int64_t j = 0; j < L.gps; ++j) macc[r][m] += mn[r * L.gps + j] * a.gsum_span(m0 + m, s)[r * L.gps + j];
    for (int64_t j = 0; j < steps; ++j, c += L.step_bytes) {
      const int64_t col = s * L.span + j * kStep;
      for (int r = 0; r < kRows; ++r) {
        uint8_t u[kStep];
        const uint8_t* cr = c + r * L.row_step_bytes;
        for (int i = 0; i < kStep; ++i) u[i] = BITS == 8 ? cr[i] : (i < 32 ? cr[i] & 0x0F : cr[i - 32] >> 4);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xq = a.q_row(m0 + m) + col;
          for (int l = 0; l < kLanes; ++l) {
            int32_t dot = a.init ? a.init_row(m0 + m)[col / 4 + l] : 0;
            for (int i = 4 * l; i < 4 * l + 4; ++i) dot += int32_t{u[i]} * xq[i];
            acc[r][m] += static_cast<float>(dot) * (sc[L.lane16[r][l]] * a.d_row(m0 + m)[col / 4 + l]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < valid; ++r) y[(m0 + m) * N + r] = acc[r][m] + macc[r][m];
}
constexpr int kMaxBlockRows = 4;

#endif

// What the integer dot must start from, per lane, times the lane's sum of q.
int32_t init_multiplier(const Layout& L) {
  int32_t mult = L.has_mins ? 0 : -static_cast<int32_t>(L.offset);
#if defined(TM_QUANT_AVX2) && !defined(TM_QUANT_AVX_VNNI)
  if (L.bits == 8) mult += 128;  // the sign trick multiplies u - 128
#endif
  return mult;
}

// Activation rows in passes of up to kMaxIntegerRows, each in blocks as even as the register
// budget allows (6 rows: 3 + 3, not 4 + 2). A row's arithmetic is the same in any block.
struct RowBlocks {
  std::vector<int64_t> start, rows;
  int64_t count = 0;
  explicit RowBlocks(int64_t M) {
    for (int64_t p = 0; p < M; p += kMaxIntegerRows) {
      const int64_t n = std::min(kMaxIntegerRows, M - p), blocks = (n + kMaxBlockRows - 1) / kMaxBlockRows;
      for (int64_t b = 0, m = p; b < blocks; ++b) {
        rows.push_back((p + n - m + (blocks - b) - 1) / (blocks - b));
        start.push_back(m);
        m += rows.back();
      }
    }
    count = static_cast<int64_t>(rows.size());
  }
};

// Rows per chunk of a many-row call: a chunk's int8 activations (64 x K bytes) stay in L2
// while a thread runs its tiles against them.
constexpr int64_t kChunkRows = 64;

// Tiles [begin, end) against row blocks [b0, b1): the tile's bytes come from memory (or L2)
// for the first block and from L1 for the others.
template <int BITS, bool MINS, bool HALF>
void run_tile_blocks(int64_t begin, int64_t end, const uint8_t* packed, const Layout& L, const ActRows& a,
                     const RowBlocks& blocks, int64_t b0, int64_t b1, float* y) {
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = L.tile(packed, t);
    const int64_t valid = std::min(kRows, L.N - t * kRows);
    float* yt = y + t * kRows;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t m0 = blocks.start[b];
      switch (blocks.rows[b]) {
        case 1: tile_rows<1, BITS, MINS, HALF>(tile, L, a, m0, yt, L.N, valid); break;
        case 2: tile_rows<2, BITS, MINS, HALF>(tile, L, a, m0, yt, L.N, valid); break;
#if defined(TM_QUANT_AVX512) || defined(TM_QUANT_SCALAR)
        case 3: tile_rows<3, BITS, MINS, HALF>(tile, L, a, m0, yt, L.N, valid); break;
        case 4: tile_rows<4, BITS, MINS, HALF>(tile, L, a, m0, yt, L.N, valid); break;
#endif
      }
    }
  }
}

// Tiles [begin, end) against every row block, a chunk of rows at a time (one parallel
// region for the whole call, however many rows: deterministic inference sends prompts here).
template <int BITS, bool MINS, bool HALF>
void run_tiles(int64_t begin, int64_t end, const uint8_t* packed, const Layout& L, const ActRows& a,
               const RowBlocks& blocks, float* y) {
  for (int64_t b0 = 0, b1 = 0; b0 < blocks.count; b0 = b1) {
    const int64_t chunk_end = blocks.start[b0] + kChunkRows;
    while (b1 < blocks.count && blocks.start[b1] < chunk_end) ++b1;
    run_tile_blocks<BITS, MINS, HALF>(begin, end, packed, L, a, blocks, b0, b1, y);
  }
}

using RunFn = void (*)(int64_t, int64_t, const uint8_t*, const Layout&, const ActRows&, const RowBlocks&, float*);

RunFn pick_run_fn(const Layout& L) {
  const bool half = L.scale_bytes == 2;
  if (L.bits == 4) {
    if (L.has_mins) return half ? &run_tiles<4, true, true> : &run_tiles<4, true, false>;
    return half ? &run_tiles<4, false, true> : &run_tiles<4, false, false>;
  }
  if (L.has_mins) return half ? &run_tiles<8, true, true> : &run_tiles<8, true, false>;
  return half ? &run_tiles<8, false, true> : &run_tiles<8, false, false>;
}

inline void load_span_scales(const uint8_t* p, const Layout& L, float* scale, float* minv);

// ----- many rows: sixteen activation rows in the lanes of a vector ----------------------------
//
// The same arithmetic as tile_rows, each output's float operations in the same order, with the
// roles of the vector lanes turned: where tile_rows gives a vector's 16 int32 lanes the 4-column
// groups of one activation row (and reduces them across lanes at the end), here a vector holds
// one 4-column group of 16 activation rows, and the 16 groups of a 64-column step are 16
// accumulators. Each of them takes exactly the fma sequence the row kernel's lane takes
// (int32 dot, converted, times scale * d, added), and the final reduction adds the 16
// accumulators in the row kernel's tree (vector adds instead of shuffles), so every output is
// bit for bit the row kernel's. What it saves at many rows: scale * d is one product per 16
// rows and per quarter step (the row kernel forms it per lane vector), the weight codes are
// unpacked once per call into a chunk that stays in L2 and broadcast 4 bytes at a time from
// it, and 16 rows' int8 activations of a step (1 KiB) are re-read from L1 for every weight row.
// x86-64 with AVX512-VNNI only; other builds run the row kernel at every row count.
#if defined(TM_QUANT_AVX512)
#define TM_QUANT_LANE_ROWS 1

constexpr int64_t kLaneRows = 16;  // activation rows per vector

// ActRows transposed by 16 rows: block b, 4-column group l -> 16 rows x 4 int8 (64 bytes); the
// scale d of each 32-column block for 16 rows; the init lanes and group sums likewise. Rows past
// M are zeros (their outputs are dropped).
struct LaneRows {
  int64_t blocks = 0, lanes = 0, dblocks = 0, spans = 0, gps = 0;
  int8_t* x = nullptr;      // [blocks][lanes][16][4]
  float* d = nullptr;       // [blocks][dblocks][16]
  int32_t* init = nullptr;  // [blocks][lanes][16] or null
  float* gsum = nullptr;    // [blocks][spans][gps][16] or null
};

LaneRows transpose_rows(const ActRows& a, const Layout& L, Scratch& scratch) {
  LaneRows t;
  t.blocks = (a.M + kLaneRows - 1) / kLaneRows, t.lanes = a.lanes, t.dblocks = a.Kp / kBlock, t.spans = a.spans,
  t.gps = L.gps;
  const size_t x_bytes = round64(t.blocks * t.lanes * 64), d_bytes = round64(t.blocks * t.dblocks * kLaneRows * 4);
  const size_t init_bytes = a.init ? round64(t.blocks * t.lanes * kLaneRows * 4) : 0;
  const size_t gsum_bytes = a.gsum ? round64(t.blocks * t.spans * t.gps * kLaneRows * 4) : 0;
  uint8_t* base = scratch.take(x_bytes + d_bytes + init_bytes + gsum_bytes);
  t.x = reinterpret_cast<int8_t*>(base);
  t.d = reinterpret_cast<float*>(base + x_bytes);
  t.init = a.init ? reinterpret_cast<int32_t*>(base + x_bytes + d_bytes) : nullptr;
  t.gsum = a.gsum ? reinterpret_cast<float*>(base + x_bytes + d_bytes + init_bytes) : nullptr;
  at::parallel_for(0, t.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t i = 0; i < kLaneRows; ++i) {
        const int64_t m = b * kLaneRows + i;
        const bool real = m < a.M;
        const int32_t* q = real ? reinterpret_cast<const int32_t*>(a.q_row(m)) : nullptr;
        int32_t* xo = reinterpret_cast<int32_t*>(t.x) + b * t.lanes * kLaneRows + i;
        for (int64_t l = 0; l < t.lanes; ++l) {
          int32_t v = 0;
          if (real) std::memcpy(&v, q + l, 4);
          xo[l * kLaneRows] = v;
        }
        float* dout = t.d + b * t.dblocks * kLaneRows + i;
        for (int64_t k = 0; k < t.dblocks; ++k) dout[k * kLaneRows] = real ? a.d_row(m)[k * (kBlock / 4)] : 0.f;
        if (t.init) {
          int32_t* io = t.init + b * t.lanes * kLaneRows + i;
          for (int64_t l = 0; l < t.lanes; ++l) io[l * kLaneRows] = real ? a.init_row(m)[l] : 0;
        }
        if (t.gsum) {  // row 0's lanes of a span's group sums: lane j is group j
          float* go = t.gsum + b * t.spans * t.gps * kLaneRows + i;
          for (int64_t s = 0; s < t.spans; ++s)
            for (int64_t j = 0; j < t.gps; ++j) go[(s * t.gps + j) * kLaneRows] = real ? a.gsum_span(m, s)[j] : 0.f;
        }
      }
  });
  return t;
}

// Weight rows unpacked for lane_rows: one byte per code in column order, and per row its
// float32 scales and mins (span s, group j at s * gps + j).
struct UnpackedRows {
  int64_t rows = 0, Kp = 0, per_row = 0;
  uint8_t* codes = nullptr;  // [rows][Kp]
  float* scale = nullptr;    // [rows][per_row]
  float* mins = nullptr;     // [rows][per_row]
};

// Tiles [t0, t1) into u (its buffers sized for them).
void unpack_tiles(const uint8_t* packed, const Layout& L, int64_t t0, int64_t t1, UnpackedRows& u) {
  float scale[kRows * 4 + 8], minv[kRows * 4 + 8];
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* p = L.tile(packed, t);
    for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
      load_span_scales(p, L, scale, minv);
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t j = 0; j < L.gps; ++j) {
          const int64_t row = (t - t0) * kRows + r;
          u.scale[row * u.per_row + s * L.gps + j] = scale[r * L.gps + j];
          u.mins[row * u.per_row + s * L.gps + j] = minv[r * L.gps + j];
        }
      const uint8_t* c = p + L.scale_block * (L.has_mins ? 2 : 1);
      for (int64_t j = 0; j < L.span / kStep; ++j, c += L.step_bytes)
        for (int64_t r = 0; r < kRows; ++r) {
          uint8_t* o = u.codes + ((t - t0) * kRows + r) * u.Kp + s * L.span + j * kStep;
          const uint8_t* cr = c + r * L.row_step_bytes;
          if (L.bits == 8) {
            std::memcpy(o, cr, kStep);
          } else {  // byte i: column i in its low nibble, column 32 + i in its high one
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr));
            const __m256i nibble = _mm256_set1_epi8(0x0F);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm256_and_si256(v, nibble));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble));
          }
        }
    }
  }
}

// A vertical add the compiler may not reassociate (-ffast-math): the tree is the row kernel's.
inline __m512 add_exact(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, _MM_FROUND_CUR_DIRECTION); }

// One weight row (unpacked) against the 16 rows of lane block b: out[i] = y[16 b + i, row].
template <int BITS, bool MINS, bool INIT>
__attribute__((always_inline)) inline void lane_rows(const uint8_t* codes, const float* scale, const float* mins,
                                                     const LaneRows& a, int64_t b, const Layout& L, float* out) {
  __m512 acc[kLanes], macc[4];
  for (int l = 0; l < kLanes; ++l) acc[l] = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) macc[j] = _mm512_setzero_ps();
  const int8_t* xb = a.x + b * a.lanes * 64;
  const float* db = a.d + b * a.dblocks * kLaneRows;
  const int32_t* ib = INIT ? a.init + b * a.lanes * kLaneRows : nullptr;
  const float* gb = MINS ? a.gsum + b * a.spans * a.gps * kLaneRows : nullptr;
  const int64_t steps = L.span / kStep, gps = L.gps;
  // The scale of lane quarter q (lanes 4q..4q+3, columns 16q..16q+15 of a step) within a span.
  int64_t qj[4];
  for (int q = 0; q < 4; ++q) qj[q] = gps > 1 ? 16 * q / L.group : 0;
  for (int64_t s = 0; s < L.spans; ++s) {
    const float* sc = scale + s * gps;
    if (MINS)
      for (int64_t j = 0; j < gps; ++j)
        macc[j] = _mm512_fmadd_ps(_mm512_set1_ps(mins[s * gps + j]), _mm512_loadu_ps(gb + (s * gps + j) * kLaneRows), macc[j]);
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t col = s * L.span + st * kStep;
      __m512 sd[4];  // scale * d, as the row kernel's mul(sw, dv)
      for (int q = 0; q < 4; ++q)
        sd[q] = _mm512_mul_ps(_mm512_set1_ps(sc[qj[q]]), _mm512_loadu_ps(db + ((col + 16 * q) / kBlock) * kLaneRows));
      const uint8_t* w = codes + col;
      const int8_t* x = xb + (col / 4) * 64;
      for (int l = 0; l < kLanes; ++l) {
        int32_t wd;
        std::memcpy(&wd, w + 4 * l, 4);
        const __m512i init = INIT ? _mm512_loadu_si512(ib + (col / 4 + l) * kLaneRows) : _mm512_setzero_si512();
        const __m512i dot = _mm512_dpbusd_epi32(init, _mm512_set1_epi32(wd), _mm512_loadu_si512(x + l * 64));
        acc[l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd[l / 4], acc[l]);
      }
    }
  }
  __m512 y;
  if (BITS == 4) {  // tile_rows: t = acc[2p] + acc[2p + 1]; chunks added; pairs; halves
    __m512 t[8];
    for (int i = 0; i < 8; ++i) t[i] = add_exact(acc[i], acc[8 + i]);
    __m512 r[4];
    for (int i = 0; i < 4; ++i) r[i] = add_exact(t[i], t[i + 4]);
    y = add_exact(add_exact(r[0], r[1]), add_exact(r[2], r[3]));
  } else {  // tile_rows: unpack lo + hi, shuffles; then the four 128-bit chunks
    __m512 q[4];
    for (int c = 0; c < 4; ++c)
      q[c] = add_exact(add_exact(acc[4 * c], acc[4 * c + 2]), add_exact(acc[4 * c + 1], acc[4 * c + 3]));
    y = add_exact(add_exact(q[0], q[2]), add_exact(q[1], q[3]));
  }
  if (MINS) {
    __m512 msum = macc[0];
    for (int64_t j = 1; j < gps; ++j) msum = add_exact(msum, macc[j]);
    y = add_exact(y, msum);
  }
  _mm512_storeu_ps(out, y);
}

// Unpacked weight rows per chunk: they stay in L2 while every lane block runs against them.
constexpr int64_t kLaneChunkBytes = 256 << 10;

template <int BITS, bool MINS, bool INIT>
void run_lane_rows(int64_t begin, int64_t end, const uint8_t* packed, const Layout& L, const LaneRows& a, int64_t M,
                   float* y) {
  thread_local Scratch scratch;
  const int64_t chunk_tiles = std::max<int64_t>(1, kLaneChunkBytes / (kRows * L.Kp));
  UnpackedRows u;
  u.Kp = L.Kp, u.per_row = L.spans * L.gps;
  const int64_t n_rows = std::min(chunk_tiles, end - begin) * kRows;
  const size_t code_bytes = round64(n_rows * L.Kp), scale_bytes = round64(n_rows * u.per_row * 4);
  uint8_t* base = scratch.take(code_bytes + 2 * scale_bytes);
  u.codes = base, u.scale = reinterpret_cast<float*>(base + code_bytes),
  u.mins = reinterpret_cast<float*>(base + code_bytes + scale_bytes);
  alignas(64) float out[kLaneRows];
  for (int64_t t0 = begin; t0 < end; t0 += chunk_tiles) {
    const int64_t t1 = std::min(end, t0 + chunk_tiles);
    unpack_tiles(packed, L, t0, t1, u);
    const int64_t n0 = t0 * kRows, n1 = std::min(L.N, t1 * kRows);
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int64_t rows = std::min(kLaneRows, M - b * kLaneRows);
      for (int64_t n = n0; n < n1; ++n) {
        const int64_t r = n - n0;
        lane_rows<BITS, MINS, INIT>(u.codes + r * L.Kp, u.scale + r * u.per_row, u.mins + r * u.per_row, a, b, L, out);
        float* yo = y + b * kLaneRows * L.N + n;
        for (int64_t i = 0; i < rows; ++i) yo[i * L.N] = out[i];
      }
    }
  }
}

using LaneRunFn = void (*)(int64_t, int64_t, const uint8_t*, const Layout&, const LaneRows&, int64_t, float*);

LaneRunFn pick_lane_run_fn(const Layout& L, bool init) {
  if (L.bits == 4) {
    if (L.has_mins) return init ? &run_lane_rows<4, true, true> : &run_lane_rows<4, true, false>;
    return init ? &run_lane_rows<4, false, true> : &run_lane_rows<4, false, false>;
  }
  if (L.has_mins) return init ? &run_lane_rows<8, true, true> : &run_lane_rows<8, true, false>;
  return init ? &run_lane_rows<8, false, true> : &run_lane_rows<8, false, false>;
}
#endif

// ----- many rows on integers, whole 32-column blocks -----------------------------------------
//
// The integer GEMM for many rows (prefill, large batches) where the execution plan measured
// it faster than the bf16 GEMM on dequantized tiles: activations quantized to int8 per 32 as
// above, and each 32-column block's dot product of codes and activations accumulated in int32
// across the whole block (vpdpbusd, exact) before one conversion and one fused multiply-add
// by scale * d: a symmetric format's dot starts from the block's -offset * sum(q) (so it is
// of the signed codes, and one fma per block adds it to the output), a format with mins adds
// the mins term once per group from the activations' group sums (panel_quad). The
// lane-order kernels convert every 4 columns. The row kernel sums in the same order
// (tile_rows_blocked below), so both give the same bits and deterministic inference uses it.
// Layout (the ik_llama.cpp / llama.cpp "interleaved rows" idea): the weight is unpacked per
// call, a chunk that stays in L2 at a time, into panels of 16 rows whose 4-column groups are
// interleaved, [K/4][16 rows][4 bytes], so one 64-byte load holds a 4-column group of 16
// rows; 4 bytes of an activation row are broadcast against it; a panel's outputs for one
// activation row are 16 contiguous floats. AVX512-VNNI builds, weight groups of 32 or more.
#if defined(TM_QUANT_AVX512)
#define TM_QUANT_BLOCK_GEMM 1

// acc + t, kept as written: -ffast-math may not reassociate the chain of block terms nor fuse
// anything into it (the row kernel and the block GEMM must perform the same operations).
inline __m512 add_ordered(__m512 acc, __m512 t) {
  __m512 r = _mm512_add_ps(acc, t);
  asm("" : "+v"(r));
  return r;
}
inline __m128 add_ordered(__m128 acc, __m128 t) {
  __m128 r = _mm_add_ps(acc, t);
  asm("" : "+v"(r));
  return r;
}

constexpr int64_t kPanelRows = 16;
constexpr int64_t kPanelTiles = kPanelRows / kRows;

struct Panels {
  int64_t Kp = 0, groups = 0;
  uint8_t* codes = nullptr;  // [panel][Kp / 4][16][4]
  float* scale = nullptr;    // [panel][groups][16]
  float* mins = nullptr;     // [panel][groups][16]
  const uint8_t* panel_codes(int64_t p) const { return codes + p * Kp * kPanelRows; }
  const float* panel_scale(int64_t p) const { return scale + p * groups * kPanelRows; }
  const float* panel_mins(int64_t p) const { return mins + p * groups * kPanelRows; }
};

// Panels [p0, p1) of W into u: codes one byte each, 4-column groups interleaved by row; rows
// past N (the last tile's padding, missing tiles) get zero codes, scales and mins (a missing
// tile is read from zeros). A panel's four tiles go through a 64-column step together, so
// each 64-byte line of the panel (one 4-column group of its 16 rows) is written whole, once:
// written a tile's quarter at a time, every store missed L1 (a 2048-column panel is 32 KiB)
// and took the miss buffers the packed weight's loads wait on. Each tile's packed bytes are
// prefetched 4 KiB ahead, every line of each span (a span's first and last lines only left an
// 8-bit span's middle three to the hardware: the Q8_0 LM head of the default model, 49,152 x 576,
// took 1.94-2.05 ms a call at 1 row, 1.56-1.60 ms with every line; 4-bit spans, 2-3 lines, no
// change): without it a span's first load (its scales) waited on memory, ~17% of the unpack in
// `perf`. (1B shapes, Q4_0, 32 rows, 2 threads: 8.6-8.9 -> 7.5-7.8 ms a pass
// of a layer's four linears, ~1 ms of the ~2.4 ms the unpack cost beyond the compute.)
constexpr int64_t kUnpackPrefetchBytes = 4096;

void unpack_panels(const uint8_t* packed, const Layout& L, int64_t p0, int64_t p1, Panels& u) {
  float scale[kRows * 4 + 8], minv[kRows * 4 + 8];
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  thread_local std::vector<uint8_t> zeros;
  const size_t tile_bytes = static_cast<size_t>(L.spans * L.span_bytes);
  if (zeros.size() < tile_bytes) zeros.assign(tile_bytes, 0);
  for (int64_t pnl = p0; pnl < p1; ++pnl) {
    uint8_t* codes = u.codes + (pnl - p0) * L.Kp * kPanelRows;
    float* sc = u.scale + (pnl - p0) * u.groups * kPanelRows;
    float* mn = u.mins + (pnl - p0) * u.groups * kPanelRows;
    const uint8_t* tile[kPanelTiles];
    for (int64_t tp = 0; tp < kPanelTiles; ++tp) {
      const int64_t t = pnl * kPanelTiles + tp;
      tile[tp] = t < L.tiles ? L.tile(packed, t) : zeros.data();
    }
    for (int64_t s = 0; s < L.spans; ++s) {
      const uint8_t* c[kPanelTiles];
      for (int64_t tp = 0; tp < kPanelTiles; ++tp) {
        const uint8_t* p = tile[tp] + s * L.span_bytes;
        for (int64_t o = 0; o < L.span_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(p + kUnpackPrefetchBytes + o), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + kUnpackPrefetchBytes + L.span_bytes - 1), _MM_HINT_T0);
        load_span_scales(p, L, scale, minv);
        for (int64_t j = 0; j < L.gps; ++j)
          for (int64_t r = 0; r < kRows; ++r) {
            sc[(s * L.gps + j) * kPanelRows + tp * kRows + r] = scale[r * L.gps + j];
            if (L.has_mins) mn[(s * L.gps + j) * kPanelRows + tp * kRows + r] = minv[r * L.gps + j];
          }
        c[tp] = p + L.scale_block * (L.has_mins ? 2 : 1);
      }
      for (int64_t st = 0; st < L.span / kStep; ++st) {
        // q[4 tp + k], 128-bit chunk j: column group 4 j + k of tile tp's 4 rows.
        __m512i q[kPanelRows];
        for (int64_t tp = 0; tp < kPanelTiles; ++tp) {
          __m512i row[kRows];  // 64 codes of each tile row, column order
          for (int r = 0; r < kRows; ++r) {
            const uint8_t* cr = c[tp] + st * L.step_bytes + r * L.row_step_bytes;
            if (L.bits == 8) {
              row[r] = _mm512_loadu_si512(cr);
            } else {  // byte i: column i in its low nibble, column 32 + i in its high one
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr));
              row[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, nibble)),
                                          _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), 1);
            }
          }
          const __m512i t0 = _mm512_unpacklo_epi32(row[0], row[1]), t1 = _mm512_unpackhi_epi32(row[0], row[1]);
          const __m512i t2 = _mm512_unpacklo_epi32(row[2], row[3]), t3 = _mm512_unpackhi_epi32(row[2], row[3]);
          q[4 * tp + 0] = _mm512_unpacklo_epi64(t0, t2), q[4 * tp + 1] = _mm512_unpackhi_epi64(t0, t2);
          q[4 * tp + 2] = _mm512_unpacklo_epi64(t1, t3), q[4 * tp + 3] = _mm512_unpackhi_epi64(t1, t3);
        }
        // Column group 4 j + k of the 16 rows: chunk j of q[k], q[4 + k], q[8 + k], q[12 + k].
        uint8_t* o = codes + (s * L.span + st * kStep) / 4 * kPanelRows * 4;
        for (int k = 0; k < 4; ++k) {
          const __m512i a01 = _mm512_shuffle_i32x4(q[k], q[4 + k], 0x44), a23 = _mm512_shuffle_i32x4(q[k], q[4 + k], 0xEE);
          const __m512i b01 = _mm512_shuffle_i32x4(q[8 + k], q[12 + k], 0x44), b23 = _mm512_shuffle_i32x4(q[8 + k], q[12 + k], 0xEE);
          _mm512_store_si512(o + (0 + k) * kPanelRows * 4, _mm512_shuffle_i32x4(a01, b01, 0x88));
          _mm512_store_si512(o + (4 + k) * kPanelRows * 4, _mm512_shuffle_i32x4(a01, b01, 0xDD));
          _mm512_store_si512(o + (8 + k) * kPanelRows * 4, _mm512_shuffle_i32x4(a23, b23, 0x88));
          _mm512_store_si512(o + (12 + k) * kPanelRows * 4, _mm512_shuffle_i32x4(a23, b23, 0xDD));
        }
      }
    }
  }
}

// The activation rows the panel kernel reads, four at a time ("quads"), interleaved so one
// pointer reaches all four: codes [quad][Kp / 4][4 rows] (4 bytes each), each block's d and
// integer start [quad][blocks][4], each group's d * sum(q) [quad][groups][4] (formats with
// mins); rows past M are zeros. (Four rows read through their own pointers, as before, left
// GCC short of registers: it spilled them and ran 0-27% slower, shape by shape.)
struct QuadRows {
  int64_t lanes = 0, blocks = 0, groups = 0;
  int32_t* q = nullptr;
  float* d = nullptr;
  int32_t* init = nullptr;
  float* gs = nullptr;
  const int32_t* q_quad(int64_t c) const { return q + c * lanes * 4; }
  const float* d_quad(int64_t c) const { return d + c * blocks * 4; }
  const int32_t* init_quad(int64_t c) const { return init + c * blocks * 4; }
  const float* gs_quad(int64_t c) const { return gs + c * groups * 4; }
};

QuadRows interleave_quads(const ActRows& a, const Layout& L, Scratch& scratch) {
  QuadRows r;
  r.lanes = a.lanes, r.blocks = L.Kp / kBlock, r.groups = L.Kp / L.group;
  const int64_t quads = (a.M + 3) / 4;
  const size_t q_bytes = round64(quads * r.lanes * 16), d_bytes = round64(quads * r.blocks * 16);
  uint8_t* base = scratch.take(q_bytes + 2 * d_bytes + round64(quads * r.groups * 16));
  r.q = reinterpret_cast<int32_t*>(base);
  r.d = reinterpret_cast<float*>(base + q_bytes);
  r.init = reinterpret_cast<int32_t*>(base + q_bytes + d_bytes);
  r.gs = reinterpret_cast<float*>(base + q_bytes + 2 * d_bytes);
  auto fill = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t m = 4 * c + i;
        int32_t* q = r.q + c * r.lanes * 4 + i;
        float* d = r.d + c * r.blocks * 4 + i;
        int32_t* init = r.init + c * r.blocks * 4 + i;
        float* gs = r.gs + c * r.groups * 4 + i;
        const bool row = m < a.M;
        const int32_t* qm = row ? reinterpret_cast<const int32_t*>(a.q_row(m)) : nullptr;
        for (int64_t l = 0; l < r.lanes; ++l) q[4 * l] = row ? qm[l] : 0;
        for (int64_t b = 0; b < r.blocks; ++b) {
          d[4 * b] = row ? a.d_row(m)[b * (kBlock / 4)] : 0.f;
          init[4 * b] = row && a.init ? a.init_row(m)[b * (kBlock / 4)] : 0;
        }
        for (int64_t g = 0; g < r.groups; ++g)
          gs[4 * g] = row && a.gsum ? a.by_block_gsum(m, g / L.gps, g % L.gps, L.gps) : 0.f;
      }
  };
  if (quads >= 8)
    at::parallel_for(0, quads, 2, fill);
  else
    fill(0, quads);
  return r;
}

// acc + a * b as one fused multiply-add, kept as written (see add_ordered).
inline __m512 fma_ordered(__m512 a, __m512 b, __m512 acc) {
  __m512 r = _mm512_fmadd_ps(a, b, acc);
  asm("" : "+v"(r));
  return r;
}
inline __m128 fma_ordered(__m128 a, __m128 b, __m128 acc) {
  __m128 r = _mm_fmadd_ps(a, b, acc);
  asm("" : "+v"(r));
  return r;
}

// RW panels (16 weight rows each) against the first RA rows of quad `quad` (rows m0..m0 + RA):
// y[m0 + i, n0 + 16 v + lane]. Per 32-column block, per output: the codes . q dot on int32
// (exact; a symmetric format's from the block's -offset * sum(q), so the dot is of the signed
// codes), one conversion, and
//   symmetric: acc = fma(dot, scale * d, acc)
//   with mins: acc = acc + fma(dot, scale * d, mins * gs), gs = the group's d * sum(q) at the
//              group's last block, else 0.
// The symmetric form costs one float product and one fma per 8 vpdpbusd (the form with
// mins two products, an fma and an add: measured 155 -> 200 int8 GMAC/s on one Zen 4 core
// for the kernel alone).
// Groups [g0, g1) only (one column part of a weight with column splits: panel_quad_parts),
// the sums stored in y, or with `add_to_y` added to what y holds (a later part, in order, as
// the all-reduce of a tensor-parallel split adds its ranks' products).
template <int RA, int RW, bool MINS>
__attribute__((always_inline)) inline void panel_quad(const Panels& P, int64_t pnl, const QuadRows& a, int64_t quad,
                                                      const Layout& L, float* y, int64_t m0, int64_t n0, int64_t g0,
                                                      int64_t g1, bool add_to_y) {
  __m512 acc[RA][RW];
  for (int i = 0; i < RA; ++i)
    for (int v = 0; v < RW; ++v) acc[i][v] = _mm512_setzero_ps();
  const int64_t blocks_per_group = L.group / kBlock, w_stride = P.Kp * kPanelRows, s_stride = P.groups * kPanelRows;
  const int64_t b0 = g0 * blocks_per_group;
  const int32_t* xq = a.q_quad(quad) + b0 * kBlock;
  const float* d = a.d_quad(quad) + b0 * 4;
  const int32_t* init = a.init_quad(quad) + b0 * 4;
  const float* gs = a.gs_quad(quad) + g0 * 4;
  const uint8_t* w = P.panel_codes(pnl) + b0 * kBlock * kPanelRows;
  const float* sc = P.panel_scale(pnl) + g0 * kPanelRows;
  const float* mn = MINS ? P.panel_mins(pnl) + g0 * kPanelRows : nullptr;
  for (int64_t g = g0; g < g1; ++g, sc += kPanelRows, mn += MINS ? kPanelRows : 0, gs += 4) {
    for (int64_t bb = 0; bb < blocks_per_group; ++bb, w += kBlock * kPanelRows, xq += kBlock, d += 4, init += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 4096), _MM_HINT_T0);
      __m512i dot[RA][RW];
      for (int i = 0; i < RA; ++i)
        for (int v = 0; v < RW; ++v) dot[i][v] = MINS ? _mm512_setzero_si512() : _mm512_set1_epi32(init[i]);
      // Unrolled whole, so the RA x RW sums stay in the same registers (a rolled loop had GCC
      // copy them between registers every lane and spill the float sums).
#pragma GCC unroll 8
      for (int l = 0; l < kBlock / 4; ++l) {
        __m512i wv[RW];
        for (int v = 0; v < RW; ++v) wv[v] = _mm512_loadu_si512(w + v * w_stride + l * 64);
        for (int i = 0; i < RA; ++i) {
          const __m512i xb = _mm512_set1_epi32(xq[4 * l + i]);
          for (int v = 0; v < RW; ++v) dot[i][v] = _mm512_dpbusd_epi32(dot[i][v], wv[v], xb);
        }
      }
      // Scales and mins are read here, from L1, rather than held in registers across the block.
      const bool last = bb == blocks_per_group - 1;
      for (int i = 0; i < RA; ++i) {
        const __m512 dv = _mm512_set1_ps(d[i]);
        const __m512 gv = MINS && last ? _mm512_set1_ps(gs[i]) : _mm512_setzero_ps();
        for (int v = 0; v < RW; ++v) {
          const __m512 sd = _mm512_mul_ps(_mm512_loadu_ps(sc + v * s_stride), dv);
          const __m512 x = _mm512_cvtepi32_ps(dot[i][v]);
          if (MINS)
            acc[i][v] = add_ordered(acc[i][v], _mm512_fmadd_ps(x, sd, _mm512_mul_ps(_mm512_loadu_ps(mn + v * s_stride), gv)));
          else
            acc[i][v] = fma_ordered(x, sd, acc[i][v]);
        }
      }
    }
  }
  for (int i = 0; i < RA; ++i)
    for (int v = 0; v < RW; ++v) {
      const int64_t n = n0 + v * kPanelRows;
      const __mmask16 valid = static_cast<__mmask16>((1u << std::max<int64_t>(0, std::min(kPanelRows, L.N - n))) - 1);
      float* out = y + (m0 + i) * L.N + n;
      _mm512_mask_storeu_ps(out, valid, add_to_y ? add_ordered(_mm512_maskz_loadu_ps(valid, out), acc[i][v]) : acc[i][v]);
    }
}

// panel_quad over each column part in turn (one part: the whole weight).
template <int RA, int RW, bool MINS>
inline void panel_quad_parts(const Panels& P, int64_t pnl, const QuadRows& a, int64_t quad, const Layout& L, float* y,
                             int64_t m0, int64_t n0) {
  const int64_t blocks_per_group = L.group / kBlock;
  for (int64_t part = 0, g0 = 0; part <= L.splits; ++part) {
    const int64_t g1 = part < L.splits ? L.split_blocks[part] / blocks_per_group : P.groups;
    panel_quad<RA, RW, MINS>(P, pnl, a, quad, L, y, m0, n0, g0, g1, part > 0);
    g0 = g1;
  }
}

// 4 activation rows x 3 panels (48 outputs): 12 int32 and 12 float sums, 3 weight vectors
// and a broadcast fit the 32 registers. Measured against 6 x 2 (Zen 4, 2 threads, the default
// model's 120 linears, four alternated rounds): 128 rows 73.8 -> 64.5 ms, 64 rows 48 -> 37 ms,
// 512 rows 297 -> 245 ms (medians); 5 x 2 and 4 x 2 in between, 3 x 4 slower.
constexpr int kBlockPanels = 3;  // panels per kernel call
// Activation rows per pass over an unpacked chunk: their int8 rows stay in L2 with it.
constexpr int64_t kBlockChunkRows = 128;

// Every panel of W unpacked once, at load (quant_gemm_panels): what unpack_panels writes per
// call, for the whole weight, in three regions: codes [panels][Kp / 4][16][4], scales
// [panels][groups][16] float32, mins likewise (formats with mins).
struct PanelStore {
  int64_t panels, Kp, groups, code_bytes, scale_bytes, total;
  bool has_mins;
  explicit PanelStore(const Layout& L)
      : panels((L.tiles + kPanelTiles - 1) / kPanelTiles), Kp(L.Kp), groups(L.Kp / L.group),
        code_bytes(panels * L.Kp * kPanelRows), scale_bytes(panels * (L.Kp / L.group) * kPanelRows * 4),
        total(code_bytes + scale_bytes * (L.has_mins ? 2 : 1)), has_mins(L.has_mins) {}
  // Panels from p0 on, indexed from 0.
  Panels at(const uint8_t* base, int64_t p0) const {
    Panels u;
    u.Kp = Kp, u.groups = groups;
    u.codes = const_cast<uint8_t*>(base) + p0 * Kp * kPanelRows;
    u.scale = reinterpret_cast<float*>(const_cast<uint8_t*>(base) + code_bytes) + p0 * groups * kPanelRows;
    u.mins = has_mins ? reinterpret_cast<float*>(const_cast<uint8_t*>(base) + code_bytes + scale_bytes) + p0 * groups * kPanelRows
                      : nullptr;
    return u;
  }
};

// Rows [m0, m1) (m0 a multiple of 4) against RW panels from `pnl`, a quad at a time.
// `ahead` panels from pnl + RW on (panels unpacked at load, read from memory) are fetched
// into L2 meanwhile, a share with each quad.
template <int RW, bool MINS>
void panel_quads(const Panels& P, int64_t pnl, const QuadRows& a, int64_t M, int64_t m0, int64_t m1, const Layout& L,
                 float* y, int64_t n0, int64_t ahead = 0) {
  const int64_t quads = (m1 - m0 + 3) / 4;
  const int64_t code_lines = ahead * P.Kp * kPanelRows / 64, scale_lines = ahead * P.groups * kPanelRows * 4 / 64;
  const char* next_codes = ahead ? reinterpret_cast<const char*>(P.panel_codes(pnl + RW)) : nullptr;
  const char* next_scale = ahead ? reinterpret_cast<const char*>(P.panel_scale(pnl + RW)) : nullptr;
  const char* next_mins = ahead && MINS ? reinterpret_cast<const char*>(P.panel_mins(pnl + RW)) : nullptr;
  for (int64_t m = m0; m < m1; m += 4) {
    if (ahead) {
      const int64_t q = (m - m0) / 4;
      for (int64_t l = q * code_lines / quads; l < (q + 1) * code_lines / quads; ++l)
        _mm_prefetch(next_codes + 64 * l, _MM_HINT_T1);
      for (int64_t l = q * scale_lines / quads; l < (q + 1) * scale_lines / quads; ++l) {
        _mm_prefetch(next_scale + 64 * l, _MM_HINT_T1);
        if (MINS) _mm_prefetch(next_mins + 64 * l, _MM_HINT_T1);
      }
    }
    switch (std::min<int64_t>(4, M - m)) {
      case 4: panel_quad_parts<4, RW, MINS>(P, pnl, a, m / 4, L, y, m, n0); break;
      case 3: panel_quad_parts<3, RW, MINS>(P, pnl, a, m / 4, L, y, m, n0); break;
      case 2: panel_quad_parts<2, RW, MINS>(P, pnl, a, m / 4, L, y, m, n0); break;
      case 1: panel_quad_parts<1, RW, MINS>(P, pnl, a, m / 4, L, y, m, n0); break;
    }
  }
}

// Panels [begin, end) of W against every activation row.
template <bool MINS>
void run_panels(int64_t begin, int64_t end, const uint8_t* packed, const Layout& L, const QuadRows& a, int64_t M,
                float* y, const uint8_t* repacked) {
  thread_local Scratch scratch;
  Panels u;
  u.Kp = L.Kp, u.groups = L.Kp / L.group;
  const int64_t panel_bytes = L.Kp * kPanelRows;
  const int64_t chunk = std::max<int64_t>(kBlockPanels, (kLaneChunkBytes / panel_bytes) / kBlockPanels * kBlockPanels);
  if (!repacked) {
    const int64_t n_panels = std::min(chunk, end - begin);
    const size_t code_bytes = round64(n_panels * panel_bytes), scale_bytes = round64(n_panels * u.groups * kPanelRows * 4);
    uint8_t* base = scratch.take(code_bytes + 2 * scale_bytes);
    u.codes = base, u.scale = reinterpret_cast<float*>(base + code_bytes),
    u.mins = reinterpret_cast<float*>(base + code_bytes + scale_bytes);
  }
  const PanelStore store(L);
  for (int64_t p0 = begin; p0 < end; p0 += chunk) {
    const int64_t p1 = std::min(end, p0 + chunk);
    if (repacked)
      u = store.at(repacked, p0);
    else
      unpack_panels(packed, L, p0, p1, u);
    for (int64_t m0 = 0; m0 < M; m0 += kBlockChunkRows) {
      const int64_t m1 = std::min(M, m0 + kBlockChunkRows);
      int64_t p = p0;
      for (; p + kBlockPanels <= p1; p += kBlockPanels)
        panel_quads<kBlockPanels, MINS>(u, p - p0, a, M, m0, m1, L, y, p * kPanelRows,
                                        repacked ? std::clamp<int64_t>(end - p - kBlockPanels, 0, kBlockPanels) : 0);
      for (; p < p1; ++p) panel_quads<1, MINS>(u, p - p0, a, M, m0, m1, L, y, p * kPanelRows);
    }
  }
}

// What a block's integer dot starts from, per block's sum of q: a symmetric format's -offset
// (the dot is then of the signed codes), 0 with mins (their term is added in float).
int32_t block_init_multiplier(const Layout& L) { return L.has_mins ? 0 : -static_cast<int32_t>(L.offset); }

// Every panel against every row of `a` (quantized by_block), panels spread over the threads.
void run_all_panels(const ActRows& a, const Layout& L, const uint8_t* packed, float* y, const uint8_t* repacked) {
  thread_local Scratch scratch;
  const QuadRows quads = interleave_quads(a, L, scratch);
  const int64_t panels = (L.tiles + kPanelTiles - 1) / kPanelTiles;
  const int64_t grain = std::max<int64_t>(1, panels / (2 * at::get_num_threads()));
  at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
    if (L.has_mins)
      run_panels<true>(begin, end, packed, L, quads, a.M, y, repacked);
    else
      run_panels<false>(begin, end, packed, L, quads, a.M, y, repacked);
  });
}

void block_integer_linear(const float* x, int64_t M, const int64_t* perm, const Layout& L, const uint8_t* packed,
                          float* y, const uint8_t* repacked) {
  thread_local Scratch scratch;
  run_all_panels(quantize_activations(x, M, L.K, perm, L, block_init_multiplier(L), scratch, L.has_mins, true), L,
                 packed, y, repacked);
}

// W's panels for the block GEMM, unpacked once (PanelStore).
at::Tensor repack_panels(const tokenmill::QuantWeight& w, const Layout& L) {
  const PanelStore store(L);
  at::Tensor out = at::empty({store.total}, w.packed.options());
  uint8_t* base = out.data_ptr<uint8_t>();
  const uint8_t* packed = w.packed.data_ptr<uint8_t>();
  at::parallel_for(0, store.panels, 1, [&](int64_t p0, int64_t p1) {
    Panels u = store.at(base, p0);
    if (!u.mins) u.mins = u.scale;  // never written: unpack_panels writes mins only for formats with mins
    unpack_panels(packed, L, p0, p1, u);
  });
  return out;
}

// ----- few rows in the block GEMM's order ------------------------------------------------------
//
// The row kernel (tile_rows: 4 weight rows against 1-4 activation rows, read in the stored
// tile order) with the block GEMM's arithmetic: each 32-column block's vpdpbusd lanes summed
// in int32 (exact; a symmetric format's from -offset * the block's sum of q) before one
// conversion and one fused multiply-add by scale * d, and a group's mins term after its last
// block. Every output is the float operation sequence the
// block GEMM performs for it, so the two give the same bits at any row count: a row's result
// depends neither on how many rows share the call nor on which kernel the row count picks
// (chunked or cached prompts, batches, deterministic inference). Weight groups of 32 or more.

// Sums of the two 8-lane halves of v0..v3: lanes 0-3 half 0 of (v0, v1, v2, v3), lanes 4-7 half 1.
inline __m256i half_sums(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v0, v1), _mm512_unpackhi_epi32(v0, v1));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v2, v3), _mm512_unpackhi_epi32(v2, v3));
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  // chunk 0 + chunk 1 and chunk 2 + chunk 3, side by side
  return _mm512_castsi512_si256(_mm512_add_epi32(_mm512_shuffle_i32x4(u, u, 0x08), _mm512_shuffle_i32x4(u, u, 0x0D)));
}

// A column part ends before a block: its sum joins the parts' before it (in order), and the
// next part's sum starts from zero. The parts' sum starts at -0, which added to the first
// part's sum gives that sum exactly, whatever its sign (as the parts computed apart have it).
inline __m128 negative_zeros() { return _mm_castsi128_ps(_mm_set1_epi32(static_cast<int>(0x80000000u))); }
__attribute__((always_inline)) inline void close_part(__m128& parts, __m128& acc) {
  parts = add_ordered(parts, acc);
  acc = _mm_setzero_ps();
}

// SPLITS: the weight has column splits (L.split_blocks), each part's sum kept apart until the end.
template <int MB, int BITS, bool MINS, bool HALF, bool SPLITS>
__attribute__((always_inline)) inline void tile_rows_blocked(const uint8_t* tile, const Layout& L, const ActRows& a,
                                                             int64_t m0, float* y, int64_t N, int64_t valid) {
  __m128 acc[MB], parts[MB];  // parts: the sum of the column parts closed so far
  for (int m = 0; m < MB; ++m) acc[m] = _mm_setzero_ps(), parts[m] = negative_zeros();
  const uint8_t* step_cuts = SPLITS ? L.step_cuts.data() : nullptr;
  const __mmask16 smask = static_cast<__mmask16>((1u << (kRows * L.gps)) - 1);
  const int64_t steps = L.span / kStep, gps = L.gps;
  const uint8_t* p = tile;
  // Lanes 0-3: group j0's scale lanes (r * gps + j0) of rows 0-3, lanes 4-7 group j1's, j0 and
  // j1 the groups of a 64-column step's two blocks (0 and 1, or 0 and 0 for groups of 64+).
  const int j1 = gps > 1 ? 1 : 0;
  const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, static_cast<int>(3 * gps + j1),
                                        static_cast<int>(2 * gps + j1), static_cast<int>(gps + j1), j1,
                                        static_cast<int>(3 * gps), static_cast<int>(2 * gps), static_cast<int>(gps), 0);
  // 4-bit half sums come as (r0b0, r2b0, r0b1, r2b1 | r1b0, r3b0, r1b1, r3b1)
  const __m256i rows4 = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
    for (int64_t o = 0; o < L.span_bytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + o), TM_PREFETCH_HINT);
    const __m512 sv = load_scale_lanes<HALF>(p, smask);
    const __m256 sw = _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, sv));  // [block 0 | block 1] x rows 0-3
    const __m256 mw = MINS ? _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, load_scale_lanes<HALF>(p + L.scale_block, smask)))
                           : _mm256_setzero_ps();
    const uint8_t* c = p + L.scale_block * (MINS ? 2 : 1);
    for (int64_t st = 0; st < steps; ++st, c += L.step_bytes) {
      const int64_t col = s * L.span + st * kStep;
      // the group sums times the mins where a block ends a group (groups of 32: both blocks;
      // of 64+: block 1 of the span's last step, by_block_gsum's lanes 4-7), else times 0
      const bool mins_here = gps > 1 || st == steps - 1;
      // Column parts that end before this step's block 0 (bit 0) or block 1 (bit 1).
      const int cuts = SPLITS ? step_cuts[col / kStep] : 0;
      __m512i w[kRows];
      load_step_codes<BITS>(c, w);
      // The step's rows; with CUT, the parts that end in it closed before their block (its own
      // copy: the other steps carry no test for them).
      auto step_rows = [&](auto cut) __attribute__((always_inline)) {
        constexpr bool CUT = decltype(cut)::value;
        for (int m = 0; m < MB; ++m) {
          const int8_t* xq = a.q_row(m0 + m) + col;
          const float* dx = a.d_row(m0 + m) + col / 4;
          __m512i dot[kRows];
          if (BITS == 8) {
            const __m512i xv = _mm512_loadu_si512(xq);
            for (int v = 0; v < kRows; ++v) dot[v] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[v], xv);
          } else {  // vector 2p + h: rows 2p, 2p + 1, block h
            for (int h = 0; h < 2; ++h) {
              const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * h)));
              dot[h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[h], xv);
              dot[2 + h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2 + h], xv);
            }
          }
          __m256i blocks;  // [block 0 | block 1] integer dots of rows 0-3
          if (BITS == 8) {
            blocks = half_sums(dot[0], dot[1], dot[2], dot[3]);
          } else {
            blocks = _mm256_permutevar8x32_epi32(half_sums(dot[0], dot[2], dot[1], dot[3]), rows4);
          }
          const __m256 d = _mm256_loadu_ps(dx + 4);  // lanes 4-11 of the step: d of block 0 x4, block 1 x4
          if (!MINS) {  // the dots start from -offset * sum(q) (init lanes 4-11, as d), then one fma per block
            blocks = _mm256_add_epi32(blocks, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.init_row(m0 + m) + col / 4 + 4)));
            const __m256 x = _mm256_cvtepi32_ps(blocks), sd = _mm256_mul_ps(sw, d);
            if (CUT && (cuts & 1)) close_part(parts[m], acc[m]);
            acc[m] = fma_ordered(_mm256_castps256_ps128(x), _mm256_castps256_ps128(sd), acc[m]);
            if (CUT && (cuts & 2)) close_part(parts[m], acc[m]);
            acc[m] = fma_ordered(_mm256_extractf128_ps(x, 1), _mm256_extractf128_ps(sd, 1), acc[m]);
            continue;
          }
          const __m256 g = mins_here ? _mm256_loadu_ps(a.gsum_span(m0 + m, s)) : _mm256_setzero_ps();
          const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), _mm256_mul_ps(sw, d), _mm256_mul_ps(mw, g));
          if (CUT && (cuts & 1)) close_part(parts[m], acc[m]);
          acc[m] = add_ordered(acc[m], _mm256_castps256_ps128(t));
          if (CUT && (cuts & 2)) close_part(parts[m], acc[m]);
          acc[m] = add_ordered(acc[m], _mm256_extractf128_ps(t, 1));
        }
      };
      if (SPLITS && cuts)
        step_rows(std::true_type{});
      else
        step_rows(std::false_type{});
    }
  }
  for (int m = 0; m < MB; ++m) {
    if (SPLITS) acc[m] = add_ordered(parts[m], acc[m]);  // the last part joins the others
    _mm_mask_storeu_ps(y + (m0 + m) * N, static_cast<__mmask8>((1u << valid) - 1), acc[m]);
  }
}

template <int BITS, bool MINS, bool HALF, bool SPLITS>
void run_tiles_blocked(int64_t begin, int64_t end, const uint8_t* packed, const Layout& L, const ActRows& a,
                       const RowBlocks& blocks, float* y) {
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* tile = L.tile(packed, t);
    const int64_t valid = std::min(kRows, L.N - t * kRows);
    float* yt = y + t * kRows;
    for (int64_t b = 0; b < blocks.count; ++b) {
      const int64_t m0 = blocks.start[b];
      switch (blocks.rows[b]) {
        case 1: tile_rows_blocked<1, BITS, MINS, HALF, SPLITS>(tile, L, a, m0, yt, L.N, valid); break;
        case 2: tile_rows_blocked<2, BITS, MINS, HALF, SPLITS>(tile, L, a, m0, yt, L.N, valid); break;
        case 3: tile_rows_blocked<3, BITS, MINS, HALF, SPLITS>(tile, L, a, m0, yt, L.N, valid); break;
        case 4: tile_rows_blocked<4, BITS, MINS, HALF, SPLITS>(tile, L, a, m0, yt, L.N, valid); break;
      }
    }
  }
}

template <bool SPLITS>
RunFn pick_blocked_run_fn(const Layout& L) {
  const bool half = L.scale_bytes == 2;
  if (L.bits == 4) {
    if (L.has_mins) return half ? &run_tiles_blocked<4, true, true, SPLITS> : &run_tiles_blocked<4, true, false, SPLITS>;
    return half ? &run_tiles_blocked<4, false, true, SPLITS> : &run_tiles_blocked<4, false, false, SPLITS>;
  }
  if (L.has_mins) return half ? &run_tiles_blocked<8, true, true, SPLITS> : &run_tiles_blocked<8, true, false, SPLITS>;
  return half ? &run_tiles_blocked<8, false, true, SPLITS> : &run_tiles_blocked<8, false, false, SPLITS>;
}

// The row kernel for this weight: where it has column splits, an instance that keeps its parts'
// sums apart (the usual one carries no test for them).
RunFn pick_blocked_run_fn(const Layout& L) {
  return L.splits ? pick_blocked_run_fn<true>(L) : pick_blocked_run_fn<false>(L);
}
#endif

// Whether the block kernel covers this weight (and this build has it).
bool block_gemm_covers(const Layout& L) {
#if defined(TM_QUANT_BLOCK_GEMM)
  return L.group % kBlock == 0;
#else
  (void)L;
  return false;
#endif
}

// Integer dot products over every tile, tiles spread over the threads (few rows: decode;
// any number under deterministic inference). From `many_rows` rows on (-1: kManyRows) the
// lane-rows kernel computes the same bits faster, where the build has it.
void integer_linear(const float* x, int64_t M, const int64_t* perm, const Layout& L, const uint8_t* packed, float* y,
                    int64_t many_rows, const uint8_t* repacked) {
  thread_local Scratch scratch;
#if defined(TM_QUANT_BLOCK_GEMM)
  if (block_gemm_covers(L)) {  // the block order: the row kernel and the block GEMM give the same bits
    const ActRows a = quantize_activations(x, M, L.K, perm, L, block_init_multiplier(L), scratch, L.has_mins, true);
    if (M >= (many_rows < 0 ? kManyRows : many_rows)) return run_all_panels(a, L, packed, y, repacked);
    const RowBlocks blocks(M);
    const RunFn run = pick_blocked_run_fn(L);
    const int64_t grain = std::max<int64_t>(4, L.tiles / (4 * at::get_num_threads()));
    at::parallel_for(0, L.tiles, grain, [&](int64_t begin, int64_t end) { run(begin, end, packed, L, a, blocks, y); });
    return;
  }
#endif
  const ActRows a = quantize_activations(x, M, L.K, perm, L, init_multiplier(L), scratch, L.has_mins);
#if defined(TM_QUANT_LANE_ROWS)
  if (M >= (many_rows < 0 ? kManyRows : many_rows)) {
    thread_local Scratch lane_scratch;
    const LaneRows t = transpose_rows(a, L, lane_scratch);
    const LaneRunFn run = pick_lane_run_fn(L, a.init != nullptr);
    const int64_t grain = std::max<int64_t>(1, L.tiles / (2 * at::get_num_threads()));
    at::parallel_for(0, L.tiles, grain, [&](int64_t begin, int64_t end) { run(begin, end, packed, L, t, M, y); });
    return;
  }
#endif
  const RowBlocks blocks(M);
  const RunFn run = pick_run_fn(L);
  // Several chunks per thread (uneven thread speed), each worth a hand-off.
  const int64_t grain = std::max<int64_t>(4, L.tiles / (4 * at::get_num_threads()));
  at::parallel_for(0, L.tiles, grain, [&](int64_t begin, int64_t end) { run(begin, end, packed, L, a, blocks, y); });
}

// ----- dequantization (prefill's GEMM input, embedding rows, tests) ---------------------------

#if defined(TM_QUANT_AVX512)
inline void store16(float* o, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(o, mask, v); }
inline void store16(c10::BFloat16* o, __m512 v, __mmask16 mask) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(o, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) o[i] = c10::BFloat16(f[i]);
#endif
}

// One row's 64 columns of a step: codes -> scale * u + min (a fused multiply-add: scale * u
// is exact for every stored format, so it rounds like the reference's two operations).
template <typename T>
inline void dequantize_step(const uint8_t* cr, int64_t bits, const float* sc, const float* mn, int64_t gps,
                            int64_t group, int64_t width, T* o) {
#if defined(__AVX512BF16__)
  if (std::is_same_v<T, c10::BFloat16> && bits == 4 && gps <= 2 && width == kStep) {
    // 4-bit to bf16 by table: the 16 values of each of the step's (one or two) groups, in
    // bf16, and vpermw picks one per code: ~11 operations per 64 values instead of ~20.
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t j1 = gps > 1 ? 1 : 0;
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[0]), _mm512_set1_ps(mn[0]));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[j1]), _mm512_set1_ps(mn[j1]));
    const __m512i table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t1, t0));  // entries 0-15: group 0
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr));
    const __m256i lo = _mm256_and_si256(t, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), _mm256_set1_epi8(0x0F));
    const __m512i idx_hi = _mm512_or_si512(_mm512_cvtepu8_epi16(hi), _mm512_set1_epi16(16));
    _mm512_storeu_si512(o, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), table));
    _mm512_storeu_si512(o + 32, _mm512_permutexvar_epi16(idx_hi, table));
    return;
  }
  if (std::is_same_v<T, c10::BFloat16> && bits == 8 && width == kStep) {
    for (int c = 0; c < 2; ++c) {  // 32 columns per pair of conversions
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr + 32 * c));
      const int64_t j0 = gps > 1 ? 32 * c / group : 0, j1 = gps > 1 ? (32 * c + 16) / group : 0;
      const __m512 u0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(b)));
      const __m512 u1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(b, 1)));
      const __m512 v0 = _mm512_fmadd_ps(u0, _mm512_set1_ps(sc[j0]), _mm512_set1_ps(mn[j0]));
      const __m512 v1 = _mm512_fmadd_ps(u1, _mm512_set1_ps(sc[j1]), _mm512_set1_ps(mn[j1]));
      _mm512_storeu_si512(o + 32 * c, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0)));
    }
    return;
  }
#endif
  __m128i chunk[4];
  if (bits == 8) {
    for (int c = 0; c < 4; ++c) chunk[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cr + 16 * c));
  } else {
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cr));
    const __m256i lo = _mm256_and_si256(t, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), _mm256_set1_epi8(0x0F));
    chunk[0] = _mm256_castsi256_si128(lo), chunk[1] = _mm256_extracti128_si256(lo, 1);
    chunk[2] = _mm256_castsi256_si128(hi), chunk[3] = _mm256_extracti128_si256(hi, 1);
  }
  for (int c = 0; c < 4 && 16 * c < width; ++c) {
    const int64_t j = gps > 1 ? 16 * c / group : 0;
    const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(chunk[c]));
    const int64_t n = std::min<int64_t>(16, width - 16 * c);
    store16(o + 16 * c, _mm512_fmadd_ps(u, _mm512_set1_ps(sc[j]), _mm512_set1_ps(mn[j])),
            static_cast<__mmask16>((1u << n) - 1));
  }
}
#endif

// A span's scales and mins (-offset * scale for symmetric formats) for the tile's rows.
inline void load_span_scales(const uint8_t* p, const Layout& L, float* scale, float* minv) {
  const int64_t n = kRows * L.gps;
#if defined(__F16C__)
  if (L.scale_bytes == 2) {  // 16-bit floats through the hardware conversion, 8 at a time
    for (int64_t i = 0; i < n; i += 8) {
      _mm256_storeu_ps(scale + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
      if (L.has_mins)
        _mm256_storeu_ps(minv + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + L.scale_block + 2 * i))));
    }
  } else
#endif
  {
    for (int64_t i = 0; i < n; ++i) {
      scale[i] = load_scale(p, i, L.scale_bytes);
      if (L.has_mins) minv[i] = load_scale(p + L.scale_block, i, L.scale_bytes);
    }
  }
  if (!L.has_mins)
    for (int64_t i = 0; i < n; ++i) minv[i] = -static_cast<float>(L.offset) * scale[i];
}

#if defined(TM_QUANT_AVX512) && defined(__AVX512BF16__)
// The GEMM path's common case, a whole tile of 4-bit codes (group >= 32) to bf16: per span
// and row, the bf16 values of the row's (one or two) groups as a 32-entry table, which
// vpermw indexes with the codes (the second group's codes offset by 16).
template <bool HALF, bool MINS>
void dequantize_tile_q4_bf16(const uint8_t* tile, const Layout& L, c10::BFloat16* out) {
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 smask = static_cast<__mmask16>((1u << (kRows * L.gps)) - 1);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i second = _mm512_set1_epi16(16);
  alignas(64) float sc[kLanes], mn[kLanes];
  const uint8_t* p = tile;
  for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
    const __m512 sv = load_scale_lanes<HALF>(p, smask);
    _mm512_store_ps(sc, sv);
    _mm512_store_ps(mn, MINS ? load_scale_lanes<HALF>(p + L.scale_block, smask)
                             : _mm512_mul_ps(sv, _mm512_set1_ps(-static_cast<float>(L.offset))));
    __m512i table[kRows];
    for (int r = 0; r < kRows; ++r) {
      const int64_t j0 = r * L.gps, j1 = j0 + L.gps - 1;
      const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[j0]), _mm512_set1_ps(mn[j0]));
      const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[j1]), _mm512_set1_ps(mn[j1]));
      table[r] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(t1, t0));
    }
    const uint8_t* c = p + L.scale_block * (MINS ? 2 : 1);
    for (int64_t j = 0; j < L.span / kStep; ++j, c += L.step_bytes) {
      c10::BFloat16* o = out + s * L.span + j * kStep;
      for (int r = 0; r < kRows; ++r, o += L.K) {
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * L.row_step_bytes));
        const __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(t, nibble));
        const __m512i hi = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(t, 4), nibble)), second);
        _mm512_storeu_si512(o, _mm512_permutexvar_epi16(lo, table[r]));
        _mm512_storeu_si512(o + 32, _mm512_permutexvar_epi16(hi, table[r]));
      }
    }
  }
}
#endif

// Rows [row_begin, row_end) of W (stored column order) into out [rows, K], float or bf16.
template <typename T>
void dequantize_rows(const uint8_t* packed, const Layout& L, int64_t row_begin, int64_t row_end, T* out) {
  const int64_t t_begin = row_begin / kRows, t_end = (row_end + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, 16384 / (kRows * L.Kp));
  at::parallel_for(t_begin, t_end, grain, [&](int64_t tb, int64_t te) {
    float scale[kRows * 4 + 8], minv[kRows * 4 + 8];  // + 8: the 8-wide conversion's spill-over
    float vals[kStep];
    for (int64_t t = tb; t < te; ++t) {
#if defined(TM_QUANT_AVX512) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const bool whole = t * kRows >= row_begin && (t + 1) * kRows <= row_end;
        if (whole && L.bits == 4 && L.gps <= 2 && L.K == L.Kp) {
          T* o = out + (t * kRows - row_begin) * L.K;
          const uint8_t* tile = L.tile(packed, t);
          if (L.scale_bytes == 2)
            L.has_mins ? dequantize_tile_q4_bf16<true, true>(tile, L, o) : dequantize_tile_q4_bf16<true, false>(tile, L, o);
          else
            L.has_mins ? dequantize_tile_q4_bf16<false, true>(tile, L, o) : dequantize_tile_q4_bf16<false, false>(tile, L, o);
          continue;
        }
      }
#endif
      const uint8_t* p = L.tile(packed, t);
      for (int64_t s = 0; s < L.spans; ++s, p += L.span_bytes) {
        load_span_scales(p, L, scale, minv);
        const uint8_t* c = p + L.scale_block * (L.has_mins ? 2 : 1);
        for (int64_t j = 0; j < L.span / kStep; ++j, c += L.step_bytes) {
          const int64_t col = s * L.span + j * kStep;
          const int64_t width = std::min(kStep, L.K - col);
          if (width <= 0) break;
          for (int64_t r = 0; r < kRows; ++r) {
            const int64_t row = t * kRows + r;
            if (row < row_begin || row >= row_end) continue;
            const uint8_t* cr = c + r * L.row_step_bytes;
            const float* sc = scale + r * L.gps;
            const float* mn = minv + r * L.gps;
            T* o = out + (row - row_begin) * L.K + col;
#if defined(TM_QUANT_AVX512)
            dequantize_step(cr, L.bits, sc, mn, L.gps, L.group, width, o);
            continue;
#endif
            // As the reference: scale * (u - offset), or scale * u + min (scale * u is exact
            // for every stored format, so a fused multiply-add rounds the same).
            const int64_t g = L.group;
            for (int i = 0; i < kStep; ++i) {
              const int u = L.bits == 8 ? cr[i] : (i < 32 ? cr[i] & 0x0F : cr[i - 32] >> 4);
              const int64_t j = L.gps > 1 ? i / g : 0;
              vals[i] = L.has_mins ? sc[j] * static_cast<float>(u) + mn[j] : sc[j] * static_cast<float>(u - L.offset);
            }
            for (int64_t i = 0; i < width; ++i) o[i] = static_cast<T>(vals[i]);
          }
        }
      }
    }
  });
}

at::Tensor dequantize_impl(const tokenmill::QuantWeight& w, const Layout& L, int64_t row_begin, int64_t row_end,
                           at::ScalarType dtype) {
  at::Tensor out = at::empty({row_end - row_begin, L.K}, w.packed.options().dtype(dtype));
  const uint8_t* p = w.packed.data_ptr<uint8_t>();
  if (dtype == at::kFloat)
    dequantize_rows(p, L, row_begin, row_end, out.data_ptr<float>());
  else
    dequantize_rows(p, L, row_begin, row_end, out.data_ptr<c10::BFloat16>());
  return out;
}

// Many rows: W dequantized to bf16, up to 4 MiB of it at a time, into a reused buffer (a
// fresh allocation per call cost more in page faults than the dequantization), and
// multiplied by oneDNN's bf16 GEMM (AMX where the CPU has it). Chunks are large because a
// GEMM call costs ~20 us however small.
constexpr int64_t kGemmChunkBytes = int64_t{4} << 20;

at::Tensor gemm_linear(const at::Tensor& x, const tokenmill::QuantWeight& w, const Layout& L) {
  at::Tensor xb = x;
  if (w.col_perm.has_value()) xb = xb.index_select(1, *w.col_perm);
  xb = xb.to(at::kBFloat16);
  thread_local Scratch scratch;
  const int64_t chunk = std::min(L.N, std::max<int64_t>(kRows, kGemmChunkBytes / (2 * L.K) / kRows * kRows));
  auto* buffer = reinterpret_cast<c10::BFloat16*>(scratch.take(chunk * L.K * sizeof(c10::BFloat16)));
  const uint8_t* p = w.packed.data_ptr<uint8_t>();
  const bool transposed = x.size(0) <= kTransposedGemmRows;
  auto product = [&](const at::Tensor& wc) { return transposed ? at::mm(wc, xb.t()).t() : at::mm(xb, wc.t()); };
  if (chunk == L.N && !transposed && x.scalar_type() == at::kBFloat16) {  // nothing to copy
    dequantize_rows(p, L, 0, L.N, buffer);
    return product(at::from_blob(buffer, {L.N, L.K}, xb.options()));
  }
  at::Tensor y = tokenmill::activation_empty({x.size(0), L.N}, x.options());
  for (int64_t r = 0; r < L.N; r += chunk) {
    const int64_t end = std::min(L.N, r + chunk);
    dequantize_rows(p, L, r, end, buffer);
    y.narrow(1, r, end - r).copy_(product(at::from_blob(buffer, {end - r, L.K}, xb.options())));
  }
  return y;
}

}  // namespace

namespace tokenmill {

QuantWeight QuantWeight::from_format(at::Tensor packed, at::IntArrayRef format, std::optional<at::Tensor> col_perm,
                                     std::optional<at::Tensor> gemm_panels, at::IntArrayRef column_splits) {
  TORCH_CHECK(format.size() == 6, "quantized weight format must be [N, K, bits, group_size, scale_bytes, code_offset]");
  return QuantWeight{std::move(packed), format[0], format[1], format[2], format[3], format[4], format[5],
                     std::move(col_perm), std::move(gemm_panels), column_splits.vec()};
}

at::Tensor quant_gemm_panels(const QuantWeight& w) {
  const Layout L(w);
#if defined(TM_QUANT_BLOCK_GEMM)
  TORCH_CHECK(block_gemm_covers(L), "quant_gemm_panels: the block GEMM does not cover groups of ", L.group);
  return repack_panels(w, L);
#else
  TORCH_CHECK(false, "quant_gemm_panels: this build has no block GEMM (AVX512-VNNI)");
  return at::Tensor();
#endif
}

at::Tensor quant_linear(const at::Tensor& x, const QuantWeight& w, int64_t max_integer_rows, int64_t many_rows,
                        bool integer_gemm) {
  const Layout L(w);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(x.size(1) == L.K, "x has ", x.size(1), " columns but the quantized weight has K = ", L.K);
  const int64_t* perm = nullptr;
  if (w.col_perm.has_value()) {
    const at::Tensor& p = *w.col_perm;
    TORCH_CHECK(p.scalar_type() == at::kLong && p.is_contiguous() && p.dim() == 1 && p.size(0) == L.K,
                "col_perm: contiguous int64 [K]");
    perm = p.data_ptr<int64_t>();
  }
  const int64_t M = x.size(0);
  const bool many = M > (max_integer_rows < 0 ? default_integer_rows(L.bits) : max_integer_rows);
  const bool block = many && integer_gemm && block_gemm_covers(L);
  TORCH_CHECK(!L.splits || (block_gemm_covers(L) && !perm && (!many || integer_gemm)),
              "column_splits need the block-order integer kernels (an AVX512-VNNI build, groups of 32 or more, no "
              "act-order permutation, the integer GEMM past the integer rows): compute the parts apart (ColumnParts)");
  // (bf16 rows would round the sum of the parts once where the parts computed apart round each.)
  TORCH_CHECK(!L.splits || x.scalar_type() == at::kFloat, "column_splits take float32 activations");
  // With integer_gemm a weight the block GEMM does not cover (Q6_K's groups of 16) keeps the
  // row kernel's integer arithmetic at every row count (its lane-rows form from 16 rows on), so
  // that the plan's "a row's bits do not depend on the step's rows" holds for every tensor.
  // (Builds without the block GEMM run the bf16 GEMM past the integer rows, integer_gemm or not.)
#if defined(TM_QUANT_BLOCK_GEMM)
  if (many && !integer_gemm) return gemm_linear(x, w, L);
#else
  if (many) return gemm_linear(x, w, L);
#endif
  if (x.scalar_type() == at::kBFloat16)
    return quant_linear(x.to(at::kFloat), w, max_integer_rows, many_rows, integer_gemm).to(at::kBFloat16);
  at::Tensor y = activation_empty({M, L.N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* packed = w.packed.data_ptr<uint8_t>();
  const uint8_t* repacked = nullptr;  // the block GEMM's panels, unpacked at load
#if defined(TM_QUANT_BLOCK_GEMM)
  if (w.gemm_panels.has_value() && block_gemm_covers(L)) {
    const at::Tensor& t = *w.gemm_panels;
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == PanelStore(L).total,
                "gemm_panels: not quant_gemm_panels of this weight (uint8, ", PanelStore(L).total, " bytes; got ",
                t.scalar_type(), ", ", t.numel(), ")");
    repacked = t.data_ptr<uint8_t>();
  }
  if (block) {
    block_integer_linear(xp, M, perm, L, packed, yp, repacked);
    return y;
  }
#endif
  integer_linear(xp, M, perm, L, packed, yp, many_rows, repacked);
  return y;
}

at::Tensor quant_dequantize(const QuantWeight& w, at::ScalarType dtype, const std::optional<at::Tensor>& rows) {
  const Layout L(w);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: dtype must be float32 or bfloat16");
  if (!rows.has_value()) return dequantize_impl(w, L, 0, L.N, dtype);
  const at::Tensor index = rows->to(at::kLong).contiguous();
  TORCH_CHECK(index.dim() == 1, "quant_dequantize: rows must be 1-D");
  const int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < L.N, "quant_dequantize: row ", ip[i], " is outside [0, ", L.N, ")");
  std::vector<at::Tensor> out;
  out.reserve(index.numel());
  for (int64_t i = 0; i < index.numel(); ++i) out.push_back(dequantize_impl(w, L, ip[i], ip[i] + 1, dtype));
  return index.numel() ? at::cat(out) : at::empty({0, L.K}, w.packed.options().dtype(dtype));
}

std::tuple<at::Tensor, at::Tensor> quantize_activations_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "quantize_activations_q8: K must be a multiple of 32");
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / kBlock}, x.options());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / kBlock; ++b)
      quantize_block(x.data_ptr<float>() + m * K + b * kBlock, q.data_ptr<int8_t>() + m * K + b * kBlock,
                     d.data_ptr<float>() + m * (K / kBlock) + b);
  return {q, d};
}

const char* quant_isa() {
#if defined(TM_QUANT_AVX512)
  return "avx512_vnni";
#elif defined(TM_QUANT_AVX_VNNI)
  return "avx_vnni";
#elif defined(TM_QUANT_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace tokenmill

namespace {
at::Tensor quant_linear_op(const at::Tensor& x, const at::Tensor& packed, at::IntArrayRef format,
                           const std::optional<at::Tensor>& col_perm, int64_t max_integer_rows, int64_t many_rows,
                           bool integer_gemm, const std::optional<at::Tensor>& gemm_panels,
                           at::IntArrayRef column_splits) {
  return tokenmill::quant_linear(
      x, tokenmill::QuantWeight::from_format(packed, format, col_perm, gemm_panels, column_splits), max_integer_rows,
      many_rows, integer_gemm);
}
at::Tensor quant_gemm_panels_op(const at::Tensor& packed, at::IntArrayRef format) {
  return tokenmill::quant_gemm_panels(tokenmill::QuantWeight::from_format(packed, format, std::nullopt));
}
at::Tensor quant_dequantize_op(const at::Tensor& packed, at::IntArrayRef format, at::ScalarType dtype,
                               const std::optional<at::Tensor>& rows) {
  return tokenmill::quant_dequantize(tokenmill::QuantWeight::from_format(packed, format, std::nullopt), dtype, rows);
}
std::string quant_isa_op() { return tokenmill::quant_isa(); }
}  // namespace

TORCH_LIBRARY_FRAGMENT(TOKENMILL_OPS_NS, m) {
  m.def("quant_linear(Tensor x, Tensor packed, int[] format, Tensor? col_perm, int max_integer_rows=-1, "
        "int many_rows=-1, bool integer_gemm=False, Tensor? gemm_panels=None, int[] column_splits=[]) -> Tensor");
  m.def("quant_gemm_panels(Tensor packed, int[] format) -> Tensor");
  m.def("quant_dequantize(Tensor packed, int[] format, ScalarType dtype, Tensor? rows=None) -> Tensor");
  m.def("quantize_activations_q8(Tensor x) -> (Tensor, Tensor)");
  m.def("quant_isa() -> str", &quant_isa_op);
}

TORCH_LIBRARY_IMPL(TOKENMILL_OPS_NS, CPU, m) {
  m.impl("quant_linear", &quant_linear_op);
  m.impl("quant_dequantize", &quant_dequantize_op);
  m.impl("quant_gemm_panels", &quant_gemm_panels_op);
  m.impl("quantize_activations_q8", &tokenmill::quantize_activations_q8);
}
