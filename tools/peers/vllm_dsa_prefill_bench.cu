// vllm_dsa_prefill_bench - the two DSA prefill kernels of vLLM's DeepSeek-V3.2 path on an H200
// (sm_90a), for a chunk of T query tokens that ends a context of CTX keys (causal: query t sees
// keys [0, CTX - T + t + 1)). Our driver; the peers' code is compiled from
// $PEERS_DIR/peers-bench/third_party by tools/peers/build.sh, none of it is copied here.
//   dg_fp8_mqa_logits            DeepGEMM fp8_mqa_logits (sm90): q e4m3 [T, 64, 128], keys e4m3
//                                [CTX, 128] + fp32 scales [CTX] (vLLM gathers the paged index keys
//                                into this contiguous form first), fp32 weights [T, 64], ks/ke per
//                                query, fp32 logits [T, align(CTX + 256, 256)]. vLLM calls it with
//                                clean_logits=False (its prefill top-k reads ks/ke), so
//                                DeepGEMM's clean_logits kernel is not part of the row.
//   flashmla_sparse_fwd_prefill  FlashMLA sm90 sparse prefill (prefill/sparse phase1, d_qk 576):
//                                q bf16 [T, 128, 576], kv bf16 [CTX, 1, 576], 2048 causal-valid
//                                indices per query, out bf16 [T, 128, 512].
// CSV: B = T, S = CTX. --launches is not used: each graph holds max(4, copies) launches, where
// cold mode (--rotate) rotates over enough copies of each kernel's reused inputs (keys/queries
// of the logits kernel, the kv rows of sparse_fwd) that their bytes reach ~2.5x the L2.
//
// Two parts, two translation units (build.sh): -DVLLM_DSA_PART_DEEPGEMM (DeepGEMM's template
// instantiated as its host code would on an H200, its TMA descriptors, DeepGEMM's CUTLASS) and
// the driver (FlashMLA's headers and CUTLASS, peers_common.cuh).
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "dsa_peers_common.h"

namespace dsa_prefill {
constexpr int kHeads = 64, kDim = 128;
constexpr int kBlockQ = 128 / kHeads;  // 2 queries per tile (block_qh 128 / 64 heads)
constexpr int kBlockKV = 256;
constexpr int kDgSms = 132;  // compiled into the kernel (its persistent grid stride)

struct MqaLogitsPlan {
  CUtensorMap q, kv, kv_scales, weights;
  int seq_len = 0, seq_len_kv = 0, stride = 0, smem = 0;
  const int* ks = nullptr;
  const int* ke = nullptr;
  float* logits = nullptr;
};
// q e4m3 [T][64][128], kv e4m3 [CTX][128], scales fp32 [align(CTX, 4)], weights fp32 [T][64]
void make_mqa_logits_plan(MqaLogitsPlan* p, const void* q, const void* kv, const float* kv_scales, const float* weights,
                          int seq_len, int seq_len_kv, const int* ks, const int* ke, float* logits, int stride);
void mqa_logits(const MqaLogitsPlan& p, cudaStream_t s);
}  // namespace dsa_prefill

#if defined(VLLM_DSA_PART_DEEPGEMM)
// =================================================================== part 1: DeepGEMM
// csrc/jit_kernels/impls/sm90_fp8_mqa_logits.hpp at 54e22612 for 64 heads x 128, FP8:
//   sm90_fp8_mqa_logits<heads 64, head_dim 128, not compressed (max_seqlen_k = 0), block_q 2,
//       block_kv 256, 3 q stages, 3 kv stages, SMs (132), 128 TMA threads, 512 math threads,
//       float logits>, grid = SMs, PDL on.
#include <deep_gemm/impls/sm90_fp8_mqa_logits.cuh>

