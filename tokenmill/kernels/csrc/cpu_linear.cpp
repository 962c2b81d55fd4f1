// Skinny matrix multiply for decode on the CPU: y[M, N] = x[M, K] . W[N, K]^T with few
// rows M (one per decoding sequence), W in float32 or bfloat16, arithmetic in float32.
//
// Why a native kernel: with M = 1 a decode step is a stream of weight reads, and the
// BLAS paths PyTorch takes on this CPU read them at about half the memory bandwidth
// (F.linear of the 49152 x 576 LM head: 9.5 GB/s where a plain read of memory reaches
// 23 GB/s); with M = 2..8 they are slower still (M = 4 took 2-3x the time of M = 1).
//
// Why a tiled weight layout: reading four rows of W side by side is four interleaved
// streams 1-3 KB apart, which the hardware prefetchers follow badly (a bfloat16 W was
// read at 11-14 GB/s that way). W is therefore stored as [ceil(N/4)][K/16][4][16]: the
// kernel walks memory strictly in order, reaching 21-25 GB/s, and each 4-row tile stays
// in L1 while it is multiplied with every row of x. Rows past N in the last tile are zero.

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

constexpr int64_t kTileRows = 4;   // rows of W per tile
constexpr int64_t kKBlock = 16;    // consecutive K elements of one row inside a tile

#if defined(__AVX512F__)
using tokenmill::load16;

// AVX-512: a tile's K block of one row (16 elements) is exactly one register, so each
// block is one load per tile row, one per x row and 4R FMAs, half the instructions of the
// AVX2 loop below; the 4R accumulators are reduced once at the end.
template <int R, typename W>
inline void tile_times_rows(const float* x, int64_t K, const W* tile, float* y, int64_t N, int64_t valid) {
  __m512 acc[kTileRows][R];
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < R; ++m) acc[r][m] = _mm512_setzero_ps();
  const W* p = tile;
  for (int64_t k = 0; k < K; k += kKBlock, p += kTileRows * kKBlock) {
    __m512 xv[R];
    for (int m = 0; m < R; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < kTileRows; ++r) {
      const __m512 w = load16(p + r * kKBlock);
      for (int m = 0; m < R; ++m) acc[r][m] = _mm512_fmadd_ps(w, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < valid; ++r)
    for (int m = 0; m < R; ++m) y[m * N + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <typename W>
void tile_times_x(const float* x, int64_t M, int64_t K, const W* tile, float* y, int64_t N, int64_t valid) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_times_rows<4>(x + m * K, K, tile, y + m * N, N, valid);
  if (M - m == 3) tile_times_rows<3>(x + m * K, K, tile, y + m * N, N, valid);
  if (M - m == 2) tile_times_rows<2>(x + m * K, K, tile, y + m * N, N, valid);
  if (M - m == 1) tile_times_rows<1>(x + m * K, K, tile, y + m * N, N, valid);
}
#elif defined(__AVX2__) && defined(__FMA__)
using tokenmill::hsum;
using tokenmill::load8;

// One tile (4 rows of W) against R rows of x: 4R accumulators, each tile element
// loaded once per R rows. `valid` rows of the tile are real (the last tile may be short).
template <int R, typename W>
inline void tile_times_rows(const float* x, int64_t K, const W* tile, float* y, int64_t N, int64_t valid) {
  __m256 acc[kTileRows][R];
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < R; ++m) acc[r][m] = _mm256_setzero_ps();
  const W* p = tile;
  for (int64_t k = 0; k < K; k += kKBlock, p += kTileRows * kKBlock) {
    for (int half = 0; half < 2; ++half) {
      __m256 xv[R];
      for (int m = 0; m < R; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k + 8 * half);
      for (int r = 0; r < kTileRows; ++r) {
        const __m256 w = load8(p + r * kKBlock + 8 * half);
        for (int m = 0; m < R; ++m) acc[r][m] = _mm256_fmadd_ps(w, xv[m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < valid; ++r)
    for (int m = 0; m < R; ++m) y[m * N + r] = hsum(acc[r][m]);
}

template <typename W>
void tile_times_x(const float* x, int64_t M, int64_t K, const W* tile, float* y, int64_t N, int64_t valid) {
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_times_rows<3>(x + m * K, K, tile, y + m * N, N, valid);
  if (M - m == 2) tile_times_rows<2>(x + m * K, K, tile, y + m * N, N, valid);
  if (M - m == 1) tile_times_rows<1>(x + m * K, K, tile, y + m * N, N, valid);
}
#else
template <typename W>
void tile_times_x(const float* x, int64_t M, int64_t K, const W* tile, float* y, int64_t N, int64_t valid) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < valid; ++r) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k)
        s += x[m * K + k] * static_cast<float>(tile[(k / kKBlock) * kTileRows * kKBlock + r * kKBlock + k % kKBlock]);
      y[m * N + r] = s;
    }
}
#endif

// tiled: [ceil(N / 4), K / 16, 4, 16] as tokenmill.kernels.tile_for_skinny lays it out.
}  // namespace

