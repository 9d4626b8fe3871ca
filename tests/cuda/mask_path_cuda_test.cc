// The CUDA mask path against the CPU mask path and an fp64 reference; the
// device gather against the host gather; the device block->row pass against
// the host one.
#include <random>

#include "cuda/cuda_test_util.h"
#include "sparsepage/mask_path.h"
#include "sparsepage/selection.h"

namespace sparsepage::testing {
namespace {

enum class MaskKind { kNone, kRandom };

struct DenseCase {
  const char* name;
  DType dtype;
  int32_t batch, heads, k_heads;  // k_heads > heads: K carries extra heads after the attention heads
  int32_t group_size, dim_qk, dim_v, dim_extra;
  int64_t capacity, live_len;
  bool v_aliases_k;
  int32_t k_row_padding;
  MaskKind mask;
};

/// A dense problem in host memory: rows past live_len and K's extra heads are
/// NaN, so any read outside the live window of the attention heads shows.
struct DenseProblem {
  DenseCase c;
  std::vector<uint8_t> q, q_extra, k, v, e;
  std::vector<float> mask;
  int64_t k_stride = 0;
  float scale = 0;

  int64_t requests() const { return int64_t{c.batch} * c.heads; }
  MaskedDecodeParams params(const void* dq, const void* dqe, const void* dk, const void* dv, const void* de,
                            const float* dmask, void* o, float* lse) const {
    MaskedDecodeParams p;
    p.dtype = c.dtype;
    p.batch = c.batch;
    p.num_kv_heads = c.heads;
    p.group_size = c.group_size;
    p.live_len = c.live_len;
    p.q = dq;
    p.k = RowView::dense(dk, c.k_heads, c.capacity, c.dim_qk, k_stride);
    p.v = c.v_aliases_k ? RowView::dense(dk, c.k_heads, c.capacity, c.dim_v, k_stride)
                        : RowView::dense(dv, c.heads, c.capacity, c.dim_v);
    if (c.dim_extra > 0) {
      p.q_extra = dqe;
      p.k_extra = RowView::dense(de, c.heads, c.capacity, c.dim_extra);
    }
    p.mask = c.mask == MaskKind::kNone ? nullptr : dmask;
    p.scale = scale;
    p.o = o;
    p.lse = lse;
    return p;
  }
};

std::vector<uint8_t> dense_rows(DType dtype, int64_t batch, int64_t heads, int32_t live_heads, int64_t capacity,
                                int64_t live, int64_t stride, int64_t dim, std::mt19937_64& rng) {
  const size_t esize = dtype_size(dtype);
  std::vector<uint8_t> out = nan_values(dtype, static_cast<size_t>(batch * heads * capacity * stride));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < live_heads; ++h)
      for (int64_t t = 0; t < live; ++t) {
        const auto row = random_values(dtype, static_cast<size_t>(dim), rng);
        std::copy(row.begin(), row.end(),
                  out.begin() + static_cast<std::ptrdiff_t>(((b * heads + h) * capacity + t) * stride * esize));
      }
  return out;
}

DenseProblem make_dense(const DenseCase& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  DenseProblem pb;
  pb.c = c;
  pb.k_stride = c.dim_qk + c.k_row_padding;
  const size_t g_rows = static_cast<size_t>(pb.requests() * c.group_size);
  pb.q = random_values(c.dtype, g_rows * c.dim_qk, rng);
  pb.k = dense_rows(c.dtype, c.batch, c.k_heads, c.heads, c.capacity, c.live_len, pb.k_stride, c.dim_qk, rng);
  if (!c.v_aliases_k)
    pb.v = dense_rows(c.dtype, c.batch, c.heads, c.heads, c.capacity, c.live_len, c.dim_v, c.dim_v, rng);
  if (c.dim_extra > 0) {
    pb.q_extra = random_values(c.dtype, g_rows * c.dim_extra, rng);
    pb.e = dense_rows(c.dtype, c.batch, c.heads, c.heads, c.capacity, c.live_len, c.dim_extra, c.dim_extra, rng);
  }
  pb.scale = 1.0f / std::sqrt(static_cast<float>(c.dim_qk + c.dim_extra));
  if (c.mask == MaskKind::kRandom) {
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    pb.mask.resize(static_cast<size_t>(pb.requests() * c.live_len));
    for (float& m : pb.mask) {
      const float x = u(rng);
      m = x < 0.7f ? 0.0f : x < 0.9f ? -std::numeric_limits<float>::infinity() : -2.0f * u(rng);
    }
    // Request 1 sees nothing at all: o = 0, lse = -inf, and no NaN.
    if (pb.requests() > 1)
      std::fill(pb.mask.begin() + c.live_len, pb.mask.begin() + 2 * c.live_len,
                -std::numeric_limits<float>::infinity());
  }
  return pb;
}

Reference dense_reference(const DenseProblem& pb) {
  const DenseCase& c = pb.c;
  const auto q = as_float(c.dtype, pb.q), k = as_float(c.dtype, pb.k);
  const auto v = c.v_aliases_k ? k : as_float(c.dtype, pb.v);
  const auto qe = as_float(c.dtype, pb.q_extra), e = as_float(c.dtype, pb.e);
  const int64_t v_stride = c.v_aliases_k ? pb.k_stride : c.dim_v;
  const int32_t v_heads = c.v_aliases_k ? c.k_heads : c.heads;
  Reference ref;
  ref.o.assign(static_cast<size_t>(pb.requests() * c.group_size * c.dim_v), 0.0);
  ref.lse.assign(static_cast<size_t>(pb.requests() * c.group_size), -std::numeric_limits<double>::infinity());
  for (int64_t r = 0; r < pb.requests(); ++r) {
    const int64_t b = r / c.heads, h = r % c.heads;
    const int64_t k0 = (b * c.k_heads + h) * c.capacity, v0 = (b * v_heads + h) * c.capacity,
                  e0 = (b * c.heads + h) * c.capacity;
    for (int64_t g = 0; g < c.group_size; ++g) {
      const int64_t qrow = r * c.group_size + g;
      std::vector<double> s(static_cast<size_t>(c.live_len));
      double mx = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < c.live_len; ++t) {
        const double bias = pb.mask.empty() ? 0.0 : pb.mask[static_cast<size_t>(r * c.live_len + t)];
        double dot = 0;
        for (int64_t d = 0; d < c.dim_qk; ++d) dot += double{q[qrow * c.dim_qk + d]} * k[(k0 + t) * pb.k_stride + d];
        for (int64_t d = 0; d < c.dim_extra; ++d)
          dot += double{qe[qrow * c.dim_extra + d]} * e[(e0 + t) * c.dim_extra + d];
        s[t] = std::isinf(bias) ? bias : dot * pb.scale + bias;
        mx = std::max(mx, s[t]);
      }
      if (std::isinf(mx)) continue;
      double sum = 0;
      for (int64_t t = 0; t < c.live_len; ++t) {
        const double w = std::exp(s[t] - mx);
        if (w == 0) continue;
        sum += w;
        for (int64_t d = 0; d < c.dim_v; ++d) ref.o[qrow * c.dim_v + d] += w * v[(v0 + t) * v_stride + d];
      }
      for (int64_t d = 0; d < c.dim_v; ++d) ref.o[qrow * c.dim_v + d] /= sum;
      ref.lse[qrow] = mx + std::log(sum);
    }
  }
  return ref;
}

