// Refusals of the layers' engine forms that the fuzzer's engine-forms
// target found unnamed or late (tests/fuzz/engine_forms_fuzz.cc):
// - an engine-pools step whose attention block table names a block outside
//   the pool was refused by the CPU decode after the indexer had written
//   the step's selection, with a message that did not name the layer;
// - a pool view the decode refuses (rows past its capacity, a table too
//   narrow for the bound) gave "sparse decode: ..." without the layer's
//   name, in both engine forms.
// - a DSA engine-pools step over native keys of another dtype than the
//   layer's, or over a key table narrower than max_seq_len, was refused by
//   the indexer as "dsa_select_tokens_cpu: ...".
// All are now refused by name before anything is written.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sparsepage/index_keys.h"
#include "sparsepage/memory.h"
#include "sparsepage/models/dsa.h"
#include "support/reference.h"

namespace sparsepage {
namespace {

// A small bf16 DSA layer over an engine's pools: MLA rows [16 latent | 8
// rope], index keys of 8 values in blocks of 8, two sequences of 5 and 3
// tokens in blocks of 4 rows (sequence 0: blocks 2, 0; sequence 1: block 3).
struct SmallPools {
  static constexpr int32_t kBatch = 2, kBlock = 4, kWidth = 2, kBlocks = 4, kKeyBlock = 8;
  DsaConfig c;
  std::vector<int32_t> table = {2, 0, 3, -1}, key_table = {0, 1};
  std::vector<int32_t> lens = {5, 3};
  Buffer mla, keys;
  std::vector<uint8_t> q, q_pe, q_index;
  std::vector<float> weights;

