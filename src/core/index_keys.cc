// Index-key sources (sparsepage/index_keys.h): the pool description's checks
// and the CPU write op and query quantizer. The CUDA twins
// (src/cuda/cache/index_keys_write.cu) share the checks and the scale rules
// (core/index_keys_rule.h) and write the same bytes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/index_keys_checks.h"
#include "core/index_keys_rule.h"
#include "sparsepage/models/dsa.h"

namespace sparsepage {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

float load_key_value(DType dtype, const void* keys, int64_t i) {
  const uint16_t bits = static_cast<const uint16_t*>(keys)[i];
  return dtype == DType::kBF16 ? bf16_to_float(bits) : f16_to_float(bits);
}

// One key of 128 values quantized into a block slot (values and scale), by
// the rule the CUDA kernel applies lane by lane.
void quantize_key(DType dtype, const void* key, IndexScaleFormat format, unsigned char* values,
                  unsigned char* scale_at) {
  float x[IndexKeyFp8::kDim];
  float amax = 0.0f;
  for (int32_t i = 0; i < IndexKeyFp8::kDim; ++i) {
    x[i] = load_key_value(dtype, key, i);
    amax = std::fmax(amax, std::fabs(x[i]));  // a NaN value is ignored, as fmaxf does
  }
  const float scale = index_key_scale(amax, format);
  for (int32_t i = 0; i < IndexKeyFp8::kDim; ++i) values[i] = float_to_e4m3(index_div(x[i], scale));
  std::memcpy(scale_at, &scale, 4);
}

}  // namespace

int64_t index_key_token_bytes(const PagedIndexKeys& keys, int32_t index_head_dim) {
  if (keys.format == IndexKeyFormat::kE4m3) return IndexKeyFp8::kTokenBytes;
  return keys.token_stride_bytes != 0 ? keys.token_stride_bytes : int64_t{index_head_dim} * 2;
}

int64_t index_key_block_bytes(const PagedIndexKeys& keys, int32_t index_head_dim) {
  if (keys.block_stride_bytes != 0) return keys.block_stride_bytes;
  return int64_t{keys.block_size} * index_key_token_bytes(keys, index_head_dim);
}

namespace {
// The blocks' part of paged_index_keys_problem (all the write op needs).
std::string pool_problem(const PagedIndexKeys& k, int32_t dim) {
  const bool fp8 = k.format == IndexKeyFormat::kE4m3;
  if (!fp8 && k.format != IndexKeyFormat::kNative) return "format is not an IndexKeyFormat";
  if (k.pool == nullptr) return "the pool is null";
  if (!aligned16(k.pool)) return "the pool must be 16-byte aligned (blocks are copied in 16-byte pieces)";
  if (k.num_blocks < 1 || k.num_blocks > std::numeric_limits<int32_t>::max())
    return "num_blocks = " + std::to_string(k.num_blocks) + " must lie in [1, 2^31) (block ids are int32)";
  if (k.block_size < 8 || k.block_size % 8 != 0 || (64 % k.block_size != 0 && k.block_size % 64 != 0))
    return "block_size = " + std::to_string(k.block_size) +
           " must be a multiple of 8 that divides 64 or is a multiple of 64 (a 64-position key tile is whole "
           "blocks or a 64-row piece of one)";
  if (fp8) {
    if (dim != IndexKeyFp8::kDim)
      return "index_head_dim = " + std::to_string(dim) + " does not match the FP8 format's 128 values per key";
    if (k.token_stride_bytes != 0) return "token_stride_bytes is set, but the FP8 format fixes it (132 bytes)";
  } else {
    if (k.dtype != DType::kBF16 && k.dtype != DType::kF16)
      return std::string("native keys must be f16 or bf16, got ") + dtype_name(k.dtype);
    if (dim < 8 || dim % 8 != 0) return "index_head_dim = " + std::to_string(dim) + " must be a multiple of 8";
    if (k.token_stride_bytes != 0 && (k.token_stride_bytes < int64_t{dim} * 2 || k.token_stride_bytes % 16 != 0))
      return "token_stride_bytes = " + std::to_string(k.token_stride_bytes) +
             " must be a multiple of 16 of at least index_head_dim x 2 = " + std::to_string(int64_t{dim} * 2);
  }
  const int64_t token_bytes = index_key_token_bytes(k, dim);
  if (k.block_stride_bytes != 0 &&
      (k.block_stride_bytes < int64_t{k.block_size} * token_bytes || k.block_stride_bytes % 16 != 0))
    return "block_stride_bytes = " + std::to_string(k.block_stride_bytes) + " must be a multiple of 16 of at least " +
           "block_size x " + std::to_string(token_bytes) + " = " + std::to_string(int64_t{k.block_size} * token_bytes);
  const int64_t block_bytes = index_key_block_bytes(k, dim);
  if (block_bytes % 16 != 0)
    return "blocks of " + std::to_string(block_bytes) + " bytes are not 16-byte aligned (set block_stride_bytes)";
  if (static_cast<long double>(k.num_blocks) * static_cast<long double>(block_bytes) >= 4.6e18L)
    return "the pool spans more than 2^62 bytes";
  return {};
}
}  // namespace

