// The CUDA DSA indexer's key tensor maps as host data (core/index_key_map.h),
// checked without a GPU: for every key source and block size the GPU tests
// run (dense rows at their geometries; native f16 / bf16 and FP8 pools at
// block sizes 8 .. 192, packed and padded), each of cuTensorMapEncodeTiled's
// rules is asserted here on its own, the map is shown to address the bytes
// the format puts each key at, and the library's check names the value and
// the rule of every kind of map the driver would refuse (the FP8 pool's
// 132-byte token stride, which the driver refused, among them).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/index_key_map.h"
#include "sparsepage/index_keys.h"

namespace sparsepage {
namespace {

using detail::KeyMapElement;
using detail::KeyTensorMap;

// A 16-byte aligned address that is never dereferenced: the maps are data.
void* const kPool = reinterpret_cast<void*>(uintptr_t{1} << 20);

// cuTensorMapEncodeTiled's documented rules for a tiled map with no
// interleave and the 128-byte swizzle, written out on their own (not through
// key_map_problem), for one map.
void expect_driver_accepts(const KeyTensorMap& m, const std::string& what) {
  SCOPED_TRACE(what + ": " + detail::describe_key_map(m));
  const uint64_t esize = m.element == KeyMapElement::kU8 ? 1 : 2;
  EXPECT_NE(m.address, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(m.address) % 16, 0u) << "globalAddress 16-byte aligned";
  for (int i = 0; i < 3; ++i) {
    EXPECT_GE(m.dims[i], 1u) << "globalDim[" << i << "]";
    EXPECT_LE(m.dims[i], uint64_t{1} << 32) << "globalDim[" << i << "]";
    EXPECT_GE(m.box[i], 1u) << "boxDim[" << i << "]";
    EXPECT_LE(m.box[i], 256u) << "boxDim[" << i << "]";
    EXPECT_GE(m.element_strides[i], 1u) << "elementStrides[" << i << "]";
    EXPECT_LE(m.element_strides[i], 8u) << "elementStrides[" << i << "]";
  }
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(m.strides[i] % 16, 0u) << "globalStrides[" << i << "] a multiple of 16";
    EXPECT_LT(m.strides[i], uint64_t{1} << 40) << "globalStrides[" << i << "] below 2^40";
  }
  EXPECT_GE(m.strides[0], m.dims[0] * esize) << "globalStrides[0] covers a row";
  EXPECT_GE(m.strides[1], m.dims[1] * m.strides[0]) << "globalStrides[1] covers a block / sequence";
  EXPECT_EQ(m.box[0] * esize % 16, 0u) << "boxDim[0] x element size a multiple of 16";
  EXPECT_LE(m.box[0] * esize, 128u) << "the inner box within the 128-byte swizzle span";
  // And the library's own check agrees.
  EXPECT_EQ(detail::key_map_problem(m), "");
}

// The score kernels' boxes of a 64-position tile land at rows y = (first %
// block_size) of the block, box[1] rows each: every such box lies inside
// its block, and the boxes of a tile fill whole 64-row slabs.
void expect_boxes_fit_blocks(const KeyTensorMap& m, int32_t block_size) {
  ASSERT_EQ(64 % m.box[1], 0u) << "a tile is whole boxes";
  for (int64_t first = 0; first < 4 * 64 + 3 * block_size; first += m.box[1]) {
    const int64_t y = first % block_size;
    EXPECT_LE(uint64_t(y) + m.box[1], m.dims[1]) << "a box at row " << y << " leaves its block";
  }
}

// The global byte offset of element (x, y, z) of the map.
uint64_t offset_of(const KeyTensorMap& m, uint64_t x, uint64_t y, uint64_t z) {
  const uint64_t esize = m.element == KeyMapElement::kU8 ? 1 : 2;
  return x * esize + y * m.strides[0] + z * m.strides[1];
}

PagedIndexKeys pool_of(IndexKeyFormat format, DType dtype, int32_t dim, int32_t block_size, int64_t pad,
                       int64_t token_stride) {
  PagedIndexKeys k;
  k.format = format;
  k.dtype = dtype;
  k.pool = kPool;
  k.num_blocks = 1000;
  k.block_size = block_size;
  k.token_stride_bytes = token_stride;
  const int64_t token = format == IndexKeyFormat::kE4m3 ? IndexKeyFp8::kTokenBytes
                                                        : (token_stride != 0 ? token_stride : int64_t{dim} * 2);
  k.block_stride_bytes = pad == 0 ? 0 : int64_t{block_size} * token + pad;
  k.block_table = reinterpret_cast<const int32_t*>(kPool);
  k.block_table_stride = 4;
  k.max_blocks = 4;
  return k;
}

const std::vector<int32_t> kBlockSizes = {8, 16, 32, 64, 128, 192};

TEST(IndexKeyMap, Fp8PoolsAreValidMapsOverTheValuesAtEveryBlockSize) {
  for (const int32_t block_size : kBlockSizes) {
    for (const int64_t pad : {int64_t{0}, int64_t{48}, int64_t{32}}) {
      const PagedIndexKeys k = pool_of(IndexKeyFormat::kE4m3, DType::kBF16, 128, block_size, pad, 0);
      ASSERT_EQ(paged_index_keys_problem(k, 128), "") << block_size << " pad " << pad;
      const KeyTensorMap m = detail::paged_key_map(k, 128);
      const std::string what = "FP8 block " + std::to_string(block_size) + " pad " + std::to_string(pad);
      expect_driver_accepts(m, what);
      expect_boxes_fit_blocks(m, block_size);
      EXPECT_EQ(m.element, KeyMapElement::kU8) << what;
      EXPECT_EQ(m.box[0], 128u) << what << ": a box row is a key's 128 e4m3 values";
      EXPECT_EQ(m.box[1], uint32_t(std::min(block_size, 64))) << what;
      EXPECT_EQ(m.dims[2], uint64_t(k.num_blocks)) << what;
      // Element (x, y, z) is value x of token y of block z: the format's byte.
      const uint64_t block_bytes = uint64_t(index_key_block_bytes(k, 128));
      for (const uint64_t z : {uint64_t{0}, uint64_t{1}, uint64_t{999}}) {
        for (uint64_t y = 0; y < uint64_t(block_size); y += 7) {
          for (const uint64_t x : {uint64_t{0}, uint64_t{77}, uint64_t{127}}) {
            EXPECT_EQ(offset_of(m, x, y, z),
                      z * block_bytes + uint64_t(IndexKeyFp8::value_offset(block_size, int32_t(y))) + x)
                << what << " value " << x << " of token " << y << " of block " << z;
          }
        }
      }
      // The values of a block end where its scales begin: no box reads a scale.
      EXPECT_EQ(m.dims[1] * m.strides[0], uint64_t(IndexKeyFp8::scale_offset(block_size, 0))) << what;
    }
  }
}

TEST(IndexKeyMap, NativePoolsAreValidMapsAtEveryBlockSizeAndStride) {
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    for (const int32_t dim : {64, 128}) {
      for (const int32_t block_size : kBlockSizes) {
        for (const int64_t pad : {int64_t{0}, int64_t{48}}) {
          for (const int64_t token_stride : {int64_t{0}, int64_t{2} * dim + 32}) {
            const PagedIndexKeys k = pool_of(IndexKeyFormat::kNative, dtype, dim, block_size, pad, token_stride);
            const std::string what = std::string(dtype_name(dtype)) + " dim " + std::to_string(dim) + " block " +
                                     std::to_string(block_size) + " pad " + std::to_string(pad) + " token stride " +
                                     std::to_string(token_stride);
            ASSERT_EQ(paged_index_keys_problem(k, dim), "") << what;
            const KeyTensorMap m = detail::paged_key_map(k, dim);
            expect_driver_accepts(m, what);
            expect_boxes_fit_blocks(m, block_size);
            EXPECT_EQ(m.element, dtype == DType::kF16 ? KeyMapElement::kF16 : KeyMapElement::kBF16) << what;
            EXPECT_EQ(m.box[0], 64u) << what << ": one 64-column slab per box";
            const uint64_t token_bytes = uint64_t(index_key_token_bytes(k, dim));
            const uint64_t block_bytes = uint64_t(index_key_block_bytes(k, dim));
            EXPECT_EQ(offset_of(m, 5, 3, 2), 2 * block_bytes + 3 * token_bytes + 10) << what;
          }
        }
      }
    }
  }
}