namespace dsa_prefill {
namespace {
// DeepGEMM's make_tma_2d_desc: [outer][inner] with the outer stride in elements.
CUtensorMap tma_2d(CUtensorMapDataType dt, int elem, const void* ptr, uint64_t inner, uint64_t outer,
                   uint32_t box_inner, uint32_t box_outer, uint64_t outer_stride, int swizzle) {
  const uint64_t dims[2] = {inner, outer}, strides[1] = {outer_stride};
  uint32_t box[2] = {box_inner, box_outer};
  return dsa_peers::tma_desc(dt, elem, ptr, 2, dims, strides, box, swizzle);
}

constexpr int kQStages = 3, kKVStages = 3, kTmaThreads = 128, kMathThreads = 512;
constexpr auto kKernel = &deep_gemm::sm90_fp8_mqa_logits<kHeads, kDim, false, kBlockQ, kBlockKV, kQStages, kKVStages,
                                                         kDgSms, kTmaThreads, kMathThreads, float>;
constexpr int smem_bytes() {  // as DeepGEMM's host sums it
  return kQStages * kBlockQ * kHeads * kDim + kKVStages * kBlockKV * kDim + kQStages * kBlockQ * kHeads * 4 +
         kKVStages * kBlockKV * 4 + (kQStages * 2 + kKVStages * 2 + (kMathThreads / 128) * 2) * 8 + 4;
}
}  // namespace

void make_mqa_logits_plan(MqaLogitsPlan* p, const void* q, const void* kv, const float* kv_scales, const float* weights,
                          int seq_len, int seq_len_kv, const int* ks, const int* ke, float* logits, int stride) {
  p->q =
      tma_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, q, kDim, uint64_t(seq_len) * kHeads, kDim, kBlockQ * kHeads, kDim, kDim);
  p->kv = tma_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, kv, kDim, uint64_t(seq_len_kv), kDim, kBlockKV, kDim, kDim);
  // scales: one row of align(seq_len_kv, 4) floats (get_tma_aligned_size), outer stride 0
  p->kv_scales =
      tma_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, kv_scales, uint64_t((seq_len_kv + 3) / 4 * 4), 1, kBlockKV, 1, 0, 0);
  p->weights =
      tma_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, weights, kHeads, uint64_t(seq_len), kHeads, kBlockQ, kHeads, 0);
  p->seq_len = seq_len;
  p->seq_len_kv = seq_len_kv;
  p->stride = stride;
  p->ks = ks;
  p->ke = ke;
  p->logits = logits;
  p->smem = smem_bytes();
  DSA_CK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, p->smem));
}

void mqa_logits(const MqaLogitsPlan& p, cudaStream_t s) {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t c = dsa_peers::pdl_launch_config(dim3(kDgSms), dim3(kTmaThreads + kMathThreads), p.smem, s, attr);
  uint32_t seq_len = uint32_t(p.seq_len), seq_len_kv = uint32_t(p.seq_len_kv), max_seqlen_k = 0,
           stride = uint32_t(p.stride);
  uint32_t* ks = reinterpret_cast<uint32_t*>(const_cast<int*>(p.ks));
  uint32_t* ke = reinterpret_cast<uint32_t*>(const_cast<int*>(p.ke));
  float* logits = p.logits;
  CUtensorMap q = p.q, kv = p.kv, sc = p.kv_scales, w = p.weights;
  void* args[] = {&seq_len, &seq_len_kv, &max_seqlen_k, &stride, &ks, &ke, &logits, &q, &kv, &sc, &w};
  DSA_CK(cudaLaunchKernelExC(&c, reinterpret_cast<const void*>(kKernel), args));
}
}  // namespace dsa_prefill

#else
// =================================================================== part 2: the driver
#include <cuda_fp8.h>

#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

#include "peers_common.cuh"
#include "dsa_peers_device.cuh"

namespace {
using bf16 = cutlass::bfloat16_t;
using dsa_prefill::kDim;
using dsa_prefill::kHeads;
constexpr int H = 128, D_QK = 576, D_V = 512, TOPK = 2048;
constexpr float LOG2E = 1.44269504f;

using dsa_peers::fill_e4m3_kernel;
using dsa_peers::fill_f32_kernel;

// Keys as vLLM's indexer cache holds them (gathered contiguous): e4m3 values and a power-of-two
// (ue8m0) fp32 scale per key. One warp per key.
__global__ void fill_keys_kernel(uint8_t* k, float* scales, size_t n, uint64_t seed) {
  const size_t t = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (t >= n) return;
  uint8_t bytes[4];
  const float scale = dsa_peers::warp_fp8_key(seed, t, bytes);
  for (int i = 0; i < 4; ++i) k[t * kDim + lane * 4 + i] = bytes[i];
  if (lane == 0) scales[t] = scale;
}
// Valid logits of row i are columns [0, len0 + i); count the non-finite ones.
__global__ void count_nonfinite_causal_kernel(const float* p, int rows, size_t stride, int len0,
                                              unsigned long long* n) {
  unsigned long long c = 0;
  for (int r = blockIdx.x; r < rows; r += gridDim.x)
    for (int j = threadIdx.x; j < len0 + r; j += blockDim.x)
      if (!isfinite(p[size_t(r) * stride + j])) ++c;
  if (c) atomicAdd(n, c);
}
__global__ void count_nonfinite_bf16_kernel(const __nv_bfloat16* p, size_t n, unsigned long long* out) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    if (!isfinite(__bfloat162float(p[i]))) ++c;
  if (c) atomicAdd(out, c);
}

