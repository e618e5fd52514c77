// The elementwise parts of a Llama layer for bfloat16 activations, fused.
//
// torch runs RMSNorm, the residual add and SwiGLU's silu(gate) * up on bfloat16 as a
// chain of ops that each convert to float32 and back: on a 1024-token prefill step they
// cost a fifth of the matrix products. Here each is one pass over the data with the
// same roundings as transformers' modules, so outputs match its bfloat16 forward
// (AVX-512, AVX2 and AArch64 NEON bodies for SiLU; NEON ones for the add and RMSNorm,
// whose portable loops x86 compilers vectorise on their own):
//   add:      x = bf16(x + r)
//   RMSNorm:  h = bf16(w * bf16(x / sqrt(mean(x^2) + eps)))   (LlamaRMSNorm)
//   SwiGLU:   a = bf16(bf16(silu(g)) * u)                      (SiLU, then the product)
//   GeGLU:    a = bf16(bf16(gelu_tanh(g)) * u)                 (Gemma's gelu_pytorch_tanh)
// with torch's float32 formula for bf16 GeLU (ATen's GeluKernelImpl, approximate='tanh'):
//   gelu_tanh(x) = (0.5 x) (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// tanh from exp (simd_math.h's tanh_ps) in the vector bodies, std::tanh in the tail; torch
// uses Sleef's: the float32 values differ in the last bits, so a rare bf16 rounding flips.

#include <cmath>
#include <cstdint>

#include "simd_math.h"

using namespace llmctl_simd;

// A decode step's few rows take ~1 us in one thread; waking the pool costs more.
constexpr int64_t kParallelRows = 8;

#if defined(__aarch64__) && defined(__ARM_NEON)
namespace {

// The two loops of add_rms_norm_bf16 on 4-lane NEON vectors, 8 columns a step, with the
// portable loops' roundings. x += residual (rounded to bf16 and stored) where residual is
// not null; returns the sum of the squares of x in two 4-lane partial sums: the portable
// loop's float32 terms, added in another order.
inline float add_square_sum(uint16_t* x, const uint16_t* residual, int64_t cols) {
  float32x4_t s0 = vdupq_n_f32(0.f), s1 = vdupq_n_f32(0.f);
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    uint16x8_t xv = vld1q_u16(x + c);
    if (residual != nullptr) {
      const uint16x8_t rv = vld1q_u16(residual + c);
      xv = to_bf16x8(vaddq_f32(widen_bf16_lo(xv), widen_bf16_lo(rv)),
                     vaddq_f32(widen_bf16_hi(xv), widen_bf16_hi(rv)));
      vst1q_u16(x + c, xv);
    }
    const float32x4_t lo = widen_bf16_lo(xv), hi = widen_bf16_hi(xv);
    s0 = vfmaq_f32(s0, lo, lo);
    s1 = vfmaq_f32(s1, hi, hi);
  }
  float sum = vaddvq_f32(vaddq_f32(s0, s1));
  for (; c < cols; ++c) {
    if (residual != nullptr) x[c] = float_to_bf16(bf16_to_float(x[c]) + bf16_to_float(residual[c]));
    const float f = bf16_to_float(x[c]);
    sum += f * f;
  }
  return sum;
}

// out = bf16(weight * bf16(x * inv))
inline void scale_row(const uint16_t* x, const uint16_t* weight, float inv, uint16_t* out,
                      int64_t cols) {
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    const uint16x8_t xv = vld1q_u16(x + c), wv = vld1q_u16(weight + c);
    const float32x4_t lo = round_bf16x4(vmulq_n_f32(widen_bf16_lo(xv), inv));
    const float32x4_t hi = round_bf16x4(vmulq_n_f32(widen_bf16_hi(xv), inv));
    vst1q_u16(out + c, to_bf16x8(vmulq_f32(widen_bf16_lo(wv), lo),
                                 vmulq_f32(widen_bf16_hi(wv), hi)));
  }
  for (; c < cols; ++c)
    out[c] = float_to_bf16(bf16_to_float(weight[c]) * round_bf16(bf16_to_float(x[c]) * inv));
}

}  // namespace
#endif  // __aarch64__ && __ARM_NEON

extern "C" {

#if defined(__aarch64__) && defined(__ARM_NEON)
// As paged_attention_simd: the vector bodies this build has (ARM builds only).
const char* norm_act_simd() { return "neon"; }
#endif

// x [rows, cols] bf16, updated in place to x + residual when residual is not null;
// out [rows, cols] = RMSNorm(x) * weight.
void add_rms_norm_bf16(uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                       uint16_t* out, int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* xr = x + r * cols;
#if defined(__aarch64__) && defined(__ARM_NEON)
    const float sum = add_square_sum(xr, residual != nullptr ? residual + r * cols : nullptr, cols);
#else
    float sum = 0.f;
    if (residual != nullptr) {
      const uint16_t* rr = residual + r * cols;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t v = float_to_bf16(bf16_to_float(xr[c]) + bf16_to_float(rr[c]));
        xr[c] = v;
        const float f = bf16_to_float(v);
        sum += f * f;
      }
    } else {
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        const float f = bf16_to_float(xr[c]);
        sum += f * f;
      }
    }
#endif
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
    uint16_t* outr = out + r * cols;
#if defined(__aarch64__) && defined(__ARM_NEON)
    scale_row(xr, weight, inv, outr, cols);
#else
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
      outr[c] = float_to_bf16(bf16_to_float(weight[c]) * round_bf16(bf16_to_float(xr[c]) * inv));
