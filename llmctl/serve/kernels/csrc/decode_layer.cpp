// One decoder layer for a decode step (up to 256 tokens on bf16 weights, 8 on
// int4/int8 codes with VNNI, 12 on torch-layout bf16 weights with AVX2:
// llmctl/serve/layers/decode_layers.py), bfloat16 activations, in one call.
//
// At batch 1 a SmolLM2 layer is ten kernel calls of a few microseconds of work each;
// from Python each cost 5-10 us more in dispatch (ctypes, torch.empty, views), about
// 1 ms of a 7-12 ms token. Here the same kernels run in the same order on the same
// data, called from C: the result is bit for bit the layer-by-layer path's
// (tests/serve/kernels/test_cpu_kernels.py and test_decode_layer_avx2.py hold it to that).
// Nothing new is computed here.
//
//   qkv = W_qkv h;  RoPE(q, k), K/V -> cache;  a = attention(q, cache)
//   o = W_o a;  o = RMSNorm(o) w_attn_out (sandwich/post norms);  x += o * rs
//   h = RMSNorm(x) w_post (or h = x without a pre-MLP norm)
//   m = W_down act_mul(W_gate_up h);  m = RMSNorm(m) w_mlp_out;  x += m * rs
//   h = RMSNorm(x) w_next (or h = x: the next layer reads the residual stream)
// as llmctl/serve/model/decoder.py's layer loop does it (LlamaModel.forward, _branch,
// _add_norm): act_mul is SwiGLU or GeGLU (norm_act.cpp), rs Granite's residual
// multiplier (1: no product; else bf16(x * float(rs)), torch's bf16 product with a
// Python float), a norm on a branch is add_rms_norm_bf16 without a residual, an add
// without a norm torch's bf16 add (bf16(x + b)). Per layer (Layer): its sliding window,
// its RoPE table (Gemma 3's sliding layers have their own; rot < head_dim: partial
// rotary) and which norms it has; per model (Step): the attention scale and soft-cap.
//
// Each matrix (Matrix.kind) is, with the kernel and the arguments its Python layer
// (llmctl/serve/layers/quant_linear.py, lowbit.py) passes:
//   0  a bf16 weight in gemm_bf16.cpp's layout (PackedLinear's own form; AVX512-BF16)
//   1  int4/int8 codes in lowbit_vnni.cpp's layout (LowBitLinear, up to its vnni_rows)
//   2  a bf16 weight in torch's [n, k] layout, gemm_bf16w_avx2 (gemv_bf16_avx2.cpp:
//      WideningBF16Linear, AVX2 + FMA), widened to float32 in registers
//   3  int4/int8 codes in lowbit_avx2.cpp's layout, lowbit_gemv_avx2 (LowBitLinear with
//      avx2 set: a CPU with AVX2 + FMA but no AVX512-BF16)
// so an AVX2-only CPU (AMD Zen 3) runs the fused layer on kinds 2 and 3, and a layer may
// mix kinds. A bias (bf16) is added as the Python layer adds it: kinds 0, 1 and 3 round
// the product to bf16 and then add (torch's `out + bias`: one more rounding); kind 2
// adds it to the float32 sums and rounds once (WideningBF16Linear). A layer with a q/k
// norm runs here only where the layer loop norms q and k with norm_act.cpp's kernel
// (NormActKernels.qk_norm), not torch's RMSNorm op. The cache is bf16 (kv_kind 0), int8
// codes with their scales per slot (1) or fp8 codes with the layer's static scales (2)
// (llmctl/serve/layers/kv_quant.py), written and read by the _i8 and _f8 kernels; attention,
// RoPE, the norms and SwiGLU are portable C with AVX-512 or AVX2 bodies where compiled in.
//
// LoRA: a step whose rows carry adapters (Step.lora: row ranges, each with its adapter)
// adds each fused linear's adapter terms right after its product (and bias), with the
// kernel the layer loop calls (lora.cpp), so the result stays the layer loop's.

