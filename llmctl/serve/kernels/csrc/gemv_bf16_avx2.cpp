// Dense bfloat16 weights times a few rows of activations on AVX2 + FMA (no AVX-512, no
// native bf16: Zen 1-3, Haswell to Alder Lake), for decode. torch emulates bf16 matrix
// products on such a CPU (~0.85 GFLOP/s per thread on Zen 3) and oneDNN refuses to pack
// bf16 weights there, yet a bf16 weight is half the bytes of a float32 one: widened in
// registers and summed with float32 FMA, a memory-bound decode step reads half as much.
//
//   out[m, j] = sum_k x[m, k] w[j, k]
//
// w is the bf16 [n, k] row-major weight as torch holds it (no repacking, one copy); x is
// float32 or bf16 rows ldx apart; sums are float32 (FMA), the output float32 or bf16
// (rounded to nearest even once, as float_to_bf16).
//
// Widening without a shuffle: a 256-bit load holds 16 bf16 weights, two per 32-bit lane;
// `lane << 16` is the even-indexed weight as a float32 and `lane & 0xFFFF0000` the odd one
// (bf16 is the top half of a float32). So 16 weights cost one load and two integer ops,
// against two vpmovzxwd + two shifts in source order. The activations are put in the
// matching order once per call: each 16-input chunk of a row as [x0 x2 .. x14 | x1 x3 ..
// x15] in float32, zero-padded to whole chunks; a weight row's last k % 16 inputs are
// copied into a zeroed chunk (w is never read past k), so k needs no alignment.
//
// Tiles: MT rows (1-4) share each weight vector loaded, NT output columns at once, one
// float32 vector accumulator per (row, column) summed across its lanes at the end.
// Registers (16 ymm): MT x NT accumulators, the loaded weights and their two halves;
// the activations are FMA memory operands (L1-resident).
//
// Measured (Zen 3, 1 thread, a background test run holding the other core at load ~2,
// weights cycled through >= 64 MB of copies so they stream from memory as in decode;
// development measurement), this kernel / float32 oneDNN packed / bf16 F.linear, ms:
//   576 x 576      1 row 0.12 / 0.23 / 0.11    4 rows 0.14 / 0.26 / 0.36
//   1536 x 576     1 row 0.27 / 0.51 / 0.29    4 rows 0.28 / 0.62 / 0.80
//   576 x 1536     1 row 0.23 / 0.57 / 0.30    4 rows 0.30 / 0.75 / 0.91
//   49152 x 576    1 row 7.5  / 14.3 / 8.5     4 rows 8.5  / 18.3 / 29.0
// Without the prefetch of the next tile's rows (1 KiB ahead within each row instead)
// the same took 0.16 / 0.39 / 0.35 / 10.2 ms at 1 row. 2-thread timings on that loaded
// 2-core machine were dominated by the other process (slower than 1 thread throughout).

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvx2 = true;
constexpr int64_t kChunk = 16;  // inputs per 256-bit weight load
// Columns a thread takes as one unit: every row tile runs over them before the next
// unit, so with more than 4 rows the unit's weights (8 x k x 2 bytes, 9-24 KiB for
// k = 576-1536) are read from memory once and from L1/L2 by the later row tiles.
constexpr int64_t kUnit = 8;

struct Problem {
  const float* xs;  // [m][kp] activations in chunk order (see the header)
  int64_t kp;  // k rounded up to a whole chunk
  const uint16_t* w;
  int64_t k, n;
  void* out;
  int64_t ldo;
  bool out_bf16;
};

inline void store(const Problem& p, int64_t row, int64_t col, float v) {
  if (p.out_bf16)
    static_cast<uint16_t*>(p.out)[row * p.ldo + col] = float_to_bf16(v);
  else
    static_cast<float*>(p.out)[row * p.ldo + col] = v;
}

