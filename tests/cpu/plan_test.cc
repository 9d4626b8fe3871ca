#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "sparsepage/plan.h"
#include "sparsepage/types.h"
#include "support/expect_error.h"

namespace sparsepage {
namespace {

// Every token of every request is covered exactly once, in order.
void expect_covers(const DecodePlan& plan, const std::vector<int32_t>& seq_lens) {
  std::vector<int64_t> next(seq_lens.size(), 0);
  std::vector<int> items(seq_lens.size(), 0);
  for (const WorkItem& w : plan.work) {
    EXPECT_EQ(w.token_begin, next[static_cast<size_t>(w.request)]);
    EXPECT_LE(w.token_begin, w.token_end);
    EXPECT_LE(w.token_end - w.token_begin, plan.chunk_tokens);
    next[static_cast<size_t>(w.request)] = w.token_end;
    ++items[static_cast<size_t>(w.request)];
  }
  for (size_t r = 0; r < seq_lens.size(); ++r) {
    EXPECT_EQ(next[r], seq_lens[r]) << "request " << r;
    EXPECT_GE(items[r], 1) << "every request needs an item, empty ones too";
  }
}

TEST(Plan, SplitsToFillTheMachine) {
  PlanShape shape;
  shape.group_size = 16;
  shape.head_dim_v = 128;
  shape.num_sms = 132;
  const std::vector<int32_t> lens(4, 2048);  // block-sparse geometry, batch 1
  const DecodePlan plan = make_decode_plan(lens, shape);
  expect_covers(plan, lens);
  EXPECT_GE(static_cast<int64_t>(plan.work.size()), 64) << "batch 1 must still spread over the GPU";
  EXPECT_TRUE(plan.needs_merge());
  EXPECT_EQ(plan.merge_requests.size(), 4u);
  EXPECT_EQ(plan.num_partials, static_cast<int32_t>(plan.work.size()));
  EXPECT_EQ(plan.chunk_tokens % shape.chunk_granule, 0);
  EXPECT_GE(plan.workspace.total, static_cast<size_t>(plan.num_partials) * 16 * 129 * 4);
}

TEST(Plan, HeadTilesShareTheMachine) {
  // The MLA kernel's shape: 128 heads in two 64-head CTAs per item, one CTA
  // per SM. Batch 64 of 2048 tokens fills 132 SMs with one item per request.
  PlanShape shape;
  shape.group_size = 128;
  shape.head_dim_v = 512;
  shape.num_sms = 132;
  shape.items_per_sm = 1;
  const std::vector<int32_t> lens(64, 2048);
  shape.ctas_per_item = 2;
  const DecodePlan paired = make_decode_plan(lens, shape);
  expect_covers(paired, lens);
  EXPECT_EQ(paired.work.size(), lens.size());
  EXPECT_FALSE(paired.needs_merge());
  // Counted as one CTA per item, the same batch would be split in two.
  shape.ctas_per_item = 1;
  const DecodePlan single = make_decode_plan(lens, shape);
  EXPECT_EQ(single.work.size(), 2 * lens.size());
  shape.ctas_per_item = 0;
  EXPECT_THROW(make_decode_plan(lens, shape), Error);
}

TEST(Plan, LargeBatchesNeedNoSplit) {
  PlanShape shape;
  shape.num_sms = 132;
  const std::vector<int32_t> lens(1024, 300);
  const DecodePlan plan = make_decode_plan(lens, shape);
  expect_covers(plan, lens);
  EXPECT_FALSE(plan.needs_merge());
  EXPECT_EQ(plan.work.size(), lens.size());
  for (const WorkItem& w : plan.work) EXPECT_EQ(w.partial, -1);
}

TEST(Plan, FixedChunksAndEmptyRequests) {
  PlanShape shape;
  shape.fixed_chunk_tokens = 32;
  shape.chunk_granule = 32;
  const std::vector<int32_t> lens = {0, 100, 32, 33};
  const DecodePlan plan = make_decode_plan(lens, shape);
  expect_covers(plan, lens);
  EXPECT_EQ(plan.chunk_tokens, 32);
  EXPECT_EQ(plan.merge_requests, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(plan.merge_indptr, (std::vector<int32_t>{0, 4, 6}));
  EXPECT_EQ(plan.work.front().token_end, 0);
}

TEST(Plan, ChunksOfARequestAreBalanced) {
  PlanShape shape;
  shape.num_sms = 132;
  const std::vector<int32_t> lens(256, 4096);  // batch 64 x 4 KV heads x 4096 rows
  const DecodePlan plan = make_decode_plan(lens, shape);
  expect_covers(plan, lens);
  for (const WorkItem& w : plan.work) {
    EXPECT_GE(w.token_end - w.token_begin, 1024) << "no tiny tail items";
  }
}

TEST(Plan, IsDeterministic) {
  PlanShape shape;
  const std::vector<int32_t> lens = {5000, 17, 900, 0, 4096};
  const DecodePlan a = make_decode_plan(lens, shape);
  const DecodePlan b = make_decode_plan(lens, shape);
  ASSERT_EQ(a.work.size(), b.work.size());
  for (size_t i = 0; i < a.work.size(); ++i) {
    EXPECT_EQ(a.work[i].request, b.work[i].request);
    EXPECT_EQ(a.work[i].token_begin, b.work[i].token_begin);
    EXPECT_EQ(a.work[i].partial, b.work[i].partial);
  }
  EXPECT_EQ(a.workspace.total, b.workspace.total);
}

// Requests that nearly fill the grid by themselves stay whole: 256 of 4096
// rows for 132 SMs x 2 items (the even share, 3972, is 97% of a request)
// take one item each, no partials; 128 of 2048 (48%) are still split in two,
// and so are 256 when only 200 would fill the grid (78%).
TEST(Plan, RequestsThatNearlyFillTheGridStayWhole) {
  PlanShape shape;
  shape.num_sms = 132;
  shape.items_per_sm = 2;
  const DecodePlan full = make_decode_plan(std::vector<int32_t>(256, 4096), shape);
  EXPECT_EQ(full.work.size(), 256u);
  EXPECT_EQ(full.uniform_chunks, 1);
  EXPECT_FALSE(full.needs_merge());
  const DecodePlan half = make_decode_plan(std::vector<int32_t>(128, 2048), shape);
  EXPECT_EQ(half.uniform_chunks, 2);
  EXPECT_TRUE(half.needs_merge());
  EXPECT_EQ(make_uniform_split(256, 4096, shape).chunks_per_request, 1);  // the uniform split agrees
  EXPECT_EQ(make_uniform_split(128, 2048, shape).chunks_per_request, 2);
  shape.num_sms = 164;  // 328 slots: the even share is 78% of a request
  EXPECT_EQ(make_decode_plan(std::vector<int32_t>(256, 4096), shape).uniform_chunks, 2);
}

TEST(Plan, EqualCountsMakeAUniformSplit) {
  PlanShape shape;
  shape.group_size = 16;
  shape.head_dim_v = 128;
  shape.num_sms = 132;
  const std::vector<int32_t> lens(4, 2000);  // 2000 is no multiple of the chunk: the last chunks are short
  const DecodePlan plan = make_decode_plan(lens, shape);
  ASSERT_GT(plan.uniform_chunks, 1);
  EXPECT_EQ(static_cast<int64_t>(plan.work.size()), 4 * int64_t{plan.uniform_chunks});
  for (size_t w = 0; w < plan.work.size(); ++w) {
    const int32_t r = static_cast<int32_t>(w) / plan.uniform_chunks, c = static_cast<int32_t>(w) % plan.uniform_chunks;
    EXPECT_EQ(plan.work[w].request, r);
    EXPECT_EQ(plan.work[w].token_begin, c * plan.uniform_chunk_tokens);
    EXPECT_EQ(plan.work[w].token_end, std::min(2000, (c + 1) * plan.uniform_chunk_tokens));
    EXPECT_EQ(plan.work[w].partial, static_cast<int32_t>(w));
  }
  check_decode_plan(plan);
  // One chunk per request: uniform, written directly.
  shape.fixed_chunk_tokens = 4096;
  const DecodePlan whole = make_decode_plan(lens, shape);
  EXPECT_EQ(whole.uniform_chunks, 1);
  EXPECT_EQ(whole.uniform_chunk_tokens, 2000);
  EXPECT_FALSE(whole.needs_merge());
  // Different counts: a list, not a formula.
  EXPECT_EQ(make_decode_plan({2000, 1999, 2000}, PlanShape{}).uniform_chunks, 0);
  EXPECT_EQ(make_decode_plan({}, PlanShape{}).uniform_chunks, 0);
  // An edited uniform claim is refused.
  DecodePlan edited = plan;
  edited.uniform_chunk_tokens += 64;
  EXPECT_THROW(check_decode_plan(edited), Error);
  edited = plan;
  edited.uniform_chunks = 2 * plan.uniform_chunks;
  EXPECT_THROW(check_decode_plan(edited), Error);
}

TEST(Plan, RejectsBadShapes) {
  PlanShape shape;
  shape.group_size = 0;
  EXPECT_THROW(make_decode_plan({1}, shape), Error);
  shape = PlanShape{};
  shape.num_sms = 0;
  EXPECT_THROW(make_decode_plan({1}, shape), Error);
  EXPECT_THROW(make_decode_plan({1, -1}, PlanShape{}), Error);
}

// ---- the plan as data (serialize_decode_plan / deserialize_decode_plan) ----

void expect_same_plan(const DecodePlan& a, const DecodePlan& b) {
  EXPECT_EQ(a.num_requests, b.num_requests);
  EXPECT_EQ(a.group_size, b.group_size);
  EXPECT_EQ(a.head_dim_v, b.head_dim_v);
  EXPECT_EQ(a.chunk_tokens, b.chunk_tokens);
  EXPECT_EQ(a.num_partials, b.num_partials);
  EXPECT_EQ(a.uniform_chunks, b.uniform_chunks);
  EXPECT_EQ(a.uniform_chunk_tokens, b.uniform_chunk_tokens);
  ASSERT_EQ(a.work.size(), b.work.size());
  for (size_t i = 0; i < a.work.size(); ++i) {
    EXPECT_EQ(a.work[i].request, b.work[i].request) << i;
    EXPECT_EQ(a.work[i].token_begin, b.work[i].token_begin) << i;
    EXPECT_EQ(a.work[i].token_end, b.work[i].token_end) << i;
    EXPECT_EQ(a.work[i].partial, b.work[i].partial) << i;
  }
  EXPECT_EQ(a.merge_requests, b.merge_requests);
  EXPECT_EQ(a.merge_indptr, b.merge_indptr);
  EXPECT_EQ(a.seq_lens, b.seq_lens);
  const WorkspaceLayout &x = a.workspace, &y = b.workspace;
  EXPECT_EQ(x.partial_o, y.partial_o);
  EXPECT_EQ(x.partial_lse, y.partial_lse);
  EXPECT_EQ(x.work_items, y.work_items);
  EXPECT_EQ(x.merge_indptr, y.merge_indptr);
  EXPECT_EQ(x.merge_requests, y.merge_requests);
  EXPECT_EQ(x.error_flag, y.error_flag);
  EXPECT_EQ(x.total, y.total);
}

PlanShape plan_shape(int32_t group_size) {
  PlanShape shape;
  shape.group_size = group_size;
  shape.head_dim_v = 128;
  shape.num_sms = 16;
  return shape;
}

std::vector<DecodePlan> sample_plans() {
  PlanShape split = plan_shape(4);
  split.num_sms = 132;
  PlanShape fixed = plan_shape(8);
  fixed.fixed_chunk_tokens = 64;
  return {make_decode_plan({100000, 3, 0, 70000}, split),  // split requests, merge lists, an empty request
          make_decode_plan({512, 512, 512}, split),        // a uniform split
          make_decode_plan({0, 5, 300, 77, 16, 513}, fixed), make_decode_plan({7}, plan_shape(1)),
          make_decode_plan({}, plan_shape(2))};
}

TEST(PlanAsData, ARoundTripGivesTheSamePlan) {
  for (const DecodePlan& plan : sample_plans()) {
    const std::vector<int64_t> words = serialize_decode_plan(plan);
    const DecodePlan back = deserialize_decode_plan(words.data(), words.size());
    expect_same_plan(plan, back);
    EXPECT_EQ(serialize_decode_plan(back), words);
  }
  EXPECT_GT(sample_plans()[0].merge_requests.size(), 0u) << "the samples must include merge lists";
  EXPECT_GT(sample_plans()[1].uniform_chunks, 0) << "and a uniform split";
}

void expect_refused(const std::vector<int64_t>& words, size_t count, const std::string& want) {
  try {
    (void)deserialize_decode_plan(words.data(), count);
    ADD_FAILURE() << "accepted; wanted an error naming: " << want;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("deserialize_decode_plan: ", 0), 0u) << what;
    EXPECT_NE(what.find(want), std::string::npos) << what;
  }
}

TEST(PlanAsData, CorruptedOrTruncatedBlobsAreRefusedByName) {
  const DecodePlan plan = sample_plans()[0];
  const std::vector<int64_t> words = serialize_decode_plan(plan);
  ASSERT_GT(words.size(), 24u);
  expect_refused(words, words.size() - 1, "truncated or padded");
  expect_refused(words, 5, "fewer than the 20-word header");
  std::vector<int64_t> padded = words;
  padded.push_back(0);
  expect_refused(padded, padded.size(), "truncated or padded");
  const auto edited = [&](size_t i, int64_t value) {
    std::vector<int64_t> w = words;
    w[i] = value;
    return w;
  };
  expect_refused(edited(0, words[0] + 1), words.size(), "magic number");
  expect_refused(edited(3, int64_t{1} << 40), words.size(), "group_size = 1099511627776 does not fit in int32");
  expect_refused(edited(15, -8), words.size(), "workspace.total = -8 is negative");
  expect_refused(edited(16, words[16] + 1), words.size(), "do not fill");
  expect_refused(edited(16, int64_t{1} << 61), words.size(), "do not fill");
  expect_refused(edited(19, -1), words.size(), "the seq_lens count = -1 is negative");
  // A field inside its range that disagrees with the rest: check_decode_plan's words.
  expect_refused(edited(20 + 2, words[22] + 1), words.size(), "plan: work[");
  expect_refused(edited(6, words[6] + 1), words.size(), "plan: merge_indptr");
  expect_refused(edited(15, 16), words.size(), "plan: the workspace layout");
  std::vector<int64_t> none;
  EXPECT_THROW((void)deserialize_decode_plan(nullptr, 20), Error);
  expect_refused(none, 0, "fewer than the 20-word header");
}

// A merge list whose first entry runs past num_partials while a later one
// decreases back to it: the check names it instead of reading past the
// slot owners (found writing the deserializer, which feeds it any lists).
TEST(PlanAsData, AMergeListPastTheSlotsIsNamedNotRead) {
  DecodePlan plan = sample_plans()[0];
  ASSERT_GE(plan.merge_indptr.size(), 3u);
  plan.merge_indptr[1] = plan.num_partials + 5;
  try {
    check_decode_plan(plan);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lies outside [0, num_partials"), std::string::npos) << e.what();
  }
}

// A small machine cutting every request into chunks of 64 tokens: the
// merge lists' tests below edit the plans it gives.
PlanShape chunks_of_64() {
  PlanShape shape;
  shape.group_size = 2;
  shape.head_dim_v = 8;
  shape.num_sms = 3;
  shape.fixed_chunk_tokens = 64;
  return shape;
}

// A forged blob once passed the checks with a split request's partials
// listed as two merge entries (each slot its own, so slot by slot nothing
// was amiss) and merged it wrongly. Each merge entry must list all of its
// request's partials, and a request only once.
TEST(PlanAsData, ARequestsPartialsMergeAsOneEntry) {
  const PlanShape shape = chunks_of_64();
  const DecodePlan base = make_decode_plan({200, 0, 130, 64}, shape);
  ASSERT_FALSE(base.merge_requests.empty());
  const int32_t first_slots = base.merge_indptr[1] - base.merge_indptr[0];
  ASSERT_GE(first_slots, 2);
  DecodePlan split = base;  // request merge_requests[0]'s slots as two entries
  split.merge_requests.insert(split.merge_requests.begin(), base.merge_requests[0]);
  split.merge_indptr.insert(split.merge_indptr.begin() + 1, first_slots / 2);
  EXPECT_TRUE(testing::throws_error_naming([&] { check_decode_plan(split); }, "merge entry 0 lists"));
  DecodePlan twice = split;  // both entries listing all its slots: the second names a merged request
  twice.merge_indptr[1] = first_slots;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_decode_plan(twice); }, "names a request already merged"));
  DecodePlan shrunk = base;  // one entry listing fewer slots than the request has partials
  shrunk.merge_indptr[1] -= 1;
  EXPECT_TRUE(testing::throws_error_naming([&] { check_decode_plan(shrunk); }, "partials"));
  DecodePlan stray = base;  // an entry for a request that does not exist
  stray.merge_requests[0] = 99;
  EXPECT_TRUE(
      testing::throws_error_naming([&] { check_decode_plan(stray); }, "merge_requests[0] = 99 is out of range"));
  EXPECT_NO_THROW(check_decode_plan(base));
  const std::vector<int64_t> words = serialize_decode_plan(base);
  EXPECT_NO_THROW(check_decode_plan(deserialize_decode_plan(words.data(), words.size())));
}

}  // namespace
// A request with no partial slots writes its output directly; a merge
// entry naming it (zero slots, so the slot count agreed) would overwrite
// that output with an empty merge.
TEST(PlanAsData, AMergeEntryForAnUnsplitRequestIsRefused) {
  const PlanShape shape = chunks_of_64();
  const DecodePlan base = make_decode_plan({256, 64}, shape);  // request 0 split in 4, request 1 not
  ASSERT_EQ(base.merge_requests, std::vector<int32_t>{0});
  DecodePlan forged = base;
  forged.merge_requests.push_back(1);
  forged.merge_indptr.push_back(forged.merge_indptr.back());
  EXPECT_TRUE(testing::throws_error_naming([&] { check_decode_plan(forged); },
                                           "merge entry 1 names request 1, which has no partial slots"));
  EXPECT_NO_THROW(check_decode_plan(base));
}