#include <cstdint>

#include "lora.h"
#include "simd_math.h"

using namespace llmctl_simd;

extern "C" {

void gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t m, int64_t blocks,
               int64_t k, uint16_t* out, int64_t ldo, int64_t n_valid, int num_threads);
void lowbit_gemv_vnni(const uint16_t* x, int64_t ldx, const uint8_t* w, int bits, const float* s,
                      const float* z, int64_t m, int64_t blocks, int64_t k, int64_t group,
                      void* out, int64_t ldo, int64_t n_valid, int out_f32, int num_threads);
void gemm_bf16w_avx2(const void* x, int64_t ldx, int x_is_bf16, const uint16_t* w,
                     int64_t rows, int64_t n, int64_t k, void* out, int64_t ldo,
                     int out_is_bf16, int num_threads);
void lowbit_gemv_avx2(const void* x, int64_t ldx, int x_f32, const uint8_t* w, int bits,
                      const float* s, const float* z, int64_t m, int64_t blocks, int64_t k,
                      int64_t group, void* out, int64_t ldo, int64_t n_valid, int out_f32,
                      int num_threads);
void rope_kv_bf16(uint16_t* qk, int64_t qk_stride, const uint16_t* v, int64_t v_stride,
                  int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d, int64_t rot,
                  const float* freqs, const int64_t* positions, const int64_t* slots,
                  uint16_t* k_cache, uint16_t* v_cache, int num_threads);
void paged_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                          const int64_t* bt, int64_t max_blocks, const int64_t* ctx,
                          int64_t num_seqs, int64_t q_len, int64_t q_stride, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, float* out, int num_threads, int64_t window,
                          float softcap, const float* sinks);
void rope_kv_bf16_i8(uint16_t* qk, int64_t qk_stride, const uint16_t* v, int64_t v_stride,
                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                     int64_t rot, const float* freqs, const int64_t* positions,
                     const int64_t* slots,
                     int8_t* k_cache, int8_t* v_cache, float* k_scale, float* v_scale,
                     int num_threads);
void paged_attention_bf16_i8(const uint16_t* q, const int8_t* k, const int8_t* v,
                             const float* ks, const float* vs, const int64_t* bt,
                             int64_t max_blocks, const int64_t* ctx, int64_t num_seqs,
                             int64_t q_len, int64_t q_stride, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float* out, int num_threads, int64_t window,
                          float softcap, const float* sinks);
void rope_kv_bf16_f8(uint16_t* qk, int64_t qk_stride, const uint16_t* v, int64_t v_stride,
                     int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                     int64_t rot, const float* freqs, const int64_t* positions,
                     const int64_t* slots,
                     uint8_t* k_cache, uint8_t* v_cache, const float* k_scale,
                     const float* v_scale, int num_threads);
void paged_attention_bf16_f8(const uint16_t* q, const uint8_t* k, const uint8_t* v,
                             const float* ks, const float* vs, const int64_t* bt,
                             int64_t max_blocks, const int64_t* ctx, int64_t num_seqs,
                             int64_t q_len, int64_t q_stride, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             float scale, float* out, int num_threads, int64_t window,
                          float softcap, const float* sinks);
void add_rms_norm_bf16(uint16_t* x, const uint16_t* residual, const uint16_t* weight,
                       uint16_t* out, int64_t rows, int64_t cols, float eps, int num_threads);
void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter,
                   int num_threads);
void gelu_tanh_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t inter,
                        int num_threads);
void rms_norm_groups_bf16(const uint16_t* x, int64_t ld, uint16_t* out, int64_t out_ld,
                          int64_t rows, int64_t groups, int64_t cols, const uint16_t* weight,
                          int64_t w_ld, float eps, int num_threads);

