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

}  // namespace
}  // namespace sparsepage
