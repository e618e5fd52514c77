// Paged attention on CPU: queries against K/V read in place through block tables.
//
// The pure-torch path gathers every sequence's blocks into a padded [B, S] tensor and
// then runs SDPA on it: each cached K/V byte is read, written and read again, plus the
// padding. Here each (sequence, KV head) pair is one work item that walks its block
// table once with an online softmax (Milakov & Gimelshein 2018), so the cache is read
// exactly once per step. The g = heads / kv_heads query heads of a KV head, times q_len
// query positions, share every K/V row loaded: GQA costs no extra memory traffic.
//
// Causality: query i (of q_len) of a sequence with ctx tokens sits at position
// ctx - q_len + i and sees keys j <= ctx - q_len + i; with a sliding window W > 0 also
// only j >= ctx - q_len + i - W + 1 (transformers' kv_idx > q_idx - W). A work item's
// walk starts at its first query's first key (rounded down to a 16-key tile, which stays
// inside that key's block), so blocks before every window are never read: the engine
// drops them from the block tables.
//
// Five implementations, picked by dispatch(): AVX512-BF16 for bf16 queries on a bf16,
// int8 or fp8 cache (both products on vdpbf16ps, two passes), AVX-512 float32 math for float32
// or bf16 without that extension (online softmax over 16-key tiles), the same on 8-lane
// AVX2 + FMA vectors for CPUs without AVX-512 and on 4-lane NEON vectors for AArch64, and
// a portable loop for other head sizes, block sizes and CPUs. All see a call through Call
// and a work item through Item (where its query, output and K/V rows are); the four
// online-softmax ones share OnlineRows (queries in float32, running max and sum,
// accumulators).
//
// int8 cache (llmctl/serve/layers/kv_quant.py): codes c with one float32 scale s per (slot, KV
// head) for K and for V, x = c * s. Read in place, never dequantized into a copy: the
// float32 kernels widen each row as they load it (c * s, kv_quant.dequantize_int8's
// product); the bf16 kernel feeds the codes to vdpbf16ps as bf16 (exact: |c| <= 127 has
// 7 significant bits) and applies the scales outside the products: a score is
// s_k * (q . c_k), and a value row enters the second product with its probability
// times s_v (the probabilities are rounded to bf16 there anyway).
//
// Soft-capping (Gemma 2, softcap > 0): each scaled score s becomes cap * tanh(s / cap)
// before the mask and the softmax, as transformers' eager attention computes it
// (w = q k^T * scaling; w = w / cap; w = tanh(w); w = w * cap). Every body caps the
// scores of a tile right after computing them, in float32 with std::tanh; softcap 0
// leaves each body's arithmetic as it was.
//
// Attention sinks (gpt-oss, sinks: one float32 logit per query head, null: none): the
// softmax runs over [scores, sink] and the sink's column is dropped (transformers'
// eager GptOssAttention), so with m = max(max_j s_j, sink)
//   out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)).
// The sink is a key with a zero value row: the online-softmax bodies start each row's
// walk as if it had seen it (m = sink, l = exp(sink - m) = 1, acc = 0) and go on as
// before; the two-pass AVX512-BF16 body takes it into the row's max and adds its term to
// the row's sum. A row that sees no key then gets 0 / 1 = 0, and one whose sink dwarfs
// its scores attends to (almost) nothing. A sink must be finite or -inf (+inf would make
// exp(m - m) NaN). Without sinks every body's arithmetic is what it was.
//
// fp8 cache: E4M3 codes (fp8.h) with static scales, one per (layer, K or V, KV head),
// x = e4m3(c) * s. The same arithmetic as int8 with the code widened from E4M3 (exact
// in float32 and in bf16) and the scale of the item's KV head for every position.
//
// Built by llmctl/serve/kernels/cpu.py with -O3 -march=native -fopenmp and loaded with
// ctypes (a C ABI, no torch headers: it compiles in a few seconds).

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "fp8.h"
#include "simd_math.h"

namespace {

using namespace llmctl_simd;
using llmctl_fp8::e4m3;

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

inline float load(const e4m3* p, int64_t i) { return llmctl_fp8::e4m3_to_float(p[i].bits); }

// cap * tanh(s / cap): Gemma 2's logit soft-capping, in transformers' order of operations
inline float capped(float s, float cap) { return std::tanh(s / cap) * cap; }

// the n scores at s capped (cap > 0), in place
inline void cap_scores(float* s, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) s[i] = capped(s[i], cap);
}

// n values as float32 times scale (1 for a float cache: exact)
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n, float scale) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src, i) * scale;
}

// One call: q [num_seqs * q_len, num_heads, head_dim] with q_stride elements between
// tokens; k_cache, v_cache [blocks, block_size, num_kv_heads, head_dim] and, for an int8
// cache, k_scale, v_scale [blocks, block_size, num_kv_heads] (an fp8 cache:
// [num_kv_heads]; null otherwise);
// block_tables [num_seqs, max_blocks]; out float32 [num_seqs * q_len, num_heads, head_dim].
template <typename Q, typename KV>
struct Call {
  const Q* q;
  const KV* k_cache;
  const KV* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int64_t* block_tables;
  int64_t max_blocks;
  const int64_t* context_lens;
  int64_t num_seqs, q_len, q_stride, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  float* out;
  int num_threads;
  int64_t window;  // sliding window, 0: none
  float softcap;   // logit soft-capping, 0: none
  const float* sinks;  // attention sinks [num_heads], null: none

  int64_t group() const { return num_heads / num_kv_heads; }  // query heads per KV head
  int64_t rows() const { return group() * q_len; }              // rows of one work item
  int64_t items() const { return num_seqs * num_kv_heads; }
};

// Work item `index`: sequence seq, KV head kvh. Its row r = i * g + j is query position
// i of head kvh * g + j, which sees keys 0 .. ctx - q_len + i.
template <typename Q, typename KV>
struct Item {
  const Call<Q, KV>& c;
  int64_t seq, kvh, ctx, g;
  const int64_t* table;

  Item(const Call<Q, KV>& call, int64_t index)
      : c(call), seq(index / call.num_kv_heads), kvh(index % call.num_kv_heads),
        ctx(call.context_lens[seq]), g(call.group()), table(call.block_tables + seq * call.max_blocks) {}

