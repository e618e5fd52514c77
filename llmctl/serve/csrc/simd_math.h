// bfloat16 <-> float32 and exp(x), scalar and 16 lanes: shared by paged_attention.cpp and
// norm_act.cpp. llmctl/serve/cpu_kernels.py hashes this file with the sources, so a
// change here rebuilds the library.
//
// bfloat16 is the top half of a float32: widening is a shift, narrowing rounds to
// nearest even as torch does (no NaN inputs here).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace llmctl_simd {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#if defined(__AVX512F__)
// 16 bfloat16 values (as their 16-bit patterns) -> 16 floats
inline __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline __m512 load_bf16(const uint16_t* p) {
  return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats -> 16 bfloat16 patterns, round to nearest even
inline __m256i to_bf16(__m512 f) {
  __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// exp(x) = 2^(x log2 e) = 2^n * 2^f with n = floor, f in [0, 1); 2^f by a degree-6
// polynomial (relative error < 2e-7), 2^n applied by scalef. x is clamped to [-87, 88],
// where float32 exp is finite and normal (exp(-87) = 1.6e-38): a caller that needs an
// exact 0 for -inf (masked attention scores) zeroes those lanes itself.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif  // __AVX512F__

}  // namespace llmctl_simd
