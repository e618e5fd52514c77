// The elementwise parts of a Llama layer for bfloat16 activations, fused.
//
// torch runs RMSNorm, the residual add and SwiGLU's silu(gate) * up on bfloat16 as a
// chain of ops that each convert to float32 and back: on a 1024-token prefill step they
// cost a fifth of the matrix products. Here each is one pass over the data with the
// same roundings as transformers' modules, so outputs match its bfloat16 forward (SiLU
// has AVX-512 and AVX2 bodies; the add and RMSNorm loops x86 compilers vectorise):
//   add:      x = bf16(x + r)
//   RMSNorm:  h = bf16(w * bf16(x / sqrt(mean(x^2) + eps)))   (LlamaRMSNorm)
//   SwiGLU:   a = bf16(bf16(silu(g)) * u)                      (SiLU, then the product)

#include <cmath>
#include <cstdint>

#include "simd_math.h"

using namespace llmctl_simd;

// A decode step's few rows take ~1 us in one thread; waking the pool costs more.
constexpr int64_t kParallelRows = 8;

extern "C" {

// x [rows, cols] bf16, updated in place to x + residual when residual is not null;
// out [rows, cols] = RMSNorm(x) * weight.
void add_rms_norm_bf16(uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                       uint16_t* out, int64_t rows, int64_t cols, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* xr = x + r * cols;
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
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
    uint16_t* outr = out + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c)
      outr[c] = float_to_bf16(bf16_to_float(weight[c]) * round_bf16(bf16_to_float(xr[c]) * inv));
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
#endif
    for (; c < inter; ++c) {
      const float gf = bf16_to_float(g[c]);
      const float s = round_bf16(gf / (1.f + std::exp(-gf)));
      o[c] = float_to_bf16(s * bf16_to_float(u[c]));
    }
  }
}

}  // extern "C"