  explicit SmallPools(KVStorage storage) {
    c.num_qo_heads = 2;
    c.latent_dim = 16;
    c.rope_dim = 8;
    c.index_heads = 1;
    c.index_head_dim = 8;
    c.index_topk = 2;
    c.kv_storage = storage;
    std::mt19937_64 rng(5);
    const auto rows = testing::random_values(DType::kBF16, size_t(kBlocks) * kBlock * 24, rng);
    mla = Buffer(Device::kCpu, rows.size());
    std::memcpy(mla.data(), rows.data(), rows.size());
    const auto k = testing::random_values(DType::kBF16, size_t(kBatch) * kKeyBlock * 8, rng);
    keys = Buffer(Device::kCpu, k.size());
    std::memcpy(keys.data(), k.data(), k.size());
    q = testing::random_values(DType::kBF16, size_t(kBatch) * 2 * 16, rng);
    q_pe = testing::random_values(DType::kBF16, size_t(kBatch) * 2 * 8, rng);
    q_index = testing::random_values(DType::kBF16, size_t(kBatch) * 8, rng);
    weights.assign(kBatch, 0.5f);
  }
  EnginePagedKV kv() {
    EnginePagedKV kv;
    kv.k.data = mla.data();
    kv.k.row_stride = 24;
    kv.k.dim = 16;
    kv.k.capacity = int64_t{kBlocks} * kBlock;
    kv.v = kv.k;
    kv.k_extra = kv.k;
    kv.k_extra.data = static_cast<const uint8_t*>(mla.data()) + 16 * 2;
    kv.k_extra.dim = 8;
    kv.block_table.data = table.data();
    kv.block_table.row_stride = kWidth;
    kv.block_table.max_blocks = kWidth;
    kv.block_table.num_rows = kBatch;
    kv.block_table.block_size = kBlock;
    kv.block_table.num_blocks = kBlocks;
    if (c.kv_storage == KVStorage::kEnginePools) {
      kv.seq_lens = lens.data();
      kv.max_seq_len = 5;
      kv.index_keys.format = IndexKeyFormat::kNative;
      kv.index_keys.pool = keys.data();
      kv.index_keys.num_blocks = kBatch;
      kv.index_keys.block_size = kKeyBlock;
      kv.index_keys.dtype = DType::kBF16;
      kv.index_keys.block_table = key_table.data();
      kv.index_keys.block_table_stride = 1;
      kv.index_keys.max_blocks = 1;
    }
    return kv;
  }
  DsaTokens tokens(void* o, const void* index_k) const {
    DsaTokens t;
    t.q_latent = q.data();
    t.q_pe = q_pe.data();
    t.q_index = q_index.data();
    t.index_weights = weights.data();
    t.index_k = index_k;
    t.o = o;
    return t;
  }
};

std::string refusal(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(EngineFormRefusals, APoolsBlockIdOutsideThePoolIsNamedBeforeTheSelection) {
  SmallPools p(KVStorage::kEnginePools);
  DsaAttention layer(Device::kCpu, DType::kBF16, p.c, SmallPools::kBatch,
                     DispatchConfig::defaults().without_performance_gates());
  std::vector<uint8_t> o(size_t(SmallPools::kBatch) * 2 * 16 * 2, 0xFF);
  const std::vector<uint8_t> before = o;
  p.table[1] = SmallPools::kBlocks;  // sequence 0's positions 4 .. 7
  const EnginePagedKV kv = p.kv();
  const std::string what = refusal([&] { layer.decode(p.tokens(o.data(), nullptr), kv); });
  EXPECT_EQ(what.rfind("DsaAttention (engine pools): block_table row 0, entry 1 = 4 is outside the pool", 0), 0u)
      << what;
  EXPECT_EQ(o, before) << "a refused step wrote its output";
  EXPECT_TRUE(layer.last_selected_positions().empty()) << "the refused step's selection was written";
  EXPECT_NO_THROW(layer.check_errors()) << "a refusal by the arguments leaves no flag";

  p.table[1] = 0;  // the same layer then runs
  const EnginePagedKV good = p.kv();
  EXPECT_NO_THROW(layer.decode(p.tokens(o.data(), nullptr), good));
  EXPECT_EQ(layer.last_selected_positions().size(), 2u);
}

TEST(EngineFormRefusals, PoolViewsTheDecodeRefusesNameTheLayer) {
  for (KVStorage storage : {KVStorage::kEnginePaged, KVStorage::kEnginePools}) {
    const bool pools = storage == KVStorage::kEnginePools;
    const std::string name = pools ? "DsaAttention (engine pools): " : "DsaAttention (engine-paged): ";
    SmallPools p(storage);
    DsaAttention layer(Device::kCpu, DType::kBF16, p.c, SmallPools::kBatch,
                       DispatchConfig::defaults().without_performance_gates());
    std::mt19937_64 rng(9);
    if (!pools) {  // the layer's own slots: sequences of 4 and 2 tokens before this step's
      const auto prompt = testing::random_values(DType::kBF16, 4 * 8, rng);
      for (int32_t b = 0; b < SmallPools::kBatch; ++b) {
        layer.release(b);
        layer.admit(b, prompt.data(), nullptr, b == 0 ? 4 : 2);
      }
    }
    const std::vector<int64_t> lens = layer.kv_lens();
    const auto index_k = testing::random_values(DType::kBF16, size_t(SmallPools::kBatch) * 8, rng);
    std::vector<uint8_t> o(size_t(SmallPools::kBatch) * 2 * 16 * 2, 0xFF);
    const std::vector<uint8_t> before = o;
    EnginePagedKV kv = p.kv();
    kv.k.capacity = 3;  // the table reaches rows up to 15
    kv.v.capacity = 3;
    kv.k_extra.capacity = 3;
    std::string what = refusal([&] { layer.decode(p.tokens(o.data(), pools ? nullptr : index_k.data()), kv); });
    EXPECT_EQ(what.rfind(name + "sparse decode: k:", 0), 0u) << what;
    EXPECT_NE(what.find("capacity = 3"), std::string::npos) << what;
    kv = p.kv();
    kv.block_table.max_blocks = 1;  // 4 positions, fewer than the longest sequence's 5
    what = refusal([&] { layer.decode(p.tokens(o.data(), pools ? nullptr : index_k.data()), kv); });
    EXPECT_EQ(what.rfind(name + "sparse decode: block_table:", 0), 0u) << what;
    EXPECT_EQ(o, before) << "a refused step wrote its output";
    EXPECT_EQ(layer.kv_lens(), lens) << "a refused step appended";
    EXPECT_TRUE(layer.last_selected_positions().empty());
  }
}

TEST(EngineFormRefusals, DsaKeyPoolsTheIndexerCannotReadAreNamedByTheLayer) {
  SmallPools p(KVStorage::kEnginePools);
  DsaAttention layer(Device::kCpu, DType::kBF16, p.c, SmallPools::kBatch,
                     DispatchConfig::defaults().without_performance_gates());
  std::vector<uint8_t> o(size_t(SmallPools::kBatch) * 2 * 16 * 2, 0xFF);
  EnginePagedKV kv = p.kv();
  kv.index_keys.dtype = DType::kF16;
  EXPECT_EQ(refusal([&] { layer.decode(p.tokens(o.data(), nullptr), kv); }),
            "DsaAttention (engine pools): kv.index_keys holds f16 keys; the layer's index queries are bf16");
  kv = p.kv();
  kv.max_seq_len = SmallPools::kKeyBlock + 1;  // the attention table holds 8 positions, the key table 8
  kv.block_table.max_blocks = 3;
  kv.block_table.row_stride = 3;
  std::vector<int32_t> wide = {2, 0, 1, 3, 1, 2};
  kv.block_table.data = wide.data();
  EXPECT_EQ(refusal([&] { layer.decode(p.tokens(o.data(), nullptr), kv); }),
            "DsaAttention (engine pools): kv.index_keys' table holds 1 blocks of 8 positions, fewer than "
            "max_seq_len = 9");
  EXPECT_TRUE(layer.last_selected_positions().empty());
  EXPECT_NO_THROW(layer.check_errors());
}

}  // namespace
}  // namespace sparsepage
