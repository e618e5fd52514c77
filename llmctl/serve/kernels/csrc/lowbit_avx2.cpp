// Low-bit weights times a few rows of activations on AVX2 + FMA: the companion of
// lowbit_vnni.cpp for CPUs without AVX-512 (Zen 1-3, Haswell to Alder Lake), where
// lowbit_gemm.cpp has only its scalar reference path.
//
// Activations: each row is cut into blocks of 32 inputs, each block quantized with its
// own scale, d = amax / 32767, xq = round(x / d) in [-32767, 32767]: 16 bits, one more
// than lowbit_vnni.cpp's 15, and a rounding no coarser than bfloat16's (half an ulp, at
// least |x| 2^-9) for every element within 2^7 of its block's largest (half a step,
// amax 2^-16). x is float32 or bfloat16 (torch's int4 kernel, the path before this one,
// rounded float32 activations to bfloat16).
//
// Products: vpmaddwd (_mm256_madd_epi16) multiplies 16 signed 16-bit pairs and adds each
// pair into a 32-bit lane, exactly: |q| <= 128 and |xq| <= 2^15 - 1 give a pair below
// 2^23 and a 32-input block below 2^27, so the block's integer sum I_b is exact in int32
// with no saturation anywhere (vpmaddwd saturates only for two -32768 * -32768 pairs,
// and xq never reaches -32768). llama.cpp's AVX2 path uses vpmaddubsw (u8 x s8, saturating
// 16-bit pair sums) on 8-bit activations; keeping 16-bit activations that way needs each
// xq split into two bytes (two vpmaddubsw, and for int8 codes |q| as the unsigned operand
// with the sign moved onto x by vpsignb, plus vpmaddwd to widen: 8 instructions per row
// and 32 int8 weights against 4 here). For int4 the two cost the same per row (the codes'
// widening is shared by the rows); measured on 1 row of a 1536 x 576 int4 layer (Zen 3,
// 1 thread, L2-resident, development measurement) this way took 20.5 us, the byte-split
// way 25 us.
// So, as in lowbit_vnni.cpp, the result is the exact product of the dequantized weights
// with d * xq up to float32 rounding of the per-block sums:
//
//   y[m, n] = sum_g s[n, g] sum_{b in g} d_b I_b + z[n, g] sum_{b in g} d_b S_b
//   I_b = sum_{k in b} q[n, k] xq[m, k] (int32, exact),  S_b = sum_{k in b} xq[m, k]
//
// Weights (llmctl/serve/layers/lowbit.py's pack_avx2): output columns in blocks of 32 (zero
// rows pad N), each block a stream along k of steps, a step 4 sub-blocks of 8 columns
// (one vector of float32 results each). Lane c (32 bits) of a sub-block holds two 16-bit
// words, p = 0, 1, for column c and inputs k + 2i + p, the pair vpmaddwd adds:
//   int4, 8 k per step, 32 bytes a sub-block: word p of lane c has q[c, k + 2i + p] in
//         bits 4i..4i+3 (i < 4), so (word >> 4i) & 15 widens it: 6 instructions for 64
//         codes, no shuffle; q unsigned 0..15 as stored
//   int8, 2 k per step, 16 bytes a sub-block: byte 2c + p = q[c, k + p], widened by one
//         vpmovsxbw
//   E2M1 (bits = -4, MXFP4), the int4 layout holding j = e ^ 15 for the E2M1 nibble e:
//         vpshufb maps j to u = 2 E2M1(e) + 12 in 0..24 (the low byte; the high byte,
//         index 0, to T[0] = 0: why j and not e, whose T[0] would be 12), so w = s (u -
//         12): the int4 body plus one vpshufb per vector, and the offset z = -12 s made
//         from s, not stored (z is null); s is the E8M0 byte e per group ([block][group]
//         [32] uint8), 2^(e - 128) made here from its bits. u <= 24 keeps I_b below
//         2^25: exact in int32, rounded once to float32 (the int4 codes' I_b < 2^24
//         converts exactly).
// s and z are [block][group][32] float32 (z may be null: no offset). Groups must be
// whole multiples of the 32-input activation block.
//
// Rows: any number, in tiles of up to 4 over each block of codes (a block's later tiles
// read it from L1 again). Tuned for 1-8 (decode), it also beats the alternative for
// prefill, a float32 weight dequantized on the fly and F.linear: 0.54 / 2.3 / 7.2 ms
// against 2.1 / 4.3 / 8.6 ms at 16 / 64 / 256 rows of a 1536 x 576 int4 layer, and the
// dequantization alone was 1.3-1.7 ms (576 x 1536: 6-8 ms); 1 thread, development
// measurement.

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kAvx2 = true;
constexpr int64_t kSub = 8, kSubs = 4, kCols = kSub * kSubs, kBlock = 32;
constexpr float kQmax = 32767.f;
constexpr int kFp4 = -4;  // the bits value of E2M1 codebook codes
constexpr float kFp4Offset = 12.f;  // their codes u = 2 E2M1 + 12 (see the header)
// Software prefetch distance along a thread's stream of codes: one row of a 1536 x 576
// int4 layer streamed from memory (150 such layers cycled, 1 thread, Zen 3 under load,
// development measurement) took 74-105 us without it, 53-76 with 4 KiB or 8 KiB ahead.
constexpr int64_t kPrefetch = 4096;