// A matrix as llmctl/serve/layers/decode_layers.py's DecodeLayers describes it (ctypes Structure).
struct Matrix {
  int64_t kind;  // 0: gemm_bf16, 1: lowbit_gemv_vnni, 2: gemm_bf16w_avx2, 3: lowbit_gemv_avx2
  const void* w;
  const float* s;
  const float* z;
  int64_t bits, blocks, k, group, n;
  const uint16_t* bias;  // bf16 [n], or null
};

struct Step {  // what every layer of one step shares
  int64_t m, hidden, q_heads, kv_heads, head_dim;
  const int64_t* positions;
  const int64_t* slots;
  const int64_t* block_tables;
  int64_t max_blocks;
  const int64_t* context_lens;
  int64_t block_size;
  float scale, eps;
  uint16_t* x;  // [m, hidden] residual stream, updated
  uint16_t* h;  // [m, hidden] normed input, replaced by the next layer's
  uint16_t* qkv;  // scratch [m, qkv n]
  uint16_t* attn;  // scratch [m, q_heads * head_dim]
  float* attn_f;  // scratch, same, float32
  uint16_t* proj;  // scratch [m, hidden]
  uint16_t* gate_up;  // scratch [m, gate_up n]
  uint16_t* act_out;  // scratch [m, gate_up n / 2]
  int num_threads;
  const LoraSeg* lora;  // the step's adapter row ranges (lora.h), lora_n of them (0: none)
  int64_t lora_n;
  int64_t layer;  // this layer's index, for the adapters' tables (set before each call)
  float* sums;  // scratch [m, widest n] float32: a kind 2 product's sums before its bias
  float softcap;  // attention logit soft-capping, 0: none
  int64_t act;  // the gated MLP's activation: 0 SiLU (SwiGLU), 1 tanh GeLU (GeGLU)
  float residual_scale;  // each branch's output times this before the residual add
};

struct Layer {  // one layer's descriptors, bound once (decode_layers.py's Layer)
  const Matrix* qkv;
  const Matrix* o;
  const Matrix* gate_up;
  const Matrix* down;
  const float* freqs;  // its RoPE table [positions, rot / 2, 2]
  int64_t rot;  // the rotated dimensions of a head
  int64_t window;  // its sliding window, 0: none
  int64_t input_is_x;  // no input norm (OLMo 2): attention reads the residual stream
  const uint16_t* attn_out_norm;  // RMSNorm weights [hidden] or null
  const uint16_t* post_norm;  // before the MLP; null: the MLP reads the residual stream
  const uint16_t* mlp_out_norm;
  const uint16_t* next_norm;  // the next layer's input norm (or the final norm); null: none
  const uint16_t* qk_norm;  // q/k norm weights or null: [heads + kv_heads, head_dim] per
  int64_t qk_norm_per_head;  // head, else [(heads + kv_heads) * head_dim] per projection
};