  int64_t last_key(int64_t r) const { return ctx - c.q_len + r / g; }
  int64_t first_key(int64_t r) const {
    return c.window > 0 ? std::max<int64_t>(0, last_key(r) - c.window + 1) : 0;
  }
  int64_t first_tile() const { return first_key(0) / 16 * 16; }  // row 0 sees the least
  const Q* q_row(int64_t r) const {
    return c.q + (seq * c.q_len + r / g) * c.q_stride + (kvh * g + r % g) * c.head_dim;
  }
  float* out_row(int64_t r) const {
    return c.out + ((seq * c.q_len + r / g) * c.num_heads + kvh * g + r % g) * c.head_dim;
  }
  float sink(int64_t r) const { return c.sinks[kvh * g + r % g]; }  // of row r's head
  // fp8: one scale per KV head for every position, not one per slot
  static constexpr bool static_scales = std::is_same<KV, e4m3>::value;
  // (slot, KV head) index of key / value `pos` of this KV head
  int64_t slot_head(int64_t pos) const {
    const int64_t block = table[pos / c.block_size];
    return (block * c.block_size + pos % c.block_size) * c.num_kv_heads + kvh;
  }
  // where key / value `pos` of this KV head starts in k_cache / v_cache
  int64_t kv_offset(int64_t pos) const { return slot_head(pos) * c.head_dim; }
  // where the scales of key / value `pos` of this KV head are in k_scale / v_scale
  int64_t scale_offset(int64_t pos) const { return static_scales ? kvh : slot_head(pos); }
  float k_scale(int64_t pos) const { return c.k_scale ? c.k_scale[scale_offset(pos)] : 1.f; }
  float v_scale(int64_t pos) const { return c.v_scale ? c.v_scale[scale_offset(pos)] : 1.f; }
};

// Per-thread state of the online softmax over one work item's rows: the queries scaled
// to float32, accumulators, running max m and sum l, and the first and last key each
// row sees.
struct OnlineRows {
  int64_t rows, d;
  std::vector<float> qf, acc, m, l;
  std::vector<int64_t> first, limit;

  OnlineRows(int64_t rows, int64_t d)
      : rows(rows), d(d), qf(rows * d), acc(rows * d), m(rows), l(rows), first(rows),
        limit(rows) {}

  template <typename Q, typename KV>
  void start(const Item<Q, KV>& it, float scale) {
    for (int64_t r = 0; r < rows; ++r) {
      const Q* src = it.q_row(r);
      float* dst = qf.data() + r * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) dst[x] = load(src, x) * scale;
      limit[r] = it.last_key(r);
      first[r] = it.first_key(r);
      // a sink is a key already seen with a zero value: m = sink, l = exp(sink - m) = 1
      m[r] = it.c.sinks ? it.sink(r) : -INFINITY;
      l[r] = it.c.sinks ? 1.f : 0.f;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
  }

  // out = acc / l; a row that saw no key gets zeros
  template <typename Q, typename KV>
  void finish(const Item<Q, KV>& it) const {
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = it.out_row(r);
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      const float* ar = acc.data() + r * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) dst[x] = ar[x] * inv;
    }
  }
};

template <typename Q, typename KV>
void attend(const Call<Q, KV>& c) {
  const int64_t d = c.head_dim;
#pragma omp parallel num_threads(c.num_threads)
  {
    OnlineRows st(c.rows(), d);
    std::vector<float> kf(d), vf(d);  // one K and one V row in float32

#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < c.items(); ++index) {
      const Item<Q, KV> it(c, index);
      st.start(it, c.scale);
      for (int64_t pos = it.first_key(0); pos < it.ctx; ++pos) {
        const int64_t off = it.kv_offset(pos);
        to_float(c.k_cache + off, kf.data(), d, it.k_scale(pos));
        to_float(c.v_cache + off, vf.data(), d, it.v_scale(pos));
        for (int64_t r = 0; r < st.rows; ++r) {
          if (pos > st.limit[r] || pos < st.first[r]) continue;
          const float* qr = st.qf.data() + r * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < d; ++x) dot += qr[x] * kf[x];
          if (c.softcap > 0.f) dot = capped(dot, c.softcap);
          float* ar = st.acc.data() + r * d;
          if (dot > st.m[r]) {
            // new running max: rescale what was accumulated under the old one
            const float rescale = std::exp(st.m[r] - dot);
            st.l[r] = st.l[r] * rescale + 1.f;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) ar[x] = ar[x] * rescale + vf[x];
            st.m[r] = dot;
          } else {
            const float p = std::exp(dot - st.m[r]);
            st.l[r] += p;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) ar[x] += p * vf[x];
          }
        }
      }
      st.finish(it);
    }
  }
}

#if defined(__AVX2__)  // AVX-512 implies it

// The 16 rows of a tile (row_elems each, stride apart) into L1. A work item reads one KV
// head's rows (every num_kv_heads-th row) of blocks scattered over the cache, which the
// hardware prefetcher does not follow: asking for the next tile while computing this
// one took a 128-sequence bf16 decode from 8.5-9.0 to 6.7-7.8 ms here.
template <typename T>
inline void prefetch_rows(const T* first, int64_t stride, int64_t row_elems) {
  const int64_t row_bytes = row_elems * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < 16; ++t) {
    const char* row = reinterpret_cast<const char*>(first + t * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

#endif  // __AVX2__

#if defined(__AVX512F__)

// One K/V row of d = 16 * D4 elements as D4 float32 vectors (int8 or fp8 codes times
// the row's scale; a float row has none).
template <int D4>
inline void load_row(const float* p, __m512* out, float) {
  for (int j = 0; j < D4; ++j) out[j] = _mm512_loadu_ps(p + 16 * j);
}

template <int D4>
inline void load_row(const uint16_t* p, __m512* out, float) {
  for (int j = 0; j < D4; ++j) out[j] = load_bf16(p + 16 * j);
}

template <int D4>
inline void load_row(const int8_t* p, __m512* out, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int j = 0; j < D4; ++j) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j));
    out[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), s);
  }
}

template <int D4>
inline void load_row(const e4m3* p, __m512* out, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int j = 0; j < D4; ++j)
    out[j] = _mm512_mul_ps(llmctl_fp8::e4m3x16_to_ps(&p[16 * j].bits), s);
}