struct Problem {
  const int16_t* xq;  // [m][k]
  const float* d;  // [m][k / 32] block scales
  const float* zx;  // [m][groups] sum over the group's blocks of d_b S_b
  const uint8_t* w;
  int bits;
  const float* s;
  const float* z;
  int64_t k, group;
  void* out;
  int64_t ldo, n_valid;
  bool out_f32;
};

inline __m256 load8(const void* x, bool f32, int64_t at) {
  return f32 ? _mm256_loadu_ps(static_cast<const float*>(x) + at)
             : load_bf16x8(static_cast<const uint16_t*>(x) + at);
}

// One row's 32-input blocks: xq, d and (per group) sum d S.
void quantize_row(const void* x, bool f32, int64_t k, int64_t group, int16_t* xq, float* d,
                  float* zx) {
  const int64_t per_group = group / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x, f32, b * kBlock + i * kSub);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float top = reduce_max8(amax);
    const __m256 inv = _mm256_set1_ps(top > 0.f ? kQmax / top : 0.f);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest even
      sum = _mm256_add_epi32(sum, q[i]);
    }
    // packs works within 128-bit halves: 0xD8 puts the 64-bit quarters back in order
    for (int i = 0; i < 2; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kBlock + 16 * i),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]), 0xD8));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d[b] = top / kQmax;
    if (b % per_group == 0) zx[b / per_group] = 0.f;
    zx[b / per_group] += d[b] * static_cast<float>(_mm_cvtsi128_si32(s4));
  }
}

inline __m256i bcast2(const int16_t* p) {  // xq[k], xq[k + 1] into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

void store(const Problem& p, int64_t row, int64_t col0, __m256 v) {
  if (col0 >= p.n_valid) return;
  const int64_t n = p.n_valid - col0 < kSub ? p.n_valid - col0 : kSub;
  if (p.out_f32) {
    float* o = static_cast<float*>(p.out) + row * p.ldo + col0;
    if (n == kSub) return _mm256_storeu_ps(o, v);
    alignas(32) float vals[kSub];
    _mm256_store_ps(vals, v);
    std::memcpy(o, vals, static_cast<size_t>(n) * sizeof(float));
  } else {
    uint16_t* o = static_cast<uint16_t*>(p.out) + row * p.ldo + col0;
    const __m128i h = to_bf16x8(v);
    if (n == kSub) return _mm_storeu_si128(reinterpret_cast<__m128i*>(o), h);
    alignas(16) uint16_t vals[kSub];
    _mm_store_si128(reinterpret_cast<__m128i*>(vals), h);
    std::memcpy(o, vals, static_cast<size_t>(n) * sizeof(uint16_t));
  }
}

// 8 groups' scales from s + at: float32, or for E2M1 E8M0 bytes e made into 2^(e - 128)
// by their bits: (e - 1) << 23 for e >= 2, the subnormals 2^-128 and 2^-127 (0x00200000
// << e) for e < 2
template <int BITS>
inline __m256 scales(const Problem& p, int64_t at) {
  if constexpr (BITS != kFp4) {
    return _mm256_loadu_ps(p.s + at);
  } else {
    const __m256i e = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint8_t*>(p.s) + at)));
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(
        _mm256_set1_epi32(2), e)));
  }
}

