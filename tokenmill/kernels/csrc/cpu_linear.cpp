// Skinny matrix multiply for decode on the CPU: y[M, N] = x[M, K] . W[N, K]^T with few
// rows M (one per decoding sequence), W in float32 or bfloat16, arithmetic in float32.
//
// Why a native kernel: with M = 1 a decode step is a stream of weight reads, and the
// BLAS paths PyTorch takes on this CPU read them at about half the memory bandwidth
// (F.linear of the 49152 x 576 LM head: 9.5 GB/s where a plain read of memory reaches
// 19 GB/s); with M = 2..8 they are slower still (M = 4 took 2-3x the time of M = 1).
// Here each thread streams its share of W's rows once and multiplies every row of x
// with them while they are in registers, so the cost stays that of reading W.

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_vec.h"

namespace {

constexpr int64_t kMaxRows = 16;  // larger M is matrix-shaped work for BLAS

#if defined(__AVX2__) && defined(__FMA__)
using tokenmill::hsum;
using tokenmill::load8;

// Rows n0, n0+1 of W against R rows of x (R <= 4): 2R independent FMA chains.
template <int R, typename W>
inline void tile(const float* x, int64_t x_stride, const W* w0, const W* w1, int64_t K, float* y, int64_t y_stride) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v0 = load8(w0 + k), v1 = load8(w1 + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);
      a0[r] = _mm256_fmadd_ps(xv, v0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xv, v1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float s0 = hsum(a0[r]), s1 = hsum(a1[r]);
    for (int64_t j = k; j < K; ++j) {
      s0 += x[r * x_stride + j] * static_cast<float>(w0[j]);
      s1 += x[r * x_stride + j] * static_cast<float>(w1[j]);
    }
    y[r * y_stride] = s0;
    y[r * y_stride + 1] = s1;
  }
}

template <typename W>
void rows_block(const float* x, int64_t M, int64_t K, const W* w, int64_t n_begin, int64_t n_end, float* y, int64_t N) {
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) {
    const W* w0 = w + n * K;
    const W* w1 = w0 + K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile<4>(x + m * K, K, w0, w1, K, y + m * N + n, N);
    switch (M - m) {
      case 3: tile<3>(x + m * K, K, w0, w1, K, y + m * N + n, N); break;
      case 2: tile<2>(x + m * K, K, w0, w1, K, y + m * N + n, N); break;
      case 1: tile<1>(x + m * K, K, w0, w1, K, y + m * N + n, N); break;
      default: break;
    }
  }
  for (; n < n_end; ++n)  // an odd last row
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * static_cast<float>(w[n * K + k]);
      y[m * N + n] = s;
    }
}
#else
template <typename W>
void rows_block(const float* x, int64_t M, int64_t K, const W* w, int64_t n_begin, int64_t n_end, float* y, int64_t N) {
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * static_cast<float>(w[n * K + k]);
      y[m * N + n] = s;
    }
}
#endif

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight: contiguous [N, K]");
  TORCH_CHECK(x.size(1) == weight.size(1), "x and weight disagree on K");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear takes at most 16 rows");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Chunks of rows big enough that thread hand-off is noise, even so a multiple of 2.
  const int64_t grain = std::max<int64_t>(64, (N / (4 * at::get_num_threads())) & ~int64_t(1));
  AT_DISPATCH_V2(weight.scalar_type(), "skinny_linear", AT_WRAP([&] {
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      if (begin % 2 && begin < end) {  // keep row pairs aligned across chunks
        rows_block(xp, M, K, wp, begin, begin + 1, yp, N);
        ++begin;
      }
      rows_block(xp, M, K, wp, begin, end, yp, N);
    });
  }), at::kFloat, at::kBFloat16);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("skinny_linear(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
}
