// A standalone check of the engine's native kernels with no Python: linked with the
// kernels' sources and run natively, or cross-compiled for aarch64 and run under
// qemu-user (tests/serve/kernels/test_kernel_cross.py), where there is no torch to compare with.
// Each kernel is compared with a naive reference written here in double precision:
//
// - paged attention, every exported pair of query and cache types (float32 or bf16
//   queries; a float32, bf16, int8 or fp8 cache): random queries and a paged cache
//   reached through shuffled block tables, decode (q_len 1) and a 3-token step with
//   causal masking, GQA, head_dim 64 and 128 (the vector bodies) and 16 (the portable
//   loop), contexts that end inside and on block edges and span several 16-key tiles,
//   with and without a sliding window, with and without logit soft-capping (each scaled
//   score s -> cap * tanh(s / cap) before the softmax), with and without attention sinks
//   (one logit per query head in each softmax's denominator, gpt-oss). The reference
//   takes the same bf16 queries and the same dequantized K/V (code times scale): float32
//   sums of at most a few hundred terms, so relative error 1e-4 is generous.
//   AVX512-BF16's body for bf16 queries rounds the probabilities to bf16 for its P.V
//   product (2^-9 relative each, |v| <= 1): absolute error 4e-3 there.
// - add_rms_norm_bf16 and silu_mul_bf16: bf16 in and out, so one bf16 rounding
//   (2^-8 relative) plus float32 noise: 2^-7 relative.
//
// Prints which vector bodies an ARM build has (paged_attention_simd, norm_act_simd,
// exported only there), then "ok: N checks" and exits 0, or the first mismatch and
// exits 1.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
// (..., q_len, q_stride, num_heads, num_kv_heads, head_dim, block_size, scale, out,
// num_threads, window, softcap, sinks), after the queries, the cache (and its scales) and
// the tables
#define PA_TAIL                                                                          \
  const int64_t *bt, int64_t max_blocks, const int64_t *ctx, int64_t num_seqs,           \
      int64_t q_len, int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,          \
      int64_t head_dim, int64_t block_size, float scale, float *out, int num_threads,   \
      int64_t window, float softcap, const float *sinks
void paged_attention_f32(const float* q, const float* k, const float* v, PA_TAIL);
void paged_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, PA_TAIL);
void paged_attention_f32_i8(const float* q, const int8_t* k, const int8_t* v, const float* ks,
                            const float* vs, PA_TAIL);
void paged_attention_bf16_i8(const uint16_t* q, const int8_t* k, const int8_t* v,
                             const float* ks, const float* vs, PA_TAIL);
void paged_attention_f32_f8(const float* q, const uint8_t* k, const uint8_t* v, const float* ks,
                            const float* vs, PA_TAIL);
void paged_attention_bf16_f8(const uint16_t* q, const uint8_t* k, const uint8_t* v,
                             const float* ks, const float* vs, PA_TAIL);
#undef PA_TAIL
// the vector bodies of an ARM build; null elsewhere
__attribute__((weak)) const char* paged_attention_simd();
__attribute__((weak)) const char* norm_act_simd();
void add_rms_norm_bf16(uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                       uint16_t* out, int64_t rows, int64_t cols, float eps, int num_threads);
void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter,
                   int num_threads);
}

namespace {

std::mt19937 rng(1234);
int checks = 0;

float uniform() { return std::uniform_real_distribution<float>(-1.f, 1.f)(rng); }

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float from_bf16(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

bool close(double got, double want, double rel, double abs_tol, const char* what) {
  ++checks;
  if (std::fabs(got - want) <= abs_tol + rel * std::fabs(want)) return true;
  std::printf("mismatch in %s: got %.8g, want %.8g\n", what, got, want);
  return false;
}

// E4M3 code -> value, written out here rather than taken from fp8.h: s eeee mmm, bias 7,
// 2^(e-7) * (1 + m/8), or m * 2^-9 for e = 0
double from_e4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double mag = e ? std::ldexp(8 + m, e - 10) : std::ldexp(m, -9);
  return (b & 0x80) ? -mag : mag;
}

enum class Cache { f32, bf16, i8, f8 };

// One exported paged attention: its query type, cache type and name.
struct Variant {
  bool bf16_q;
  Cache cache;
  const char* name;
};

const Variant kVariants[] = {
    {false, Cache::f32, "paged_attention_f32"},  {true, Cache::bf16, "paged_attention_bf16"},
    {false, Cache::i8, "paged_attention_f32_i8"}, {true, Cache::i8, "paged_attention_bf16_i8"},
    {false, Cache::f8, "paged_attention_f32_f8"}, {true, Cache::f8, "paged_attention_bf16_f8"}};

// K or V of a cache as the kernel stores it, and the values it stands for (code times
// scale) for the reference
struct CacheData {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<int8_t> i8;
  std::vector<uint8_t> f8;
  std::vector<float> scales;  // int8: per (slot, KV head); fp8: per KV head
  std::vector<double> value;

