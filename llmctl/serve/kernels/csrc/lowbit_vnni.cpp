// Low-bit weights times a few rows of activations (batch-1 to batch-8 decode) with
// AVX512-VNNI's byte dot product, the small-batch companion of lowbit_gemm.cpp. At 6-8
// rows it is level with lowbit_gemm.cpp (SmolLM2's int4 layers, development measurement)
// and faster below; it goes to 8 so such steps also run as one call per layer
// (decode_layer.cpp).
//
// Why a second kernel: at one row nothing amortizes lowbit_gemm.cpp's widening of the
// codes to bfloat16 (about 8 vector instructions per 64 int4 weights), and that, not
// memory, bounds it. vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and adds
// each group of 4 products into a 32-bit lane, so the codes are used as bytes as stored
// (int4: one AND and one shift per 128 weights), as llama.cpp does on its q8 blocks.
//
// Activations: each row is cut into blocks of 32 inputs, each block quantized to 15 bits
// with its own scale, d = amax / 16383, xq = round(x / d) in [-16383, 16383], and split
// into bytes xq = 128 h + l (h in [-128, 127], l in [0, 127]) so the byte product needs
// two vpdpbusd. 15 bits per block of 32 is finer than bfloat16's 8-bit mantissa for
// every element within 2^7 of the block's largest, so this stays a 16-bit-activation
// product (llama.cpp rounds activations to 8 bits). The result is the exact dot product
// of the dequantized weights with d * xq, up to float32 rounding of the per-block sums:
//
//   y[m, n] = sum_g s[n, g] sum_{b in g} d_b I_b + z[n, g] sum_{b in g} d_b S_b
//   I_b = sum_{k in b} q[n, k] xq[m, k] (int32, exact),  S_b = sum_{k in b} xq[m, k]
//
// Weights (llmctl/serve/layers/lowbit.py packs them): output columns in blocks of 16 (an even
// number of blocks, zero-padded), each block a stream along k of 64-byte steps, the two
// blocks of a pair interleaved step by step; byte 4c+j of a step holds column c (lane c
// of vpdpbusd):
//   int4, 8 k per step: byte 4c+j = q[c, k+j] | q[c, k+4+j] << 4, q unsigned 0..15
//   int8, 4 k per step: byte 4c+j = q[c, k+j] + 128 (vpdpbusd wants the unsigned operand;
//                       I_b is corrected by 128 S_b in int32, before any rounding)
// s and z are [block][group][16] float32 as they are (z may be null: no offset). Groups must be
// whole multiples of the 32-input activation block.

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
constexpr int64_t kCols = 16, kBlock = 32, kStepBytes = 64, kPair = 2;
// Software prefetch distance along a thread's stream of codes. Without it one row read
// cold codes at 25 GB/s on 2 Zen 4 cores (the out-of-order window, ~10 instructions per
// 64 bytes, keeps too few lines in flight); 1-32 KiB ahead all gave 30-34 GB/s, against
// 35 GB/s for a plain sum over memory.
constexpr int64_t kPrefetch = 4096;
constexpr float kQmax = 16383.f;

struct Problem {
  const int8_t* hi;  // [m][k] high bytes of xq
  const int8_t* lo;  // [m][k] low bytes
  const float* d;  // [m][k / 32] block scales
  const int32_t* corr;  // [m][k / 32] 128 S_b (int8 weights)
  const float* zx;  // [m][groups] sum over the group's blocks of d_b S_b
  const uint8_t* w;
  int bits;
  const float* s;
  const float* z;
  int64_t m, blocks, k, group;
  void* out;
  int64_t ldo, n_valid;
  bool out_f32;
};

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// One row's 32-input blocks: xq's bytes, d, 128 S and (per group) sum d S.
void quantize_row(const uint16_t* x, int64_t k, int64_t group, int8_t* hi, int8_t* lo, float* d,
                  int32_t* corr, float* zx) {
  const int64_t per_group = group / kBlock;
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 x0 = load_bf16(x + b * kBlock), x1 = load_bf16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float inv = amax > 0.f ? kQmax / amax : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));  // nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
    const __m512i low = _mm512_set1_epi32(127);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + b * kBlock), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q0, 7)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + b * kBlock + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q1, 7)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + b * kBlock), _mm512_cvtepi32_epi8(_mm512_and_si512(q0, low)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + b * kBlock + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(q1, low)));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = amax / kQmax;
    corr[b] = 128 * sum;
    if (b % per_group == 0) zx[b / per_group] = 0.f;
    zx[b / per_group] += d[b] * static_cast<float>(sum);
  }
}