// Entry points, also called directly by the fused decoder layer (cpu_kernels.h).
namespace tokenmill {

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& tiled, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(tiled.dim() == 4 && tiled.is_contiguous() && tiled.size(2) == kTileRows && tiled.size(3) == kKBlock,
              "weight: contiguous [ceil(N/4), K/16, 4, 16] (see tile_for_skinny)");
  const int64_t M = x.size(0), K = x.size(1), tiles = tiled.size(0);
  TORCH_CHECK(tiled.size(1) * kKBlock == K, "x and weight disagree on K");
  TORCH_CHECK(N > (tiles - 1) * kTileRows && N <= tiles * kTileRows, "N does not match the number of weight tiles");
  at::Tensor y = activation_empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Several chunks per thread (uneven thread speed), each big enough to be worth a hand-off.
  const int64_t grain = std::max<int64_t>(8, tiles / (4 * at::get_num_threads()));
  AT_DISPATCH_V2(tiled.scalar_type(), "skinny_linear", AT_WRAP([&] {
    const scalar_t* wp = tiled.data_ptr<scalar_t>();
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        tile_times_x(xp, M, K, wp + t * kTileRows * K, yp + t * kTileRows, N, std::min(kTileRows, N - t * kTileRows));
    });
  }), at::kFloat, at::kBFloat16);
  return y;
}

// Several weights of one shape, each against its own run of rows: y[offsets[g]:offsets[g+1]]
// = x[offsets[g]:offsets[g+1]] . W_g^T. A mixture of experts' step: the rows are the step's
// tokens grouped by expert, W_g an expert's matrix. One parallel loop over every (weight,
// tile) pair, so the threads meet once per call, not once per expert: a decode step of
// eight experts costs the barriers of one dense matrix.
at::Tensor grouped_skinny_linear(const at::Tensor& x, at::IntArrayRef offsets, at::TensorList tiled, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t groups = static_cast<int64_t>(tiled.size());
  TORCH_CHECK(groups > 0 && static_cast<int64_t>(offsets.size()) == groups + 1, "offsets: one more than the weights");
  TORCH_CHECK(offsets[0] == 0 && offsets[groups] == x.size(0), "offsets must run from 0 to the rows of x");
  const int64_t K = x.size(1), tiles = tiled[0].size(0);
  for (const auto& w : tiled) {
    TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(0) == tiles && w.size(1) * kKBlock == K &&
                    w.size(2) == kTileRows && w.size(3) == kKBlock && w.scalar_type() == tiled[0].scalar_type(),
                "weights: contiguous [ceil(N/4), K/16, 4, 16] of one shape and dtype (see tile_for_skinny)");
  }
  TORCH_CHECK(N > (tiles - 1) * kTileRows && N <= tiles * kTileRows, "N does not match the number of weight tiles");
  at::Tensor y = activation_empty({x.size(0), N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t total = groups * tiles;
  const int64_t grain = std::max<int64_t>(8, total / (4 * at::get_num_threads()));
  AT_DISPATCH_V2(tiled[0].scalar_type(), "grouped_skinny_linear", AT_WRAP([&] {
    std::vector<const scalar_t*> wps(groups);
    for (int64_t g = 0; g < groups; ++g) wps[g] = tiled[g].data_ptr<scalar_t>();
    at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t g = i / tiles, t = i % tiles, row = offsets[g], M = offsets[g + 1] - row;
        if (M > 0)
          tile_times_x(xp + row * K, M, K, wps[g] + t * kTileRows * K, yp + row * N + t * kTileRows, N,
                       std::min(kTileRows, N - t * kTileRows));
      }
    });
  }), at::kFloat, at::kBFloat16);
  return y;
}

}  // namespace tokenmill

