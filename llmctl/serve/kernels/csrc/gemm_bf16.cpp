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
// Each step prefetches both cache lines of the step kPrefetch bytes ahead: on the 2-core
// Zen 4 guests the hardware prefetchers alone kept up (no difference measured); on the
// Intel Xeon (AMX) guests they did not: one row of a 13824 x 1152 weight read at
// 17-18 GB/s over 1 GB of cold matrices without, 23-24 GB/s with (2 threads, quiet
// rounds of /tmp-style microbenchmarks, development measurement; 8 KiB ahead the same).
// Products are exact in float32; the sum is float32 over the inputs in order, rounded
// once to bfloat16.
//
// AMX (Intel Xeon 4th gen on, where the build's -march has AMX-BF16): from kAmxRows rows
// the same layout feeds the tile unit. A pair's step t is the 64-byte row t of an AMX B
// tile for each of its blocks (16 columns of 2 inputs, the dword order TDPBF16PS takes),
// so 16 steps of a block are one tile loaded with a 128-byte stride, the weights stay
// where they are. 16 rows x 32 inputs of x are an A tile (x copied once per call into a
// zero-padded buffer of whole 16-row blocks, so no tile reads past it); C tiles hold 16
// rows x 16 columns of float32 sums. Per pair: up to 32 rows at once (4 C, 2 A, 2 B tiles:
// all eight), inputs past the last whole 32 (k % 32) by vdpbf16ps on the stored sums.
// TDPBF16PS sums each 32-input chunk before adding it (not the vdpbf16ps order), so the
// two paths differ in the last float32 bits; which one runs depends on the row count
// only, so the fused decode layers and the layer loop still agree bit for bit. Linux
// grants a process the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, once);
// refused, every row count takes the vdpbf16ps path.

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kSimd = true;
constexpr int64_t kCols = 16, kStepBytes = 64, kPair = 2;
// 8 rows: 16 accumulators. 12 (24) measured level to 64 rows and 5-8% slower at 128-512.
constexpr int kRowBlock = 8;
constexpr int64_t kPrefetch = 4096;

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
    // past the matrix's end a prefetch is a no-op, not a fault
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch + kStepBytes), _MM_HINT_T0);
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// From this many rows the tile unit: below it a pair's stream is read from memory at the
// same speed either way and the A tiles would be mostly padding.
constexpr int64_t kAmxRows = 8;
// The tile path's prefetch distance: twice the vdpbf16ps path's (a chunk of two B tiles
// is 2 KiB; 4 KiB ahead is two chunks, short of the memory latency once a chunk is 4
// TDPBF16PS). 17 products of Granite-3.1-2B's shapes (621 MB, cold, 2 threads, 10
// alternating rounds, development measurement): 32 rows 16.7 -> 17.7 GB/s and 21.1 ->
// 22.2 in a second run, 16 rows 24.0 -> 25.3, 8 rows 20.4 -> 20.8; 12 and 16 KiB no
// better, an L2-only hint (T1) 17.2.
constexpr int64_t kAmxPrefetch = 8192;
// The padded x's row stride: k plus one cache line. An A tile reads 16 rows at this
// stride; where k * 2 bytes is a multiple of 4 KiB (k = 2048, 4096, 8192, ...) all of
// them fall in one L1 set of 12 ways and evict each other (two A tiles at 32 rows). Padded:
// 32 rows of 17 Granite-3.1-2B-shaped products over 621 MB, cold, 2 threads, 10
// alternating rounds, 13.5 -> 16.8 GB/s (median), 16 and 24 rows level (development
// measurement, Intel Xeon with AMX).
int64_t x_ld(int64_t k) { return k + 32; }

