// A standalone check of the engine's native kernels with no Python: linked with the
// kernels' sources and run natively, or cross-compiled for aarch64 and run under
// qemu-user (tests/serve/test_kernel_cross.py), where there is no torch to compare with.
// Each kernel is compared with a naive reference written here in double precision:
//
// - paged_attention_f32: random queries and a paged float32 cache reached through
//   shuffled block tables, decode (q_len 1) and a 3-token step with causal masking,
//   GQA, contexts that end inside and on block edges, with and without a sliding window;
//   float32 sums of at most a few hundred terms: relative error 1e-4 is generous.
// - add_rms_norm_bf16 and silu_mul_bf16: bf16 in and out, so one bf16 rounding
//   (2^-8 relative) plus float32 noise: 2^-7 relative.
//
// Prints "ok: N checks" and exits 0, or the first mismatch and exits 1.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

extern "C" {
void paged_attention_f32(const float* q, const float* k, const float* v, const int64_t* bt,
                         int64_t max_blocks, const int64_t* ctx, int64_t num_seqs, int64_t q_len,
                         int64_t q_stride, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, float* out,
                         int num_threads, int64_t window);
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

bool attention_case(int64_t heads, int64_t kv_heads, int64_t d, int64_t block,
                    int64_t q_len, int64_t window) {
  const std::vector<int64_t> contexts = {q_len, q_len + 5, q_len + 15, q_len + 16, q_len + 40};
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
  std::vector<float> k(total_blocks * block * slot), v(k.size());
  for (auto& x : k) x = uniform();
  for (auto& x : v) x = uniform();
  const int64_t q_stride = heads * d + 8;  // rows strided apart, as a fused qkv has them
  std::vector<float> q(seqs * q_len * q_stride);
  for (auto& x : q) x = uniform();
  std::vector<float> out(seqs * q_len * heads * d, NAN);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  paged_attention_f32(q.data(), k.data(), v.data(), tables.data(), max_blocks, contexts.data(),
                      seqs, q_len, q_stride, heads, kv_heads, d, block, scale, out.data(), 2,
                      window);
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
          for (int64_t x = 0; x < d; ++x) dot += static_cast<double>(qr[x]) * k[at + x];
          logits.push_back(dot * scale);
          top = std::max(top, logits.back());
        }
        double sum = 0;
        for (double& l : logits) sum += (l = std::exp(l - top));
        const float* got = out.data() + ((s * q_len + t) * heads + h) * d;
        for (int64_t x = 0; x < d; ++x) {
          double want = 0;
          for (int64_t p = first; p <= last; ++p) {
            const int64_t at = (tables[s * max_blocks + p / block] * block + p % block) * slot
                               + kvh * d;
            want += logits[p - first] / sum * v[at + x];
          }
          if (!close(got[x], want, 1e-4, 1e-5, "paged_attention_f32")) return false;
        }
      }
    }
  }
  return true;
}

bool norm_act_case(int64_t rows, int64_t cols) {
  std::vector<uint16_t> x(rows * cols), r(rows * cols), w(cols), out(rows * cols);
  std::vector<float> xf(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) {
    x[i] = to_bf16(3 * uniform());
    r[i] = to_bf16(uniform());
    xf[i] = from_bf16(to_bf16(from_bf16(x[i]) + from_bf16(r[i])));  // the in-place sum
  }
  for (auto& e : w) e = to_bf16(1.f + 0.5f * uniform());
  add_rms_norm_bf16(x.data(), r.data(), w.data(), out.data(), rows, cols, 1e-5f, 2);
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
    }
  }
  std::vector<uint16_t> gate_up(rows * 2 * cols), act(rows * cols);
  for (auto& e : gate_up) e = to_bf16(4 * uniform());
  silu_mul_bf16(gate_up.data(), act.data(), rows, cols, 2);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const double g = from_bf16(gate_up[i * 2 * cols + c]);
      const double u = from_bf16(gate_up[i * 2 * cols + cols + c]);
      if (!close(from_bf16(act[i * cols + c]), g / (1 + std::exp(-g)) * u, 1.0 / 128, 1e-6,
                 "silu_mul_bf16"))
        return false;
    }
  return true;
}

}  // namespace

int main() {
  // (heads, kv_heads, head_dim, block, q_len, window): SmolLM2's GQA 9/3 x 64, MHA x 128,
  // a head_dim and a block size off the vector paths, a sliding window
  const int64_t cases[][6] = {{9, 3, 64, 16, 1, 0},  {9, 3, 64, 16, 3, 0}, {4, 4, 128, 32, 1, 0},
                              {4, 2, 16, 16, 3, 0},  {6, 2, 64, 8, 1, 0},  {9, 3, 64, 16, 3, 7}};
  for (const auto& c : cases)
    if (!attention_case(c[0], c[1], c[2], c[3], c[4], c[5])) return 1;
  for (int64_t rows : {1, 7})
    for (int64_t cols : {576, 1000})
      if (!norm_act_case(rows, cols)) return 1;
  std::printf("ok: %d checks\n", checks);
  return 0;
}
