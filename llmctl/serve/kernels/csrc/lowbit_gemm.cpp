// Weight-only low-bit matrix products for bfloat16 activations ("W4A16", "W8A16"):
//
//   y[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = s[n, g] * q[n, k] + z[n, g],  g = k / group
//
// with q an unsigned 4-bit code (GPTQ/AWQ/RTN int4 as u = q + 8, GGUF Q4_0/Q4_1), a
// signed 8-bit one (int8 channel/group, GGUF Q8_0, the int8 lm_head), or a 4-bit index
// into the E2M1 table (MXFP4, below).
//
// Layout (llmctl/serve/layers/lowbit.py packs it once at load): output columns in blocks of 16,
// each block's codes one contiguous stream along k, 32 bytes per step:
//   int4 and E2M1, 4 k per step: byte 2c+p = q[c, k+p] | q[c, k+2+p] << 4   (c < 16, p < 2)
//   int8, 2 k per step: byte 2c+p = q[c, k+p]
// so one step widens into one (int8) or two (int4) vectors of 32 bfloat16 in the pair
// order AVX512-BF16's dot product (vdpbf16ps) takes: lane c accumulates column c, each
// instruction adds x[m, k] w[c, k] + x[m, k+1] w[c, k+1] for 16 columns. A step's codes
// are widened once and used for every row of x in the tile (rows share the weights, as
// in llama.cpp's repacked interleaved rows). Scales s and offsets z are [block][g][16].
//
// int4 codes widen without any conversion: OR-ing u << 3 into the bits of 1.0 makes the
// bfloat16 1 + u/16 exactly, so per group (X = sum of x over the group)
//   sum w x = s (16 D - 16 X) + z X = (16 s) D + (z - 16 s) X,   D = sum (1 + u/16) x,
// and the packer stores 16 s and z - 16 s. The products are exact in float32 and D keeps
// about 22 bits after the X term cancels: more precise than rounding the dequantized
// weight to bfloat16 as a dense bf16 matmul would. int8 codes convert exactly through
// float32 (|q| <= 128), so there s and z are stored as they are (z may be absent).
//
// E2M1 codebook (bits = -4, MXFP4's experts read in place): the int4 layout, but each
// nibble indexes the table T of twice the E2M1 values (llmctl/quant/mxfp4.py FP4_TIMES_2:
// 0 1 2 3 4 6 8 12, bit 3 the sign), w = s T[u] with s = 2^(e - 128) per group, no
// offset, and s held as the checkpoint's E8M0 byte e ([block][g][16] uint8: 0.5 + 1/32
// bytes per weight), made into float32 here (vscalefps, or ldexp: exact for every e,
// 2^-128 and 2^-127 as float32 subnormals) (llama.cpp's ggml-cpu has the same doubled table, kvalues_mxfp4, with the half
// E8M0 scale, for its int8 dot products). vpermw looks the 32 nibble lanes of a step up in
// T as bfloat16 (integers up to 12: exact), so sum w x = s D, D = sum T[u] x, the
// products exact in float32 as for int8.
// The table is repeated to 32 entries, so the low nibble needs no mask (vpermw reads 5
// bits of each index: the fifth, the high nibble's lowest, picks the same value).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

constexpr int64_t kCols = 16;  // output columns per block (one float32 vector)
constexpr int64_t kStepBytes = 32;
// rows per tile: 16 measured best against 8 and 12 at 16-64 rows (SmolLM2's layers)
constexpr int64_t MT_MAX = 16;

struct Problem {
  const uint16_t* x;  // [m, ldx] bf16
  int64_t ldx;
  const uint8_t* w;  // [blocks][k / k_step][32]
  int bits;
  const float* s;  // [blocks][groups][16]
  const float* z;  // same, or null
  const float* xsum;  // [m][groups] when z is set
  int64_t m, blocks, k, group;
  void* out;  // [m, ldo] float32 or bf16
  int64_t ldo, n_valid;
  bool out_f32;

  int64_t groups() const { return k / group; }
  int64_t k_step() const { return bits == 8 ? 2 : 4; }
};

constexpr int kFp4 = -4;  // the bits value of E2M1 codebook codes
// twice the E2M1 values by nibble (bit 3 the sign), llmctl.quant.mxfp4.FP4_TIMES_2
constexpr float kFp4Times2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E2M1 group's scale 2^(e - 128) from its E8M0 byte (s then points at bytes).
inline float fp4_scale(const Problem& p, int64_t at) {
  return std::ldexp(0.5f, static_cast<int>(reinterpret_cast<const uint8_t*>(p.s)[at]) - 127);
}

void store_row(const Problem& p, int64_t row, int64_t col0, const float* vals) {
  const int64_t n = p.n_valid - col0 < kCols ? p.n_valid - col0 : kCols;
  if (p.out_f32) {
    float* o = static_cast<float*>(p.out) + row * p.ldo + col0;
    for (int64_t c = 0; c < n; ++c) o[c] = vals[c];
  } else {
    uint16_t* o = static_cast<uint16_t*>(p.out) + row * p.ldo + col0;
    for (int64_t c = 0; c < n; ++c) o[c] = float_to_bf16(vals[c]);
  }
}