  CacheData(Cache kind, int64_t slots, int64_t kv_heads, int64_t d) : value(slots * kv_heads * d) {
    const int64_t n = static_cast<int64_t>(value.size());
    switch (kind) {
      case Cache::f32:
        f32.resize(n);
        for (int64_t i = 0; i < n; ++i) value[i] = f32[i] = uniform();
        break;
      case Cache::bf16:
        bf16.resize(n);
        for (int64_t i = 0; i < n; ++i) value[i] = from_bf16(bf16[i] = to_bf16(uniform()));
        break;
      case Cache::i8:  // codes in -127..127, scales that keep |value| <= 1
        i8.resize(n);
        scales.resize(slots * kv_heads);
        for (auto& s : scales) s = (0.75f + 0.25f * uniform()) / 127.f;
        for (int64_t i = 0; i < n; ++i) {
          i8[i] = static_cast<int8_t>(std::lround(127 * uniform()));
          value[i] = static_cast<double>(i8[i]) * scales[i / d];
        }
        break;
      case Cache::f8:  // any code but the NaNs (0x7f, 0xff), subnormals included
        f8.resize(n);
        scales.resize(kv_heads);
        for (auto& s : scales) s = (0.75f + 0.25f * uniform()) / 448.f;
        for (int64_t i = 0; i < n; ++i) {
          do f8[i] = static_cast<uint8_t>(rng() & 0xFF); while ((f8[i] & 0x7F) == 0x7F);
          value[i] = from_e4m3(f8[i]) * scales[(i / d) % kv_heads];
        }
        break;
    }
  }
};

bool attention_case(const Variant& kind, int64_t heads, int64_t kv_heads, int64_t d,
                    int64_t block, int64_t q_len, int64_t window, float softcap,
                    bool with_sinks) {
  const std::vector<int64_t> contexts = {q_len, q_len + 5, q_len + 15, q_len + 16, q_len + 40,
                                         q_len + 70};
  const int64_t seqs = static_cast<int64_t>(contexts.size());
  int64_t max_blocks = 0, total_blocks = 0;
  for (int64_t c : contexts) {
    max_blocks = std::max(max_blocks, (c + block - 1) / block);
    total_blocks += (c + block - 1) / block;
  }
  total_blocks += 3;  // unused blocks the tables never name
  std::vector<int64_t> order(total_blocks);
  for (int64_t i = 0; i < total_blocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int64_t> tables(seqs * max_blocks, 0);
  int64_t next = 0;
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t b = 0; b < (contexts[s] + block - 1) / block; ++b)
      tables[s * max_blocks + b] = order[next++];
  const int64_t slot = kv_heads * d;
  const CacheData k(kind.cache, total_blocks * block, kv_heads, d);
  const CacheData v(kind.cache, total_blocks * block, kv_heads, d);
  const int64_t q_stride = heads * d + 8;  // rows strided apart, as a fused qkv has them
  std::vector<float> q(seqs * q_len * q_stride);
  std::vector<uint16_t> q16(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    q[i] = uniform();
    q16[i] = to_bf16(q[i]);
    if (kind.bf16_q) q[i] = from_bf16(q16[i]);  // what the kernel sees
  }
  // sinks of either sign around the scaled scores (~0.3, up to ~1), so they bite
  std::vector<float> sinks(heads);
  for (auto& e : sinks) e = 2 * uniform();
  std::vector<float> out(seqs * q_len * heads * d, NAN);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
#define TAIL tables.data(), max_blocks, contexts.data(), seqs, q_len, q_stride, heads, kv_heads, \
             d, block, scale, out.data(), 2, window, softcap,                         \
             with_sinks ? sinks.data() : nullptr
  const uint8_t* kf8 = k.f8.data();
  const uint8_t* vf8 = v.f8.data();
  switch (kind.cache) {
    case Cache::f32: paged_attention_f32(q.data(), k.f32.data(), v.f32.data(), TAIL); break;
    case Cache::bf16: paged_attention_bf16(q16.data(), k.bf16.data(), v.bf16.data(), TAIL); break;
    case Cache::i8:
      if (kind.bf16_q)
        paged_attention_bf16_i8(q16.data(), k.i8.data(), v.i8.data(), k.scales.data(),
                                v.scales.data(), TAIL);
      else
        paged_attention_f32_i8(q.data(), k.i8.data(), v.i8.data(), k.scales.data(),
                               v.scales.data(), TAIL);
      break;
    case Cache::f8:
      if (kind.bf16_q)
        paged_attention_bf16_f8(q16.data(), kf8, vf8, k.scales.data(), v.scales.data(), TAIL);
      else
        paged_attention_f32_f8(q.data(), kf8, vf8, k.scales.data(), v.scales.data(), TAIL);
      break;
  }
#undef TAIL
  double rel = 1e-4, abs_tol = 1e-5;
#if defined(__AVX512BF16__)
  if (kind.bf16_q && d % 32 == 0 && block % 16 == 0) rel = 0, abs_tol = 4e-3;  // see the top
#endif
  const int64_t group = heads / kv_heads;
  for (int64_t s = 0; s < seqs; ++s) {
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t last = contexts[s] - q_len + t;  // the key of this query's position
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qr = q.data() + (s * q_len + t) * q_stride + h * d;
        const int64_t kvh = h / group;
        std::vector<double> logits;
        double top = -INFINITY;
        for (int64_t p = first; p <= last; ++p) {
          const int64_t at = (tables[s * max_blocks + p / block] * block + p % block) * slot
                             + kvh * d;
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += static_cast<double>(qr[x]) * k.value[at + x];
          logits.push_back(softcap > 0 ? std::tanh(dot * scale / softcap) * softcap
                                       : dot * scale);
          top = std::max(top, logits.back());
        }
        // a sink: in the max, and exp(sink - top) in the sum (its column is dropped)
        if (with_sinks) top = std::max(top, static_cast<double>(sinks[h]));
        double sum = with_sinks ? std::exp(sinks[h] - top) : 0;
        for (double& l : logits) sum += (l = std::exp(l - top));
        const float* got = out.data() + ((s * q_len + t) * heads + h) * d;
        for (int64_t x = 0; x < d; ++x) {
          double want = 0;
          for (int64_t p = first; p <= last; ++p) {
            const int64_t at = (tables[s * max_blocks + p / block] * block + p % block) * slot
                               + kvh * d;
            want += logits[p - first] / sum * v.value[at + x];
          }
          if (!close(got[x], want, rel, abs_tol, kind.name)) {
            std::printf("  (heads %lld/%lld, head_dim %lld, block %lld, q_len %lld, window %lld, "
                        "softcap %g, sinks %d, context %lld)\n", (long long)heads,
                        (long long)kv_heads, (long long)d, (long long)block, (long long)q_len,
                        (long long)window, softcap, (int)with_sinks, (long long)contexts[s]);
            return false;
          }
        }
      }
    }
  }
  return true;
}

