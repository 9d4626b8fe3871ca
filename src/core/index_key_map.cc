// The index keys' tensor maps as host data, and the driver's rules for them
// (core/index_key_map.h).
#include "core/index_key_map.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace sparsepage::detail {

int32_t key_map_element_bytes(KeyMapElement e) { return e == KeyMapElement::kU8 ? 1 : 2; }

namespace {

const char* element_name(KeyMapElement e) {
  switch (e) {
    case KeyMapElement::kU8: return "uint8";
    case KeyMapElement::kF16: return "f16";
    case KeyMapElement::kBF16: return "bf16";
  }
  return "unknown element type";
}

template <typename T, size_t N>
std::string list(const T (&values)[N]) {
  std::string s = "{";
  for (size_t i = 0; i < N; ++i) s += (i > 0 ? ", " : "") + std::to_string(values[i]);
  return s + "}";
}

}  // namespace

std::string describe_key_map(const KeyTensorMap& m) {
  char address[32];
  std::snprintf(address, sizeof(address), "%p", m.address);
  return "dims " + list(m.dims) + " strides " + list(m.strides) + " box " + list(m.box) + " element strides " +
         list(m.element_strides) + " (" + element_name(m.element) + ", address " + address + ")";
}

std::string key_map_problem(const KeyTensorMap& m) {
  const auto broken = [&](const std::string& what) { return what + "; the map: " + describe_key_map(m); };
  if (m.element != KeyMapElement::kU8 && m.element != KeyMapElement::kF16 && m.element != KeyMapElement::kBF16)
    return broken("the element type is not a KeyMapElement");
  const uint64_t esize = static_cast<uint64_t>(key_map_element_bytes(m.element));
  if (m.address == nullptr) return broken("globalAddress is null");
  if (reinterpret_cast<uintptr_t>(m.address) % 16 != 0) return broken("globalAddress must be 16-byte aligned");
  for (int i = 0; i < 3; ++i) {
    if (m.dims[i] < 1 || m.dims[i] > (uint64_t{1} << 32))
      return broken("globalDim[" + std::to_string(i) + "] = " + std::to_string(m.dims[i]) + " must lie in [1, 2^32]");
  }
  // Each stride must step over the previous dimension's bytes: dims[0] x
  // the element size, then dims[1] x strides[0] (compared by division, which
  // cannot overflow; strides[0] is a nonzero multiple of 16 by then).
  for (int i = 0; i < 2; ++i) {
    const std::string name = "globalStrides[" + std::to_string(i) + "] = " + std::to_string(m.strides[i]);
    if (m.strides[i] % 16 != 0 || m.strides[i] == 0) return broken(name + " bytes must be a nonzero multiple of 16");
    if (m.strides[i] >= (uint64_t{1} << 40)) return broken(name + " bytes must be below 2^40");
    const bool covers = i == 0 ? m.strides[0] / esize >= m.dims[0] : m.strides[1] / m.strides[0] >= m.dims[1];
    if (!covers) {
      return broken(name + " bytes is less than dimension " + std::to_string(i) + "'s extent (" +
                    (i == 0 ? "globalDim[0] = " + std::to_string(m.dims[0]) + " x " + std::to_string(esize) + " bytes"
                            : "globalDim[1] = " + std::to_string(m.dims[1]) +
                                  " x globalStrides[0] = " + std::to_string(m.strides[0])) +
                    ")");
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (m.box[i] < 1 || m.box[i] > 256)
      return broken("boxDim[" + std::to_string(i) + "] = " + std::to_string(m.box[i]) + " must lie in [1, 256]");
  }
  const uint64_t inner = m.box[0] * esize;
  if (inner % 16 != 0)
    return broken("boxDim[0] x element size = " + std::to_string(inner) + " bytes must be a multiple of 16");
  if (inner > 128)
    return broken("boxDim[0] x element size = " + std::to_string(inner) +
                  " bytes exceeds the 128-byte swizzle span (CU_TENSOR_MAP_SWIZZLE_128B)");
  for (int i = 0; i < 3; ++i) {
    if (m.element_strides[i] < 1 || m.element_strides[i] > 8)
      return broken("elementStrides[" + std::to_string(i) + "] = " + std::to_string(m.element_strides[i]) +
                    " must lie in [1, 8]");
  }
  return {};
}

int32_t paged_key_box_rows(int32_t block_size) { return std::min(block_size, kIndexKeyTileRows); }

namespace {
KeyMapElement native_element(DType dtype) { return dtype == DType::kF16 ? KeyMapElement::kF16 : KeyMapElement::kBF16; }
}  // namespace

KeyTensorMap dense_key_map(DType dtype, const void* k_cache, int64_t row_elements, int32_t key_offset, int32_t dim,
                           int64_t capacity, int32_t sequences) {
  KeyTensorMap m;
  m.element = native_element(dtype);
  const auto esize = static_cast<uint64_t>(dtype_size(dtype));
  m.address = static_cast<const unsigned char*>(k_cache) + static_cast<uint64_t>(key_offset) * esize;
  const uint64_t row_bytes = static_cast<uint64_t>(row_elements) * esize;
  m.dims[0] = static_cast<uint64_t>(dim);
  m.dims[1] = static_cast<uint64_t>(capacity);
  m.dims[2] = static_cast<uint64_t>(sequences);
  m.strides[0] = row_bytes;
  m.strides[1] = row_bytes * static_cast<uint64_t>(capacity);
  m.box[0] = static_cast<uint32_t>(kIndexKeySlabColumns);
  m.box[1] = static_cast<uint32_t>(kIndexKeyTileRows);
  m.box[2] = 1;
  return m;
}

KeyTensorMap paged_key_map(const PagedIndexKeys& keys, int32_t index_head_dim) {
  KeyTensorMap m;
  const bool fp8 = keys.format == IndexKeyFormat::kE4m3;
  m.address = keys.pool;
  m.dims[1] = static_cast<uint64_t>(keys.block_size);
  m.dims[2] = static_cast<uint64_t>(keys.num_blocks);
  m.strides[1] = static_cast<uint64_t>(index_key_block_bytes(keys, index_head_dim));
  m.box[1] = static_cast<uint32_t>(paged_key_box_rows(keys.block_size));
  m.box[2] = 1;
  if (fp8) {
    // The values alone: token s's 128 bytes at 128 s (IndexKeyFp8::value_offset).
    m.element = KeyMapElement::kU8;
    m.dims[0] = static_cast<uint64_t>(IndexKeyFp8::kDim);
    m.strides[0] = static_cast<uint64_t>(IndexKeyFp8::value_offset(keys.block_size, 1) -
                                         IndexKeyFp8::value_offset(keys.block_size, 0));
    m.box[0] = static_cast<uint32_t>(IndexKeyFp8::kDim);
  } else {
    m.element = native_element(keys.dtype);
    m.dims[0] = static_cast<uint64_t>(index_head_dim);
    m.strides[0] = static_cast<uint64_t>(index_key_token_bytes(keys, index_head_dim));
    m.box[0] = static_cast<uint32_t>(kIndexKeySlabColumns);
  }
  return m;
}

}  // namespace sparsepage::detail