TEST(IndexKeyMap, DenseRowsAreValidMapsAtTheTestedGeometries) {
  struct Geometry {
    int32_t latent, dim;
    int64_t capacity;
    int32_t sequences;
  };
  // The DSA indexer tests (latent 64; dims 64 and 128; capacities past the
  // window), the index-key tests' dense rows, and the DSA layer (latent 512 +
  // 64 index columns, capacity steps of 64) at 1 and 4 slots.
  const std::vector<Geometry> geometries = {{64, 64, 737, 2},  {64, 128, 6037, 3}, {64, 128, 9037, 2},
                                            {64, 64, 137, 1},  {64, 128, 4099, 7}, {512, 64, 448, 4},
                                            {512, 64, 448, 1}, {512, 128, 64, 32}, {64, 256, 100, 1}};
  for (const Geometry& g : geometries) {
    for (const DType dtype : {DType::kBF16, DType::kF16}) {
      const KeyTensorMap m =
          detail::dense_key_map(dtype, kPool, g.latent + g.dim, g.latent, g.dim, g.capacity, g.sequences);
      const std::string what = "dense latent " + std::to_string(g.latent) + " dim " + std::to_string(g.dim) +
                               " capacity " + std::to_string(g.capacity);
      expect_driver_accepts(m, what);
      EXPECT_EQ(m.box[0], 64u) << what;
      EXPECT_EQ(m.box[1], 64u) << what;
      // Element (x, t, b) is column latent + x of row b * capacity + t.
      const uint64_t row = uint64_t(g.latent + g.dim) * 2;
      EXPECT_EQ(static_cast<const unsigned char*>(m.address) - static_cast<const unsigned char*>(kPool),
                std::ptrdiff_t(g.latent) * 2)
          << what;
      EXPECT_EQ(offset_of(m, 3, 5, uint64_t(g.sequences - 1)),
                (uint64_t(g.sequences - 1) * uint64_t(g.capacity) + 5) * row + 6)
          << what;
    }
  }
}

