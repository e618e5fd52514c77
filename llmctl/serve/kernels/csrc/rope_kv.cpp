// RoPE on this step's queries and keys, and the K/V cache write, in one pass (bfloat16).
//
// The torch path is seven ops for the rotation (to float32, complex view, multiply, back
// to bfloat16) and two index_copy_ calls for the cache, per layer: at batch 1 that was
// ~25 us of each layer's ~270, all of it dispatch. The arithmetic is the same: pairs
// (2j, 2j+1) of a head (llmctl permutes q/k rows into interleaved pairs at load, see
// llmctl/serve/layers/rope.py) are multiplied in float32 by freqs[pos][j] = a (cos, sin), then
// rounded to bfloat16 (nearest even), as the complex64 product and .to(bfloat16) do:
//   y0 = x0 c - x1 s,   y1 = x0 s + x1 c.
// Partial rotary (Phi-3/4 rotate 75 % of each head): with a table of rot / 2 rotations per
// position (rot < d, even) only the first rot dimensions of a head rotate, as pairs
// (2j, 2j+1) of them; the other d - rot pass through (rope.rotate_pairs). The table is an
// argument of each call: one library serves any number of tables (Gemma 3's sliding
// layers rotate with their own).
//
// An int8 cache (llmctl/serve/layers/kv_quant.py) gets each token's K and V heads quantized as
// they are written, with kv_quant.quantize_int8's arithmetic (float32, IEEE division,
// round half to even): s = max |x| / 127, c = round(x / s), s = 0 -> c = 0.
//
// An fp8 cache gets E4M3 codes of x / s with the layer's static scale s of each KV head
// (kv_quant.quantize_fp8: float32 division, round to nearest even, saturate at 448).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fp8.h"
#include "simd_math.h"

using namespace llmctl_simd;

namespace {

// Rotate the first rot dimensions of the q and k heads of token t's row in place.
inline void rotate(uint16_t* row, int64_t heads, int64_t d, int64_t rot, const float* f) {
  const int64_t half = rot / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* x = row + h * d;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float x0 = bf16_to_float(x[2 * j]), x1 = bf16_to_float(x[2 * j + 1]);
      const float c = f[2 * j], s = f[2 * j + 1];
      x[2 * j] = float_to_bf16(x0 * c - x1 * s);
      x[2 * j + 1] = float_to_bf16(x0 * s + x1 * c);
    }
  }
}

// kv_heads heads of d bf16 values -> int8 codes and one scale per head.
inline void quantize_heads(const uint16_t* src, int64_t kv_heads, int64_t d, int8_t* codes,
                           float* scales) {
  for (int64_t h = 0; h < kv_heads; ++h) {
    const uint16_t* x = src + h * d;
    float amax = 0.f;
    for (int64_t i = 0; i < d; ++i) amax = std::fmax(amax, std::fabs(bf16_to_float(x[i])));
    const float scale = amax / 127.f;
    const float divisor = scale > 0.f ? scale : 1.f;
    for (int64_t i = 0; i < d; ++i) {
      const float c = std::nearbyint(bf16_to_float(x[i]) / divisor);
      codes[h * d + i] = static_cast<int8_t>(std::fmin(127.f, std::fmax(-127.f, c)));
    }
    scales[h] = scale;
  }
}

// kv_heads heads of d bf16 values -> E4M3 codes of x / scales[h]
inline void quantize_heads_fp8(const uint16_t* src, int64_t kv_heads, int64_t d,
                               const float* scales, uint8_t* codes) {
  for (int64_t h = 0; h < kv_heads; ++h)
    for (int64_t i = 0; i < d; ++i)
      codes[h * d + i] = llmctl_fp8::float_to_e4m3(bf16_to_float(src[h * d + i]) / scales[h]);
}

}  // namespace

extern "C" {

// qk [tokens, q_heads + kv_heads, d] (qk_stride elements between tokens) is rotated in
// place; its key heads and v [tokens, kv_heads, d] (v_stride) are copied to the caches
// [slots, kv_heads, d] at slots[t]. freqs [positions, rot / 2, 2] float32 (rot <= d, even:
// the dimensions of each head that rotate).
void rope_kv_bf16(uint16_t* qk, int64_t qk_stride, const uint16_t* v, int64_t v_stride,
                  int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t rot,
                  const float* freqs, const int64_t* positions, const int64_t* slots,
                  uint16_t* k_cache, uint16_t* v_cache, int num_threads) {
  // a decode step has a handful of tokens: forking threads would cost more than the work
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= 64)
  for (int64_t t = 0; t < tokens; ++t) {
    uint16_t* row = qk + t * qk_stride;
    rotate(row, q_heads + kv_heads, d, rot, freqs + positions[t] * rot);
    const size_t bytes = static_cast<size_t>(kv_heads * d) * sizeof(uint16_t);
    std::memcpy(k_cache + slots[t] * kv_heads * d, row + q_heads * d, bytes);
    std::memcpy(v_cache + slots[t] * kv_heads * d, v + t * v_stride, bytes);
  }
}

// The same into an int8 cache: codes at [slots, kv_heads, d], scales at [slots, kv_heads].
void rope_kv_bf16_i8(uint16_t* qk, int64_t qk_stride, const uint16_t* v, int64_t v_stride,
                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                     int64_t rot, const float* freqs, const int64_t* positions,
                     const int64_t* slots,
                     int8_t* k_cache, int8_t* v_cache, float* k_scale, float* v_scale,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= 64)
  for (int64_t t = 0; t < tokens; ++t) {
    uint16_t* row = qk + t * qk_stride;
    rotate(row, q_heads + kv_heads, d, rot, freqs + positions[t] * rot);
    const int64_t slot = slots[t];
    quantize_heads(row + q_heads * d, kv_heads, d, k_cache + slot * kv_heads * d,
                   k_scale + slot * kv_heads);
    quantize_heads(v + t * v_stride, kv_heads, d, v_cache + slot * kv_heads * d,
                   v_scale + slot * kv_heads);
  }
}

// The same into an fp8 cache: codes at [slots, kv_heads, d]; k_scale, v_scale
// [kv_heads] are the layer's static scales (read, not written).
void rope_kv_bf16_f8(uint16_t* qk, int64_t qk_stride, const uint16_t* v, int64_t v_stride,
                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                     int64_t rot, const float* freqs, const int64_t* positions,
                     const int64_t* slots,
                     uint8_t* k_cache, uint8_t* v_cache, const float* k_scale,
                     const float* v_scale, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= 64)
  for (int64_t t = 0; t < tokens; ++t) {
    uint16_t* row = qk + t * qk_stride;
    rotate(row, q_heads + kv_heads, d, rot, freqs + positions[t] * rot);
    const int64_t slot = slots[t];
    quantize_heads_fp8(row + q_heads * d, kv_heads, d, k_scale, k_cache + slot * kv_heads * d);
    quantize_heads_fp8(v + t * v_stride, kv_heads, d, v_scale, v_cache + slot * kv_heads * d);
  }
}

}  // extern "C"
