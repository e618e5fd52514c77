// Causal self-attention of fresh sequences (whole prompts, or first chunks with nothing
// cached before), bfloat16, AVX512-BF16: the "fresh" groups of llmctl/serve/layers/attention.py.
//
// torch's SDPA flash kernel for CPU ran these at ~40 GFLOP/s (16 sequences of 128 tokens,
// SmolLM2's 9 heads of 64 over 3 KV heads: 7.7 ms per layer, development measurement),
// and llmctl's paged kernel spends as much on horizontal sums (one query row against one
// key row at a time) as on products. Here both products are small GEMMs on vdpbf16ps
// with no horizontal sum:
//
//   work item = (sequence, KV head); its keys and values are packed once, in pairs:
//     kp[t][j] = (k[j][2t], k[j][2t+1])      t < d/2, j < L (keys in lanes)
//     vp[j][c] = (v[2j][c], v[2j+1][c])      j < L/2, c < d (columns in lanes)
//   each query row (the g query heads of the KV head, every position) then runs
//     scores of 16 keys = sum over t of vdpbf16ps(q pair t broadcast, kp[t][16 keys])
//     acc[16 columns]  += vdpbf16ps(p pair j broadcast, vp[j][16 columns])
//   with the softmax between them on the row's scores (max, exp, sum in float32; the
//   probabilities rounded to bfloat16 pairs for the second product, as FlashAttention
//   and llmctl's paged kernel do). Query position i sees keys j <= i, and with a sliding
//   window W > 0 only j >= i - W + 1 (transformers' kv_idx > q_idx - W). With logit
//   soft-capping (Gemma 2, softcap > 0) each scaled score s becomes cap * tanh(s / cap)
//   before the mask and the softmax (transformers' eager attention), float32 std::tanh.
//   With attention sinks (gpt-oss, one float32 logit per query head) the softmax runs
//   over [scores, sink] with the sink's column dropped: the sink enters the row's max m
//   and exp(sink - m) its sum, so out = sum_j p_j v_j / (sum_j p_j + exp(sink - m)) as
//   in paged_attention.cpp (a sink must be finite or -inf).
//
// Work items: (sequence, KV head, block of 128 query positions), scheduled dynamically
// over the threads, the blocks with the most keys first (48 items for 16 sequences of 128
// tokens of SmolLM2; 48 for one of 2048). Each packs the keys and values its queries see:
// from the first query's first key (rounded down to a 16-key tile) to its last query.
// Output bf16 [T, out_stride], heads side by side.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd_math.h"

using namespace llmctl_simd;

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kSimd = true;