// ---------------------------------------------------------------------------------------
// Panel GEMM: y[M, N] = x[M, K] . W[N, K]^T computed the same way at every row count.
//
// Why: the skinny kernel above gives way to oneDNN past a few rows, and the two round a
// row's outputs differently, so a token's logits depended on how many rows shared its
// step (a batch, a chunked prompt, a prefix-cache hit: issue 24). This kernel is fast at
// both ends and sums every output the same way whatever M, the thread split or the
// position of the row in the step: one float32 accumulator per output, walked through K in
// order (a sum over K in blocks goes through y between blocks, which is exact), never split
// over threads. W is stored in panels of 64 outputs, k-major, so that one K step is four
// vector loads shared by six activation rows (24 accumulators):
//   float32 panels: [ceil(N/64), K, 64],     one FMA per (row, k);
//   bf16 panels:    [ceil(N/64), K/2, 64, 2], one vdpbf16ps per (row, k pair), the
//                   activations rounded to bf16 (to nearest even, as torch casts).
// A decode row streams each panel once (memory order); many rows reuse a K block of a
// panel from L2 across their micro-tiles. Outputs past N in the last panel are zero
// weights and never stored.
namespace {

constexpr int64_t kPanelCols = 64;       // outputs per panel: four zmm of float32 accumulators
constexpr int64_t kPanelTileRows = 6;    // activation rows per micro-tile
constexpr int64_t kPanelRowBlock = 48;   // rows per work item (eight micro-tiles)
constexpr int64_t kPanelKBlock = 1024;   // K per pass over a panel: 128 KiB of bf16, 256 KiB of float32

#if defined(__AVX512F__)
inline __mmask16 panel_mask(int64_t valid, int c) {
  const int64_t n = std::clamp<int64_t>(valid - 16 * c, 0, 16);
  return static_cast<__mmask16>((1u << n) - 1u);
}

// R rows x C vectors of 16 outputs (a whole panel: C = 4; half of one: C = 2) over K
// elements [k0, k0 + kn): `w` and `y` point at the part's first column; acc starts at 0
// (first block) or at what y holds, and is stored back to the `valid` outputs.
template <int R, int C>
inline void panel_tile_f32(const float* x, int64_t ldx, const float* w, int64_t kn, float* y, int64_t ldy,
                           int64_t valid, bool first) {
  __m512 acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c)
      acc[m][c] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(panel_mask(valid, c), y + m * ldy + 16 * c);
  for (int64_t k = 0; k < kn; ++k, w += kPanelCols) {
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(w + 16 * c);
    for (int m = 0; m < R; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_fmadd_ps(wv[c], xv, acc[m][c]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + m * ldy + 16 * c, panel_mask(valid, c), acc[m][c]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// As panel_tile_f32 over k pairs: x and w as bf16 pairs (one 32-bit lane each).
template <int R, int C>
inline void panel_tile_bf16(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t pairs, float* y, int64_t ldy,
                            int64_t valid, bool first) {
  __m512 acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c)
      acc[m][c] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(panel_mask(valid, c), y + m * ldy + 16 * c);
  for (int64_t k = 0; k < pairs; ++k, w += kPanelCols) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + 16 * c);
    for (int m = 0; m < R; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * ldx + k]));
      for (int c = 0; c < C; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xv, wv[c]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(y + m * ldy + 16 * c, panel_mask(valid, c), acc[m][c]);
}

// float32 -> bf16, rounded to nearest even as torch's cast rounds (a NaN stays a NaN unless
// only its low 16 mantissa bits are set; activations carry none).
void round_rows_to_bf16(const float* x, int64_t count, uint16_t* out) {
  at::parallel_for(0, count, 16384, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
      const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(x + i));
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(rounded));
    }
    for (; i < end; ++i) out[i] = c10::BFloat16(x[i]).x;
  });
}
#endif

// Steps of up to this many rows (decodes, one block of rows) split the panels evenly over the
// threads in half panels: whole panels, the 9 of a 576-wide matrix went 5:4 over two threads
// (one thread idle for a ninth of the call). Each thread takes a run of halves, whole panels
// where it has both halves, so only a panel on a boundary is read in two strided halves
// (reading every panel in halves was 1.5x slower on a Zen 4 EPYC).
constexpr int64_t kEvenSplitRows = 16;

// Each output is computed by one thread, K blocks in order, so its sum is the same whatever
// the split. `tile(rows, first row, panel, first column in it, columns, k0, kn, valid, first)`.
template <typename Tile>
void run_panels(int64_t M, int64_t N, int64_t K, int64_t panels, int64_t k_step, const Tile& tile) {
  auto part = [&](int64_t r0, int64_t r1, int64_t p, int64_t col0, int64_t width) {
    const int64_t valid = std::min(width, N - p * kPanelCols - col0);
    if (valid <= 0) return;  // the last panel's second half, past N
    for (int64_t k0 = 0; k0 < K; k0 += k_step)
      for (int64_t m = r0; m < r1; m += kPanelTileRows)
        tile(std::min(kPanelTileRows, r1 - m), m, p, col0, width, k0, std::min(k_step, K - k0), valid, k0 == 0);
  };
  const int64_t threads = at::get_num_threads();
  if (M <= kEvenSplitRows && threads > 1) {
    const int64_t halves = 2 * panels, half = kPanelCols / 2;
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t u1 = halves * (t + 1) / threads;
        for (int64_t u = halves * t / threads; u < u1;) {
          if (u % 2 == 0 && u + 1 < u1) {
            part(0, M, u / 2, 0, kPanelCols);
            u += 2;
          } else {
            part(0, M, u / 2, (u % 2) * half, half);
            u += 1;
          }
        }
      }
    });
    return;
  }
  const int64_t row_blocks = (M + kPanelRowBlock - 1) / kPanelRowBlock;
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = (item % row_blocks) * kPanelRowBlock;
      part(r0, std::min(M, r0 + kPanelRowBlock), item / row_blocks, 0, kPanelCols);
    }
  });
}

