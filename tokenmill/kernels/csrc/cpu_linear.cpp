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
  at::Tensor y = at::empty({M, N}, x.options());
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
  at::Tensor y = at::empty({x.size(0), N}, x.options());
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

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("skinny_linear(Tensor x, Tensor tiled, int n) -> Tensor");
  m.def("grouped_skinny_linear(Tensor x, int[] offsets, Tensor[] tiled, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("skinny_linear", &tokenmill::skinny_linear);
  m.impl("grouped_skinny_linear", &tokenmill::grouped_skinny_linear);
}
