#include <gtest/gtest.h>

#include "sparsepage/selection.h"

namespace sparsepage {
namespace {

TEST(Selection, MaterializeRoundTrips) {
  const SparseSelection s = make_selection(Device::kCpu, {{5, 1, 1}, {}, {9}});
  EXPECT_EQ(s.num_requests(), 3);
  EXPECT_EQ(s.total(), 4);
  EXPECT_EQ(s.offsets(), (std::vector<int32_t>{0, 3, 3, 4}));
  EXPECT_EQ(s.materialize(), (std::vector<std::vector<int32_t>>{{5, 1, 1}, {}, {9}}));
}

TEST(Selection, FromBlocksExpandsAndClipsTheFinalBlock) {
  // Request 0: live 10, blocks of 4 -> final block 2 is partial (2 rows), listed last.
  // Request 1: live 8 (no partial block), base 100, blocks 1 and 0 unsorted.
  const Buffer ids = upload(Device::kCpu, std::vector<int32_t>{0, 2, 1, 0});
  const SparseSelection s = selection_from_blocks(ids, {2, 2}, 4, {0, 100}, {10, 8});
  EXPECT_EQ(s.counts, (std::vector<int32_t>{6, 8}));
  EXPECT_EQ(s.materialize(),
            (std::vector<std::vector<int32_t>>{{0, 1, 2, 3, 8, 9}, {104, 105, 106, 107, 100, 101, 102, 103}}));
}

TEST(Selection, FromBlocksRejectsRowsOutsideTheWindow) {
  const auto expect_error = [](std::vector<int32_t> ids, int32_t count, int64_t live, const char* what) {
    const Buffer b = upload(Device::kCpu, ids);
    try {
      selection_from_blocks(b, {count}, 4, {0}, {live});
      ADD_FAILURE() << "expected an error: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error({3}, 1, 10, "outside its live window");   // block 3 starts at row 12 >= 10
  expect_error({2, 0}, 2, 10, "before its last entry");  // partial block not last
  expect_error({0, 1}, 2, 10, "not among its blocks");   // partial final block missing
  expect_error({-1}, 1, 8, "outside its live window");
  const Buffer few = upload(Device::kCpu, std::vector<int32_t>{0});
  EXPECT_THROW(selection_from_blocks(few, {2}, 4, {0}, {8}), Error);
  EXPECT_THROW(selection_from_blocks(few, {1}, 0, {0}, {8}), Error);
  EXPECT_THROW(selection_from_blocks(few, {1}, 4, {0, 1}, {8}), Error);
}

}  // namespace
}  // namespace sparsepage