// Of n outputs, how many have the bits of transformers' roundings computed here in
// float32 (a formula and its bf16 rounding): a body that drops an intermediate rounding
// stays inside the tolerance but matches far fewer (measured: under 90 %), while the
// kernels' other float32 differences (summation order, exp's polynomial) flip a rounding
// now and then (over 99 % match).
struct BitMatch {
  const char* what;
  int64_t same = 0, n = 0;
  void add(uint16_t got, uint16_t want) { same += got == want, ++n; }
  bool ok() {
    ++checks;
    if (same >= 0.97 * n) return true;
    std::printf("mismatch in %s: %lld of %lld outputs with transformers' roundings\n", what,
                (long long)same, (long long)n);
    return false;
  }
};

bool norm_act_case(int64_t rows, int64_t cols, bool with_residual) {
  std::vector<uint16_t> x(rows * cols), r(rows * cols), w(cols), out(rows * cols);
  std::vector<float> xf(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = to_bf16(3 * uniform());
    r[i] = to_bf16(uniform());
    xf[i] = with_residual ? from_bf16(to_bf16(from_bf16(x[i]) + from_bf16(r[i])))  // in place
                          : from_bf16(x[i]);
  }
  for (auto& e : w) e = to_bf16(1.f + 0.5f * uniform());
  add_rms_norm_bf16(x.data(), with_residual ? r.data() : nullptr, w.data(), out.data(), rows,
                    cols, 1e-5f, 2);
  BitMatch norm_bits{"add_rms_norm_bf16"};
  for (int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<double>(xf[i * cols + c]) * xf[i * cols + c];
    const double inv = 1.0 / std::sqrt(ss / cols + 1e-5);
    for (int64_t c = 0; c < cols; ++c) {
      if (!close(from_bf16(x[i * cols + c]), xf[i * cols + c], 0, 0, "add_rms_norm_bf16 residual"))
        return false;
      const double want = xf[i * cols + c] * inv * from_bf16(w[c]);
      if (!close(from_bf16(out[i * cols + c]), want, 1.0 / 128, 1e-6, "add_rms_norm_bf16"))
        return false;
      const float normed = from_bf16(to_bf16(xf[i * cols + c] * static_cast<float>(inv)));
      norm_bits.add(out[i * cols + c], to_bf16(from_bf16(w[c]) * normed));
    }
  }
  if (!norm_bits.ok()) return false;
  std::vector<uint16_t> gate_up(rows * 2 * cols), act(rows * cols);
  for (auto& e : gate_up) e = to_bf16(4 * uniform());
  silu_mul_bf16(gate_up.data(), act.data(), rows, cols, 2);
  BitMatch silu_bits{"silu_mul_bf16"};
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const float g = from_bf16(gate_up[i * 2 * cols + c]);
      const float u = from_bf16(gate_up[i * 2 * cols + cols + c]);
      const double want = g / (1 + std::exp(-static_cast<double>(g))) * u;
      if (!close(from_bf16(act[i * cols + c]), want, 1.0 / 128, 1e-6, "silu_mul_bf16"))
        return false;
      silu_bits.add(act[i * cols + c], to_bf16(from_bf16(to_bf16(g / (1.f + std::exp(-g)))) * u));
    }
  return silu_bits.ok();
}

}  // namespace