// Blocks of up to 16 keys: the 16 scores of a row are one vector, so the softmax
// (max, exp, sum) is vectorised over keys; Q and the accumulators stay in float32.
// 16-key tiles never straddle a block: dispatch() sends only block sizes that are a
// multiple of 16 here.
template <int D4, typename Q, typename KV>
void attend_avx512(const Call<Q, KV>& c) {
  constexpr int64_t d = 16 * D4;
  const int64_t stride = c.num_kv_heads * d;  // between the K/V rows of one KV head

#pragma omp parallel num_threads(c.num_threads)
  {
    OnlineRows st(c.rows(), d);
    std::vector<float> probs(st.rows * 16), scores(st.rows * 16);

#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < c.items(); ++index) {
      const Item<Q, KV> it(c, index);
      st.start(it, c.scale);
      for (int64_t start = it.first_tile(); start < it.ctx; start += 16) {
        const int64_t nk = it.ctx - start < 16 ? it.ctx - start : 16;
        const int64_t base = it.kv_offset(start);
        if (start + 16 < it.ctx) {
          const int64_t next = it.kv_offset(start + 16);
          prefetch_rows(c.k_cache + next, stride, d);
          prefetch_rows(c.v_cache + next, stride, d);
        }
        // scores: each K row loaded once and dotted with every row's query
        for (int64_t t = 0; t < nk; ++t) {
          __m512 kv[D4];
          load_row<D4>(c.k_cache + base + t * stride, kv, it.k_scale(start + t));
          for (int64_t r = 0; r < st.rows; ++r) {
            const float* qr = st.qf.data() + r * d;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qr), kv[0]);
            for (int j = 1; j < D4; ++j) s = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * j), kv[j], s);
            scores[r * 16 + t] = _mm512_reduce_add_ps(s);
          }
        }
        if (c.softcap > 0.f)
          for (int64_t r = 0; r < st.rows; ++r) cap_scores(scores.data() + r * 16, nk, c.softcap);
        for (int64_t r = 0; r < st.rows; ++r) {
          if (st.limit[r] < start || st.first[r] >= start + nk) {
            // no visible key in this tile: no weight for any of its values
            _mm512_storeu_ps(probs.data() + r * 16, _mm512_setzero_ps());
            continue;
          }
          const int64_t visible = st.limit[r] - start + 1;  // keys t < visible are seen
          const int64_t valid = visible < nk ? visible : nk;
          // keys t < skip are before the row's window
          const int64_t skip = st.first[r] > start ? st.first[r] - start : 0;
          const __mmask16 live =
              static_cast<__mmask16>(((1u << valid) - 1u) & ~((1u << skip) - 1u));
          const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, scores.data() + r * 16);
          const float bm = _mm512_reduce_max_ps(s);
          const float nm = bm > st.m[r] ? bm : st.m[r];
          const float rescale = std::exp(st.m[r] - nm);  // 0 first, without a sink (m = -inf)
          const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(nm))));
          st.l[r] = st.l[r] * rescale + _mm512_reduce_add_ps(p);
          st.m[r] = nm;
          _mm512_storeu_ps(probs.data() + r * 16, p);
          float* ar = st.acc.data() + r * d;
          const __m512 cv = _mm512_set1_ps(rescale);
          for (int j = 0; j < D4; ++j)
            _mm512_storeu_ps(ar + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(ar + 16 * j), cv));
        }
        // values: each V row loaded once, added into every row that sees it
        for (int64_t t = 0; t < nk; ++t) {
          __m512 vv[D4];
          load_row<D4>(c.v_cache + base + t * stride, vv, it.v_scale(start + t));
          for (int64_t r = 0; r < st.rows; ++r) {
            const float pr = probs[r * 16 + t];
            if (!(pr > 0.f)) continue;  // masked, underflowed, or a skipped row
            const __m512 pv = _mm512_set1_ps(pr);
            float* ar = st.acc.data() + r * d;
            for (int j = 0; j < D4; ++j)
              _mm512_storeu_ps(ar + 16 * j,
                               _mm512_fmadd_ps(pv, vv[j], _mm512_loadu_ps(ar + 16 * j)));
          }
        }
      }
      st.finish(it);
    }
  }
}
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// One K/V row of d = 8 * D8 elements widened into dst as float32 (int8 or fp8 codes times
// the row's scale, as load_row does; a bf16 row has none).
template <int D8>
inline void widen_row(const uint16_t* p, float* dst, float) {
  for (int j = 0; j < D8; ++j) _mm256_storeu_ps(dst + 8 * j, load_bf16x8(p + 8 * j));
}

template <int D8>
inline void widen_row(const int8_t* p, float* dst, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int j = 0; j < D8; ++j) {
    const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j));
    _mm256_storeu_ps(dst + 8 * j,
                     _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), s));
  }
}

template <int D8>
inline void widen_row(const e4m3* p, float* dst, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int j = 0; j < D8; ++j)
    _mm256_storeu_ps(dst + 8 * j, _mm256_mul_ps(llmctl_fp8::e4m3x8_to_ps(&p[8 * j].bits), s));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
// The same on 4-lane NEON vectors (code times scale: one rounding, the same product)
template <int D8>
inline void widen_row(const uint16_t* p, float* dst, float) {
  for (int j = 0; j < D8; ++j) {
    const uint16x8_t v = vld1q_u16(p + 8 * j);
    vst1q_f32(dst + 8 * j, widen_bf16_lo(v));
    vst1q_f32(dst + 8 * j + 4, widen_bf16_hi(v));
  }
}

template <int D8>
inline void widen_row(const int8_t* p, float* dst, float scale) {
  for (int j = 0; j < D8; ++j) {
    const int16x8_t w = vmovl_s8(vld1_s8(p + 8 * j));
    vst1q_f32(dst + 8 * j, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), scale));
    vst1q_f32(dst + 8 * j + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(w)), scale));
  }
}

