// Which of a tile's keys are `-1` padding (IndexPadding::kMinusOneSkips), for
// the MLA consumers' softmax (PagedSourceT::skipped_pairs). Host and device:
// the CPU tests check it against the per-key lookup it replaces.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SP_PADDED_KEYS_FN __host__ __device__ __forceinline__
#else
#define SP_PADDED_KEYS_FN inline
#endif
#if defined(__CUDA_ARCH__)
#define SP_PADDED_KEYS_UNROLL _Pragma("unroll")
#else
#define SP_PADDED_KEYS_UNROLL  // host compilers: no such pragma
#endif

namespace sparsepage {
namespace cuda {

/// The 2 kGroups keys first_key + 8 g + e (g < kGroups, e < 2) of a tile
/// whose first token sits at position `pos0` of its page run (the request's
/// first page offset + the tile's first token) and which holds `n` tokens:
/// bit 2 g + e is set where the key is below n and its page id in `slot`
/// (the tile's ids, from the page of pos0 on) is -1. page_shift is
/// log2(page_size), or -1 when page_size is not a power of two (then each
/// key's page takes a division).
///
/// Every key's id is loaded, below n or not, so the loads carry no branch
/// and issue together on the consumers' path between S and the softmax;
/// the n test then clears the bits of keys past the tile. Precondition:
/// first_key + 8 (kGroups - 1) + 1 < 64 (the MLA consumers pass at most
/// 38 with kGroups 4), and `slot` holds 64 ids (the kernels' id slots), so
/// every key's page index is below 64; entries past the tile's pages are
/// stale, never out of bounds.
template <int kGroups>
SP_PADDED_KEYS_FN uint32_t padded_key_pairs(const int32_t* slot, int32_t pos0, int32_t first_key, int32_t n,
                                            int32_t page_shift, int32_t page_size) {
  const auto bits_over = [&](auto page_index) {
    uint32_t bits = 0;
    SP_PADDED_KEYS_UNROLL
    for (int i = 0; i < 2 * kGroups; ++i) {
      const int32_t key = first_key + 8 * (i >> 1) + (i & 1);
      const bool padded = slot[page_index(key)] == -1;
      bits |= static_cast<uint32_t>(padded && key < n) << i;
    }
    return bits;
  };
  if (page_shift == 0) return bits_over([](int32_t key) { return key; });  // token ids: page = key
  if (page_shift > 0) {
    const int32_t page0 = pos0 >> page_shift;
    return bits_over([=](int32_t key) { return ((pos0 + key) >> page_shift) - page0; });
  }
  const int32_t page0 = pos0 / page_size;
  return bits_over([=](int32_t key) { return (pos0 + key) / page_size - page0; });
}

}  // namespace cuda
}  // namespace sparsepage
