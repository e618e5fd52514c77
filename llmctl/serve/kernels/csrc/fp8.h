// FP8 E4M3 ("e4m3fn": no infinities, one NaN pattern per sign) <-> float32 and bf16,
// for an fp8 KV cache (llmctl/serve/layers/kv_quant.py). Shared by paged_attention.cpp and
// rope_kv.cpp; llmctl/serve/kernels/cpu.py hashes this file with the sources.
//
// A code is s eeee mmm, exponent bias 7:
//   e > 0:  (-1)^s * 2^(e-7) * (1 + m/8)      largest finite: e=15, m=6 -> 448
//   e = 0:  (-1)^s * 2^-6 * (m/8) = m * 2^-9  (subnormals)
// Every code is exact in bfloat16 (8 exponent bits, 7 mantissa bits) and in float32, so
// widening is exact; narrowing rounds to nearest even and saturates at +-448 (the
// codes 0x7f/0xff, NaN, are never written), as torch's x.clamp(-448, 448).to(
// torch.float8_e4m3fn) does: the kernels and kv_quant.quantize_fp8 give the same bits.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace llmctl_fp8 {

// A cache element: the code's bits (a distinct type, so templates over the cache
// element pick the fp8 overloads, not the uint8/int8 ones).
struct e4m3 {
  uint8_t bits;
};

constexpr float kE4M3Max = 448.f;

inline float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e ? std::ldexp(static_cast<float>(8 + m), e - 10)
                      : std::ldexp(static_cast<float>(m), -9);
  return (b & 0x80) ? -mag : mag;
}

// float32 -> code, round to nearest even, saturating (NaN inputs are not expected).
inline uint8_t float_to_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const float a = std::fabs(x);
  if (!(a < kE4M3Max)) return sign | 0x7E;  // 448 = e 15, m 6
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (a * 512 is exact)
    const int m = static_cast<int>(std::nearbyint(a * 512.f));  // 8 rounds up to 0x08
    return sign | static_cast<uint8_t>(m);
  }
  int e = static_cast<int>((u >> 23) & 0xFF) - 127 + 7;  // 1 .. 15
  uint32_t m = (u >> 20) & 7;
  const uint32_t rest = u & 0xFFFFF, half = 0x80000;
  if (rest > half || (rest == half && (m & 1))) {
    if (++m == 8) {
      m = 0;
      ++e;
    }
  }
  if (e > 15 || (e == 15 && m == 7)) return sign | 0x7E;  // rounded past 448
  return sign | static_cast<uint8_t>((e << 3) | m);
}

#if defined(__AVX512F__)
// 16 codes -> 16 floats, exact: magnitude = mant * 2^(max(e, 1) - 10) with mant = m + 8
// for normals and m for subnormals (scalef applies the power of two exactly).
inline __m512 e4m3x16_to_ps(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(v, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(v, _mm512_set1_epi32(7));
  const __mmask16 normal = _mm512_test_epi32_mask(e, e);
  const __m512i mant = _mm512_mask_or_epi32(m, normal, m, _mm512_set1_epi32(8));
  const __m512i ex = _mm512_sub_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(1)),
                                      _mm512_set1_epi32(10));
  const __m512 mag = _mm512_scalef_ps(_mm512_cvtepi32_ps(mant), _mm512_cvtepi32_ps(ex));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}
#endif

#if defined(__AVX2__)
// 8 codes -> 8 floats, exact, without scalef. Normals: the 7 magnitude bits shifted
// under float32's exponent field (e + 120 = e - 7 + 127), m into the mantissa's top 3
// bits. Subnormals: m * 2^-9 (m <= 7 and the product are exact).
inline __m256 e4m3x8_to_ps(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), _mm256_castsi256_ps(sign));
}
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
// 4 codes (widened to 32 bits) -> 4 floats, exact: e4m3x8_to_ps's arithmetic on 4 lanes
inline float32x4_t e4m3x4_to_ps(uint32x4_t v) {
  const uint32x4_t mag = vandq_u32(v, vdupq_n_u32(0x7F));
  const uint32x4_t normal = vaddq_u32(vshlq_n_u32(mag, 20), vdupq_n_u32(120u << 23));
  const float32x4_t sub = vmulq_f32(vcvtq_f32_u32(mag), vdupq_n_f32(1.f / 512.f));
  const uint32x4_t is_sub = vcltq_u32(mag, vdupq_n_u32(8));
  const uint32x4_t sign = vshlq_n_u32(vandq_u32(v, vdupq_n_u32(0x80)), 24);
  return vreinterpretq_f32_u32(
      vorrq_u32(vbslq_u32(is_sub, vreinterpretq_u32_f32(sub), normal), sign));
}

// 8 codes -> their first and last 4 as floats
inline float32x4x2_t e4m3x8_to_f32(const uint8_t* p) {
  const uint16x8_t w = vmovl_u8(vld1_u8(p));
  return {{e4m3x4_to_ps(vmovl_u16(vget_low_u16(w))), e4m3x4_to_ps(vmovl_high_u16(w))}};
}
#endif

#if defined(__AVX512BW__)
// 32 codes -> 32 bfloat16 patterns, exact. Normals: the 7 magnitude bits shifted under
// bf16's exponent field (e + 120 = e - 7 + 127), m into the mantissa's top 3 bits.
// Subnormals (8 patterns) from a table indexed by m.
inline __m512i e4m3x32_to_bf16(const uint8_t* p) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i mag = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  // m * 2^-9 for m = 0..7 as bf16: 0, 2^-9, 2^-8, 1.5 * 2^-8, 2^-7, 1.25, 1.5, 1.75 * 2^-7
  const __m512i table = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0x0000);
  const __m512i sub = _mm512_permutexvar_epi16(mag, table);
  const __mmask32 is_sub = _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8));
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8);
  return _mm512_or_si512(_mm512_mask_blend_epi16(is_sub, normal, sub), sign);
}
#endif

}  // namespace llmctl_fp8