inline uint32_t pair_of(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

struct Call {
  const uint16_t* q;
  int64_t q_stride;
  const uint16_t* k;
  const uint16_t* v;
  int64_t kv_stride;
  int64_t num_seqs, len, heads, kv_heads;
  float scale;
  uint16_t* out;
  int64_t out_stride;
  int64_t window;  // 0: none
  float softcap;   // 0: none
  const float* sinks;  // [heads], null: none
};

constexpr int64_t kQueryBlock = 128;  // query positions per work item

// Query positions [i0, i1) of one (sequence, KV head); D16 = head_dim / 16. The keys it
// sees are kb .. i1 - 1 (kb: i0's first key, down to a tile): only those are packed, key
// j at packed index j - kb.
template <int D16>
void item(const Call& c, int64_t seq, int64_t kvh, int64_t i0, int64_t i1,
          std::vector<uint32_t>& kp, std::vector<uint32_t>& vp, std::vector<float>& scores,
          std::vector<uint32_t>& probs) {
  constexpr int64_t d = 16 * D16;
  auto first_key = [&](int64_t i) {
    return c.window > 0 ? std::max<int64_t>(0, i - c.window + 1) : int64_t{0};
  };
  const int64_t kb = first_key(i0) / 16 * 16;
  const int64_t len = i1 - kb, padded = (len + 15) / 16 * 16, g = c.heads / c.kv_heads;
  const int64_t t0 = seq * c.len + kb;  // token row of packed key 0
  // pack K (keys in lanes) and V (pairs of keys), zero past the end
  kp.assign(static_cast<size_t>(d / 2 * padded), 0u);
  vp.assign(static_cast<size_t>(padded / 2 * d), 0u);
  for (int64_t j = 0; j < len; ++j) {
    const uint16_t* kr = c.k + (t0 + j) * c.kv_stride + kvh * d;
    for (int64_t t = 0; t < d / 2; ++t) kp[t * padded + j] = pair_of(kr[2 * t], kr[2 * t + 1]);
  }
  for (int64_t j = 0; j < len; j += 2) {
    const uint16_t* va = c.v + (t0 + j) * c.kv_stride + kvh * d;
    const uint16_t* vb = j + 1 < len ? va + c.kv_stride : nullptr;
    uint32_t* dst = vp.data() + (j / 2) * d;
    for (int64_t col = 0; col < d; ++col) dst[col] = pair_of(va[col], vb ? vb[col] : 0);
  }
  scores.resize(static_cast<size_t>(padded));
  probs.resize(static_cast<size_t>(padded / 2));
  const __m512 scale = _mm512_set1_ps(c.scale);
  for (int64_t hh = 0; hh < g; ++hh) {
    const int64_t head = kvh * g + hh;
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t* qr = c.q + (seq * c.len + i) * c.q_stride + head * d;
      // packed keys first - kb .. i - kb, in tiles tf .. last
      const int64_t first = first_key(i) - kb, tf = first / 16, tiles = (i - kb) / 16 + 1;
      // scores, four tiles at a time (independent dot-product chains)
      for (int64_t tile = tf; tile < tiles; tile += 4) {
        const int64_t nt = std::min<int64_t>(4, tiles - tile);
        __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
        for (int64_t t = 0; t < d / 2; ++t) {
          int32_t qv;
          std::memcpy(&qv, qr + 2 * t, sizeof(qv));
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(qv);
          const uint32_t* row = kp.data() + t * padded + tile * 16;
          for (int64_t u = 0; u < nt; ++u)
            s[u] = _mm512_dpbf16_ps(s[u], qb, (__m512bh)_mm512_loadu_si512(row + 16 * u));
        }
        for (int64_t u = 0; u < nt; ++u)
          _mm512_storeu_ps(scores.data() + (tile + u) * 16, _mm512_mul_ps(s[u], scale));
      }
      if (c.softcap > 0.f)  // before the mask below, so masked keys stay -inf
        for (int64_t j = tf * 16; j < tiles * 16; ++j)
          scores[j] = std::tanh(scores[j] / c.softcap) * c.softcap;
      // keys past i (the last tile) and before the window (tile tf): -inf
      const int64_t last = tiles - 1, valid = i - kb - last * 16 + 1;
      auto live = [&](int64_t tile) {
        uint32_t bits = 0xFFFFu;
        if (tile == last) bits &= (1u << valid) - 1u;
        if (tile == tf) bits &= ~((1u << (first - tf * 16)) - 1u);
        return static_cast<__mmask16>(bits);
      };
      for (int64_t tile : {tf, last}) {
        float* sl = scores.data() + tile * 16;
        _mm512_storeu_ps(sl, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live(tile),
                                                _mm512_loadu_ps(sl)));
      }
      __m512 mv = _mm512_set1_ps(-INFINITY);
      for (int64_t tile = tf; tile < tiles; ++tile)
        mv = _mm512_max_ps(mv, _mm512_loadu_ps(scores.data() + tile * 16));
      // a sink enters the row's max, and its exp(sink - m) the sum below
      const float top = _mm512_reduce_max_ps(mv);
      const float mr = c.sinks ? std::max(top, c.sinks[head]) : top;
      const __m512 m = _mm512_set1_ps(mr);
      __m512 lv = _mm512_setzero_ps();
      for (int64_t tile = tf; tile < tiles; ++tile) {
        __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores.data() + tile * 16), m));
        // exact zeros past i and before the window
        if (tile == last || tile == tf) p = _mm512_maskz_mov_ps(live(tile), p);
        lv = _mm512_add_ps(lv, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs.data() + tile * 8),
                            (__m256i)_mm512_cvtneps_pbh(p));
      }
      const float l = _mm512_reduce_add_ps(lv) + (c.sinks ? std::exp(c.sinks[head] - mr) : 0.f);
      // P.V over pairs of keys (a zero probability pads an odd end)
      __m512 acc[D16];
      for (int u = 0; u < D16; ++u) acc[u] = _mm512_setzero_ps();
      const int64_t pairs = (i - kb + 2) / 2;
      for (int64_t j = tf * 8; j < pairs; ++j) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[j]));
        const uint32_t* vr = vp.data() + j * d;
        for (int u = 0; u < D16; ++u)
          acc[u] = _mm512_dpbf16_ps(acc[u], pb, (__m512bh)_mm512_loadu_si512(vr + 16 * u));
      }
      const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
      uint16_t* dst = c.out + (seq * c.len + i) * c.out_stride + head * d;
      for (int u = 0; u < D16; ++u)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * u),
                            to_bf16(_mm512_mul_ps(acc[u], inv)));
    }
  }
}