// The code of column c, input k, in block b (portable path and tests' reference).
inline float code_at(const Problem& p, int64_t b, int64_t c, int64_t k) {
  const int64_t step = k / p.k_step(), r = k % p.k_step();
  const uint8_t* base = p.w + (b * (p.k / p.k_step()) + step) * kStepBytes;
  if (p.bits != 8) {
    const uint8_t byte = base[2 * c + (r & 1)];
    const int u = r < 2 ? (byte & 15) : (byte >> 4);
    return p.bits == kFp4 ? kFp4Times2[u] : static_cast<float>(u);
  }
  return static_cast<float>(static_cast<int8_t>(base[2 * c + r]));
}

// Portable path: any CPU, float32 arithmetic on the true codes.
void tile_portable(const Problem& p, int64_t b, int64_t m0, int64_t rows) {
  const int64_t groups = p.groups();
  float acc[kCols];
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* xr = p.x + (m0 + i) * p.ldx;
    for (int64_t c = 0; c < kCols; ++c) acc[c] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (b * groups + g) * kCols;
      const float* s = p.bits == kFp4 ? nullptr : p.s + at;
      const float* z = p.z ? p.z + (b * groups + g) * kCols : nullptr;
      for (int64_t c = 0; c < kCols; ++c) {
        float dot = 0.f, xs = 0.f;
        for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
          const float xv = bf16_to_float(xr[k]);
          dot += code_at(p, b, c, k) * xv;
          xs += xv;
        }
        // the packer's int4 encoding: s holds 16 s, z holds z - 16 s (see the header)
        if (p.bits == 4) acc[c] += s[c] / 16.f * dot + (z[c] + s[c]) * xs;
        else if (p.bits == kFp4) acc[c] += fp4_scale(p, at + c) * dot;
        else acc[c] += s[c] * dot + (z ? z[c] * xs : 0.f);
      }
    }
    store_row(p, m0 + i, b * kCols, acc);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kSimd = true;

// kFp4Times2 as bfloat16 bit patterns (1 = 0x3F80 ... 12 = 0x4140, bit 15 the sign),
// twice over: vpermw's 32 entries (see the header)
alignas(64) constexpr uint16_t kFp4Bf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
    0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
    0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140};
inline __m512i fp4_table() { return _mm512_load_si512(kFp4Bf16); }

// 16 E8M0 bytes -> 2^(e - 128): vscalefps computes 0.5 * 2^(e - 127) exactly, subnormal
// results included
inline __m512 fp4_scales(const Problem& p, int64_t at) {
  const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      reinterpret_cast<const uint8_t*>(p.s) + at));
  const __m512 pow = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(e)),
                                   _mm512_set1_ps(127.f));
  return _mm512_scalef_ps(_mm512_set1_ps(0.5f), pow);
}

inline __m512bh pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// MT rows of x times NT column blocks, all of k.
template <int MT, int NT, int BITS>
void tile_simd(const Problem& p, int64_t b0, int64_t m0) {
  constexpr int64_t KS = BITS == 8 ? 2 : 4;
  const int64_t groups = p.groups(), steps = p.k / KS;
  const __m512i mask = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(0x3F80);
  const __m512i fp4 = fp4_table();
  __m512 tot[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) tot[i][j] = _mm512_setzero_ps();
  const uint16_t* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = p.x + (m0 + i) * p.ldx;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = g * p.group; k < (g + 1) * p.group; k += KS) {
      for (int j = 0; j < NT; ++j) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
            p.w + ((b0 + j) * steps + k / KS) * kStepBytes));
        if constexpr (BITS == 4) {
          const __m512i v = _mm512_cvtepu8_epi16(raw);
          const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(
              _mm512_slli_epi16(v, 3), mask, one, 0xEA);  // (a & b) | c
          const __m512bh hi = (__m512bh)_mm512_ternarylogic_epi32(
              _mm512_srli_epi16(v, 1), mask, one, 0xEA);
          for (int i = 0; i < MT; ++i) {
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pair(xr[i] + k), lo);
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pair(xr[i] + k + 2), hi);
          }
        } else if constexpr (BITS == kFp4) {
          const __m512i v = _mm512_cvtepu8_epi16(raw);
          const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(v, fp4);
          const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), fp4);
          for (int i = 0; i < MT; ++i) {
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pair(xr[i] + k), lo);
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pair(xr[i] + k + 2), hi);
          }
        } else {
          const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
          const __m512 f1 = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
          const __m512bh wv = _mm512_cvtne2ps_pbh(f1, f0);  // f0 -> lanes 0..15
          for (int i = 0; i < MT; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], pair(xr[i] + k), wv);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const int64_t at = ((b0 + j) * groups + g) * kCols;
      const __m512 sv = BITS == kFp4 ? fp4_scales(p, at) : _mm512_loadu_ps(p.s + at);
      for (int i = 0; i < MT; ++i) tot[i][j] = _mm512_fmadd_ps(sv, acc[i][j], tot[i][j]);
      if (p.z != nullptr) {
        const __m512 zv = _mm512_loadu_ps(p.z + at);
        for (int i = 0; i < MT; ++i)
          tot[i][j] = _mm512_fmadd_ps(zv, _mm512_set1_ps(p.xsum[(m0 + i) * groups + g]), tot[i][j]);
      }
    }
  }
  alignas(64) float vals[kCols];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      const int64_t col0 = (b0 + j) * kCols;
      if (p.n_valid - col0 >= kCols) {  // a full block: store the vector directly
        if (p.out_f32)
          _mm512_storeu_ps(static_cast<float*>(p.out) + (m0 + i) * p.ldo + col0, tot[i][j]);
        else
          _mm256_storeu_si256(
              reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + (m0 + i) * p.ldo + col0),
              (__m256i)_mm512_cvtneps_pbh(tot[i][j]));
      } else {
        _mm512_store_ps(vals, tot[i][j]);
        store_row(p, m0 + i, col0, vals);
      }
    }
}

