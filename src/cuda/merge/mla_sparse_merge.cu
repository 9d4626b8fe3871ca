// The merge of the FlashMLA-shaped sparse decode (mla_sparse.h): every
// request's partials, those of the main cache and of the extra one, combine
// in one launch of the decode's merge kernel (decode_merge.cuh), whose
// finalize applies the attention sink and writes FlashMLA's lse of an empty
// row. Its own translation unit, so decode.cu's instantiations stay as they
// are; the three kernels here are bf16 and f16 of the batch size a request's
// partial count picks.
#include "core/cuda_hooks.h"
#include "cuda/merge/decode_merge.cuh"

namespace sparsepage::detail {

void merge_partials_cuda(const MergePartialsArgs& a, void* stream) {
  if (a.num_requests == 0) return;
  if (a.heads < 1 || a.tokens < 1 || a.dv < 4 || a.dv % 4 != 0)
    throw Error("mla_sparse merge: heads, tokens must be at least 1 and dv a positive multiple of 4");
  cuda::MergeParams m;
  m.partial_o = a.partial_o;
  m.partial_lse = a.partial_lse;
  m.merge_indptr = a.merge_indptr;
  m.merge_requests = a.merge_requests;
  m.group_size = a.heads;  // one query token per request: rows are heads
  m.heads = a.heads;
  m.q_len = 1;
  m.dv = a.dv;
  m.partial_dv = a.dv;
  m.num_kv_heads = a.tokens;  // request r = b * tokens + t, folded as KV head t of sequence b
  m.o_seq = a.o_seq;
  m.o_head = a.o_head;
  m.o = a.o;
  m.lse = a.lse;
  m.sink = a.sink;
  m.empty_lse = a.empty_lse;
  auto s = static_cast<cudaStream_t>(stream);
  if (a.dtype == DType::kBF16) {
    cuda::launch_merge<__nv_bfloat16>(m, a.max_partials, a.num_requests, s);
  } else if (a.dtype == DType::kF16) {
    cuda::launch_merge<__half>(m, a.max_partials, a.num_requests, s);
  } else {
    throw Error(std::string("mla_sparse merge: o of dtype ") + dtype_name(a.dtype) + " has no CUDA merge (bf16, f16)");
  }
}

}  // namespace sparsepage::detail