std::string paged_index_keys_problem(const PagedIndexKeys& k, int32_t dim) {
  std::string problem = pool_problem(k, dim);
  if (!problem.empty()) return problem;
  if (k.block_table == nullptr) return "block_table is null";
  if (k.max_blocks < 1) return "max_blocks = " + std::to_string(k.max_blocks) + " must be at least 1";
  if (k.block_table_stride < k.max_blocks)
    return "block_table_stride = " + std::to_string(k.block_table_stride) +
           " is less than max_blocks = " + std::to_string(k.max_blocks);
  return {};
}

namespace detail {

std::string write_index_keys_problem(const PagedIndexKeys& pool, int32_t dim, DType key_dtype, const void* keys,
                                     int64_t key_stride, const int64_t* slots, int64_t num_tokens) {
  std::string problem = pool_problem(pool, dim);  // the write op reads no block table
  if (!problem.empty()) return problem;
  if (key_dtype != DType::kBF16 && key_dtype != DType::kF16)
    return std::string("keys must be f16 or bf16, got ") + dtype_name(key_dtype);
  if (pool.format == IndexKeyFormat::kNative && key_dtype != pool.dtype)
    return std::string("keys are ") + dtype_name(key_dtype) + " but the native pool holds " + dtype_name(pool.dtype);
  if (num_tokens < 0) return "num_tokens = " + std::to_string(num_tokens) + " is negative";
  if (num_tokens == 0) return {};
  if (keys == nullptr || slots == nullptr) return "keys and slots must be set";
  if (key_stride < dim)
    return "key_stride = " + std::to_string(key_stride) + " is less than index_head_dim = " + std::to_string(dim);
  return {};
}

std::string quantize_index_queries_problem(DType dtype, const void* q, const float* weights, int64_t rows,
                                           int32_t heads, const void* q_fp8, const float* weights_out) {
  if (dtype != DType::kBF16 && dtype != DType::kF16)
    return std::string("queries must be f16 or bf16, got ") + dtype_name(dtype);
  if (rows < 0 || heads < 1)
    return "rows = " + std::to_string(rows) + " and heads = " + std::to_string(heads) + " must be >= 0 and >= 1";
  if (rows == 0) return {};
  if (q == nullptr || weights == nullptr || q_fp8 == nullptr || weights_out == nullptr)
    return "q, weights, q_fp8 and weights_out must be set";
  return {};
}

std::string index_source_problem(const DsaConfig& c, const DsaIndexerArgs& a) {
  if (a.q_format != IndexQueryFormat::kNative && a.q_format != IndexQueryFormat::kE4m3)
    return "q_format is not an IndexQueryFormat";
  if (a.key_layout == IndexKeyLayout::kDense) {
    if (a.q_format == IndexQueryFormat::kE4m3) return "q_format kE4m3 needs FP8 keys (the dense rows are native)";
    return {};
  }
  if (a.key_layout != IndexKeyLayout::kPaged) return "key_layout is not an IndexKeyLayout";
  std::string problem = paged_index_keys_problem(a.paged, c.index_head_dim);
  if (!problem.empty()) return "paged keys: " + problem;
  if (a.paged.format == IndexKeyFormat::kNative) {
    if (a.paged.dtype != a.dtype)
      return std::string("the native paged keys are ") + dtype_name(a.paged.dtype) + " but dtype (of q_index) is " +
             dtype_name(a.dtype);
    if (a.q_format == IndexQueryFormat::kE4m3) return "q_format kE4m3 needs FP8 keys (the pool holds native keys)";
  }
  if (a.max_kv_len > int64_t{a.paged.max_blocks} * a.paged.block_size)
    return "max_kv_len = " + std::to_string(a.max_kv_len) + " exceeds what a block-table row holds (max_blocks x " +
           "block_size = " + std::to_string(int64_t{a.paged.max_blocks} * a.paged.block_size) + ")";
  return {};
}

}  // namespace detail