// The map the indexer used to build for FP8 pools: 132-byte rows (the token
// size, not the values' stride), which the driver refused with
// CUDA_ERROR_INVALID_VALUE before any launch.
TEST(IndexKeyMap, TheOldFp8MapIsRefusedNamingItsStride) {
  KeyTensorMap m = detail::paged_key_map(pool_of(IndexKeyFormat::kE4m3, DType::kBF16, 128, 64, 0, 0), 128);
  m.strides[0] = IndexKeyFp8::kTokenBytes;
  const std::string problem = detail::key_map_problem(m);
  EXPECT_NE(problem.find("globalStrides[0] = 132"), std::string::npos) << problem;
  EXPECT_NE(problem.find("multiple of 16"), std::string::npos) << problem;
  // The error prints the whole map.
  EXPECT_NE(problem.find("dims {128, 64, 1000}"), std::string::npos) << problem;
  EXPECT_NE(problem.find("strides {132, 8448}"), std::string::npos) << problem;
  EXPECT_NE(problem.find("box {128, 64, 1}"), std::string::npos) << problem;
}

TEST(IndexKeyMap, EveryBrokenRuleIsNamed) {
  const KeyTensorMap good = detail::paged_key_map(pool_of(IndexKeyFormat::kNative, DType::kBF16, 128, 16, 0, 0), 128);
  ASSERT_EQ(detail::key_map_problem(good), "");
  struct Case {
    const char* needle;
    void (*edit)(KeyTensorMap&);
  };
  const std::vector<Case> cases = {
      {"globalAddress is null", [](KeyTensorMap& m) { m.address = nullptr; }},
      {"globalAddress must be 16-byte aligned",
       [](KeyTensorMap& m) { m.address = static_cast<const unsigned char*>(m.address) + 8; }},
      {"globalDim[2] = 0", [](KeyTensorMap& m) { m.dims[2] = 0; }},
      {"globalDim[1] = 4294967297", [](KeyTensorMap& m) { m.dims[1] = (uint64_t{1} << 32) + 1; }},
      {"globalStrides[0] = 136 bytes must be a nonzero multiple of 16", [](KeyTensorMap& m) { m.strides[0] = 136; }},
      {"globalStrides[1] = 1099511627776 bytes must be below 2^40",
       [](KeyTensorMap& m) { m.strides[1] = uint64_t{1} << 40; }},
      {"globalStrides[0] = 128 bytes is less than dimension 0's extent (globalDim[0] = 128 x 2 bytes)",
       [](KeyTensorMap& m) { m.strides[0] = 128; }},
      {"globalStrides[1] = 2048 bytes is less than dimension 1's extent (globalDim[1] = 16 x globalStrides[0] = 256)",
       [](KeyTensorMap& m) { m.strides[1] = 2048; }},
      {"boxDim[1] = 0", [](KeyTensorMap& m) { m.box[1] = 0; }},
      {"boxDim[2] = 257", [](KeyTensorMap& m) { m.box[2] = 257; }},
      {"boxDim[0] x element size = 20 bytes must be a multiple of 16", [](KeyTensorMap& m) { m.box[0] = 10; }},
      {"boxDim[0] x element size = 256 bytes exceeds the 128-byte swizzle span",
       [](KeyTensorMap& m) { m.box[0] = 128; }},
      {"elementStrides[1] = 9", [](KeyTensorMap& m) { m.element_strides[1] = 9; }},
  };
  for (const Case& c : cases) {
    KeyTensorMap m = good;
    c.edit(m);
    const std::string problem = detail::key_map_problem(m);
    EXPECT_NE(problem.find(c.needle), std::string::npos) << "want '" << c.needle << "', got '" << problem << "'";
    EXPECT_NE(problem.find("dims {"), std::string::npos) << problem;
  }
}

}  // namespace
}  // namespace sparsepage