// Address of block b's 64-byte step t: blocks come in interleaved pairs (kPair), so
// a pair's steps are one sequential stream, the way the hardware prefetcher and a
// 1-row tile of both blocks read them.
inline const uint8_t* step_at(const Problem& p, int64_t b, int64_t t, int64_t steps_total) {
  return p.w + ((b / kPair) * steps_total * kPair + t * kPair + b % kPair) * kStepBytes;
}

// MT rows times NT column blocks from b0, all of k. With one row the byte halves of an
// int4 step get their own accumulators, so no dot-product chain waits on another.
template <int MT, int NT, int BITS>
void tile(const Problem& p, int64_t b0) {
  constexpr int64_t kPerStep = BITS == 4 ? 8 : 4, steps = kBlock / kPerStep;
  constexpr int kSplit = (BITS == 4 && MT == 1) ? 2 : 1;
  const int64_t groups = p.k / p.group, per_group = p.group / kBlock, nb = p.k / kBlock;
  const int64_t steps_total = p.k / kPerStep;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512 tot[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) tot[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc[MT][NT];
    for (int i = 0; i < MT; ++i)
      for (int j = 0; j < NT; ++j) gacc[i][j] = _mm512_setzero_ps();
    for (int64_t kb = g * per_group; kb < (g + 1) * per_group; ++kb) {
      __m512i ah[MT][NT][kSplit], al[MT][NT][kSplit];
      for (int i = 0; i < MT; ++i)
        for (int j = 0; j < NT; ++j)
          for (int h = 0; h < kSplit; ++h) ah[i][j][h] = al[i][j][h] = _mm512_setzero_si512();
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t k0 = kb * kBlock + t * kPerStep;
        for (int j = 0; j < NT; ++j) {
          const uint8_t* src = step_at(p, b0 + j, kb * steps + t, steps_total);
          _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetch, _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(src);
          if constexpr (BITS == 4) {
            const __m512i first = _mm512_and_si512(v, nib);
            const __m512i second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            for (int i = 0; i < MT; ++i) {
              const int8_t* h = p.hi + i * p.k + k0;
              const int8_t* l = p.lo + i * p.k + k0;
              constexpr int s2 = kSplit - 1;
              ah[i][j][0] = _mm512_dpbusd_epi32(ah[i][j][0], first, bcast4(h));
              al[i][j][0] = _mm512_dpbusd_epi32(al[i][j][0], first, bcast4(l));
              ah[i][j][s2] = _mm512_dpbusd_epi32(ah[i][j][s2], second, bcast4(h + 4));
              al[i][j][s2] = _mm512_dpbusd_epi32(al[i][j][s2], second, bcast4(l + 4));
            }
          } else {
            for (int i = 0; i < MT; ++i) {
              ah[i][j][0] = _mm512_dpbusd_epi32(ah[i][j][0], v, bcast4(p.hi + i * p.k + k0));
              al[i][j][0] = _mm512_dpbusd_epi32(al[i][j][0], v, bcast4(p.lo + i * p.k + k0));
            }
          }
        }
      }
      for (int i = 0; i < MT; ++i) {
        const __m512 dv = _mm512_set1_ps(p.d[i * nb + kb]);
        const __m512i cv = _mm512_set1_epi32(p.corr[i * nb + kb]);
        for (int j = 0; j < NT; ++j) {
          __m512i hi = ah[i][j][0], lo = al[i][j][0];
          if constexpr (kSplit == 2) {
            hi = _mm512_add_epi32(hi, ah[i][j][1]);
            lo = _mm512_add_epi32(lo, al[i][j][1]);
          }
          __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo);
          if constexpr (BITS == 8) dot = _mm512_sub_epi32(dot, cv);
          gacc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dv, gacc[i][j]);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const int64_t at = ((b0 + j) * groups + g) * kCols;
      const __m512 sv = _mm512_loadu_ps(p.s + at);
      for (int i = 0; i < MT; ++i) tot[i][j] = _mm512_fmadd_ps(sv, gacc[i][j], tot[i][j]);
      if (p.z != nullptr) {  // symmetric int8 has none: its bytes are not read at all
        const __m512 zv = _mm512_loadu_ps(p.z + at);
        for (int i = 0; i < MT; ++i)
          tot[i][j] = _mm512_fmadd_ps(zv, _mm512_set1_ps(p.zx[i * groups + g]), tot[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) {
      const int64_t col0 = (b0 + j) * kCols;
      if (col0 >= p.n_valid) continue;
      const int64_t n = p.n_valid - col0 < kCols ? p.n_valid - col0 : kCols;
      const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1u);
      if (p.out_f32)
        _mm512_mask_storeu_ps(static_cast<float*>(p.out) + i * p.ldo + col0, keep, tot[i][j]);
      else
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + i * p.ldo + col0, keep, to_bf16(tot[i][j]));
    }
}

// One interleaved pair of blocks: both at once for up to two rows, one after the other
// beyond (the accumulators, 2 per row and block, must fit the 32 vector registers).
template <int BITS>
void run_pair(const Problem& p, int64_t b0) {
  switch (p.m) {
    case 1: return tile<1, 2, BITS>(p, b0);
    case 2: return tile<2, 2, BITS>(p, b0);
    case 3: tile<3, 1, BITS>(p, b0); return tile<3, 1, BITS>(p, b0 + 1);
    default: tile<4, 1, BITS>(p, b0); return tile<4, 1, BITS>(p, b0 + 1);
  }
}
#else
constexpr bool kVnni = false;
#endif

}  // namespace