using dsa_peers::dalloc;
using dsa_peers::e4m3_to_float;
using dsa_peers::grid_for;
using dsa_peers::to_host;
int copies_for(const peers::Options& opt, const peers::DeviceInfo& dev, double bytes_per_copy) {
  if (!opt.rotate) return 1;
  return std::max(1, std::min(64, int(std::ceil(peers::cold_target_bytes(opt, dev) / bytes_per_copy))));
}
unsigned long long device_count(std::function<void(unsigned long long*)> launch) {
  unsigned long long* d = dalloc<unsigned long long>(1);
  CK(cudaMemset(d, 0, 8));
  launch(d);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  unsigned long long n = to_host(d, 1)[0];
  CK(cudaFree(d));
  return n;
}

void fill_row(peers::Row& row, const peers::Options& opt, const char* lib, const char* kernel, int T, int CTX, int hq,
              int dqk, int dv, int L, int P) {
  row.lib = lib;
  row.kernel = kernel;
  row.mode = opt.rotate ? "cold" : "warm";
  row.pool = "contiguous";
  row.B = T;
  row.S = CTX;
  row.hq = hq;
  row.requests = 1;
  row.dqk = dqk;
  row.dv = dv;
  row.launches = L;
  row.selections = P;
}

// ---------------------------------------------------------------- DeepGEMM fp8_mqa_logits
void run_logits(const peers::Options& opt, const peers::DeviceInfo& dev, cudaStream_t s, int T, int CTX) {
  const int stride = (CTX + dsa_prefill::kBlockKV + 255) / 256 * 256;  // align(CTX + block_kv, 1024 B)
  const int rows = (T + dsa_prefill::kBlockQ - 1) / dsa_prefill::kBlockQ * dsa_prefill::kBlockQ;
  const int ctx4 = (CTX + 3) / 4 * 4;
  const double copy_bytes = double(T) * kHeads * (kDim + 4) + double(CTX) * (kDim + 4);
  const int P = copies_for(opt, dev, copy_bytes), L = std::max(4, P);
  struct Copy {
    uint8_t *q, *k;
    float *w, *ks;
    dsa_prefill::MqaLogitsPlan plan;
  };
  std::vector<Copy> c(P);
  // ks = 0, ke = CTX - T + t + 1: a single request whose chunk ends its context.
  std::vector<int> h_ks(T, 0), h_ke(T);
  for (int t = 0; t < T; ++t) h_ke[t] = CTX - T + t + 1;
  int* ks = dalloc<int>(T);
  int* ke = dalloc<int>(T);
  CK(cudaMemcpy(ks, h_ks.data(), T * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(ke, h_ke.data(), T * 4, cudaMemcpyHostToDevice));
  float* logits = dalloc<float>(size_t(rows) * stride);
  for (int i = 0; i < P; ++i) {
    const uint64_t sd = opt.seed * 31 + uint64_t(i) * 104729;
    c[i].q = dalloc<uint8_t>(size_t(T) * kHeads * kDim);
    c[i].w = dalloc<float>(size_t(T) * kHeads);
    c[i].k = dalloc<uint8_t>(size_t(CTX) * kDim);
    c[i].ks = dalloc<float>(ctx4);
    CK(cudaMemset(c[i].ks, 0, size_t(ctx4) * 4));
    fill_e4m3_kernel<<<grid_for(size_t(T) * kHeads * kDim), 256, 0, s>>>(c[i].q, size_t(T) * kHeads * kDim, sd + 1,
                                                                           448.f);
    fill_f32_kernel<<<grid_for(size_t(T) * kHeads), 256, 0, s>>>(c[i].w, size_t(T) * kHeads, sd + 2, 1.f);
    fill_keys_kernel<<<grid_for(size_t(CTX) * 32), 256, 0, s>>>(c[i].k, c[i].ks, size_t(CTX), sd + 3);
    CK(cudaGetLastError());
    dsa_prefill::make_mqa_logits_plan(&c[i].plan, c[i].q, c[i].k, c[i].ks, c[i].w, T, CTX, ks, ke, logits, stride);
  }
  CK(cudaStreamSynchronize(s));
  auto launch = [&](int i) { dsa_prefill::mqa_logits(c[i % P].plan, s); };

  // Sampled rows x sampled columns below ke against fp32 dot products of the dequantized keys
  // (sum_h relu(q_h . k) * w_h * scale), and every valid logit scanned for NaN/Inf.
  auto check = [&](int i) {
    peers::CheckResult r;
    r.nonfinite = (long long)device_count([&](unsigned long long* n) {
      count_nonfinite_causal_kernel<<<1024, 256, 0, s>>>(logits, T, size_t(stride), CTX - T + 1, n);
    });
    const std::vector<uint8_t> k = to_host(c[i].k, size_t(CTX) * kDim);
    const std::vector<float> sc = to_host(c[i].ks, size_t(CTX));
    std::mt19937 rng(uint32_t(opt.seed + i));
    dsa_peers::ErrorSum err;
    for (int t : peers::sample_requests(T, opt.check_all)) {
      const std::vector<uint8_t> q = to_host(c[i].q + size_t(t) * kHeads * kDim, size_t(kHeads) * kDim);
      const std::vector<float> w = to_host(c[i].w + size_t(t) * kHeads, size_t(kHeads));
      const std::vector<float> row = to_host(logits + size_t(t) * stride, size_t(h_ke[t]));
      std::vector<int> cols;
      for (int j = 0; j < 1024; ++j) cols.push_back(int(rng() % uint32_t(h_ke[t])));
      for (int j = std::max(0, h_ke[t] - 16); j < h_ke[t]; ++j) cols.push_back(j);
      for (int j : cols) {
        double acc = 0;
        for (int h = 0; h < kHeads; ++h) {
          double dot = 0;
          for (int d = 0; d < kDim; ++d)
            dot += double(e4m3_to_float(q[size_t(h) * kDim + d])) * e4m3_to_float(k[size_t(j) * kDim + d]);
          acc += std::max(dot, 0.0) * w[h];
        }
        acc *= sc[j];
        err.add(row[j], acc);
      }
    }
    // 2e-3: Hopper accumulates FP8 WGMMA products with fewer than fp32's mantissa bits; a layout
    // or scale mistake gives errors of order 1.
    dsa_peers::judge(r, err, 2e-3, 0.0, "logits");
    return r;
  };

  peers::Row row;
  CK(cudaMemsetAsync(logits, 0xFF, size_t(rows) * stride * 4, s));  // NaN
  launch(0);
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  row.c1 = check(0);
  peers::GraphRunner runner(s, L, opt.eager, launch);
  row.t = runner.time(opt.warmup, opt.reps);
  CK(cudaMemsetAsync(logits, 0xFF, size_t(rows) * stride * 4, s));
  runner.replay();
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  row.c2 = check((L - 1) % P);
  fill_row(row, opt, "deepgemm", "dg_fp8_mqa_logits", T, CTX, kHeads, kDim, 0, L, P);
  const double pairs = double(T) * (CTX - T) + 0.5 * double(T) * (T + 1);  // causal (query, key) pairs
  row.flops = 2.0 * pairs * kHeads * kDim;
  row.bytes = copy_bytes + double(T) * CTX * 4;  // inputs once + the logits written (upper bound)
  char notes[200];
  snprintf(notes, sizeof(notes), "copies=%d logits_stride=%d clean_logits=no block_q=%d block_kv=%d dg_sms=%d %s", P,
           stride, dsa_prefill::kBlockQ, dsa_prefill::kBlockKV, dsa_prefill::kDgSms,
           opt.eager ? "timing=eager" : "timing=graph");
  row.notes = notes;
  peers::print_row(row);
  for (Copy& x : c) cudaFree(x.q), cudaFree(x.w), cudaFree(x.k), cudaFree(x.ks);
  cudaFree(ks), cudaFree(ke), cudaFree(logits);
  CK(cudaGetLastError());
}

// ---------------------------------------------------------------- FlashMLA sparse_fwd
void run_sparse_fwd(const peers::Options& opt, const peers::DeviceInfo& dev, cudaStream_t s, int T, int CTX) {
  const double kv_bytes = double(CTX) * D_QK * 2;
  const int P = copies_for(opt, dev, kv_bytes), L = std::max(4, P);
  __nv_bfloat16* kv = dalloc<__nv_bfloat16>(size_t(P) * CTX * D_QK);  // P copies of the kv rows
  __nv_bfloat16* q = dalloc<__nv_bfloat16>(size_t(T) * H * D_QK);
  __nv_bfloat16* out = dalloc<__nv_bfloat16>(size_t(T) * H * D_V);
  float* lse = dalloc<float>(size_t(T) * H);
  float* max_logits = dalloc<float>(size_t(T) * H);
  peers::fill_uniform_bf16(kv, size_t(P) * CTX * D_QK, opt.seed * 37 + 1, 1.f, s);
  peers::fill_uniform_bf16(q, size_t(T) * H * D_QK, opt.seed * 37 + 2, 6.f, s);
  // 2048 distinct random keys per query among the ones it may see (Floyd's sampling).
  std::vector<int32_t> h_idx(size_t(T) * TOPK);
  {
    std::mt19937_64 rng(opt.seed * 41 + uint64_t(T) * 7 + CTX);
    std::vector<char> used(CTX, 0);
    for (int t = 0; t < T; ++t) {
      const int n = CTX - T + t + 1;
      int32_t* dst = h_idx.data() + size_t(t) * TOPK;
      int m = 0;
      for (int j = n - TOPK; j < n; ++j) {
        int v = int(rng() % uint64_t(j + 1));
        if (used[v]) v = j;
        used[v] = 1;
        dst[m++] = v;
      }
      for (int j = 0; j < TOPK; ++j) used[dst[j]] = 0;
      std::shuffle(dst, dst + TOPK, rng);
    }
  }
  int* idx = dalloc<int>(h_idx.size());
  CK(cudaMemcpy(idx, h_idx.data(), h_idx.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaStreamSynchronize(s));

  SparseAttnFwdParams fp;
  memset(&fp, 0, sizeof(fp));
  fp.s_q = T;
  fp.s_kv = CTX;
  fp.h_q = H;
  fp.h_kv = 1;
  fp.d_qk = D_QK;
  fp.d_v = D_V;
  fp.topk = TOPK;
  fp.sm_scale = 1.f / std::sqrt(float(D_QK));
  fp.sm_scale_div_log2 = fp.sm_scale * LOG2E;
  fp.q = reinterpret_cast<bf16*>(q);
  fp.indices = idx;
  fp.stride_q_s_q = H * D_QK;
  fp.stride_q_h_q = D_QK;
  fp.stride_kv_s_kv = D_QK;
  fp.stride_kv_h_kv = D_QK;
  fp.stride_indices_s_q = TOPK;
  fp.stride_indices_h_kv = TOPK;
  fp.out = reinterpret_cast<bf16*>(out);
  fp.max_logits = max_logits;
  fp.lse = lse;
  fp.num_sm = dev.sms;
  fp.stream = s;
  auto launch = [&](int i) {
    SparseAttnFwdParams p = fp;
    p.kv = reinterpret_cast<bf16*>(kv + size_t(i % P) * CTX * D_QK);
    sm90::fwd::run_fwd_phase1_kernel<D_QK, false>(p);
  };

  // Reference attention (peers_common.cuh, fp32) over each sampled query's 2048 rows; the whole
  // output scanned for NaN/Inf on the device (it is up to 2 GB), only sampled rows copied back.
  auto check = [&](int i) {
    peers::RefProblem rp;
    rp.nreq = T;
    rp.nheads = H;
    rp.S = TOPK;
    rp.dA = D_QK;
    rp.dB = 0;
    rp.dv = D_V;
    rp.q = q;
    rp.q_stride_req = H * D_QK;
    rp.q_stride_h = D_QK;
    rp.kA = kv + size_t(i % P) * CTX * D_QK;
    rp.kA_stride = D_QK;
    rp.v = rp.kA;
    rp.v_stride = D_QK;
    rp.idx = idx;
    rp.idx_stride = TOPK;
    rp.scale = fp.sm_scale;
    const std::vector<int> reqs = peers::sample_requests(T, opt.check_all);
    const std::vector<float> ref = peers::run_reference(rp, reqs);
    peers::CheckResult r;
    r.nonfinite = (long long)device_count([&](unsigned long long* n) {
      count_nonfinite_bf16_kernel<<<1024, 256, 0, s>>>(out, size_t(T) * H * D_V, n);
    });
    dsa_peers::ErrorSum err;
    for (size_t k = 0; k < reqs.size(); ++k) {
      const std::vector<uint16_t> o =
          to_host(reinterpret_cast<const uint16_t*>(out) + size_t(reqs[k]) * H * D_V, size_t(H) * D_V);
      for (int e = 0; e < H * D_V; ++e) {
        err.add(peers::bf16_to_float_host(o[e]), ref[k * size_t(H) * D_V + e]);
      }
    }
    dsa_peers::judge(r, err, 2e-2, 1e-3, "sparse_fwd");
    return r;
  };

  peers::Row row;
  peers::poison_bf16(out, size_t(T) * H * D_V, s);
  launch(0);
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  row.c1 = check(0);
  peers::GraphRunner runner(s, L, opt.eager, launch);
  row.t = runner.time(opt.warmup, opt.reps);
  peers::poison_bf16(out, size_t(T) * H * D_V, s);
  runner.replay();
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  row.c2 = check((L - 1) % P);
  fill_row(row, opt, "flashmla", "flashmla_sparse_fwd_prefill", T, CTX, H, D_QK, D_V, L, P);
  row.flops = 2.0 * T * H * TOPK * (D_QK + D_V);
  row.bytes = double(T) * TOPK * D_QK * 2;  // selected rows, as the decode rows count them
  char notes[160];
  snprintf(notes, sizeof(notes), "kv_copies=%d kv_MB=%.0f causal_random_top2048 grid=%d %s", P, kv_bytes / 1e6,
           (H / 64) * T, opt.eager ? "timing=eager" : "timing=graph");
  row.notes = notes;
  peers::print_row(row);
  cudaFree(kv), cudaFree(q), cudaFree(out), cudaFree(lse), cudaFree(max_logits), cudaFree(idx);
  CK(cudaGetLastError());
}
}  // namespace

int main(int argc, char** argv) {
  peers::Options opt = peers::parse_options(
      argc, argv,
      " [--kernels logits,sfwd]\n  configs: T:CTX[,T:CTX...] (chunk of T queries ending a context of CTX keys;"
      " default 4096:32768)\n  rows: dg_fp8_mqa_logits flashmla_sparse_fwd_prefill");
  if (opt.header) printf("%s\n", peers::csv_header());
  fflush(stdout);
  if (opt.configs.empty()) opt.configs = "4096:32768";
  if (opt.kernels.empty()) opt.kernels = "logits,sfwd";
  const auto configs = peers::parse_configs(opt.configs, 32768);
  peers::DeviceInfo dev = peers::device_info();
  REQUIRE(dev.cc_major == 9 && dev.cc_minor == 0, "built for sm_90a, found sm_%d%d (%s)", dev.cc_major, dev.cc_minor,
          dev.name.c_str());
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::string ks = "," + opt.kernels + ",";
  for (auto [T, CTX] : configs) {
    REQUIRE(T >= 1 && CTX >= T && CTX - T + 1 >= TOPK, "T=%d CTX=%d: every query must see >= %d keys", T, CTX, TOPK);
    if (ks.find(",logits,") != std::string::npos) run_logits(opt, dev, stream, T, CTX);
    if (ks.find(",sfwd,") != std::string::npos) run_sparse_fwd(opt, dev, stream, T, CTX);
  }
  CK(cudaStreamDestroy(stream));
  return peers::fail_count() ? 1 : 0;
}
#endif