template <int D8>
inline void widen_row(const e4m3* p, float* dst, float scale) {
  for (int j = 0; j < D8; ++j) {
    const float32x4x2_t f = llmctl_fp8::e4m3x8_to_f32(&p[8 * j].bits);
    vst1q_f32(dst + 8 * j, vmulq_n_f32(f.val[0], scale));
    vst1q_f32(dst + 8 * j + 4, vmulq_n_f32(f.val[1], scale));
  }
}
#endif

#if (defined(__AVX2__) && defined(__FMA__)) || (defined(__aarch64__) && defined(__ARM_NEON))
// The first n K or V rows of a tile (stride apart in the cache) as float32 rows, with
// the distance between them in ld: a float cache is read in place, any other is widened
// into buf (16 rows of 8 * D8), each row once, however many query rows then read it.
template <int D8, typename KV, typename ScaleOf>
inline const float* tile_rows(const KV* first, int64_t stride, int64_t n, ScaleOf scale_of,
                              float* buf, int64_t& ld) {
  if constexpr (std::is_same<KV, float>::value) {
    (void)n, (void)scale_of, (void)buf;
    ld = stride;
    return first;
  } else {
    for (int64_t t = 0; t < n; ++t)
      widen_row<D8>(first + t * stride, buf + t * 8 * D8, scale_of(t));
    ld = 8 * D8;
    return buf;
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// attend_avx512 on 8-lane vectors for AVX2 + FMA CPUs: the same 16-key tiles, masks and
// online softmax, with the 16 scores of a row in two vectors. Three differences, each
// for want of AVX-512's 32 registers or its horizontal instructions:
// - Q.K: a row's query runs against 8 keys at once, 8 accumulators chained on the
//   query's chunks, and reduce_add8x8 finishes the 8 dot products together (one
//   horizontal sum per dot product would cost more than its FMAs at d = 64).
// - P.V: a row's accumulators stay in registers (8 vectors, 64 columns at a time) across
//   the tile's 16 V rows, with the rescale applied on loading them, instead of a
//   load/FMA/store per (V row, query row).
// - int8, fp8 and bf16 rows are widened to float32 once per tile into a buffer (L1), as
//   every query row reads each of them; a float cache is read in place.
template <int D8, typename Q, typename KV>
void attend_avx2(const Call<Q, KV>& c) {
  constexpr int64_t d = 8 * D8;
  constexpr int H = D8 < 8 ? D8 : 8;          // accumulator vectors held at a time
  constexpr bool widened = !std::is_same<KV, float>::value;
  const int64_t stride = c.num_kv_heads * d;  // between the K/V rows of one KV head
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);

#pragma omp parallel num_threads(c.num_threads)
  {
    OnlineRows st(c.rows(), d);
    std::vector<float> probs(st.rows * 16), scores(st.rows * 16), rescale(st.rows);
    std::vector<char> seen(st.rows);  // the row sees a key of this tile
    std::vector<float> kbuf(widened ? 16 * d : 0), vbuf(widened ? 16 * d : 0);

#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < c.items(); ++index) {
      const Item<Q, KV> it(c, index);
      st.start(it, c.scale);
      for (int64_t start = it.first_tile(); start < it.ctx; start += 16) {
        const int64_t nk = it.ctx - start < 16 ? it.ctx - start : 16;
        const int64_t base = it.kv_offset(start);
        if (start + 16 < it.ctx) {
          const int64_t next = it.kv_offset(start + 16);
          prefetch_rows(c.k_cache + next, stride, d);
          prefetch_rows(c.v_cache + next, stride, d);
        }
        // scores of 8 keys at a time; in a group that ends past nk the extra keys are rows
        // of the same block (garbage, or stale rows of kbuf) whose lanes are masked below
        int64_t kld;
        const float* kt = tile_rows<D8>(c.k_cache + base, stride, nk,
                                        [&](int64_t t) { return it.k_scale(start + t); },
                                        kbuf.data(), kld);
        for (int64_t r = 0; r < st.rows; ++r) {
          const float* qr = st.qf.data() + r * d;
          for (int64_t g8 = 0; g8 < (nk + 7) / 8; ++g8) {
            const float* k0 = kt + 8 * g8 * kld;
            __m256 acc[8];
            for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
            for (int j = 0; j < D8; ++j) {
              const __m256 qj = _mm256_loadu_ps(qr + 8 * j);
              for (int t = 0; t < 8; ++t)
                acc[t] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k0 + t * kld + 8 * j), acc[t]);
            }
            _mm256_storeu_ps(scores.data() + r * 16 + 8 * g8, reduce_add8x8(acc));
          }
        }
        if (c.softcap > 0.f)
          for (int64_t r = 0; r < st.rows; ++r) cap_scores(scores.data() + r * 16, nk, c.softcap);
        for (int64_t r = 0; r < st.rows; ++r) {
          seen[r] = !(st.limit[r] < start || st.first[r] >= start + nk);
          if (!seen[r]) continue;  // no visible key in this tile: no weight for its values
          const int64_t visible = st.limit[r] - start + 1;  // keys t < visible are seen
          const int64_t valid = visible < nk ? visible : nk;
          // keys t < skip are before the row's window
          const int64_t skip = st.first[r] > start ? st.first[r] - start : 0;
          const __m256i hi = _mm256_set1_epi32(static_cast<int>(valid));
          const __m256i lo = _mm256_set1_epi32(static_cast<int>(skip));
          __m256 live[2], s[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i t = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * h));
            // skip <= t < valid
            live[h] = _mm256_castsi256_ps(
                _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, t), _mm256_cmpgt_epi32(hi, t)));
            s[h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                    _mm256_loadu_ps(scores.data() + r * 16 + 8 * h), live[h]);
          }
          const float bm = reduce_max8(_mm256_max_ps(s[0], s[1]));
          const float nm = bm > st.m[r] ? bm : st.m[r];
          rescale[r] = std::exp(st.m[r] - nm);  // 0 first, without a sink (m = -inf)
          const __m256 nmv = _mm256_set1_ps(nm);
          const __m256 p0 = _mm256_and_ps(live[0], exp8_ps(_mm256_sub_ps(s[0], nmv)));
          const __m256 p1 = _mm256_and_ps(live[1], exp8_ps(_mm256_sub_ps(s[1], nmv)));
          st.l[r] = st.l[r] * rescale[r] + reduce_add8(_mm256_add_ps(p0, p1));
          st.m[r] = nm;
          _mm256_storeu_ps(probs.data() + r * 16, p0);
          _mm256_storeu_ps(probs.data() + r * 16 + 8, p1);
        }
        // values: per row, H accumulator vectors in registers over the tile's V rows
        int64_t vld;
        const float* vt = tile_rows<D8>(c.v_cache + base, stride, nk,
                                        [&](int64_t t) { return it.v_scale(start + t); },
                                        vbuf.data(), vld);
        for (int64_t r = 0; r < st.rows; ++r) {
          if (!seen[r]) continue;
          const float* pr = probs.data() + r * 16;
          float* ar = st.acc.data() + r * d;
          const __m256 cv = _mm256_set1_ps(rescale[r]);
          for (int h = 0; h < D8; h += H) {
            __m256 a[H];
            for (int j = 0; j < H; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * (h + j)), cv);
            for (int64_t t = 0; t < nk; ++t) {
              if (!(pr[t] > 0.f)) continue;  // masked or underflowed
              const __m256 pv = _mm256_set1_ps(pr[t]);
              const float* vr = vt + t * vld + 8 * h;
              for (int j = 0; j < H; ++j)
                a[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * j), a[j]);
            }
            for (int j = 0; j < H; ++j) _mm256_storeu_ps(ar + 8 * (h + j), a[j]);
          }
        }
      }
      st.finish(it);
    }
  }
}
#endif  // __AVX2__ && __FMA__