#endif
  }
}

// gate_up [rows, 2 * inter] (gate columns, then up columns) -> out [rows, inter].
void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter,
                   int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + r * inter;
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= inter; c += 16) {
      const __m512 gf = load_bf16(g + c);
      const __m512 sig = _mm512_div_ps(
          gf, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gf))));
      const __m512 sr = widen_bf16(to_bf16(sig));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                          to_bf16(_mm512_mul_ps(sr, load_bf16(u + c))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // the same arithmetic on 8 lanes (exp8_ps is exp_ps's polynomial and 2^n exactly), so
    // the same bits as the AVX-512 body
    for (; c + 8 <= inter; c += 8) {
      const __m256 gf = load_bf16x8(g + c);
      const __m256 sig = _mm256_div_ps(
          gf, _mm256_add_ps(_mm256_set1_ps(1.f), exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), gf))));
      const __m256 sr = widen_bf16x8(to_bf16x8(sig));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + c),
                       to_bf16x8(_mm256_mul_ps(sr, load_bf16x8(u + c))));
    }
#elif defined(__aarch64__) && defined(__ARM_NEON)
    // the same arithmetic on 2 x 4 lanes (exp4_ps: the same polynomial and 2^n), so the
    // same bits as the x86 bodies (checked on 98,304 products under qemu)
    for (; c + 8 <= inter; c += 8) {
      const uint16x8_t gv = vld1q_u16(g + c), uv = vld1q_u16(u + c);
      const float32x4_t one = vdupq_n_f32(1.f);
      const float32x4_t g0 = widen_bf16_lo(gv), g1 = widen_bf16_hi(gv);
      const float32x4_t s0 = round_bf16x4(vdivq_f32(g0, vaddq_f32(one, exp4_ps(vnegq_f32(g0)))));
      const float32x4_t s1 = round_bf16x4(vdivq_f32(g1, vaddq_f32(one, exp4_ps(vnegq_f32(g1)))));
      vst1q_u16(o + c,
                to_bf16x8(vmulq_f32(s0, widen_bf16_lo(uv)), vmulq_f32(s1, widen_bf16_hi(uv))));
    }
#endif
    for (; c < inter; ++c) {
      const float gf = bf16_to_float(g[c]);
      const float s = round_bf16(gf / (1.f + std::exp(-gf)));
      o[c] = float_to_bf16(s * bf16_to_float(u[c]));
    }
  }
}

// q/k norm: each row of x (ld elements apart) holds `groups` groups of `cols` values, each
// RMS-normed on its own with weight row g (weight + g * w_ld; w_ld 0: one weight for every
// group) into out (out_ld apart; out may be x), with add_rms_norm_bf16's arithmetic:
// per head (Qwen3, Gemma 3: groups = heads, cols = head_dim) or over a whole projection
// (OLMo 2: one group of heads * head_dim).
void rms_norm_groups_bf16(const uint16_t* x, int64_t ld, uint16_t* out, int64_t out_ld,
                          int64_t rows, int64_t groups, int64_t cols, const uint16_t* weight,
                          int64_t w_ld, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xr = x + r * ld + g * cols;
      const uint16_t* w = weight + g * w_ld;
      uint16_t* o = out + r * out_ld + g * cols;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cols; ++c) {
        const float f = bf16_to_float(xr[c]);
        sum += f * f;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c)
        o[c] = float_to_bf16(bf16_to_float(w[c]) * round_bf16(bf16_to_float(xr[c]) * inv));
    }
  }
}

// gate_up [rows, 2 * inter] -> out [rows, inter] = gelu_tanh(gate) * up, roundings as above.
void gelu_tanh_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter,
                        int num_threads) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2/pi), GeLU's
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* g = gate_up + r * 2 * inter;
    const uint16_t* u = g + inter;
    uint16_t* o = out + r * inter;
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512 beta = _mm512_set1_ps(kBeta), kappa = _mm512_set1_ps(kKappa);
    for (; c + 16 <= inter; c += 16) {
      const __m512 x = load_bf16(g + c);
      const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 inner = _mm512_mul_ps(beta, _mm512_add_ps(x, _mm512_mul_ps(kappa, cube)));
      const __m512 act = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x),
                                       _mm512_add_ps(_mm512_set1_ps(1.f), tanh_ps(inner)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                          to_bf16(_mm512_mul_ps(widen_bf16(to_bf16(act)), load_bf16(u + c))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    // the AVX-512 body's arithmetic on 8 lanes: the same bits
    const __m256 beta = _mm256_set1_ps(kBeta), kappa = _mm256_set1_ps(kKappa);
    for (; c + 8 <= inter; c += 8) {
      const __m256 x = load_bf16x8(g + c);
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, cube)));
      const __m256 act = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x),
                                       _mm256_add_ps(_mm256_set1_ps(1.f), tanh8_ps(inner)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(o + c),
                       to_bf16x8(_mm256_mul_ps(widen_bf16x8(to_bf16x8(act)), load_bf16x8(u + c))));
    }
#endif
    for (; c < inter; ++c) {
      const float x = bf16_to_float(g[c]);
      const float cube = x * x * x;
      const float inner = kBeta * (x + kKappa * cube);
      const float act = round_bf16(0.5f * x * (1.f + std::tanh(inner)));
      o[c] = float_to_bf16(act * bf16_to_float(u[c]));
    }
  }
}

}  // extern "C"