// F<R, C>::run(args...) for R rows (1-6) and C = columns / 16 (2 or 4).
template <template <int, int> class F, typename... Args>
inline void by_shape(int64_t rows, int64_t columns, Args... args) {
  if (columns == kPanelCols) {
    switch (rows) {
      case 1: F<1, 4>::run(args...); break;
      case 2: F<2, 4>::run(args...); break;
      case 3: F<3, 4>::run(args...); break;
      case 4: F<4, 4>::run(args...); break;
      case 5: F<5, 4>::run(args...); break;
      default: F<6, 4>::run(args...); break;
    }
  } else {
    switch (rows) {
      case 1: F<1, 2>::run(args...); break;
      case 2: F<2, 2>::run(args...); break;
      case 3: F<3, 2>::run(args...); break;
      case 4: F<4, 2>::run(args...); break;
      case 5: F<5, 2>::run(args...); break;
      default: F<6, 2>::run(args...); break;
    }
  }
}

#if defined(__AVX512F__)
template <int R, int C> struct PanelF32 {
  template <typename... A> static void run(A... a) { panel_tile_f32<R, C>(a...); }
};
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <int R, int C> struct PanelBF16 {
  template <typename... A> static void run(A... a) { panel_tile_bf16<R, C>(a...); }
};
#endif

}  // namespace

namespace tokenmill {

bool panel_linear_built(at::ScalarType dtype) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK(panels.is_contiguous() && panels.size(0) > 0 &&
                  (bf16 ? panels.dim() == 4 && panels.size(2) == kPanelCols && panels.size(3) == 2
                        : panels.dim() == 3 && panels.size(2) == kPanelCols && panels.scalar_type() == at::kFloat),
              "weight: contiguous float32 [ceil(N/64), K, 64] or bf16 [ceil(N/64), K/2, 64, 2] (see pack_panels)");
  TORCH_CHECK(panel_linear_built(panels.scalar_type()), "panel_linear needs an AVX-512 build (AVX-512 BF16 for bf16 "
              "panels); use skinny_linear on this CPU");
  const int64_t M = x.size(0), K = x.size(1), count = panels.size(0);
  TORCH_CHECK((bf16 ? 2 * panels.size(1) : panels.size(1)) == K, "x and weight disagree on K");
  TORCH_CHECK(N > (count - 1) * kPanelCols && N <= count * kPanelCols, "N does not match the number of panels");
  at::Tensor y = activation_empty({M, N}, x.options());
  if (M == 0) return y;
  if (K == 0) return y.zero_();
  float* yp = y.data_ptr<float>();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (bf16) {
    at::Tensor xb = activation_empty({M, K}, x.options().dtype(at::kBFloat16));
    round_rows_to_bf16(x.data_ptr<float>(), M * K, reinterpret_cast<uint16_t*>(xb.data_ptr()));
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr());
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(panels.data_ptr());
    const int64_t pairs = K / 2;
    run_panels(M, N, pairs, count, kPanelKBlock / 2, [&](int64_t rows, int64_t m, int64_t p, int64_t col0,
                                                         int64_t columns, int64_t k0, int64_t kn, int64_t valid,
                                                         bool first) {
      by_shape<PanelBF16>(rows, columns, xp + m * pairs + k0, pairs, wp + (p * pairs + k0) * kPanelCols + col0, kn,
                          yp + m * N + p * kPanelCols + col0, N, valid, first);
    });
    return y;
  }
#endif
#if defined(__AVX512F__)
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  run_panels(M, N, K, count, kPanelKBlock, [&](int64_t rows, int64_t m, int64_t p, int64_t col0, int64_t columns,
                                               int64_t k0, int64_t kn, int64_t valid, bool first) {
    by_shape<PanelF32>(rows, columns, xp + m * K + k0, K, wp + (p * K + k0) * kPanelCols + col0, kn,
                       yp + m * N + p * kPanelCols + col0, N, valid, first);
  });
#endif
  return y;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("skinny_linear(Tensor x, Tensor tiled, int n) -> Tensor");
  m.def("grouped_skinny_linear(Tensor x, int[] offsets, Tensor[] tiled, int n) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n) -> Tensor");
  m.def("panel_linear_built(ScalarType dtype) -> bool", &tokenmill::panel_linear_built);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("skinny_linear", &tokenmill::skinny_linear);
  m.impl("grouped_skinny_linear", &tokenmill::grouped_skinny_linear);
  m.impl("panel_linear", &tokenmill::panel_linear);
}