// Rows m0 .. m0 + MT - 1 times columns j0 .. j0 + NT - 1, all of k.
template <int MT, int NT>
void tile(const Problem& p, int64_t m0, int64_t j0) {
  const __m256i odd = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t kv = p.k / kChunk * kChunk;  // whole chunks read in place
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  const uint16_t* wr[NT];
  for (int j = 0; j < NT; ++j) wr[j] = p.w + (j0 + j) * p.k;
  const float* xr = p.xs + m0 * p.kp;

  auto step = [&](const uint16_t* const* w, int64_t wk, int64_t xk) {
    for (int j = 0; j < NT; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + wk));
      const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
      for (int i = 0; i < MT; ++i) {
        const float* x = xr + i * p.kp + xk;
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x), lo, acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), hi, acc[i][j]);
      }
    }
  };
  // The tile reads NT short streams (a row of k inputs each); the hardware prefetcher
  // barely ramps up on them, so each column prefetches the same place in the next
  // tile's rows (NT rows further on, the next tile's weights are the next NT x k
  // contiguous ones), one 64-byte line every 32 inputs.
  const int64_t ahead = NT * p.k;
  for (int64_t k0 = 0; k0 < kv; k0 += kChunk) {
    if ((k0 & 31) == 0)
      for (int j = 0; j < NT; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wr[j] + ahead + k0), _MM_HINT_T0);
    step(wr, k0, k0);
  }
  if (kv < p.k) {  // the last k % 16 inputs: zero-padded copies of the rows' ends
    alignas(32) uint16_t tail[NT][kChunk];
    const uint16_t* tr[NT];
    for (int j = 0; j < NT; ++j) {
      std::memset(tail[j], 0, sizeof(tail[j]));
      std::memcpy(tail[j], wr[j] + kv, static_cast<size_t>(p.k - kv) * sizeof(uint16_t));
      tr[j] = tail[j];
    }
    step(tr, 0, kv);
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) store(p, m0 + i, j0 + j, reduce_add8(acc[i][j]));
}

// MT rows times the columns j0 .. j1 - 1 (at most kUnit), NT at a time, the rest singly.
template <int MT, int NT>
void columns(const Problem& p, int64_t m0, int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + NT <= j1; j += NT) tile<MT, NT>(p, m0, j);
  for (; j < j1; ++j) tile<MT, 1>(p, m0, j);
}

// Column widths per row count: MT x NT accumulators plus 3 weight registers fit in 16
// (1 x 8 and 2 x 4: 8 accumulators, enough independent FMA chains to cover the FMA
// latency; 3 and 4 rows: 2 columns, 6 and 8).
void rows_tile(const Problem& p, int64_t m0, int64_t rows, int64_t j0, int64_t j1) {
  switch (rows) {
    case 1: return columns<1, 8>(p, m0, j0, j1);
    case 2: return columns<2, 4>(p, m0, j0, j1);
    case 3: return columns<3, 2>(p, m0, j0, j1);
    default: return columns<4, 2>(p, m0, j0, j1);
  }
}
#else
constexpr bool kAvx2 = false;
#endif

}  // namespace

extern "C" {

int gemm_bf16w_avx2_available(void) { return kAvx2 ? 1 : 0; }

// out [rows, ldo] (float32, or bf16 if out_is_bf16) = x [rows, ldx] (float32, or bf16 if
// x_is_bf16) times w^T, w bf16 [n, k] row-major.
void gemm_bf16w_avx2(const void* x, int64_t ldx, int x_is_bf16, const uint16_t* w,
                     int64_t rows, int64_t n, int64_t k, void* out, int64_t ldo,
                     int out_is_bf16, int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
  if (rows <= 0 || n <= 0) return;
  const int64_t kp = (k + kChunk - 1) / kChunk * kChunk;
  std::vector<float> xs(static_cast<size_t>(rows * kp), 0.f);
  for (int64_t m = 0; m < rows; ++m) {  // chunk order: evens, then odds
    float* dst = xs.data() + m * kp;
    for (int64_t i = 0; i < k; ++i) {
      const float v = x_is_bf16 ? bf16_to_float(static_cast<const uint16_t*>(x)[m * ldx + i])
                                : static_cast<const float*>(x)[m * ldx + i];
      const int64_t c = i % kChunk;
      dst[i - c + (c & 1) * 8 + c / 2] = v;
    }
  }
  const Problem p{xs.data(), kp, w, k, n, out, ldo, out_is_bf16 != 0};
  const int64_t units = (n + kUnit - 1) / kUnit;
  // column units outermost: a thread walks a contiguous run of weight rows, each unit
  // reused from cache by every row tile
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < units; ++u) {
    const int64_t j0 = u * kUnit, j1 = j0 + kUnit < n ? j0 + kUnit : n;
    for (int64_t m0 = 0; m0 < rows; m0 += 4)
      rows_tile(p, m0, rows - m0 < 4 ? rows - m0 : 4, j0, j1);
  }
#else
  (void)x, (void)ldx, (void)x_is_bf16, (void)w, (void)rows, (void)n, (void)k, (void)out;
  (void)ldo, (void)out_is_bf16, (void)num_threads;
#endif
}

}  // extern "C"
