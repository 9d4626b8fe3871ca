#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "sparsepage/page_table.h"
#include "sparsepage/types.h"

namespace sparsepage {
namespace {

TEST(PageTable, StructureFromCounts) {
  const auto t = build_page_table_structure({5, 0, 17, 4}, 4, {1, 0, 3, 0});
  EXPECT_EQ(t.indptr, (std::vector<int32_t>{0, 2, 2, 7, 8}));
  EXPECT_EQ(t.last_page_len, (std::vector<int32_t>{2, 0, 4, 4}));
  EXPECT_EQ(t.first_page_offset, (std::vector<int32_t>{1, 0, 3, 0}));
  EXPECT_EQ(t.num_pages(), 8);
  EXPECT_EQ(t.total_tokens(), 26);
  EXPECT_EQ(page_table_problem(t), "");
}

TEST(PageTable, PageSizeOneIsTheRowList) {
  const auto t = build_page_table_structure({3, 1}, 1);
  EXPECT_EQ(t.indptr, (std::vector<int32_t>{0, 3, 4}));
  EXPECT_EQ(t.last_page_len, (std::vector<int32_t>{1, 1}));
}

TEST(PageTable, BuilderRejectsBadInputNamingIt) {
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { build_page_table_structure({1}, 0); }).find("page_size = 0"), std::string::npos);
  EXPECT_NE(message([] { build_page_table_structure({1, -2}, 4); }).find("seq_lens[1] = -2"), std::string::npos);
  EXPECT_NE(message([] { build_page_table_structure({1}, 4, {4}); }).find("first_page_offsets[0] = 4"),
            std::string::npos);
  EXPECT_NE(message([] {
              build_page_table_structure({1, 2}, 4, {0});
            }).find("1 entries for 2 requests"),
            std::string::npos);
  EXPECT_NE(message([] { build_page_table_structure({2000000000, 2000000000}, 1); }).find("2^31"), std::string::npos);
}

// Each invariant, broken on its own, is named by the validator.
TEST(PageTable, ValidatorNamesTheFirstViolation) {
  const PageTableStructure good = build_page_table_structure({5, 0, 9}, 4, {1, 0, 2});
  struct Case {
    const char* expect;
    void (*mutate)(PageTableStructure&);
  };
  const Case cases[] = {
      {"page_size = 0", [](PageTableStructure& t) { t.page_size = 0; }},
      {"indptr has 3 entries", [](PageTableStructure& t) { t.indptr.pop_back(); }},
      {"last_page_len has 2 entries", [](PageTableStructure& t) { t.last_page_len.pop_back(); }},
      {"first_page_offset has 2 entries", [](PageTableStructure& t) { t.first_page_offset.pop_back(); }},
      {"indptr[0] = 1", [](PageTableStructure& t) { t.indptr[0] = 1; }},
      {"indptr decreases at request 1", [](PageTableStructure& t) { t.indptr[2] = 1; }},
      {"seq_lens[2] = -1", [](PageTableStructure& t) { t.seq_lens[2] = -1; }},
      {"first_page_offset[0] = 4", [](PageTableStructure& t) { t.first_page_offset[0] = 4; }},
      {"first_page_offset[0] = -1", [](PageTableStructure& t) { t.first_page_offset[0] = -1; }},
      {"request 0 has 2 pages, expected", [](PageTableStructure& t) { t.seq_lens[0] = 8; }},
      {"last_page_len[2] = 0", [](PageTableStructure& t) { t.last_page_len[2] = 0; }},
      {"last_page_len[2] = 5", [](PageTableStructure& t) { t.last_page_len[2] = 5; }},
      {"last_page_len[0] = 1 disagrees", [](PageTableStructure& t) { t.last_page_len[0] = 1; }},
  };
  for (const Case& c : cases) {
    PageTableStructure t = good;
    c.mutate(t);
    const std::string problem = page_table_problem(t);
    ASSERT_FALSE(problem.empty()) << c.expect;
    EXPECT_NE(problem.find(c.expect), std::string::npos) << "got: " << problem << "\nexpected: " << c.expect;
    EXPECT_THROW(check_page_table(t), Error);
  }
}

TEST(PageTable, ValidatorChecksIndicesAgainstThePool) {
  const PageTableStructure t = build_page_table_structure({5, 3}, 4);
  std::vector<int32_t> indices = {0, 7, 3};
  EXPECT_EQ(page_table_problem(t, &indices, 8), "");
  indices.pop_back();
  EXPECT_NE(page_table_problem(t, &indices, 8).find("indices has 2 entries, indptr[num_requests] = 3"),
            std::string::npos);
  indices = {0, 8, 3};
  EXPECT_NE(page_table_problem(t, &indices, 8).find("indices[1] = 8 is outside the pool [0, 8)"), std::string::npos);
  indices = {0, 1, -3};
  EXPECT_NE(page_table_problem(t, &indices, 8).find("indices[2] = -3"), std::string::npos);
}

TEST(Types, HalfConversionsRoundTrip) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 1e-7f, -3.140625f}) {
    EXPECT_EQ(f16_to_float(float_to_f16(v)), f16_to_float(float_to_f16(f16_to_float(float_to_f16(v)))));
    EXPECT_NEAR(f16_to_float(float_to_f16(v)), v, std::fabs(v) * 1e-3 + 1e-7);
    EXPECT_NEAR(bf16_to_float(float_to_bf16(v)), v, std::fabs(v) * 8e-3);
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::nanf("")))));
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(1e6f))));
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xC000);
}

}  // namespace
}  // namespace sparsepage
