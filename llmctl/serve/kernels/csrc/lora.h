// The LoRA descriptors llmctl/serve/lora/batch.py hands to lora.cpp and decode_layer.cpp
// (ctypes Structures of the same layout there).

#pragma once

#include <cstdint>

struct LoraPair {  // one adapter on one fused linear of one layer
  const float* a;  // A [r, in]: the targeted projections' A stacked; null: not targeted
  const float* b;  // B^T [r, out]: block-diagonal over the projections, scale folded in
  int64_t r;
};

struct LoraSeg {  // the rows [start, end) of one adapter in a step
  int64_t start, end;
  const LoraPair* pairs;  // the adapter's table: [layer * 4 + target], targets in
                          // lora_adapter.FUSED order (qkv, o, gate_up, down)
};

extern "C" void lora_add_bf16(const uint16_t* x, int64_t ldx, uint16_t* y, int64_t ldy,
                              int64_t in, int64_t out, const LoraSeg* segs, int64_t nsegs,
                              int64_t slot, int num_threads);