bool amx_granted() {
  // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

struct TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Sums of rows r0 .. r0 + 16 * blocks - 1 (blocks 1 or 2) of the padded x times pair u,
// into sums[blocks * 2][16][16] (row block, column block); whole 32-input chunks only.
void amx_pair(const uint16_t* xp, int64_t k, int64_t ld, const uint8_t* base, int64_t r0, int blocks,
              float (*sums)[16][16]) {
  const int64_t chunks = k / 32, lda = ld * 2, step = kPair * kStepBytes;
  const uint16_t* a0 = xp + r0 * ld;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < chunks; ++c) {
    const uint8_t* b = base + c * 16 * step;
    // the 2 KiB of this chunk's two B tiles, kAmxPrefetch ahead (as the vdpbf16ps path:
    // 8 and 16 rows of a cold 13824 x 1152 weight 13 -> 18-19 GB/s, development measurement)
    for (int64_t line = 0; line < 16 * step; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b + kAmxPrefetch + line), _MM_HINT_T0);
    _tile_loadd(6, b, step);
    _tile_loadd(7, b + kStepBytes, step);
    _tile_loadd(4, a0 + c * 32, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (blocks == 2) {
      _tile_loadd(5, a0 + 16 * ld + c * 32, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if (blocks == 2) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
}

// Rows of pair u through the tile unit; the tail inputs and the rounding per row.
void amx_rows(const Problem& p, const uint16_t* xp, int64_t m, int64_t u) {
  const int64_t steps = p.k / 2, tail0 = p.k / 32 * 16;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.w) + u * steps * kPair * kStepBytes;
  alignas(64) float sums[4][16][16];
  for (int64_t r0 = 0; r0 < m; r0 += 32) {
    const int blocks = m - r0 > 16 ? 2 : 1;
    amx_pair(xp, p.k, x_ld(p.k), base, r0, blocks, sums);
    for (int64_t i = 0; i < 16 * blocks && r0 + i < m; ++i) {
      const int64_t row = r0 + i;
      __m512 acc[kPair] = {_mm512_load_ps(sums[2 * (i / 16)][i % 16]),
                           _mm512_load_ps(sums[2 * (i / 16) + 1][i % 16])};
      for (int64_t t = tail0; t < steps; ++t) {
        const uint8_t* src = base + t * kPair * kStepBytes;
        const __m512bh a = pair(p.x + row * p.ldx + 2 * t);
        acc[0] = _mm512_dpbf16_ps(acc[0], a, (__m512bh)_mm512_loadu_si512(src));
        acc[1] = _mm512_dpbf16_ps(acc[1], a, (__m512bh)_mm512_loadu_si512(src + kStepBytes));
      }
      for (int j = 0; j < kPair; ++j) {
        const int64_t col0 = (u * kPair + j) * kCols;
        if (col0 >= p.n_valid) continue;
        const int64_t n = p.n_valid - col0 < kCols ? p.n_valid - col0 : kCols;
        const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
        _mm256_mask_storeu_epi16(p.out + row * p.ldo + col0, keep, to_bf16(acc[j]));
      }
    }
  }
}

void gemm_amx(const Problem& p, int64_t m, int64_t pairs, int num_threads) {
  // x in whole 16-row blocks, rows past m zero, k contiguous (an A tile's stride)
  static thread_local std::vector<uint16_t> padded;
  const int64_t rows = (m + 15) / 16 * 16;
  const int64_t ld = x_ld(p.k);
  padded.resize(static_cast<size_t>(rows * ld));  // only the pad rows need zeros
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(padded.data() + r * ld, p.x + r * p.ldx, static_cast<size_t>(p.k) * 2);
  std::memset(padded.data() + m * ld, 0, static_cast<size_t>((rows - m) * ld) * 2);
  const uint16_t* xp = padded.data();  // the caller's buffer (thread_local is per thread)
#pragma omp parallel num_threads(num_threads)
  {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < pairs; ++u) amx_rows(p, xp, m, u);
    _tile_release();
  }
}
#else
constexpr int64_t kAmxRows = 0;
#endif
#else
constexpr bool kSimd = false;
#endif

}  // namespace

extern "C" {

// 1 when this build has the kernel (a CPU with AVX512-BF16), else 0.
int gemm_bf16_available(void) { return kSimd ? 1 : 0; }

// The fewest rows that take the tile unit (AMX-BF16 compiled in and granted), else 0.
int gemm_bf16_amx_rows(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_granted() ? static_cast<int>(kAmxRows) : 0;
#else
  return 0;
#endif
}

// out [m, ldo] = x [m, ldx] w^T, bf16 in and out, k even, any m.
void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t m, int64_t blocks,
               int64_t k, uint16_t* out, int64_t ldo, int64_t n_valid, int num_threads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (m <= 0) return;
  const Problem p{x, ldx, w, k, out, ldo, n_valid};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (m >= kAmxRows && amx_granted()) return gemm_amx(p, m, blocks / kPair, num_threads);
#endif
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