extern "C" {

// The most rows lowbit_gemv_vnni takes: a tile's rows (up to 4) share each 64-byte load;
// rows 5-8 are a second pass over the same pair of blocks, from L1/L2.
int lowbit_vnni_rows(void) { return kVnni ? 8 : 0; }

// y = x w^T for m <= 8 rows of bf16 x [m, ldx]; out float32 or bf16 [m, ldo].
void lowbit_gemv_vnni(const uint16_t* x, int64_t ldx, const uint8_t* w, int bits, const float* s,
                      const float* z, int64_t m, int64_t blocks, int64_t k, int64_t group,
                      void* out, int64_t ldo, int64_t n_valid, int out_f32, int num_threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int64_t nb = k / kBlock, groups = k / group;
  std::vector<int8_t> bytes(static_cast<size_t>(2 * m * k));
  std::vector<float> d(static_cast<size_t>(m * nb)), zx(static_cast<size_t>(m * groups));
  std::vector<int32_t> corr(static_cast<size_t>(m * nb));
  for (int64_t i = 0; i < m; ++i)
    quantize_row(x + i * ldx, k, group, bytes.data() + i * k, bytes.data() + (m + i) * k,
                 d.data() + i * nb, corr.data() + i * nb, zx.data() + i * groups);
  const int64_t first = m < 4 ? m : 4;
  const Problem p{bytes.data(), bytes.data() + m * k, d.data(), corr.data(), zx.data(), w, bits,
                  s, z, first, blocks, k, group, out, ldo, n_valid, out_f32 != 0};
  // rows 4.. as a Problem of their own (m - 4 of them; none when m <= 4)
  const Problem rest{p.hi + 4 * k, p.lo + 4 * k, p.d + 4 * nb, p.corr + 4 * nb, p.zx + 4 * groups,
                     w, bits, s, z, m - first, blocks, k, group,
                     static_cast<char*>(out) + 4 * ldo * (out_f32 ? 4 : 2), ldo, n_valid,
                     out_f32 != 0};
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t u = 0; u < blocks / kPair; ++u) {
    for (const Problem* q : {&p, &rest}) {
      if (q->m == 0) continue;
      if (bits == 4) run_pair<4>(*q, u * kPair);
      else run_pair<8>(*q, u * kPair);
    }
  }
#else
  (void)x, (void)ldx, (void)w, (void)bits, (void)s, (void)z, (void)m, (void)blocks, (void)k;
  (void)group, (void)out, (void)ldo, (void)n_valid, (void)out_f32, (void)num_threads;
#endif
}

}  // extern "C"