// out = W x (+ bias) for the step's rows, then the adapters' terms of fused linear `target`
static void apply(const Matrix& mat, const uint16_t* x, uint16_t* out, const Step& st,
                  int64_t target) {
  const int64_t n = mat.n;
  bool rounded = true;  // out holds the bf16 product (else st.sums the float32 one)
  switch (mat.kind) {
    case 0:
      gemm_bf16(x, mat.k, static_cast<const uint16_t*>(mat.w), st.m, mat.blocks, mat.k, out, n,
                n, st.num_threads);
      break;
    case 1:
      lowbit_gemv_vnni(x, mat.k, static_cast<const uint8_t*>(mat.w), static_cast<int>(mat.bits),
                       mat.s, mat.z, st.m, mat.blocks, mat.k, mat.group, out, n, n, 0,
                       st.num_threads);
      break;
    case 2:  // with a bias, float32 sums: the bias joins them before the one rounding
      rounded = mat.bias == nullptr;
      gemm_bf16w_avx2(x, mat.k, 1, static_cast<const uint16_t*>(mat.w), st.m, n, mat.k,
                      rounded ? static_cast<void*>(out) : static_cast<void*>(st.sums), n,
                      rounded ? 1 : 0, st.num_threads);
      break;
    default:
      lowbit_gemv_avx2(x, mat.k, 0, static_cast<const uint8_t*>(mat.w),
                       static_cast<int>(mat.bits), mat.s, mat.z, st.m, mat.blocks, mat.k,
                       mat.group, out, n, n, 0, st.num_threads);
  }
  if (mat.bias != nullptr) {
    for (int64_t r = 0; r < st.m; ++r) {
      uint16_t* o = out + r * n;
      if (rounded) {  // torch's bf16 `out + bias`: the float32 sum rounded to nearest even
        for (int64_t j = 0; j < n; ++j)
          o[j] = float_to_bf16(bf16_to_float(o[j]) + bf16_to_float(mat.bias[j]));
      } else {  // WideningBF16Linear: `out += bias.float()`, then `.to(bfloat16)`
        const float* f = st.sums + r * n;
        for (int64_t j = 0; j < n; ++j) o[j] = float_to_bf16(f[j] + bf16_to_float(mat.bias[j]));
      }
    }
  }
  if (st.lora_n)
    lora_add_bf16(x, mat.k, out, n, mat.k, n, st.lora, st.lora_n, st.layer * 4 + target,
                  st.num_threads);
}

// RoPE + cache write and attention of the step's q/k/v in st.qkv, into st.attn (bf16)
// (no attention sinks: the one family with them, gpt-oss, has mixture-of-experts layers,
// which have no form here, so decoder.py never builds this for it)
static void attention(const Step& st, const Layer& ly, void* k_cache, void* v_cache,
                      float* k_scale, float* v_scale, int64_t kv_kind) {
  const int64_t d = st.head_dim, q_size = st.q_heads * d, width = ly.qkv->n;
  const uint16_t* v_new = st.qkv + q_size + st.kv_heads * d;
  if (kv_kind == 2) {
    uint8_t* kc = static_cast<uint8_t*>(k_cache);
    uint8_t* vc = static_cast<uint8_t*>(v_cache);
    rope_kv_bf16_f8(st.qkv, width, v_new, width, st.m, st.q_heads, st.kv_heads, d, ly.rot,
                    ly.freqs, st.positions, st.slots, kc, vc, k_scale, v_scale, st.num_threads);
    paged_attention_bf16_f8(st.qkv, kc, vc, k_scale, v_scale, st.block_tables, st.max_blocks,
                            st.context_lens, st.m, 1, width, st.q_heads, st.kv_heads, d,
                            st.block_size, st.scale, st.attn_f, st.num_threads, ly.window,
                            st.softcap, nullptr);
  } else if (kv_kind == 1) {
    int8_t* kc = static_cast<int8_t*>(k_cache);
    int8_t* vc = static_cast<int8_t*>(v_cache);
    rope_kv_bf16_i8(st.qkv, width, v_new, width, st.m, st.q_heads, st.kv_heads, d, ly.rot,
                    ly.freqs, st.positions, st.slots, kc, vc, k_scale, v_scale, st.num_threads);
    paged_attention_bf16_i8(st.qkv, kc, vc, k_scale, v_scale, st.block_tables, st.max_blocks,
                            st.context_lens, st.m, 1, width, st.q_heads, st.kv_heads, d,
                            st.block_size, st.scale, st.attn_f, st.num_threads, ly.window,
                            st.softcap, nullptr);
  } else {
    uint16_t* kc = static_cast<uint16_t*>(k_cache);
    uint16_t* vc = static_cast<uint16_t*>(v_cache);
    rope_kv_bf16(st.qkv, width, v_new, width, st.m, st.q_heads, st.kv_heads, d, ly.rot,
                 ly.freqs, st.positions, st.slots, kc, vc, st.num_threads);
    paged_attention_bf16(st.qkv, kc, vc, st.block_tables, st.max_blocks, st.context_lens,
                         st.m, 1, width, st.q_heads, st.kv_heads, d, st.block_size, st.scale,
                         st.attn_f, st.num_threads, ly.window, st.softcap, nullptr);
  }
  for (int64_t i = 0; i < st.m * q_size; ++i) st.attn[i] = float_to_bf16(st.attn_f[i]);
}

