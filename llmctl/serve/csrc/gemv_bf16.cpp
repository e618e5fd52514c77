// Dense bfloat16 weights times one to four rows (batch-1 to batch-4 decode), AVX512-BF16.
//
// Why not oneDNN: its blocked GEMM streams cold weights at ~21 GB/s on these 2-core Zen 4
// machines (80 distinct 3072 x 576 layers) against 35 GB/s for a plain sum over memory,
// and at one row nothing but memory matters. Here each thread reads one sequential stream
// (column blocks interleaved in pairs, as in lowbit_vnni.cpp) with software prefetch,
// and every 64 bytes feed one vdpbf16ps per row. Over SmolLM2's layers (development
// measurement, 2 threads): 7.8 vs 12.1 ms at 1 row, 8.9 vs 11.0 at 3, level at 4 (10.2
// vs 10.0), slower beyond (6 rows 13.1 vs 9.9): hence 4 rows at most.
//
// Layout (llmctl/serve/quant_linear.py packs it once): output columns in blocks of 16
// (an even number of blocks, zero-padded), the blocks of a pair interleaved step by
// step, a step being 2 inputs: bf16 element 2c+p of a block's step t = w[c, 2t+p], the
// pair order vdpbf16ps takes (lane c accumulates x[2t] w[c, 2t] + x[2t+1] w[c, 2t+1]).
// Products are exact in float32; the sum is float32, rounded once to bfloat16.

#include <cstdint>
#include <cstring>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kSimd = true;
constexpr int64_t kCols = 16, kStepBytes = 64, kPair = 2;
constexpr int64_t kPrefetch = 4096;  // as lowbit_vnni.cpp: 1-32 KiB ahead all alike

struct Problem {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t m, k;
  uint16_t* out;
  int64_t ldo, n_valid;
};

inline __m512bh pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// MT rows, both blocks of pair u; two accumulators per row and block (even and odd
// steps) keep enough independent dot-product chains in flight.
template <int MT>
void tile(const Problem& p, int64_t u) {
  const int64_t steps = p.k / 2;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.w) + u * steps * kPair * kStepBytes;
  __m512 acc[MT][kPair][2];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPair; ++j) acc[i][j][0] = acc[i][j][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < steps; ++t) {
    const uint8_t* src = base + t * kPair * kStepBytes;
    _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetch, _MM_HINT_T0);
    for (int j = 0; j < kPair; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(src + j * kStepBytes);
      for (int i = 0; i < MT; ++i)
        acc[i][j][t & 1] = _mm512_dpbf16_ps(acc[i][j][t & 1], pair(p.x + i * p.ldx + 2 * t), wv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < kPair; ++j) {
      const int64_t col0 = (u * kPair + j) * kCols;
      if (col0 >= p.n_valid) continue;
      const int64_t n = p.n_valid - col0 < kCols ? p.n_valid - col0 : kCols;
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
      const __m512 sum = _mm512_add_ps(acc[i][j][0], acc[i][j][1]);
      _mm256_mask_storeu_epi16(p.out + i * p.ldo + col0, keep, to_bf16(sum));
    }
}
#else
constexpr bool kSimd = false;
#endif

}  // namespace

extern "C" {

// The most rows gemv_bf16 takes; 0 when this CPU has no AVX512-BF16 (not built).
int gemv_bf16_rows(void) { return kSimd ? 4 : 0; }

// out [m, ldo] = x [m, ldx] w^T, bf16 in and out, m <= 4, k even.
void gemv_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t m, int64_t blocks,
               int64_t k, uint16_t* out, int64_t ldo, int64_t n_valid, int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const Problem p{x, ldx, w, m, k, out, ldo, n_valid};
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < blocks / kPair; ++u) {
    switch (m) {
      case 1: tile<1>(p, u); break;
      case 2: tile<2>(p, u); break;
      case 3: tile<3>(p, u); break;
      default: tile<4>(p, u); break;
    }
  }
#else
  (void)x, (void)ldx, (void)w, (void)m, (void)blocks, (void)k, (void)out, (void)ldo;
  (void)n_valid, (void)num_threads;
#endif
}

}  // extern "C"
