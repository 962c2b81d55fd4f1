// Small SIMD helpers shared by tokenmill's CPU kernels: cache/weight elements
// (float32, bfloat16, float16) loaded eight at a time as float32, and a horizontal sum.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace tokenmill {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of a float32
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

}  // namespace tokenmill