// q and k in st.qkv RMS-normed in place, as NormActKernels.qk_norm does in the layer loop
// (norm_act.cpp's rms_norm_groups_bf16): per head, or over each whole projection
static void qk_norm(const Step& st, const Layer& ly) {
  const int64_t d = st.head_dim, width = ly.qkv->n, q_size = st.q_heads * d;
  if (ly.qk_norm_per_head) {
    rms_norm_groups_bf16(st.qkv, width, st.qkv, width, st.m, st.q_heads + st.kv_heads, d,
                         ly.qk_norm, d, st.eps, st.num_threads);
    return;
  }
  rms_norm_groups_bf16(st.qkv, width, st.qkv, width, st.m, 1, q_size, ly.qk_norm, 0, st.eps,
                       st.num_threads);
  rms_norm_groups_bf16(st.qkv + q_size, width, st.qkv + q_size, width, st.m, 1,
                       st.kv_heads * d, ly.qk_norm + q_size, 0, st.eps, st.num_threads);
}

// A branch's output b [m, hidden] into the residual stream, as the layer loop's _branch
// and _add_norm do: b = RMSNorm(b) w_out (in place), b = bf16(b * rs), then x += b and
// h = RMSNorm(x) w_norm, or without w_norm x = bf16(x + b) alone (h not written).
static void add_branch(const Step& st, uint16_t* b, const uint16_t* out_norm,
                       const uint16_t* norm) {
  const int64_t n = st.m * st.hidden;
  if (out_norm != nullptr)
    add_rms_norm_bf16(b, nullptr, out_norm, b, st.m, st.hidden, st.eps, st.num_threads);
  if (st.residual_scale != 1.f)
    for (int64_t i = 0; i < n; ++i) b[i] = float_to_bf16(bf16_to_float(b[i]) * st.residual_scale);
  if (norm != nullptr) {
    add_rms_norm_bf16(st.x, b, norm, st.h, st.m, st.hidden, st.eps, st.num_threads);
  } else {
    for (int64_t i = 0; i < n; ++i)
      st.x[i] = float_to_bf16(bf16_to_float(st.x[i]) + bf16_to_float(b[i]));
  }
}

// One layer; its input is st.h (or st.x where it has no input norm), and st.h holds the
// next layer's normed input after it (where that layer has an input norm).
void decode_layer_bf16(const Step* step, const Layer* layer, void* k_cache, void* v_cache,
                       float* k_scale, float* v_scale, int64_t kv_kind) {
  const Step& st = *step;
  const Layer& ly = *layer;
  apply(*ly.qkv, ly.input_is_x ? st.x : st.h, st.qkv, st, 0);
  if (ly.qk_norm != nullptr) qk_norm(st, ly);
  attention(st, ly, k_cache, v_cache, k_scale, v_scale, kv_kind);
  apply(*ly.o, st.attn, st.proj, st, 1);
  add_branch(st, st.proj, ly.attn_out_norm, ly.post_norm);
  apply(*ly.gate_up, ly.post_norm != nullptr ? st.h : st.x, st.gate_up, st, 2);
  (st.act == 1 ? gelu_tanh_mul_bf16 : silu_mul_bf16)(st.gate_up, st.act_out, st.m,
                                                     ly.gate_up->n / 2, st.num_threads);
  apply(*ly.down, st.act_out, st.proj, st, 3);
  add_branch(st, st.proj, ly.mlp_out_norm, ly.next_norm);
}

}  // extern "C"
