// Fused element-wise ops of a decoder layer on the CPU: RMSNorm (with the residual add
// folded in), rotary embedding in place, and SwiGLU's silu(gate) * up. Arithmetic is
// float32; activations may be float32 or bf16 (the execution plan's bf16 activation path
// for many-row steps, runner/plan.py): bf16 in is read exactly, bf16 out is rounded to
// nearest even once, as torch's cast of the float32 result would be, so the bf16 path gives
// the bits the float32 ops followed by a cast give. The residual stream stays float32.
//
// Why native: in a batch-1 decode step each of these is a handful of ATen ops on a
// 576-wide row, so their cost is dispatch, not arithmetic. F.rms_norm alone was ~80 us
// a call (it decomposes into pow/mean/add/rsqrt/mul/casts), 60 calls a step: ~5 ms of a
// ~52 ms step. One pass over each row here does the same work in a few microseconds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>

#include "cpu_kernels.h"
#include "cpu_vec.h"

namespace {

// Rows (or row pieces) per parallel chunk: small batches run inline on the calling
// thread, where waking the pool would cost more than the work.
constexpr int64_t kGrainElements = 1 << 14;

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

using tokenmill::to_float;
#if defined(__AVX2__) && defined(__FMA__)
using tokenmill::exp8;
using tokenmill::hsum;
using tokenmill::load8;
using tokenmill::store8;
#endif

// out = x / sqrt(mean(x^2) + eps) * w over one row.
template <typename TI, typename TO>
inline void rms_row(const TI* x, const float* w, TO* out, int64_t n, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  ss = hsum(acc);
#endif
  for (; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vinv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), vinv), _mm256_loadu_ps(w + i)));
#endif
  for (; i < n; ++i) out[i] = static_cast<TO>(to_float(x[i]) * inv * w[i]);
}

bool is_activation(const at::Tensor& x) { return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16; }

// Calls f with (TI*) x's data and (TO*) out's data, each float or c10::BFloat16.
template <typename F>
void with_types(const at::Tensor& x, const at::Tensor& out, F&& f) {
  const bool xb = x.scalar_type() == at::kBFloat16, ob = out.scalar_type() == at::kBFloat16;
  if (!xb && !ob) f(x.data_ptr<float>(), out.data_ptr<float>());
  else if (!xb && ob) f(x.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  else if (xb && !ob) f(x.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
  else f(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
}

}  // namespace

// Entry points, also called directly by the fused decoder layer (cpu_kernels.h).
namespace tokenmill {

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && is_activation(x) && x.is_contiguous(),
              "x: contiguous float32 or bfloat16 [tokens, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(0) == x.size(1),
              "weight: contiguous float32 [hidden]");
}

at::ScalarType out_type(const at::Tensor& x, std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType t = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  return t;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, std::optional<at::ScalarType> out_dtype) {
  check_norm_args(x, weight);
  at::Tensor out = activation_empty(x.sizes(), x.options().dtype(out_type(x, out_dtype)));
  const int64_t n = x.size(1);
  const float* wp = weight.data_ptr<float>();
  with_types(x, out, [&](auto* xp, auto* op) {
    at::parallel_for(0, x.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// residual += x, then returns rms_norm(residual): the add that closes one sublayer and
// the norm that opens the next, in one pass. The residual is float32 whatever x and the
// output are.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps,
                        std::optional<at::ScalarType> out_dtype) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "residual: contiguous float32, shaped like x");
  at::Tensor out = activation_empty(x.sizes(), x.options().dtype(out_type(x, out_dtype)));
  const int64_t n = x.size(1);
  const float* wp = weight.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  with_types(x, out, [&](auto* xp, auto* op) {
    at::parallel_for(0, x.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        float* row = rp + r * n;
        const auto* xr = xp + r * n;
        for (int64_t i = 0; i < n; ++i) row[i] += to_float(xr[i]);
        rms_row(row, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

// [tokens, 2I] (gate | up) -> [tokens, I] = silu(gate) * up, in x's dtype.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && is_activation(x) && x.is_contiguous() && x.size(1) % 2 == 0,
              "x: contiguous float32 or bfloat16 [tokens, 2 * intermediate]");
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = activation_empty({tokens, inter}, x.options());
  with_types(x, out, [&](auto* xp, auto* op) {
    using TO = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, tokens, grain_rows(inter), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const auto *gate = xp + t * 2 * inter, *up = gate + inter;
        TO* dst = op + t * inter;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {
          const __m256 g = load8(gate + i);
          const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
          store8(dst + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), load8(up + i)));
        }
#endif
        for (; i < inter; ++i) {
          const float g = to_float(gate[i]);
          dst[i] = static_cast<TO>(g / (1.0f + std::exp(-g)) * to_float(up[i]));
        }
      }
    });
  });
  return out;
}