int main() {
  if (paged_attention_simd) std::printf("paged_attention_simd: %s\n", paged_attention_simd());
  if (norm_act_simd) std::printf("norm_act_simd: %s\n", norm_act_simd());
  // (heads, kv_heads, head_dim, block, q_len, window): SmolLM2's GQA 9/3 x 64, MHA and GQA
  // x 128, a head_dim and a block size off the vector paths, sliding windows (one that
  // leaves whole tiles out); each without a cap and with one that bites (the scaled
  // scores of these inputs are ~0.3, up to ~1: a cap of 0.5 bends most of them), each
  // without and with sinks
  const int64_t cases[][6] = {{9, 3, 64, 16, 1, 0},  {9, 3, 64, 16, 3, 0},  {4, 4, 128, 32, 1, 0},
                              {8, 2, 128, 16, 3, 0}, {4, 2, 16, 16, 3, 0},  {6, 2, 64, 8, 1, 0},
                              {9, 3, 64, 16, 3, 7},  {4, 2, 128, 32, 1, 20}};
  for (const Variant& kind : kVariants)
    for (const auto& c : cases)
      for (float softcap : {0.f, 0.5f})
        for (bool sinks : {false, true})
          if (!attention_case(kind, c[0], c[1], c[2], c[3], c[4], c[5], softcap, sinks))
            return 1;
  // SmolLM2's hidden size, sizes that leave a tail to every vector width, no residual
  for (int64_t rows : {1, 7})
    for (int64_t cols : {576, 1000, 1003})
      for (bool with_residual : {true, false})
        if (!norm_act_case(rows, cols, with_residual)) return 1;
  std::printf("ok: %d checks\n", checks);
  return 0;
}