// MT rows from m0 times NT sub-blocks from j0 of column block b, all of k.
template <int MT, int NT, int BITS>
void tile(const Problem& p, int64_t b, int j0, int64_t m0) {
  constexpr int64_t kPerStep = BITS == 8 ? 2 : 8, kSubBytes = BITS == 8 ? 16 : 32;
  constexpr int64_t steps = kBlock / kPerStep;
  const int64_t groups = p.k / p.group, per_group = p.group / kBlock, nb = p.k / kBlock;
  const uint8_t* wb = p.w + b * (p.k / kPerStep) * kSubs * kSubBytes;  // block b's stream
  const __m256i nib = _mm256_set1_epi16(15);
  // E2M1: j = e ^ 15 -> 2 E2M1(e) + 12 (see the header), in both 128-bit halves
  const __m256i fp4 = _mm256_setr_epi8(0, 4, 6, 8, 9, 10, 11, 12, 24, 20, 18, 16, 15, 14, 13, 12,
                                       0, 4, 6, 8, 9, 10, 11, 12, 24, 20, 18, 16, 15, 14, 13, 12);
  __m256 tot[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) tot[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t kb = g * per_group; kb < (g + 1) * per_group; ++kb) {
      __m256i acc[MT][NT];
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_si256();
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t k0 = kb * kBlock + t * kPerStep;
        const uint8_t* step = wb + (kb * steps + t) * kSubs * kSubBytes;
        for (int64_t line = 0; line < kSubs * kSubBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetch + line, _MM_HINT_T0);
        const uint8_t* src = step + j0 * kSubBytes;
        for (int j = 0; j < NT; ++j) {
          if constexpr (BITS != 8) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j * kSubBytes));
            __m256i w0 = _mm256_and_si256(v, nib);
            __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(v, 8), nib);
            __m256i w3 = _mm256_srli_epi16(v, 12);
            if constexpr (BITS == kFp4) {
              w0 = _mm256_shuffle_epi8(fp4, w0);
              w1 = _mm256_shuffle_epi8(fp4, w1);
              w2 = _mm256_shuffle_epi8(fp4, w2);
              w3 = _mm256_shuffle_epi8(fp4, w3);
            }
            for (int i = 0; i < MT; ++i) {
              const int16_t* x = p.xq + (m0 + i) * p.k + k0;
              const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(w0, bcast2(x)),
                                                 _mm256_madd_epi16(w1, bcast2(x + 2)));
              const __m256i c = _mm256_add_epi32(_mm256_madd_epi16(w2, bcast2(x + 4)),
                                                 _mm256_madd_epi16(w3, bcast2(x + 6)));
              acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_add_epi32(a, c));
            }
          } else {
            const __m256i v = _mm256_cvtepi8_epi16(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * kSubBytes)));
            for (int i = 0; i < MT; ++i)
              acc[i][j] = _mm256_add_epi32(acc[i][j],
                                           _mm256_madd_epi16(v, bcast2(p.xq + (m0 + i) * p.k + k0)));
          }
        }
      }
      for (int j = 0; j < NT; ++j) {
        const __m256 sv = scales<BITS>(p, (b * groups + g) * kCols + (j0 + j) * kSub);
        for (int i = 0; i < MT; ++i) {
          const __m256 d = _mm256_set1_ps(p.d[(m0 + i) * nb + kb]);
          if constexpr (BITS == kFp4) {  // (I d) s: an E8M0 scale's power of two, exact
            // unless the result is itself subnormal (s d would be, for s = 2^-128)
            const __m256 id = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][j]), d);
            tot[i][j] = _mm256_fmadd_ps(id, sv, tot[i][j]);
          } else {
            tot[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), _mm256_mul_ps(sv, d),
                                        tot[i][j]);
          }
        }
      }
    }
    // symmetric int8 has no z: its bytes are not read at all; E2M1's is -12 s, not stored
    if (BITS == kFp4 || p.z != nullptr) {
      for (int j = 0; j < NT; ++j) {
        const int64_t at = (b * groups + g) * kCols + (j0 + j) * kSub;
        const __m256 zv = BITS == kFp4
            ? _mm256_mul_ps(scales<BITS>(p, at), _mm256_set1_ps(-kFp4Offset))
            : _mm256_loadu_ps(p.z + at);
        for (int i = 0; i < MT; ++i)
          tot[i][j] = _mm256_fmadd_ps(zv, _mm256_set1_ps(p.zx[(m0 + i) * groups + g]), tot[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) store(p, m0 + i, b * kCols + (j0 + j) * kSub, tot[i][j]);
}

// Rows m0.. (up to 4) of one column block, as wide a tile as the 16 registers allow
// (2 per row and sub-block: the int32 block sum and the float32 total). Against one or
// two sub-blocks per tile, 2 rows x 4 and 3 rows x 2 took 57-77% of the time (1536 x 576
// int4, 1 thread, development measurement); 4 rows x 2 was slower than 4 rows x 1.
template <int BITS>
void run_rows(const Problem& p, int64_t b, int64_t m0, int64_t rows) {
  switch (rows) {
    case 1: return tile<1, 4, BITS>(p, b, 0, m0);
    case 2: return tile<2, 4, BITS>(p, b, 0, m0);
    case 3: tile<3, 2, BITS>(p, b, 0, m0); return tile<3, 2, BITS>(p, b, 2, m0);
    default:
      for (int j = 0; j < kSubs; ++j) tile<4, 1, BITS>(p, b, j, m0);
  }
}
#else
constexpr bool kAvx2 = false;
#endif

}  // namespace

extern "C" {

// The most rows a decode step sends here (what the kernel is tuned for); lowbit_gemv_avx2
// takes any number, in tiles of 4 rows.
int lowbit_avx2_rows(void) { return kAvx2 ? 8 : 0; }

// y = x w^T for m rows of x [m, ldx] (float32 if x_f32, else bf16); out float32 or bf16
// [m, ldo]; blocks of 32 output columns, of which the first n_valid are stored.
void lowbit_gemv_avx2(const void* x, int64_t ldx, int x_f32, const uint8_t* w, int bits,
                      const float* s, const float* z, int64_t m, int64_t blocks, int64_t k,
                      int64_t group, void* out, int64_t ldo, int64_t n_valid, int out_f32,
                      int num_threads) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t nb = k / kBlock, groups = k / group;
  std::vector<int16_t> xq(static_cast<size_t>(m * k));
  std::vector<float> d(static_cast<size_t>(m * nb)), zx(static_cast<size_t>(m * groups));
  const int64_t item = x_f32 ? 4 : 2;
  for (int64_t i = 0; i < m; ++i)
    quantize_row(static_cast<const char*>(x) + i * ldx * item, x_f32 != 0, k, group,
                 xq.data() + i * k, d.data() + i * nb, zx.data() + i * groups);
  const Problem p{xq.data(), d.data(), zx.data(), w, bits, s, z, k, group, out, ldo, n_valid,
                  out_f32 != 0};
  // column blocks outermost: a thread walks a contiguous run of the codes, each block
  // reused from cache by every row tile
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t m0 = 0; m0 < m; m0 += 4) {
      const int64_t rows = m - m0 < 4 ? m - m0 : 4;
      if (bits == 4) run_rows<4>(p, b, m0, rows);
      else if (bits == kFp4) run_rows<kFp4>(p, b, m0, rows);
      else run_rows<8>(p, b, m0, rows);
    }
  }
#else
  (void)x, (void)ldx, (void)x_f32, (void)w, (void)bits, (void)s, (void)z, (void)m, (void)blocks;
  (void)k, (void)group, (void)out, (void)ldo, (void)n_valid, (void)out_f32, (void)num_threads;
#endif
}

}  // extern "C"
