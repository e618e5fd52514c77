// bfloat16 <-> float32 and exp(x), scalar, 16 lanes (AVX-512), 8 lanes (AVX2 + FMA) and
// 4 lanes (AArch64 NEON): shared by the kernels. llmctl/serve/kernels/cpu.py hashes this
// file with the sources, so a change here rebuilds the library.
//
// bfloat16 is the top half of a float32: widening is a shift, narrowing rounds to
// nearest even as torch does (no NaN inputs here).

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)  // AVX-512 implies it
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
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

// tanh(y) = sign(y) (1 - 2 / (1 + exp(2 |y|))): exp_ps's clamp keeps 1 + exp finite, so
// tanh is exactly +-1 past |y| = 44. Absolute error a few float32 steps of 1 (what
// 1 + tanh(y), GeLU's use, needs; not a small relative error for tiny y).
inline __m512 tanh_ps(__m512 y) {
  const __m512 sign = _mm512_and_ps(y, _mm512_set1_ps(-0.f));
  const __m512 a = _mm512_andnot_ps(_mm512_set1_ps(-0.f), y);
  const __m512 e = exp_ps(_mm512_add_ps(a, a));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.f),
                                 _mm512_div_ps(_mm512_set1_ps(2.f),
                                               _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  return _mm512_or_ps(t, sign);
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// 8 bfloat16 values (as their 16-bit patterns) -> 8 floats
inline __m256 widen_bf16x8(__m128i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

inline __m256 load_bf16x8(const uint16_t* p) {
  return widen_bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 floats -> 8 bfloat16 patterns, round to nearest even (as torch rounds)
inline __m128i to_bf16x8(__m256 f) {
  __m256i bits = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
}

// exp_ps on 8 lanes: the same clamp, split and polynomial; AVX2 has no scalef, so 2^n is
// built as a float, n + 127 in the exponent field (n in [-126, 126] after the clamp:
// always a normal number, and p * 2^n is exact like scalef's).
inline __m256 exp8_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

// tanh_ps on 8 lanes: the same formula on exp8_ps (the same bits as tanh_ps)
inline __m256 tanh8_ps(__m256 y) {
  const __m256 sign = _mm256_and_ps(y, _mm256_set1_ps(-0.f));
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), y);
  const __m256 e = exp8_ps(_mm256_add_ps(a, a));
  const __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.f),
                                 _mm256_div_ps(_mm256_set1_ps(2.f),
                                               _mm256_add_ps(_mm256_set1_ps(1.f), e)));
  return _mm256_or_ps(t, sign);
}

// Sum and max of 8 lanes: halves, then pairs, then the last two.
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Sum of each of 8 vectors, as one vector: out[t] = sum of v[t]'s lanes. Two rounds of
// hadd leave, per 128-bit half, the four-lane sums of v0..v3 and of v4..v7; adding the
// low halves to the high halves finishes all 8 sums in 9 instructions (8 separate
// reduce_add8 take ~40).
inline __m256 reduce_add8x8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                       _mm256_permute2f128_ps(ab, cd, 0x31));
}
#endif  // __AVX2__ && __FMA__

#if defined(__aarch64__) && defined(__ARM_NEON)
// 4 lanes of AArch64 Advanced SIMD (every ARMv8-A core has it; 32-bit ARM's NEON lacks
// FRINTM, FDIV and the across-lane sums used here, so it keeps the portable loops).

// 4 bfloat16 patterns -> 4 floats (a widening shift), and 8 -> their low and high 4
inline float32x4_t widen_bf16x4(uint16x4_t v) { return vreinterpretq_f32_u32(vshll_n_u16(v, 16)); }

inline float32x4_t load_bf16x4(const uint16_t* p) { return widen_bf16x4(vld1_u16(p)); }

inline float32x4_t widen_bf16_lo(uint16x8_t v) { return widen_bf16x4(vget_low_u16(v)); }

inline float32x4_t widen_bf16_hi(uint16x8_t v) {
  return vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
}

// 4 floats -> 4 bfloat16 patterns, round to nearest even (float_to_bf16 on each lane)
inline uint32x4_t round_bf16_bits(float32x4_t f) {
  const uint32x4_t bits = vreinterpretq_u32_f32(f);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  return vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7FFF)));
}

// round_bf16 on 4 lanes: the float nearest to f that a bfloat16 holds
inline float32x4_t round_bf16x4(float32x4_t f) {
  return vreinterpretq_f32_u32(vandq_u32(round_bf16_bits(f), vdupq_n_u32(0xFFFF0000u)));
}

// 8 floats (lo, hi) -> 8 bfloat16 patterns
inline uint16x8_t to_bf16x8(float32x4_t lo, float32x4_t hi) {
  return vshrn_high_n_u32(vshrn_n_u32(round_bf16_bits(lo), 16), round_bf16_bits(hi), 16);
}

// exp_ps on 4 lanes: the same clamp, split, polynomial (the same fused multiply-adds, so
// the same bits) and an exact 2^n built in the exponent field as exp8_ps does.
inline float32x4_t exp4_ps(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.f)), vdupq_n_f32(88.f));
  const float32x4_t t = vmulq_f32(x, vdupq_n_f32(1.44269504088896341f));
  const float32x4_t n = vrndmq_f32(t);  // floor
  const float32x4_t f = vsubq_f32(t, n);
  float32x4_t p = vdupq_n_f32(1.535336188319500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.339887440266574e-3f), p, f);  // vfmaq_f32(a, b, c) = a + b * c
  p = vfmaq_f32(vdupq_n_f32(9.618437357674640e-3f), p, f);
  p = vfmaq_f32(vdupq_n_f32(5.550332471162809e-2f), p, f);
  p = vfmaq_f32(vdupq_n_f32(2.402264791363012e-1f), p, f);
  p = vfmaq_f32(vdupq_n_f32(6.931472028550421e-1f), p, f);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, f);
  const int32x4_t biased = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
  return vmulq_f32(p, vreinterpretq_f32_s32(vshlq_n_s32(biased, 23)));
}

// Sums of 4 vectors' lanes as one vector: out[t] = sum of v[t]'s lanes (pairwise adds:
// [a0+a1, a2+a3, b0+b1, b2+b3], then once more).
inline float32x4_t reduce_add4x4(const float32x4_t* v) {
  return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}
#endif  // __aarch64__ && __ARM_NEON

}  // namespace llmctl_simd