// Row tiles of up to 8 (the widened codes are reused 8 times); single rows and pairs
// take 4 column blocks at once instead, so enough independent dot-product chains are in
// flight to hide vdpbf16ps's latency.
template <int BITS>
void tile_rows(const Problem& p, int64_t b0, int nt, int64_t m0, int64_t rows) {
#define LLMCTL_TILE(MT, NT) \
  case MT: tile_simd<MT, NT, BITS>(p, b0, m0); break;
  if (nt == 4) {
    switch (rows) { LLMCTL_TILE(1, 4) LLMCTL_TILE(2, 4) default: break; }
    return;
  }
  switch (rows) {
    LLMCTL_TILE(1, 1) LLMCTL_TILE(2, 1) LLMCTL_TILE(3, 1) LLMCTL_TILE(4, 1)
    LLMCTL_TILE(5, 1) LLMCTL_TILE(6, 1) LLMCTL_TILE(7, 1) LLMCTL_TILE(8, 1)
    LLMCTL_TILE(9, 1) LLMCTL_TILE(10, 1) LLMCTL_TILE(11, 1) LLMCTL_TILE(12, 1)
    LLMCTL_TILE(13, 1) LLMCTL_TILE(14, 1) LLMCTL_TILE(15, 1) LLMCTL_TILE(16, 1)
    default: break;
  }
#undef LLMCTL_TILE
}
#else
constexpr bool kSimd = false;
#endif

}  // namespace

extern "C" {

// 1 when the AVX512-BF16 path was compiled in (this CPU has it), else 0: the caller
// keeps its own kernels then, the portable path being a reference, not a fast path.
int lowbit_simd(void) { return kSimd ? 1 : 0; }

void lowbit_gemm(const uint16_t* x, int64_t ldx, const uint8_t* w, int bits, const float* s,
                 const float* z, int64_t m, int64_t blocks, int64_t k, int64_t group, void* out,
                 int64_t ldo, int64_t n_valid, int out_f32, int portable, int num_threads) {
  Problem p{x, ldx, w, bits, s, z, nullptr, m, blocks, k, group, out, ldo, n_valid, out_f32 != 0};
  const int64_t groups = p.groups();
  std::vector<float> xsum;
  if (z != nullptr) {
    xsum.resize(static_cast<size_t>(m * groups));
    p.xsum = xsum.data();
  }
  const bool simd = kSimd && !portable;
  const int64_t mt = m <= 2 ? m : MT_MAX;
  const int nt = (simd && m <= 2 && blocks % 4 == 0) ? 4 : 1;
  const int64_t row_tiles = (m + mt - 1) / mt, col_units = blocks / nt;
  float* sums = xsum.data();
#pragma omp parallel num_threads(num_threads)
  {
    if (z != nullptr) {
#pragma omp for schedule(static)
      for (int64_t rg = 0; rg < m * groups; ++rg) {
        const uint16_t* xg = x + (rg / groups) * ldx + (rg % groups) * group;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t kk = 0; kk < group; ++kk) acc += bf16_to_float(xg[kk]);
        sums[rg] = acc;
      }  // the implicit barrier: every sum is in place before the products start
    }
    // column blocks outermost: a thread walks a contiguous run of weight blocks, each
    // reused from cache by every row tile
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < col_units * row_tiles; ++unit) {
      const int64_t b0 = (unit / row_tiles) * nt, m0 = (unit % row_tiles) * mt;
      const int64_t rows = m - m0 < mt ? m - m0 : mt;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if (simd) {
        if (bits == 4) tile_rows<4>(p, b0, nt, m0, rows);
        else if (bits == kFp4) tile_rows<kFp4>(p, b0, nt, m0, rows);
        else tile_rows<8>(p, b0, nt, m0, rows);
        continue;
      }
#endif
      for (int j = 0; j < nt; ++j) tile_portable(p, b0 + j, m0, rows);
    }
  }
}

}  // extern "C"