#if defined(__aarch64__) && defined(__ARM_NEON)
// attend_avx2 on 4-lane AArch64 NEON vectors: the same 16-key tiles, masks, online
// softmax and float32 arithmetic (bf16 queries and bf16, int8 or fp8 rows widened to
// float32 as they are loaded; no bf16 products, so plain ARMv8-A runs it). With 32
// vector registers:
// - Q.K: a row's query against 8 keys at once, 8 accumulators chained on its 4-float
//   chunks, and two pairwise-add trees (reduce_add4x4) finish the 8 dot products.
// - P.V: 16 accumulator vectors (64 columns) per row held in registers over the tile's
//   V rows, the rescale applied on loading them.
// No software prefetch: the x86 bodies' was measured there; ARM's speed is not measured.
template <int D8, typename Q, typename KV>
void attend_neon(const Call<Q, KV>& c) {
  constexpr int64_t d = 8 * D8;
  constexpr int V4 = 2 * D8;                  // 4-float vectors per row
  constexpr int H = V4 < 16 ? V4 : 16;        // accumulator vectors held at a time
  constexpr bool widened = !std::is_same<KV, float>::value;
  const int64_t stride = c.num_kv_heads * d;  // between the K/V rows of one KV head
  const int32x4_t lane = {0, 1, 2, 3};

#pragma omp parallel num_threads(c.num_threads)
  {
    OnlineRows st(c.rows(), d);
    std::vector<float> probs(st.rows * 16), scores(st.rows * 16), rescale(st.rows);
    std::vector<char> seen(st.rows);  // the row sees a key of this tile
    std::vector<float> kbuf(widened ? 16 * d : 0), vbuf(widened ? 16 * d : 0);

#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < c.items(); ++index) {
      const Item<Q, KV> it(c, index);
      st.start(it, c.scale);
      for (int64_t start = it.first_tile(); start < it.ctx; start += 16) {
        const int64_t nk = it.ctx - start < 16 ? it.ctx - start : 16;
        const int64_t base = it.kv_offset(start);
        // scores of 8 keys at a time; in a group that ends past nk the extra keys are rows
        // of the same block (garbage, or stale rows of kbuf) whose lanes are masked below
        int64_t kld;
        const float* kt = tile_rows<D8>(c.k_cache + base, stride, nk,
                                        [&](int64_t t) { return it.k_scale(start + t); },
                                        kbuf.data(), kld);
        for (int64_t r = 0; r < st.rows; ++r) {
          const float* qr = st.qf.data() + r * d;
          for (int64_t g8 = 0; g8 < (nk + 7) / 8; ++g8) {
            const float* k0 = kt + 8 * g8 * kld;
            float32x4_t acc[8];
            for (int t = 0; t < 8; ++t) acc[t] = vdupq_n_f32(0.f);
            for (int j = 0; j < V4; ++j) {
              const float32x4_t qj = vld1q_f32(qr + 4 * j);
              for (int t = 0; t < 8; ++t)
                acc[t] = vfmaq_f32(acc[t], qj, vld1q_f32(k0 + t * kld + 4 * j));
            }
            float* sr = scores.data() + r * 16 + 8 * g8;
            vst1q_f32(sr, reduce_add4x4(acc));
            vst1q_f32(sr + 4, reduce_add4x4(acc + 4));
          }
        }
        if (c.softcap > 0.f)
          for (int64_t r = 0; r < st.rows; ++r) cap_scores(scores.data() + r * 16, nk, c.softcap);
        for (int64_t r = 0; r < st.rows; ++r) {
          seen[r] = !(st.limit[r] < start || st.first[r] >= start + nk);
          if (!seen[r]) continue;  // no visible key in this tile: no weight for its values
          const int64_t visible = st.limit[r] - start + 1;  // keys t < visible are seen
          const int64_t valid = visible < nk ? visible : nk;
          // keys t < skip are before the row's window
          const int64_t skip = st.first[r] > start ? st.first[r] - start : 0;
          const int32x4_t hi = vdupq_n_s32(static_cast<int32_t>(valid));
          const int32x4_t lo = vdupq_n_s32(static_cast<int32_t>(skip));
          uint32x4_t live[4];
          float32x4_t s[4];
          for (int h = 0; h < 4; ++h) {
            const int32x4_t t = vaddq_s32(lane, vdupq_n_s32(4 * h));
            live[h] = vandq_u32(vcgeq_s32(t, lo), vcltq_s32(t, hi));  // skip <= t < valid
            s[h] = vbslq_f32(live[h], vld1q_f32(scores.data() + r * 16 + 4 * h),
                             vdupq_n_f32(-INFINITY));
          }
          const float bm = vmaxvq_f32(vmaxq_f32(vmaxq_f32(s[0], s[1]), vmaxq_f32(s[2], s[3])));
          const float nm = bm > st.m[r] ? bm : st.m[r];
          rescale[r] = std::exp(st.m[r] - nm);  // 0 first, without a sink (m = -inf)
          const float32x4_t nmv = vdupq_n_f32(nm);
          float32x4_t p[4];
          for (int h = 0; h < 4; ++h) {
            const float32x4_t e = exp4_ps(vsubq_f32(s[h], nmv));
            p[h] = vreinterpretq_f32_u32(vandq_u32(live[h], vreinterpretq_u32_f32(e)));
            vst1q_f32(probs.data() + r * 16 + 4 * h, p[h]);
          }
          st.l[r] = st.l[r] * rescale[r] +
                    vaddvq_f32(vaddq_f32(vaddq_f32(p[0], p[1]), vaddq_f32(p[2], p[3])));
          st.m[r] = nm;
        }
        // values: per row, H accumulator vectors in registers over the tile's V rows
        int64_t vld;
        const float* vt = tile_rows<D8>(c.v_cache + base, stride, nk,
                                        [&](int64_t t) { return it.v_scale(start + t); },
                                        vbuf.data(), vld);
        for (int64_t r = 0; r < st.rows; ++r) {
          if (!seen[r]) continue;
          const float* pr = probs.data() + r * 16;
          float* ar = st.acc.data() + r * d;
          for (int h = 0; h < V4; h += H) {
            float32x4_t a[H];
            for (int j = 0; j < H; ++j) a[j] = vmulq_n_f32(vld1q_f32(ar + 4 * (h + j)), rescale[r]);
            for (int64_t t = 0; t < nk; ++t) {
              if (!(pr[t] > 0.f)) continue;  // masked or underflowed
              const float* vr = vt + t * vld + 4 * h;
              for (int j = 0; j < H; ++j) a[j] = vfmaq_n_f32(a[j], vld1q_f32(vr + 4 * j), pr[t]);
            }
            for (int j = 0; j < H; ++j) vst1q_f32(ar + 4 * (h + j), a[j]);
          }
        }
      }
      st.finish(it);
    }
  }
}
#endif  // __aarch64__ && __ARM_NEON