// A forged blob once asked for an 8 GiB workspace (refused by the
// allocator, not by name): the layout is a function of the plan's counts,
// and no more partial slots than work items may be claimed.
TEST(PlanAsData, ABlobAsksForNoMoreWorkspaceThanItsCountsNeed) {
  const DecodePlan base = sample_plans()[0];
  ASSERT_GT(base.num_partials, 0);
  const std::vector<int64_t> good = serialize_decode_plan(base);
  EXPECT_EQ(deserialize_decode_plan(good.data(), good.size()).workspace.total, base.workspace.total);
  // Header words 6 and 15: num_partials and workspace.total (the format's order).
  ASSERT_EQ(good[6], base.num_partials);
  ASSERT_EQ(good[15], static_cast<int64_t>(base.workspace.total));
  std::vector<int64_t> big = good;
  big[15] = int64_t{8} << 30;
  EXPECT_TRUE(testing::throws_error_naming([&] { (void)deserialize_decode_plan(big.data(), big.size()); },
                                           "workspace.total = 8589934592) is not the one"));
  std::vector<int64_t> slots = good;
  slots[6] = std::numeric_limits<int32_t>::max();
  EXPECT_TRUE(testing::throws_error_naming([&] { (void)deserialize_decode_plan(slots.data(), slots.size()); },
                                           "num_partials = 2147483647 exceeds the"));
}

}  // namespace sparsepage