void write_index_keys_cpu(const PagedIndexKeys& pool, int32_t dim, DType key_dtype, const void* keys,
                          int64_t key_stride, const int64_t* slots, int64_t num_tokens, IndexScaleFormat format) {
  std::string problem = detail::write_index_keys_problem(pool, dim, key_dtype, keys, key_stride, slots, num_tokens);
  if (problem.empty() && format != IndexScaleFormat::kUe8m0 && format != IndexScaleFormat::kFp32)
    problem = "scale_format is not an IndexScaleFormat";
  const int64_t pool_slots = pool.num_blocks * pool.block_size;
  for (int64_t i = 0; problem.empty() && i < num_tokens; ++i) {
    if (slots[i] < -1 || slots[i] >= pool_slots)
      problem = "slots[" + std::to_string(i) + "] = " + std::to_string(slots[i]) + " is past the pool (" +
                std::to_string(pool_slots) + " slots; -1 skips)";
  }
  if (!problem.empty()) throw Error("write_index_keys_cpu: " + problem);
  const int64_t block_bytes = index_key_block_bytes(pool, dim);
  const int64_t token_bytes = index_key_token_bytes(pool, dim);
  auto* base = static_cast<unsigned char*>(pool.pool);
  for (int64_t i = 0; i < num_tokens; ++i) {
    if (slots[i] < 0) continue;
    const int64_t block = slots[i] / pool.block_size;
    const auto slot = static_cast<int32_t>(slots[i] % pool.block_size);
    unsigned char* b = base + block * block_bytes;
    const auto* key = static_cast<const unsigned char*>(keys) + i * key_stride * 2;
    if (pool.format == IndexKeyFormat::kE4m3) {
      quantize_key(key_dtype, key, format, b + IndexKeyFp8::value_offset(pool.block_size, slot),
                   b + IndexKeyFp8::scale_offset(pool.block_size, slot));
    } else {
      std::memcpy(b + slot * token_bytes, key, size_t(dim) * 2);
    }
  }
}

void quantize_index_queries_cpu(DType dtype, const void* q, const float* weights, int64_t rows, int32_t heads,
                                void* q_fp8, float* weights_out) {
  const std::string problem =
      detail::quantize_index_queries_problem(dtype, q, weights, rows, heads, q_fp8, weights_out);
  if (!problem.empty()) throw Error("quantize_index_queries_cpu: " + problem);
  constexpr int32_t kDim = IndexKeyFp8::kDim;
  for (int64_t r = 0; r < rows * heads; ++r) {
    float x[kDim];
    float amax = 0.0f;
    for (int32_t i = 0; i < kDim; ++i) {
      x[i] = load_key_value(dtype, q, r * kDim + i);
      amax = std::fmax(amax, std::fabs(x[i]));
    }
    const float s = index_query_scale(amax);
    auto* out = static_cast<unsigned char*>(q_fp8) + r * kDim;
    for (int32_t i = 0; i < kDim; ++i) out[i] = float_to_e4m3(index_div(x[i], s));
    weights_out[r] = weights[r] * s;
  }
}

}  // namespace sparsepage
