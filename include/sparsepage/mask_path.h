// The two dense alternatives a sparse decode replaces, kept as real paths:
// the mask path (attention over the whole live window with an additive mask)
// and the gather path (copy the selected rows, then attend to the copy).
// Both are what callers fall back to and what the benchmark compares against.
#pragma once

#include <cstdint>
#include <vector>

#include "sparsepage/decode.h"
#include "sparsepage/memory.h"
#include "sparsepage/selection.h"

namespace sparsepage {

/// Dense masked decode over the live window t < live_len of every
/// (sequence b, KV head h) request r = b * num_kv_heads + h, whose row t of
/// each stream is at `RowView::offset(b, h, t)` (a dense `[B, H, Cap, D]`
/// allocation: `RowView::dense`).
/// The operands are packed (dtype kF32 too, for dequantized caches).
struct MaskedDecodeParams : AttentionOperands {
  int32_t batch = 0;
  int32_t num_kv_heads = 0;  // attention KV heads
  int32_t group_size = 1;
  int64_t live_len = 0;  // live tokens (an upper bound when live_lens is set)
  /// Per-sequence live lengths [batch], read where the kernel runs (device
  /// memory on CUDA), each in [0, live_len]; null: live_len for every
  /// sequence. An entry outside is refused by name on the CPU; the CUDA
  /// kernel (no error flag here) writes that sequence's o and lse as NaN
  /// and reads none of its rows.
  /// With them one launch (and one captured graph) serves a growing context.
  const int32_t* live_lens = nullptr;
  const float* mask = nullptr;  // [batch * num_kv_heads, mask_pitch] additive (0 keeps, -inf drops); null: no mask
  int64_t mask_pitch = 0;       // floats per request's mask row, >= live_len; 0: live_len
};

void check_masked_decode_params(const MaskedDecodeParams& params);
void run_masked_decode_cpu(const MaskedDecodeParams& params);
/// CUDA mask path; `workspace` holds `masked_decode_workspace_bytes(params)`
/// bytes of device memory. Graph-capturable like run_decode_cuda.
size_t masked_decode_workspace_bytes(const MaskedDecodeParams& params, int32_t num_sms);
void run_masked_decode_cuda(const MaskedDecodeParams& params, void* workspace, void* stream = nullptr);

/// Copies the selected rows of `pool` into `dst` `[num_requests, max_rows,
/// pool.dim]` (row stride pool.dim), zero-filling rows past each request's
/// count. `rows`/`offsets` are the selection's arrays on `device`. Rows
/// outside [0, num_pool_rows) are not read: they are written as NaN. Every
/// count must be at most `max_rows`: the CPU backend throws otherwise, the
/// CUDA backend (which cannot read the counts on the host) copies the first
/// `max_rows`.
void gather_rows(Device device, const int32_t* rows, const int32_t* offsets, int32_t num_requests, int64_t max_rows,
                 DType dtype, const RowView& pool, int64_t num_pool_rows, void* dst, void* stream = nullptr);

}  // namespace sparsepage