#if defined(__AVX512BF16__)
// A 64-byte aligned array of vectors (std::vector does not promise over-alignment).
struct Vectors {
  __m512* data;
  int64_t n;
  explicit Vectors(int64_t count)
      : data(static_cast<__m512*>(std::aligned_alloc(64, count * sizeof(__m512)))), n(count) {}
  ~Vectors() { std::free(data); }
  Vectors(const Vectors&) = delete;
  Vectors& operator=(const Vectors&) = delete;
  __m512& operator[](int64_t i) { return data[i]; }
  void zero() { for (int64_t i = 0; i < n; ++i) data[i] = _mm512_setzero_ps(); }
};

// Sum of each of 16 vectors, as one vector: out[t] = sum of v[t]'s lanes. A transpose
// tree (unpack 32-bit, unpack 64-bit, two 128-bit lane shuffles) does the 16 horizontal
// sums in 45 instructions instead of 16 separate reductions' ~130.
inline __m512 reduce16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // each 128-bit lane of x[i] now holds keys 4i..4i+3, summed over that lane's columns
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88),
                       _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// 32 consecutive K/V values as bf16: loaded as they are, or int8 codes widened (exactly)
inline __m512i bf16x32(const uint16_t* p) { return _mm512_loadu_si512(p); }

inline __m512i bf16x32(const int8_t* p) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(codes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(codes, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
}

inline __m512i bf16x32(const e4m3* p) { return llmctl_fp8::e4m3x32_to_bf16(&p->bits); }

// bfloat16 queries and cache (or int8 codes, see the top) with AVX512-BF16: both
// products run on vdpbf16ps (pairs of bf16 multiplied, summed into float32), so K/V rows
// are used as loaded, never converted.
// Q.K: the query row as stored (bf16) against each key row, scaled afterwards.
// P.V: keys taken in pairs, V rows t and t+1 interleaved element-wise, probabilities
// (p_t, p_t+1) rounded to bf16 as FlashAttention does for its second matmul; the
// interleave permutes output columns within 128-bit lanes, undone at the end.
//
// Two passes instead of an online softmax: all scores of a work item first (a few KB:
// rows x context floats), then one max/exp/sum per row, then P.V. The tiles of each
// pass are independent, so the core overlaps them; the online form chains every tile
// through a max -> exp -> rescale dependency and ran at a third of the speed.
template <int D2, typename KV>  // head_dim = 32 * D2
void attend_bf16(const Call<uint16_t, KV>& c) {
  constexpr bool scaled = std::is_same<KV, int8_t>::value || std::is_same<KV, e4m3>::value;
  constexpr int64_t d = 32 * D2;
  const int64_t rows = c.rows();
  const int64_t stride = c.num_kv_heads * d;  // between the K/V rows of one KV head
  int64_t max_ctx = 0;
  for (int64_t s = 0; s < c.num_seqs; ++s) max_ctx = std::max(max_ctx, c.context_lens[s]);
  const int64_t padded = (max_ctx + 15) / 16 * 16;

#pragma omp parallel num_threads(c.num_threads)
  {
    // per row: 2 * D2 accumulators (unpacklo and unpackhi halves of each 32 columns)
    Vectors acc(rows * 2 * D2), vpairs(8 * 2 * D2);
    std::vector<float> scores(rows * padded);
    std::vector<uint32_t> pairs(rows * padded / 2);
    std::vector<float> inv(rows);
    // int8, fp8: the item's K and V scales by key (0 past the context, whose lanes are
    // masked)
    std::vector<float> ks(scaled ? padded : 0), vs(scaled ? padded : 0);

#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < c.items(); ++index) {
      const Item<uint16_t, KV> it(c, index);
      const int64_t ctx = it.ctx;
      const int64_t tiles = (ctx + 15) / 16, t0 = it.first_tile() / 16;
      auto tile_base = [&](int64_t tile) { return it.kv_offset(tile * 16); };
      if (scaled) {
        for (int64_t j = t0 * 16; j < tiles * 16; ++j) {
          ks[j] = j < ctx ? it.k_scale(j) : 0.f;
          vs[j] = j < ctx ? it.v_scale(j) : 0.f;
        }
      }

      // pass 1: scores, -inf where a query may not look (causality, the window, past the
      // context); tiles before t0 are outside every row's window and never touched
      for (int64_t tile = t0; tile < tiles; ++tile) {
        const int64_t start = tile * 16;
        const int64_t nk = std::min<int64_t>(ctx - start, 16);
        const KV* kt = c.k_cache + tile_base(tile);
        if (tile + 1 < tiles) prefetch_rows(c.k_cache + tile_base(tile + 1), stride, d);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = it.last_key(r) - start + 1;  // keys t < visible are seen
          const int64_t skip = std::max<int64_t>(0, it.first_key(r) - start);  // before the window
          float* sr = scores.data() + r * padded + start;
          if (visible <= 0 || skip >= 16) {
            _mm512_storeu_ps(sr, _mm512_set1_ps(-INFINITY));
            continue;
          }
          const uint16_t* qr = it.q_row(r);
          __m512bh qv[D2];
          for (int jj = 0; jj < D2; ++jj) qv[jj] = (__m512bh)_mm512_loadu_si512(qr + 32 * jj);
          // all 16 rows of the tile, also past ctx: the tile lies inside one allocated
          // block, and the lanes of those keys are masked to -inf below
          __m512 part[16];
          for (int64_t t = 0; t < 16; ++t) {
            const KV* kr = kt + t * stride;
            __m512 acc_t = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)bf16x32(kr));
            for (int jj = 1; jj < D2; ++jj)
              acc_t = _mm512_dpbf16_ps(acc_t, qv[jj], (__m512bh)bf16x32(kr + 32 * jj));
            part[t] = acc_t;
          }
          const int64_t valid = std::min(visible, nk);
          const __mmask16 live =
              static_cast<__mmask16>(((1u << valid) - 1u) & ~((1u << skip) - 1u));
          __m512 factor = _mm512_set1_ps(c.scale);
          if (scaled) factor = _mm512_mul_ps(factor, _mm512_loadu_ps(ks.data() + start));
          __m512 sv = _mm512_mul_ps(reduce16(part), factor);
          if (c.softcap > 0.f) {  // capped before the mask: a masked lane stays -inf
            alignas(64) float lanes[16];
            _mm512_store_ps(lanes, sv);
            cap_scores(lanes, 16, c.softcap);
            sv = _mm512_load_ps(lanes);
          }
          _mm512_storeu_ps(sr, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, sv));
        }
      }

      // softmax per row; probabilities to bf16 pairs for pass 2
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * padded;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int64_t tile = t0; tile < tiles; ++tile)
          mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + tile * 16));
        // a sink enters the row's max, and its exp(sink - m) the sum below
        const float top = _mm512_reduce_max_ps(mv);
        const float mr = c.sinks ? std::max(top, it.sink(r)) : top;
        const __m512 m = _mm512_set1_ps(mr);
        __m512 lv = _mm512_setzero_ps();
        uint32_t* pr = pairs.data() + r * padded / 2;
        for (int64_t tile = t0; tile < tiles; ++tile) {
          const __m512 sv = _mm512_loadu_ps(sr + tile * 16);
          // -inf lanes: exp_ps clamps them to ~1e-38; zero them exactly
          const __mmask16 live = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
          const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(sv, m)));
          lv = _mm512_add_ps(lv, p);
          // int8, fp8: V's scales folded into the weights of its rows (the sum keeps p)
          const __m512 pw = scaled ? _mm512_mul_ps(p, _mm512_loadu_ps(vs.data() + tile * 16)) : p;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + tile * 8),
                              (__m256i)_mm512_cvtneps_pbh(pw));
        }
        const float l = _mm512_reduce_add_ps(lv) + (c.sinks ? std::exp(it.sink(r) - mr) : 0.f);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
      }

      // pass 2: P.V, V rows interleaved in pairs (a zero row pads an odd tail)
      acc.zero();
      for (int64_t tile = t0; tile < tiles; ++tile) {
        const int64_t start = tile * 16;
        const int64_t nk = std::min<int64_t>(ctx - start, 16);
        const KV* vt = c.v_cache + tile_base(tile);
        if (tile + 1 < tiles) prefetch_rows(c.v_cache + tile_base(tile + 1), stride, d);
        const int64_t npairs = (nk + 1) / 2;
        for (int64_t pp = 0; pp < npairs; ++pp) {
          const KV* va = vt + (2 * pp) * stride;
          for (int jj = 0; jj < D2; ++jj) {
            const __m512i a = bf16x32(va + 32 * jj);
            const __m512i b = 2 * pp + 1 < nk ? bf16x32(va + stride + 32 * jj)
                                              : _mm512_setzero_si512();
            vpairs[(pp * D2 + jj) * 2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(a, b));
            vpairs[(pp * D2 + jj) * 2 + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(a, b));
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const uint32_t* pr = pairs.data() + r * padded / 2 + tile * 8;
          __m512 a[2 * D2];
          __m512* ar = acc.data + r * 2 * D2;
          for (int jj = 0; jj < 2 * D2; ++jj) a[jj] = ar[jj];
          for (int64_t pp = 0; pp < npairs; ++pp) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pr[pp]));
            for (int jj = 0; jj < 2 * D2; ++jj)
              a[jj] = _mm512_dpbf16_ps(a[jj], pv,
                                       (__m512bh)_mm512_castps_si512(vpairs[pp * 2 * D2 + jj]));
          }
          for (int jj = 0; jj < 2 * D2; ++jj) ar[jj] = a[jj];
        }
      }

      for (int64_t r = 0; r < rows; ++r) {
        float* dst = it.out_row(r);
        alignas(64) float lo[16], hi[16];
        for (int jj = 0; jj < D2; ++jj) {
          _mm512_store_ps(lo, acc[r * 2 * D2 + 2 * jj]);
          _mm512_store_ps(hi, acc[r * 2 * D2 + 2 * jj + 1]);
          // 32-bit lane 4L + w of lo is column 8L + w, of hi column 8L + 4 + w
          float* col = dst + 32 * jj;
          for (int lane = 0; lane < 4; ++lane)
            for (int w = 0; w < 4; ++w) {
              col[8 * lane + w] = lo[4 * lane + w] * inv[r];
              col[8 * lane + 4 + w] = hi[4 * lane + w] * inv[r];
            }
        }
      }
    }
  }
}
#endif  // __AVX512BF16__

