// padded_key_pairs (the MLA consumers' -1 padding lookup, run on the GPU)
// against the per-key lookup it replaced: page_of(token) - page_of(tok0)
// indexes the tile's ids, page_of(t) = (first_offset + t) / page_size.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cuda/attention/padded_keys.h"

namespace {

using sparsepage::cuda::padded_key_pairs;

int32_t page_of(int32_t first_offset, int32_t token, int32_t page_size) { return (first_offset + token) / page_size; }

// The per-key form: one lookup per key, each with its own page arithmetic.
uint32_t per_key(const std::vector<int32_t>& slot, int32_t first_offset, int32_t tok0, int32_t first_key, int32_t n,
                 int32_t page_size) {
  uint32_t bits = 0;
  for (int i = 0; i < 8; ++i) {
    const int32_t key = first_key + 8 * (i >> 1) + (i & 1);
    if (key >= n) continue;
    const int32_t idx = page_of(first_offset, tok0 + key, page_size) - page_of(first_offset, tok0, page_size);
    if (slot.at(static_cast<size_t>(idx)) == -1) bits |= 1u << i;
  }
  return bits;
}

int32_t shift_of(int32_t page_size) {
  for (int32_t s = 0; s < 31; ++s) {
    if ((int32_t{1} << s) == page_size) return s;
  }
  return -1;
}

TEST(PaddedKeys, MatchesThePerKeyLookupAtEveryPageSizeOffsetAndLength) {
  std::mt19937 rng(7);
  int64_t checked = 0, padded = 0;
  for (int32_t page_size : {1, 2, 3, 16, 48, 64, 100}) {
    const int32_t shift = shift_of(page_size);
    for (int trial = 0; trial < 200; ++trial) {
      const int32_t first_offset = static_cast<int32_t>(rng() % static_cast<uint32_t>(page_size));
      const int32_t tok0 = 64 * static_cast<int32_t>(rng() % 512);  // a tile's first token
      const int32_t n = 1 + static_cast<int32_t>(rng() % 64);
      // The tile's ids: about a quarter padding, the rest page ids.
      std::vector<int32_t> slot(64);  // an id slot's 64 ids: a read past them shows under ASan
      for (int32_t& id : slot) id = rng() % 4 == 0 ? -1 : static_cast<int32_t>(rng() % 1000);
      for (int wg = 0; wg < 2; ++wg) {
        for (int quad = 0; quad < 4; ++quad) {
          const int32_t first_key = wg * 32 + 2 * quad;
          const uint32_t want = per_key(slot, first_offset, tok0, first_key, n, page_size);
          const uint32_t got = padded_key_pairs<4>(slot.data(), first_offset + tok0, first_key, n, shift, page_size);
          ASSERT_EQ(got, want) << "page_size " << page_size << ", first_offset " << first_offset << ", tok0 " << tok0
                               << ", n " << n << ", first_key " << first_key;
          ++checked;
          padded += want != 0;
        }
      }
    }
  }
  // The comparison saw both outcomes.
  EXPECT_GT(padded, checked / 4);
  EXPECT_LT(padded, checked);
}

TEST(PaddedKeys, KeysPastTheTileAreNeverPadding) {
  std::vector<int32_t> slot(64, -1);  // every id padding
  // n = 0: no key is read.
  EXPECT_EQ(padded_key_pairs<4>(slot.data(), 0, 0, 0, 0, 1), 0u);
  // n = 9 with first key 0: keys 0, 1 and 8 (bits 0, 1, 2) only.
  EXPECT_EQ(padded_key_pairs<4>(slot.data(), 0, 0, 9, 0, 1), 0x7u);
  // Every key of both warpgroups' lanes inside a full tile.
  EXPECT_EQ(padded_key_pairs<4>(slot.data(), 5, 38, 64, -1, 3), 0xFFu);
}

}  // namespace
