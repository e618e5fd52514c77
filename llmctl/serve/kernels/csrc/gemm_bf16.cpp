// Dense bfloat16 weights times any number of rows, AVX512-BF16 (vdpbf16ps).
//
// Why not oneDNN: on these 2-core Zen 4 machines (AVX512-BF16, no AMX) its blocked GEMM
// waits on cold weights. Over SmolLM2's 30 layers (212 MB of bf16 weights, development
// measurement, 2 threads, every weight cold): 1 row 6.4 vs 10.0 ms (oneDNN), 4 rows 6.2 vs 8.7,
// 8 rows 6.3 vs 10.5, 32 rows 17.7 vs 21.7, 64 rows 32.8 vs 40.9, 128 rows 62.5 vs 70.5,
// 512 rows 245 vs 250, 2048 rows (10 layers) 326 vs 331. At one to eight rows that is the
// memory's bandwidth (34 GB/s, as a plain sum over memory); at 64 rows 415 GFLOP/s,
// within 6% of what oneDNN reaches on warm weights (~440). CPUs with AMX keep oneDNN
// above a few rows (llmctl/serve/layers/quant_linear.py): its tile kernels are not measured here.
//
// Layout (llmctl/serve/layers/lowbit.py interleave_block_pairs, packed once): output columns
// in blocks of 16 (an even number of blocks, zero-padded), the two blocks of a pair
// interleaved step by step, a step being 2 inputs: bf16 element 2c+p of a block's step
// t = w[c, 2t+p], the pair order vdpbf16ps takes (lane c accumulates
// x[2t] w[c, 2t] + x[2t+1] w[c, 2t+1]). So a pair of blocks (32 columns) is one
// sequential stream of k/2 * 128 bytes, and each 128 bytes feed two vdpbf16ps per row.
//
// Work: threads split the pairs of blocks; each thread runs its pair over the rows in
// blocks of at most kRowBlock (2 x kRowBlock accumulators stay in registers for the
// whole k; the stream is read from memory for the first row block and from L2 after).
// The hardware prefetchers keep up with one stream per core (a software prefetch 4 KiB
// ahead measured no better). Products are exact in float32; the sum is float32 over the
// inputs in order, rounded once to bfloat16.

#include <cstdint>
#include <cstring>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kSimd = true;
constexpr int64_t kCols = 16, kStepBytes = 64, kPair = 2;
// 8 rows: 16 accumulators. 12 (24) measured level to 64 rows and 5-8% slower at 128-512.
constexpr int kRowBlock = 8;

struct Problem {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t k;
  uint16_t* out;
  int64_t ldo, n_valid;
};

inline __m512bh pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// Rows row0 .. row0 + MT - 1 times both blocks of pair u.
template <int MT>
void tile(const Problem& p, int64_t u, int64_t row0) {
  const int64_t steps = p.k / 2;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.w) + u * steps * kPair * kStepBytes;
  const uint16_t* x = p.x + row0 * p.ldx;
  __m512 acc[MT][kPair];
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < steps; ++t) {
    const uint8_t* src = base + t * kPair * kStepBytes;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(src);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(src + kStepBytes);
    for (int i = 0; i < MT; ++i) {
      const __m512bh a = pair(x + i * p.ldx + 2 * t);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
    }
  }
  for (int j = 0; j < kPair; ++j) {
    const int64_t col0 = (u * kPair + j) * kCols;
    if (col0 >= p.n_valid) continue;
    const int64_t n = p.n_valid - col0 < kCols ? p.n_valid - col0 : kCols;
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
    for (int i = 0; i < MT; ++i)
      _mm256_mask_storeu_epi16(p.out + (row0 + i) * p.ldo + col0, keep, to_bf16(acc[i][j]));
  }
}

using Tile = void (*)(const Problem&, int64_t, int64_t);
constexpr Tile kTiles[kRowBlock + 1] = {nullptr,  tile<1>, tile<2>, tile<3>, tile<4>,
                                        tile<5>,  tile<6>, tile<7>, tile<8>};
#else
constexpr bool kSimd = false;
#endif

}  // namespace

extern "C" {

// 1 when this build has the kernel (a CPU with AVX512-BF16), else 0.
int gemm_bf16_available(void) { return kSimd ? 1 : 0; }

// out [m, ldo] = x [m, ldx] w^T, bf16 in and out, k even, any m.
void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t m, int64_t blocks,
               int64_t k, uint16_t* out, int64_t ldo, int64_t n_valid, int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (m <= 0) return;
  const Problem p{x, ldx, w, k, out, ldo, n_valid};
  // row blocks as even as possible: 12 rows -> 6 + 6, not 8 + 4
  const int64_t nb = (m + kRowBlock - 1) / kRowBlock, base = m / nb, extra = m % nb;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < blocks / kPair; ++u) {
    int64_t row = 0;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t rows = base + (b < extra ? 1 : 0);
      kTiles[rows](p, u, row);
      row += rows;
    }
  }
#else
  (void)x, (void)ldx, (void)w, (void)m, (void)blocks, (void)k, (void)out, (void)ldo;
  (void)n_valid, (void)num_threads;
#endif
}

}  // extern "C"
