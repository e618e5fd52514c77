// LoRA terms of a fused linear for bfloat16 activations (llmctl/serve/lora/batch.py). For
// the rows R of each adapter, in float32:
//
//     t = x[R] A^T             A [r, in]: the targeted projections' A stacked
//     d = t B^T                B^T [r, out]: block-diagonal, lora_alpha / r folded in
//     y[R] = bf16(y[R] + bf16(d))     (torch's `y += d.to(bfloat16)`: both roundings)
//
// A row costs r (in + out) multiply-adds for its own adapter only; base rows cost nothing.
// The Python layer loop and decode_layer.cpp both call this with the same inputs, so the
// two paths add the same bits (tests/serve/lora/test_lora.py holds them to that). From Python
// the same sums were ~13 torch calls per fused linear (convert, zero, two products per
// adapter, add, convert back): 120 linears a SmolLM2 step, ~15 ms of a 8-row decode step.

#include "lora.h"

#include <vector>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

// Below this many multiply-adds a call stays on one thread: fork/join costs more than a
// few rank-8 rows (a 64-row decode step of SmolLM2's gate_up is ~1.9 M).
constexpr int64_t kParallelWork = 1 << 18;

void add_row(const uint16_t* x, uint16_t* y, int64_t in, int64_t out, const LoraPair& p,
             float* xf, float* t, float* d) {
#pragma omp simd
  for (int64_t i = 0; i < in; ++i) xf[i] = bf16_to_float(x[i]);
  for (int64_t j = 0; j < p.r; ++j) {
    const float* a = p.a + j * in;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < in; ++i) sum += xf[i] * a[i];
    t[j] = sum;
  }
  const float t0 = t[0];
#pragma omp simd
  for (int64_t o = 0; o < out; ++o) d[o] = t0 * p.b[o];
  for (int64_t j = 1; j < p.r; ++j) {
    const float tj = t[j];
    const float* b = p.b + j * out;
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) d[o] += tj * b[o];
  }
#pragma omp simd
  for (int64_t o = 0; o < out; ++o)
    y[o] = float_to_bf16(bf16_to_float(y[o]) + round_bf16(d[o]));
}

}  // namespace

extern "C" void lora_add_bf16(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy,
                              int64_t in, int64_t out, const LoraSeg* segs, int64_t nsegs,
                              int64_t slot, int num_threads) {
  int64_t rows = 0, work = 0, max_r = 0;
  for (int64_t s = 0; s < nsegs; ++s) {
    const LoraPair& p = segs[s].pairs[slot];
    if (p.a == nullptr) continue;
    rows += segs[s].end - segs[s].start;
    work += (segs[s].end - segs[s].start) * p.r * (in + out);
    if (p.r > max_r) max_r = p.r;
  }
  if (rows == 0) return;
#pragma omp parallel num_threads(num_threads) if (work >= kParallelWork && num_threads > 1)
  {
    std::vector<float> xf(in), t(max_r), d(out);
    // one index over the targeted rows of every segment, split evenly between threads
#pragma omp for schedule(static)
    for (int64_t g = 0; g < rows; ++g) {
      int64_t k = g, s = 0;
      for (;; ++s) {
        if (segs[s].pairs[slot].a == nullptr) continue;
        const int64_t n = segs[s].end - segs[s].start;
        if (k < n) break;
        k -= n;
      }
      const int64_t row = segs[s].start + k;
      add_row(x + row * ldx, y + row * ldy, in, out, segs[s].pairs[slot], xf.data(), t.data(),
              d.data());
    }
  }
}