template <typename T>
void rotary_impl(at::Tensor& x, const float* cp, const float* sp) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.data_ptr<T>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, tokens * heads, grain_rows(2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t work = begin; work < end; ++work) {
      const int64_t t = work / heads, h = work % heads;
      T* x1 = xp + t * token_stride + h * head_stride;
      T* x2 = x1 + half;
      const float *c = cp + t * half, *s = sp + t * half;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= half; i += 8) {
        const __m256 a = load8(x1 + i), b = load8(x2 + i);
        const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
        store8(x1 + i, _mm256_fmsub_ps(a, vc, _mm256_mul_ps(b, vs)));
        store8(x2 + i, _mm256_fmadd_ps(b, vc, _mm256_mul_ps(a, vs)));
      }
#endif
      for (; i < half; ++i) {
        const float a = to_float(x1[i]), b = to_float(x2[i]);
        x1[i] = static_cast<T>(a * c[i] - b * s[i]);
        x2[i] = static_cast<T>(b * c[i] + a * s[i]);
      }
    }
  });
}

// Rotate-half rotary embedding in place on x [tokens, heads, head_dim] (rows of head_dim
// contiguous, any token/head strides; float32 or bf16): with x1, x2 the two halves of a
// head, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin; cos/sin are [tokens, head_dim / 2].
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && is_activation(x) && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x: float32 or bfloat16 [tokens, heads, head_dim] with contiguous rows");
  const int64_t tokens = x.size(0), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->scalar_type() == at::kFloat && t->is_contiguous() && t->size(0) == tokens &&
                    t->size(1) == half,
                "cos/sin: contiguous float32 [tokens, head_dim / 2]");
  if (x.scalar_type() == at::kBFloat16) rotary_impl<c10::BFloat16>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
  else rotary_impl<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>());
}

namespace {

// The index of row[0:n]'s largest value, torch.argmax's: the first of equal maxima, the first
// NaN if there is one. Eight lanes each keep their own first maximum (strictly greater
// replaces), then the lanes' maximum and the lowest index holding it; the tail after.
// NaN by its bits: the kernels build with -ffast-math, under which std::isnan folds to false.
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

int64_t argmax_row(const float* row, int64_t n) {
  if (is_nan(row[0])) return 0;
  int64_t best = 0, i = 1;
  float best_value = row[0];
#if defined(__AVX2__)
  if (n >= 16) {
    __m256 vmax = _mm256_loadu_ps(row);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i idx = vidx;
    __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    const __m256i eight = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(row + i);
      idx = _mm256_add_epi32(idx, eight);
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_blendv_epi8(vidx, idx, _mm256_castps_si256(gt));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan) != 0)  // torch's answer: the first NaN
      for (int64_t j = 0;; ++j)
        if (is_nan(row[j])) return j;
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), vidx);
    best_value = values[0], best = indices[0];
    for (int lane = 1; lane < 8; ++lane)
      if (values[lane] > best_value || (values[lane] == best_value && indices[lane] < best))
        best_value = values[lane], best = indices[lane];
  }
#endif
  for (; i < n; ++i) {  // the tail (every index here is past the ones above)
    if (is_nan(row[i])) return i;
    if (row[i] > best_value) best_value = row[i], best = i;
  }
  return best;
}

}  // namespace

// Greedy sampling's argmax over each row of float32 logits [rows, V] (torch.argmax(x, -1):
// first of equal maxima, NaN the largest), rows split over the threads. torch's reduction ran
// 32 x 49,152 logits in ~1.4 ms on one thread, a few % of a 32-row decode step of the default
// model; this reads them at memory speed.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: float32 [rows, V > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, ScalarType? out_dtype=None) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps, ScalarType? out_dtype=None) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("argmax_rows", &tokenmill::argmax_rows);
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("add_rms_norm", &tokenmill::add_rms_norm);
  m.impl("silu_and_mul", &tokenmill::silu_and_mul);
  m.impl("rotary_", &tokenmill::rotary_);
}