class MaskedDecodeCuda : public ::testing::TestWithParam<DenseCase> {};

TEST_P(MaskedDecodeCuda, MatchesCpuMaskPathAndReference) {
  SKIP_WITHOUT_CUDA();
  const DenseCase& c = GetParam();
  const DenseProblem pb = make_dense(c, 0xd3u + static_cast<uint64_t>(c.live_len));
  const size_t esize = dtype_size(c.dtype);
  const size_t o_elems = static_cast<size_t>(pb.requests() * c.group_size * c.dim_v);
  const size_t lse_elems = static_cast<size_t>(pb.requests() * c.group_size);

  // CPU mask path.
  std::vector<uint8_t> o_cpu(o_elems * esize);
  std::vector<float> lse_cpu(lse_elems);
  run_masked_decode_cpu(pb.params(pb.q.data(), pb.q_extra.data(), pb.k.data(), pb.v.data(), pb.e.data(), pb.mask.data(),
                                  o_cpu.data(), lse_cpu.data()));

  // CUDA mask path, outputs poisoned.
  Buffer q = upload(Device::kCuda, pb.q), qe = upload(Device::kCuda, pb.q_extra), k = upload(Device::kCuda, pb.k);
  Buffer v = upload(Device::kCuda, pb.v), e = upload(Device::kCuda, pb.e), mask = upload(Device::kCuda, pb.mask);
  Buffer o(Device::kCuda, o_elems * esize), lse(Device::kCuda, lse_elems * 4);
  fill_bytes(o.data(), Device::kCuda, 0xFF, o.bytes());
  fill_bytes(lse.data(), Device::kCuda, 0xFF, lse.bytes());
  const MaskedDecodeParams params =
      pb.params(q.data(), qe.data(), k.data(), v.data(), e.data(), mask.as<float>(), o.data(), lse.as<float>());
  Buffer ws(Device::kCuda, std::max<size_t>(masked_decode_workspace_bytes(params, cuda_multiprocessor_count()), 256));
  fill_bytes(ws.data(), Device::kCuda, 0xFF, ws.bytes());
  run_masked_decode_cuda(params, ws.data());
  cuda_ok(cudaDeviceSynchronize(), "masked decode");

  DecodeOutput got;
  got.o = as_float(c.dtype, download<uint8_t>(Device::kCuda, o.data(), o.bytes()));
  got.lse = download<float>(Device::kCuda, lse.data(), lse_elems);
  const Reference ref = dense_reference(pb);
  PagedProblem shape_only;  // expect_matches_reference reads only spec.dim_v
  shape_only.spec.dim_v = c.dim_v;
  expect_matches_reference(shape_only, got, ref, c.name);
  EXPECT_LT(relative_l2(got.o, to_double(as_float(c.dtype, o_cpu))), 1e-2) << "GPU vs CPU mask path";
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MaskedDecodeCuda,
    ::testing::Values(
        // name, dtype, B, H, K heads, G, qk, v, extra, capacity, live, alias, pad, mask
        DenseCase{"bf16_g16_d128_extra_k_head", DType::kBF16, 2, 4, 5, 16, 128, 128, 0, 1280, 1000, false, 0,
                  MaskKind::kRandom},
        DenseCase{"f16_g4_d64_e64_nomask", DType::kF16, 3, 2, 2, 4, 64, 64, 64, 400, 333, false, 0, MaskKind::kNone},
        DenseCase{"bf16_g8_d256_long", DType::kBF16, 1, 2, 2, 8, 256, 256, 0, 4096, 4000, false, 0, MaskKind::kRandom},
        DenseCase{"f16_g16_alias_d128", DType::kF16, 2, 2, 2, 16, 128, 128, 0, 600, 555, true, 64, MaskKind::kRandom},
        DenseCase{"bf16_g1_d128_v64_empty_window", DType::kBF16, 2, 2, 2, 1, 128, 64, 0, 64, 0, false, 0,
                  MaskKind::kNone},
        // The MLA kernel on dense rows: 128 heads, K row stride 640, V = K's latent.
        DenseCase{"bf16_mla_g128_alias_d512_e64", DType::kBF16, 2, 1, 1, 128, 512, 512, 64, 700, 650, true, 128,
                  MaskKind::kRandom}),
    [](const ::testing::TestParamInfo<DenseCase>& param) { return std::string(param.param.name); });