// The vectorised kernels where they apply (head_dim 64 or 128, tiles of 16 keys inside
// one block; AVX-512 where compiled in, else AVX2 + FMA, or NEON on AArch64), the
// portable loop otherwise.
template <typename Q, typename KV>
void dispatch(const Call<Q, KV>& c) {
#if defined(__AVX512F__)
  if (c.block_size % 16 == 0) {
    if (c.head_dim == 64) return attend_avx512<4>(c);
    if (c.head_dim == 128) return attend_avx512<8>(c);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (c.block_size % 16 == 0) {
    if (c.head_dim == 64) return attend_avx2<8>(c);
    if (c.head_dim == 128) return attend_avx2<16>(c);
  }
#elif defined(__aarch64__) && defined(__ARM_NEON)
  if (c.block_size % 16 == 0) {
    if (c.head_dim == 64) return attend_neon<8>(c);
    if (c.head_dim == 128) return attend_neon<16>(c);
  }
#endif
  attend(c);
}

// bf16 queries: vdpbf16ps where the CPU has it
template <typename KV>
void dispatch_bf16(const Call<uint16_t, KV>& c) {
#if defined(__AVX512BF16__)
  if (c.block_size % 16 == 0) {
    if (c.head_dim == 64) return attend_bf16<2>(c);
    if (c.head_dim == 128) return attend_bf16<4>(c);
  }
#endif
  dispatch(c);
}

}  // namespace