template <int D16>
void run(const Call& c, int num_threads) {
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<uint32_t> kp, vp, probs;
    std::vector<float> scores;
    // (sequence, KV head, block of query positions), the last blocks (most keys) first
    const int64_t blocks = (c.len + kQueryBlock - 1) / kQueryBlock;
    const int64_t pairs = c.num_seqs * c.kv_heads;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < pairs * blocks; ++it) {
      const int64_t block = blocks - 1 - it / pairs, pair = it % pairs;
      const int64_t i0 = block * kQueryBlock, i1 = std::min(c.len, i0 + kQueryBlock);
      item<D16>(c, pair / c.kv_heads, pair % c.kv_heads, i0, i1, kp, vp, scores, probs);
    }
  }
}
#else
constexpr bool kSimd = false;
#endif

}  // namespace

extern "C" {

// 1 when this build has the kernel (AVX512-BF16), else 0.
int prefill_attention_available(void) { return kSimd ? 1 : 0; }

// q [num_seqs * len, q_stride], k/v [num_seqs * len, kv_stride] (heads side by side,
// head_dim each), out [num_seqs * len, out_stride] bf16, window 0 (causal) or a sliding
// window, softcap 0 (none) or the logit soft-cap, sinks null (none) or one float32 logit
// per query head. head_dim 64 or 128; returns 0 when it ran, -1 when this shape is not
// supported (the caller takes its other path).
int prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                           const uint16_t* v, int64_t kv_stride, int64_t num_seqs, int64_t len,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                           uint16_t* out, int64_t out_stride, int num_threads, int64_t window,
                           float softcap, const float* sinks) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (kv_heads <= 0 || heads % kv_heads != 0 || len <= 0 || window < 0) return -1;
  const Call c{q, q_stride, k, v, kv_stride, num_seqs, len, heads, kv_heads, scale, out,
               out_stride, window, softcap, sinks};
  if (head_dim == 64) { run<4>(c, num_threads); return 0; }
  if (head_dim == 128) { run<8>(c, num_threads); return 0; }
  return -1;
#else
  (void)q, (void)q_stride, (void)k, (void)v, (void)kv_stride, (void)num_seqs, (void)len;
  (void)heads, (void)kv_heads, (void)head_dim, (void)scale, (void)out, (void)out_stride;
  (void)num_threads, (void)window, (void)softcap, (void)sinks;
  return -1;
#endif
}

}  // extern "C"