TEST(MaskedDecodeCudaErrors, F32IsRefusedClearly) {
  SKIP_WITHOUT_CUDA();
  Buffer buf(Device::kCuda, 1 << 16);
  MaskedDecodeParams p = testing::one_request_masked_params(DType::kF32, 1, 8, 64, buf.data(), buf.data(), buf.data());
  p.o = buf.data();
  EXPECT_THROW(run_masked_decode_cuda(p, buf.data()), Error);
}

bool same_value(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

TEST(GatherRowsCuda, MatchesHostGather) {
  SKIP_WITHOUT_CUDA();
  std::mt19937_64 rng(41);
  struct Shape {
    DType dtype;
    int32_t dim;
    int64_t stride;
  };
  for (const Shape& s : {Shape{DType::kBF16, 128, 136}, Shape{DType::kF16, 5, 7}, Shape{DType::kF32, 64, 64}}) {
    const int64_t pool_rows = 1000;
    const auto pool = random_values(s.dtype, static_cast<size_t>(pool_rows * s.stride), rng);
    const std::vector<int32_t> rows = {5, 999, 5, 0, -1, 1000, 17, 400, 3};
    const std::vector<int32_t> offsets = {0, 4, 4, 9};  // request 1 is empty
    const int64_t max_rows = 6;
    const size_t out_bytes = static_cast<size_t>(3 * max_rows * s.dim) * dtype_size(s.dtype);
    std::vector<uint8_t> host(out_bytes);
    gather_rows(Device::kCpu, rows.data(), offsets.data(), 3, max_rows, s.dtype, RowView{pool.data(), s.stride, s.dim},
                pool_rows, host.data());
    Buffer d_pool = upload(Device::kCuda, pool), d_rows = upload(Device::kCuda, rows);
    Buffer d_offsets = upload(Device::kCuda, offsets), d_out(Device::kCuda, out_bytes);
    fill_bytes(d_out.data(), Device::kCuda, 0x5A, out_bytes);
    gather_rows(Device::kCuda, d_rows.as<int32_t>(), d_offsets.as<int32_t>(), 3, max_rows, s.dtype,
                RowView{d_pool.data(), s.stride, s.dim}, pool_rows, d_out.data());
    cuda_ok(cudaDeviceSynchronize(), "gather");
    const auto want = as_float(s.dtype, host);
    const auto got = as_float(s.dtype, download<uint8_t>(Device::kCuda, d_out.data(), out_bytes));
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_TRUE(same_value(got[i], want[i]))
          << dtype_name(s.dtype) << " element " << i << ": " << got[i] << " vs " << want[i];
  }
}

}  // namespace
}  // namespace sparsepage::testing