extern "C" {

#if defined(__aarch64__) && defined(__ARM_NEON)
// The vector body dispatch() has in this build, asked by tests/serve/kernels/csrc_check/
// kernel_check.cpp: an aarch64 build that dropped to the portable loop fails there.
// Only ARM builds export it, so the x86 objects are what they were before NEON.
const char* paged_attention_simd() { return "neon"; }
#endif

// The layouts are Call's; window 0: full causal attention; softcap 0: no soft-capping;
// sinks null: no attention sinks, else one float32 logit per query head.
void paged_attention_f32(const float* q, const float* k, const float* v, const int64_t* bt,
                         int64_t max_blocks, const int64_t* ctx, int64_t num_seqs, int64_t q_len,
                         int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, float* out,
                         int num_threads, int64_t window, float softcap, const float* sinks) {
  dispatch(Call<float, float>{q, k, v, nullptr, nullptr, bt, max_blocks, ctx, num_seqs, q_len,
                              q_stride, num_heads, num_kv_heads, head_dim, block_size, scale,
                              out, num_threads, window, softcap, sinks});
}

void paged_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                          const int64_t* bt, int64_t max_blocks, const int64_t* ctx,
                          int64_t num_seqs, int64_t q_len, int64_t q_stride, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, float* out, int num_threads, int64_t window,
                          float softcap, const float* sinks) {
  dispatch_bf16(Call<uint16_t, uint16_t>{q, k, v, nullptr, nullptr, bt, max_blocks, ctx,
                                         num_seqs, q_len, q_stride, num_heads, num_kv_heads,
                                         head_dim, block_size, scale, out, num_threads, window,
                                         softcap, sinks});
}

// int8 caches: the codes' scales ks, vs [blocks, block_size, num_kv_heads] after k and v
void paged_attention_f32_i8(const float* q, const int8_t* k, const int8_t* v, const float* ks,
                            const float* vs, const int64_t* bt, int64_t max_blocks,
                            const int64_t* ctx, int64_t num_seqs, int64_t q_len,
                            int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float* out,
                            int num_threads, int64_t window, float softcap, const float* sinks) {
  dispatch(Call<float, int8_t>{q, k, v, ks, vs, bt, max_blocks, ctx, num_seqs, q_len, q_stride,
                               num_heads, num_kv_heads, head_dim, block_size, scale, out,
                               num_threads, window, softcap, sinks});
}

void paged_attention_bf16_i8(const uint16_t* q, const int8_t* k, const int8_t* v,
                             const float* ks, const float* vs, const int64_t* bt,
                             int64_t max_blocks, const int64_t* ctx, int64_t num_seqs,
                             int64_t q_len, int64_t q_stride, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float* out, int num_threads, int64_t window,
                             float softcap, const float* sinks) {
  dispatch_bf16(Call<uint16_t, int8_t>{q, k, v, ks, vs, bt, max_blocks, ctx, num_seqs, q_len,
                                       q_stride, num_heads, num_kv_heads, head_dim, block_size,
                                       scale, out, num_threads, window, softcap, sinks});
}

// fp8 (E4M3) caches: k, v hold the codes; ks, vs [num_kv_heads] the static scales
void paged_attention_f32_f8(const float* q, const uint8_t* k, const uint8_t* v, const float* ks,
                            const float* vs, const int64_t* bt, int64_t max_blocks,
                            const int64_t* ctx, int64_t num_seqs, int64_t q_len,
                            int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale, float* out,
                            int num_threads, int64_t window, float softcap, const float* sinks) {
  dispatch(Call<float, e4m3>{q, reinterpret_cast<const e4m3*>(k),
                             reinterpret_cast<const e4m3*>(v), ks, vs, bt, max_blocks, ctx,
                             num_seqs, q_len, q_stride, num_heads, num_kv_heads, head_dim,
                             block_size, scale, out, num_threads, window, softcap, sinks});
}

void paged_attention_bf16_f8(const uint16_t* q, const uint8_t* k, const uint8_t* v,
                             const float* ks, const float* vs, const int64_t* bt,
                             int64_t max_blocks, const int64_t* ctx, int64_t num_seqs,
                             int64_t q_len, int64_t q_stride, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float* out, int num_threads, int64_t window,
                             float softcap, const float* sinks) {
  dispatch_bf16(Call<uint16_t, e4m3>{q, reinterpret_cast<const e4m3*>(k),
                                     reinterpret_cast<const e4m3*>(v), ks, vs, bt, max_blocks,
                                     ctx, num_seqs, q_len, q_stride, num_heads, num_kv_heads,
                                     head_dim, block_size, scale, out, num_threads, window,
                                     softcap, sinks});
}

}  // extern "C"
