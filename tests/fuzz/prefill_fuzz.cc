// Target 12 of the fuzzer: the sparse prefill's own entry points
// (sparsepage/prefill.h), which an engine may call directly as it would
// FlashMLA's flash_mla_sparse_fwd:
//   - MlaSparsePrefill over per-token index rows (bf16 or 656-byte FP8
//     rows, -1 padding, duplicates, per-token counts, an attention sink,
//     tokens that select nothing, sequences of different lengths);
//   - GqaBlockPrefill over block lists per query block, per KV head or per
//     query head, in bf16, f16 or f32, and over e4m3 K/V with per-KV-head
//     power-of-two scales (dense or paged), which must write the native
//     call's bits over the dequantized values;
//   - DsaPrefillIndexer over dense keys or an engine's paged pool (native
//     or vLLM's FP8 blocks, shuffled table), small integer values so that
//     every score is exact: each token's kept set must be the decode
//     indexer's twin's for that token alone; refusals write nothing; a
//     table entry outside the pool that a row reads marks that row (count
//     -1, positions -1, the block bit) or leaves it as it was, and leaves
//     the other sequences' rows alone;
//   - BlockPrefillIndexer over dense keys: every list a selection the
//     attention takes (distinct earlier blocks, the own block last, the
//     local blocks kept, the counts the positions covered), the same bits
//     on a second object, refusals that write nothing.
// A random problem (tests/support/prefill_problem.h: every row no token
// attends is NaN) is run untouched or after one hostile edit.
// Asserted:
//   - untouched, the call is accepted and matches fp64 per token (lse and
//     max_logits too), which also shows that no poisoned row was read;
//   - an edit that the call reads (an entry past its token's position, a
//     negative id other than -1, a count past the list, a sequence shorter
//     than the chunk or not starting on a block, a NaN scale, a missing
//     pointer) is refused with a sparsepage::Error, and the refused call
//     wrote nothing: out, lse and max_logits are as they were, canaries
//     included;
//   - an edit the call never reads (an entry past a token's count) changes
//     nothing: the output is the untouched one's, bit for bit;
//   - the object that refused a call runs the untouched call next and
//     writes the same bits as a fresh object; the MLA call without the
//     causal limit (causal false) writes the same bits as with it, every
//     entry being inside its token's reach.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fuzz/fuzz_support.h"
#include "sparsepage/fp8.h"
#include "sparsepage/index_keys.h"
#include "sparsepage/models/dsa.h"
#include "sparsepage/prefill.h"
#include "support/gqa_prefill_fp8.h"
#include "support/prefill_problem.h"
#include "support/reference.h"

namespace sparsepage {
namespace prefill_fuzz {
namespace {

// Outputs of one call, guarded, NaN-filled before it (0xFF bytes are NaN in
// every float format here).
struct Outputs {
  Guarded out, lse, max_logits;
  Outputs(size_t out_bytes, size_t rows) : out(out_bytes), lse(rows * 4), max_logits(rows * 4) {}
  void check_canaries(const char* what) const {
    out.check_canaries(what);
    lse.check_canaries(what);
    max_logits.check_canaries(what);
  }
  static float* floats(Guarded& g) { return static_cast<float*>(g.data()); }
  float* maxima(bool wanted) { return wanted ? floats(max_logits) : nullptr; }
  bool same_bits(const Outputs& o) const {
    return out.payload() == o.out.payload() && lse.payload() == o.lse.payload() &&
           max_logits.payload() == o.max_logits.payload();
  }
  bool untouched() const {
    const auto all_ff = [](const Guarded& g) {
      for (uint8_t b : g.payload()) {
        if (b != 0xFF) return false;
      }
      return true;
    };
    return all_ff(out) && all_ff(lse) && all_ff(max_logits);
  }
};

std::vector<float> values(const Guarded& g) {
  std::vector<float> v(g.bytes() / 4);
  std::memcpy(v.data(), g.begin(), v.size() * 4);
  return v;
}

/// What a hostile edit must do: be refused, or change nothing.
enum class Expect { kAccepted, kRefused, kSameAsUntouched };

// ---- MLA -------------------------------------------------------------------

/// The same problem read through an engine's paged pool: every sequence's
/// rows copied into blocks of 1-8 rows in shuffled order, unused pool rows
/// and table entries past each sequence poisoned. Untouched, the output must
/// be the dense run's bits (`clean`); a table entry that an attended
/// position reaches, moved outside the pool, must be refused with nothing
/// written, and one no attended position reaches must change nothing.
void fuzz_mla_paged(FuzzedDataProvider& in, const testing::MlaPrefillProblem& pb, const Outputs& clean, bool want_max) {
  const testing::MlaPrefillSpec& spec = pb.spec;
  const int32_t bs = in.ConsumeIntegralInRange<int32_t>(1, 8);
  const int32_t max_blocks = static_cast<int32_t>((pb.kv_len + bs - 1) / bs) + in.ConsumeIntegralInRange<int32_t>(0, 1);
  std::mt19937_64 rng(in.ConsumeIntegral<uint32_t>());
  std::vector<int32_t> ids(static_cast<size_t>(spec.batch) * max_blocks + 2);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  testing::MlaPrefillPool pool = testing::make_mla_prefill_pool(pb, bs, max_blocks, ids);
  std::vector<int32_t>& table = pool.table;
  const int64_t num_blocks = pool.num_blocks;
  // Which table entries an attended position reaches.
  std::vector<char> reached(table.size(), 0);
  const auto attended = testing::mla_prefill_attended(pb.host_params(nullptr, nullptr, nullptr));
  for (size_t row = 0; row < attended.size(); ++row) {
    const size_t b = row / static_cast<size_t>(spec.num_tokens);
    for (int32_t pos : attended[row]) reached[b * static_cast<size_t>(max_blocks) + static_cast<size_t>(pos / bs)] = 1;
  }
  const int edit = in.ConsumeIntegralInRange<int>(0, 3);
  bool refused = false;
  if (edit == 0) {  // one entry a live position reaches, outside the pool
    const size_t e = in.ConsumeIntegralInRange<size_t>(0, table.size() - 1);
    if (table[e] < num_blocks) {
      table[e] = in.ConsumeBool() ? -1 : static_cast<int32_t>(num_blocks);
      refused = reached[e] != 0;
    }
  }
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_heads;
  Outputs got(rows * 512 * 2, rows);
  MlaPrefillParams p = pool.paged(pb.host_params(got.out.data(), Outputs::floats(got.lse), got.maxima(want_max)));
  if (edit == 1) {  // a table too narrow for the longest sequence
    p.block_table.max_blocks = static_cast<int32_t>((pb.kv_len - 1) / bs);
    refused = true;
  }
  MlaSparsePrefill prefill(Device::kCpu);
  const bool ok = accepted([&] { prefill.run(p); }, "MlaSparsePrefill.run (paged)");
  got.check_canaries("MLA prefill (paged)");
  FUZZ_CHECK(ok != refused, "MLA prefill over a paged pool, edit " + std::to_string(edit) +
                                (refused ? ": a hostile table was accepted" : ": a valid table was refused"));
  if (refused) {
    FUZZ_CHECK(got.untouched(), "MLA prefill over a paged pool: a refused call wrote its outputs");
  } else if (!got.same_bits(clean)) {
    const std::vector<float> lse = values(got.lse), mx = values(got.max_logits);
    const std::string diff = testing::compare_mla_prefill(
        pb, testing::mla_prefill_reference(pb), testing::as_float(DType::kBF16, got.out.payload()), lse,
        want_max ? &mx : nullptr, o_tolerance(DType::kBF16), 1e-3, 1e-3);
    finding("MLA prefill over a paged pool: other bits than over the dense rows (against fp64: " +
            (diff.empty() ? std::string("within tolerance") : diff) + ")");
  }
}

void fuzz_mla(FuzzedDataProvider& in) {
  testing::MlaPrefillSpec spec;
  spec.batch = in.ConsumeIntegralInRange<int32_t>(1, 3);
  spec.num_tokens = in.ConsumeIntegralInRange<int32_t>(1, 10);
  spec.num_heads = in.ConsumeIntegralInRange<int32_t>(1, 3);
  spec.topk = in.ConsumeIntegralInRange<int32_t>(1, 12);
  spec.starts.clear();
  for (int32_t b = 0; b < spec.batch; ++b) spec.starts.push_back(in.ConsumeIntegralInRange<int32_t>(0, 30));
  spec.pad_fraction = in.ConsumeIntegralInRange<int>(0, 4) / 4.0;
  spec.duplicates = in.ConsumeBool();
  spec.topk_length = in.ConsumeBool();
  spec.sink = in.ConsumeBool();
  spec.empty_tokens = in.ConsumeIntegralInRange<int32_t>(0, spec.num_tokens);
  spec.fp8 = in.ConsumeBool();
  spec.seed = in.ConsumeIntegral<uint32_t>();
  const testing::MlaPrefillProblem pb = testing::make_mla_prefill_problem(spec);
  const testing::MlaPrefillReference ref = testing::mla_prefill_reference(pb);
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_heads;
  const bool want_max = in.ConsumeBool();

  // The untouched call, on a fresh object.
  Outputs clean(rows * 512 * 2, rows);
  MlaSparsePrefill fresh(Device::kCpu);
  const MlaPrefillParams p = pb.host_params(clean.out.data(), clean.floats(clean.lse), clean.maxima(want_max));
  FUZZ_CHECK(accepted([&] { fresh.run(p); }, "MlaSparsePrefill.run"), "MLA prefill: the untouched call was refused");
  clean.check_canaries("MLA prefill (untouched)");
  {
    const std::vector<float> out = testing::as_float(DType::kBF16, clean.out.payload());
    const std::vector<float> lse = values(clean.lse), mx = values(clean.max_logits);
    const std::string diff = testing::compare_mla_prefill(pb, ref, out, lse, want_max ? &mx : nullptr,
                                                          o_tolerance(DType::kBF16), 1e-3, 1e-3);
    FUZZ_CHECK(diff.empty(), "MLA prefill against fp64: " + diff);
  }

  // One hostile edit on a copy of the inputs.
  testing::MlaPrefillProblem bad = pb;
  Expect expect = Expect::kAccepted;
  const int32_t n = spec.num_tokens, topk = spec.topk;
  const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, spec.batch - 1);
  const int32_t t = in.ConsumeIntegralInRange<int32_t>(0, n - 1);
  const int32_t slot = in.ConsumeIntegralInRange<int32_t>(0, topk - 1);
  const size_t row = static_cast<size_t>(b) * n + t;
  const int64_t pos = pb.kv_lens[static_cast<size_t>(b)] - n + t;
  const bool slot_read = !spec.topk_length || slot < pb.topk_length[row];
  int32_t& entry = bad.indices[row * topk + slot];
  float bad_scale = pb.scale;
  bool null_q = false;
  const int edit = in.ConsumeIntegralInRange<int>(0, 9);
  switch (edit) {
    case 0:  // a later position
      entry = static_cast<int32_t>(pos + 1 + in.ConsumeIntegralInRange<int32_t>(0, 3));
      expect = slot_read ? Expect::kRefused : Expect::kSameAsUntouched;
      break;
    case 1:  // a negative id other than the padding
      entry = -in.ConsumeIntegralInRange<int32_t>(2, 1 << 30);
      expect = slot_read ? Expect::kRefused : Expect::kSameAsUntouched;
      break;
    case 2:  // a count past the row
      if (!spec.topk_length) break;
      bad.topk_length[row] = topk + in.ConsumeIntegralInRange<int32_t>(1, 5);
      expect = Expect::kRefused;
      break;
    case 3:  // a sequence shorter than its chunk
      bad.kv_lens[static_cast<size_t>(b)] = in.ConsumeIntegralInRange<int32_t>(-2, n - 1);
      expect = Expect::kRefused;
      break;
    case 4:  // a sequence past the chunk's bound
      bad.kv_lens[static_cast<size_t>(b)] = static_cast<int32_t>(pb.kv_len + 1);
      expect = Expect::kRefused;
      break;
    case 5:
      bad_scale = in.ConsumeBool() ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      expect = Expect::kRefused;
      break;
    case 6:
      null_q = true;
      expect = Expect::kRefused;
      break;
    default: break;  // untouched: runs again on the object below
  }
  MlaSparsePrefill reused(Device::kCpu);
  Outputs got(rows * 512 * 2, rows);
  MlaPrefillParams q = bad.host_params(got.out.data(), got.floats(got.lse), got.maxima(want_max));
  q.scale = bad_scale;
  if (null_q) q.q = nullptr;
  const bool ok = accepted([&] { reused.run(q); }, "MlaSparsePrefill.run (edited)");
  got.check_canaries("MLA prefill (edited)");
  if (expect == Expect::kRefused) {
    FUZZ_CHECK(!ok, "MLA prefill, edit " + std::to_string(edit) + ": a hostile edit was accepted");
    FUZZ_CHECK(got.untouched(), "MLA prefill, edit " + std::to_string(edit) + ": a refused call wrote its outputs");
  } else {
    FUZZ_CHECK(ok, "MLA prefill, edit " + std::to_string(edit) + ": an edit the call never reads was refused");
    FUZZ_CHECK(got.same_bits(clean),
               "MLA prefill, edit " + std::to_string(edit) + ": an unread edit changed the output");
  }
  // The object that refused (or ran) the edited call runs the untouched one.
  Outputs again(rows * 512 * 2, rows);
  const MlaPrefillParams r = pb.host_params(again.out.data(), again.floats(again.lse), again.maxima(want_max));
  FUZZ_CHECK(accepted([&] { reused.run(r); }, "MlaSparsePrefill.run (again)"),
             "MLA prefill, edit " + std::to_string(edit) + ": the untouched call was refused after an edited one");
  FUZZ_CHECK(again.same_bits(clean),
             "MLA prefill, edit " + std::to_string(edit) + ": a reused object wrote other bits than a fresh one");
  if (in.ConsumeBool()) fuzz_mla_paged(in, pb, clean, want_max);
  // Without the causal limit (flash_mla_sparse_fwd's form) every entry here
  // is still inside its token's reach: the same bits.
  if (in.ConsumeBool()) {
    MlaSparsePrefill open(Device::kCpu);
    Outputs free_run(rows * 512 * 2, rows);
    MlaPrefillParams o = pb.host_params(free_run.out.data(), Outputs::floats(free_run.lse), free_run.maxima(want_max));
    o.causal = false;
    FUZZ_CHECK(accepted([&] { open.run(o); }, "MlaSparsePrefill.run (causal false)"),
               "MLA prefill without the causal limit: the untouched call was refused");
    free_run.check_canaries("MLA prefill (causal false)");
    FUZZ_CHECK(free_run.same_bits(clean), "MLA prefill without the causal limit: other bits than with it");
  }
}

// ---- GQA over blocks ---------------------------------------------------------

/// The same lists over e4m3 K/V with per-KV-head power-of-two scales
/// (tests/support/gqa_prefill_fp8.h): the dequantized rows are exact in
/// spec.dtype, so the FP8 prefill must write the bits of the native one
/// over them, dense and through a shuffled paged pool, and refuse scales it
/// is not given.
void fuzz_gqa_fp8(FuzzedDataProvider& in, const testing::GqaPrefillSpec& spec) {
  const testing::GqaFp8Problem pb = testing::make_gqa_fp8_problem(spec, true);
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_qo_heads;
  const size_t out_bytes = rows * spec.head_dim * dtype_size(spec.dtype);
  Outputs native(out_bytes, rows), fp8(out_bytes, rows);
  GqaBlockPrefill a(Device::kCpu), b(Device::kCpu);
  FUZZ_CHECK(accepted([&] { a.run(pb.dequantized.host_params(native.out.data(), Outputs::floats(native.lse))); },
                      "GqaBlockPrefill.run (dequantized)"),
             "GQA prefill: the dequantized native call was refused");
  GqaPrefillParams p = pb.host_params(fp8.out.data(), Outputs::floats(fp8.lse));
  if (in.ConsumeBool()) {  // through an engine's pool
    const testing::GqaFp8Pool pool =
        testing::make_gqa_fp8_pool(pb, 1 << in.ConsumeIntegralInRange<int>(0, 4), in.ConsumeIntegral<uint32_t>());
    p = pool.paged(p, pool.k.data(), pool.v.data(), pool.table.data(), spec.batch);
    FUZZ_CHECK(accepted([&] { b.run(p); }, "GqaBlockPrefill.run (FP8, paged)"),
               "GQA prefill over a paged FP8 pool: the untouched call was refused");
  } else {
    FUZZ_CHECK(accepted([&] { b.run(p); }, "GqaBlockPrefill.run (FP8)"), "GQA prefill over FP8 rows: refused");
  }
  fp8.check_canaries("GQA prefill (FP8)");
  FUZZ_CHECK(fp8.same_bits(native), "GQA prefill over FP8 rows: other bits than the native call over their values");
  Outputs missing(out_bytes, rows);
  GqaPrefillParams q = pb.host_params(missing.out.data(), Outputs::floats(missing.lse));
  q.v_scale = nullptr;
  FUZZ_CHECK(!accepted([&] { b.run(q); }, "GqaBlockPrefill.run (FP8, no v_scale)") && missing.untouched(),
             "GQA prefill over FP8 rows without v_scale: not refused, or refused after writing");
}

void fuzz_gqa(FuzzedDataProvider& in) {
  testing::GqaPrefillSpec spec;
  constexpr DType kTypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  spec.dtype = kTypes[in.ConsumeIntegralInRange<int>(0, 2)];
  spec.batch = in.ConsumeIntegralInRange<int32_t>(1, 3);
  spec.num_kv_heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
  spec.num_qo_heads = spec.num_kv_heads * in.ConsumeIntegralInRange<int32_t>(1, 3);
  spec.head_dim = 8 * in.ConsumeIntegralInRange<int32_t>(1, 4);
  spec.block_size = in.ConsumeIntegralInRange<int32_t>(1, 8);
  spec.num_tokens = in.ConsumeIntegralInRange<int32_t>(1, 3 * spec.block_size);
  spec.starts.clear();
  for (int32_t b = 0; b < spec.batch; ++b)
    spec.starts.push_back(spec.block_size * in.ConsumeIntegralInRange<int32_t>(0, 5));
  spec.layout = in.ConsumeBool() ? BlockSelectionLayout::kPerKvHead : BlockSelectionLayout::kPerQueryHead;
  spec.width = in.ConsumeIntegralInRange<int32_t>(1, 5);
  spec.seed = in.ConsumeIntegral<uint32_t>();
  const testing::GqaPrefillProblem pb = testing::make_gqa_prefill_problem(spec);
  const testing::GqaPrefillReference ref = testing::gqa_prefill_reference(pb);
  const size_t rows = static_cast<size_t>(spec.batch) * spec.num_tokens * spec.num_qo_heads;
  const size_t out_bytes = rows * spec.head_dim * dtype_size(spec.dtype);

  Outputs clean(out_bytes, rows);
  GqaBlockPrefill fresh(Device::kCpu);
  const GqaPrefillParams p = pb.host_params(clean.out.data(), Outputs::floats(clean.lse));
  FUZZ_CHECK(accepted([&] { fresh.run(p); }, "GqaBlockPrefill.run"), "GQA prefill: the untouched call was refused");
  clean.check_canaries("GQA prefill (untouched)");
  {
    const std::string diff = testing::compare_gqa_prefill(pb, ref, testing::as_float(spec.dtype, clean.out.payload()),
                                                          values(clean.lse), o_tolerance(spec.dtype), 1e-3);
    FUZZ_CHECK(diff.empty(), "GQA prefill against fp64: " + diff);
  }

  testing::GqaPrefillProblem bad = pb;
  Expect expect = Expect::kAccepted;
  const size_t lists = pb.counts.size();
  const size_t list = in.ConsumeIntegralInRange<size_t>(0, lists - 1);
  const int32_t entry = in.ConsumeIntegralInRange<int32_t>(0, spec.width - 1);
  // counts are positions (prefill.h): entries past ceil(count / block_size) are never read.
  const bool entry_read = int64_t{entry} * spec.block_size < pb.counts[list];
  const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, spec.batch - 1);
  float bad_scale = pb.scale;
  bool null_o = false;
  const int edit = in.ConsumeIntegralInRange<int>(0, 8);
  switch (edit) {
    case 0:  // a block past every position of the chunk's sequences
      bad.block_ids[list * spec.width + entry] = static_cast<int32_t>(pb.kv_len / spec.block_size + 1);
      expect = entry_read ? Expect::kRefused : Expect::kSameAsUntouched;
      break;
    case 1:  // a negative block id
      bad.block_ids[list * spec.width + entry] = -in.ConsumeIntegralInRange<int32_t>(2, 1 << 30);
      expect = entry_read ? Expect::kRefused : Expect::kSameAsUntouched;
      break;
    case 2:  // a count past the list's positions, or negative
      bad.counts[list] =
          in.ConsumeBool() ? spec.width * spec.block_size + in.ConsumeIntegralInRange<int32_t>(1, 3) : -1;
      expect = Expect::kRefused;
      break;
    case 3:  // a chunk that does not start on a block
      if (spec.block_size == 1) break;
      bad.kv_lens[static_cast<size_t>(b)] += in.ConsumeIntegralInRange<int32_t>(1, spec.block_size - 1);
      bad.kv_len = std::max<int64_t>(bad.kv_len, bad.kv_lens[static_cast<size_t>(b)]);
      expect = Expect::kRefused;
      break;
    case 4:  // a sequence shorter than its chunk
      bad.kv_lens[static_cast<size_t>(b)] = in.ConsumeIntegralInRange<int32_t>(-1, spec.num_tokens - 1);
      expect = Expect::kRefused;
      break;
    case 5:
      bad_scale = std::numeric_limits<float>::quiet_NaN();
      expect = Expect::kRefused;
      break;
    case 6:
      null_o = true;
      expect = Expect::kRefused;
      break;
    default: break;
  }
  GqaBlockPrefill reused(Device::kCpu);
  Outputs got(out_bytes, rows);
  GqaPrefillParams q = bad.host_params(got.out.data(), Outputs::floats(got.lse));
  q.scale = bad_scale;
  if (null_o) q.o = nullptr;
  const bool ok = accepted([&] { reused.run(q); }, "GqaBlockPrefill.run (edited)");
  got.check_canaries("GQA prefill (edited)");
  if (expect == Expect::kRefused) {
    FUZZ_CHECK(!ok, "GQA prefill, edit " + std::to_string(edit) + ": a hostile edit was accepted");
    FUZZ_CHECK(got.untouched(), "GQA prefill, edit " + std::to_string(edit) + ": a refused call wrote its outputs");
  } else {
    FUZZ_CHECK(ok, "GQA prefill, edit " + std::to_string(edit) + ": an edit the call never reads was refused");
    FUZZ_CHECK(got.same_bits(clean),
               "GQA prefill, edit " + std::to_string(edit) + ": an unread edit changed the output");
  }
  Outputs again(out_bytes, rows);
  const GqaPrefillParams r = pb.host_params(again.out.data(), Outputs::floats(again.lse));
  FUZZ_CHECK(accepted([&] { reused.run(r); }, "GqaBlockPrefill.run (again)"),
             "GQA prefill, edit " + std::to_string(edit) + ": the untouched call was refused after an edited one");
  FUZZ_CHECK(again.same_bits(clean),
             "GQA prefill, edit " + std::to_string(edit) + ": a reused object wrote other bits than a fresh one");
  if (spec.dtype != DType::kF32 && in.ConsumeBool()) fuzz_gqa_fp8(in, spec);
}

// ---- the DSA prefill indexer -------------------------------------------------

/// A chunk's index inputs over small integers (every score exact in fp32,
/// so any order of the sums gives the same kept set and ties fall to the
/// lower position everywhere), the keys dense, or in an engine's paged pool
/// (native or vLLM's FP8 blocks) through a shuffled table.
struct IndexerProblem {
  DType dtype = DType::kBF16;
  int32_t batch = 1, n = 1, heads = 1, dim = 16, topk = 1, key_column = 0, block_size = 8;
  IndexKeyLayout layout = IndexKeyLayout::kDense;
  IndexKeyFormat format = IndexKeyFormat::kNative;
  int64_t kv_len = 0, capacity = 0;
  std::vector<int32_t> kv_lens, table;
  std::vector<uint8_t> k_cache, pool, q;
  std::vector<float> weights;
  int32_t max_blocks = 0;
  int64_t num_blocks = 0;

  PagedIndexKeys paged() {
    PagedIndexKeys k;
    k.format = format;
    k.pool = pool.data();
    k.num_blocks = num_blocks;
    k.block_size = block_size;
    k.dtype = dtype;
    k.block_table = table.data();
    k.block_table_stride = max_blocks;
    k.max_blocks = max_blocks;
    return k;
  }
  DsaPrefillIndexerParams params(int32_t* positions, int32_t* counts, int32_t* error) {
    DsaPrefillIndexerParams p;
    p.dtype = dtype;
    p.chunk = {batch, n, kv_len, kv_lens.data()};
    p.index_heads = heads;
    p.index_head_dim = dim;
    p.topk = topk;
    p.key_layout = layout;
    if (layout == IndexKeyLayout::kDense) {
      p.k_cache = k_cache.data();
      p.key_column = key_column;
      p.capacity = capacity;
    } else {
      p.paged = paged();
      p.error = error;
    }
    p.q_index = q.data();
    p.weights = weights.data();
    p.positions = positions;
    p.counts = counts;
    return p;
  }
  /// Token t of sequence b by the decode indexer's twin, one token alone.
  std::vector<int32_t> rule(int32_t b, int32_t t) {
    DsaConfig c;
    c.index_heads = heads;
    c.index_head_dim = dim;
    c.index_topk = topk;
    c.latent_dim = key_column;
    const int32_t len = kv_lens[static_cast<size_t>(b)] - n + t + 1;
    std::vector<int32_t> positions(static_cast<size_t>(topk)), count(1);
    int32_t error = 0;
    DsaIndexerArgs a;
    a.dtype = dtype;
    a.kv_lens = &len;
    a.max_kv_len = len;
    const size_t row = static_cast<size_t>(b) * n + t;
    a.q_index = q.data() + row * heads * dim * dtype_size(dtype);
    a.weights = weights.data() + row * heads;
    a.positions = positions.data();
    a.counts = count.data();
    a.key_layout = layout;
    if (layout == IndexKeyLayout::kDense) {
      a.k_cache = k_cache.data() + static_cast<size_t>(b) * capacity * (key_column + dim) * dtype_size(dtype);
      a.capacity = capacity;
    } else {
      a.paged = paged();
      a.paged.block_table = table.data() + static_cast<size_t>(b) * max_blocks;
      a.error = &error;
    }
    dsa_select_tokens_cpu(c, 1, a);
    positions.resize(static_cast<size_t>(std::max(0, count[0])));
    return positions;
  }
};

IndexerProblem make_indexer_problem(FuzzedDataProvider& in) {
  IndexerProblem pb;
  const int layout = in.ConsumeIntegralInRange<int>(0, 2);  // dense, paged native, paged FP8
  pb.layout = layout == 0 ? IndexKeyLayout::kDense : IndexKeyLayout::kPaged;
  pb.format = layout == 2 ? IndexKeyFormat::kE4m3 : IndexKeyFormat::kNative;
  // bf16 or f16: the decode indexer's twin, the rule here, takes those (the
  // prefill's CPU f32 path is the model's function, checked by the unit tests).
  pb.dtype = in.ConsumeBool() ? DType::kBF16 : DType::kF16;
  pb.batch = in.ConsumeIntegralInRange<int32_t>(1, 2);
  pb.n = in.ConsumeIntegralInRange<int32_t>(1, 6);
  pb.heads = in.ConsumeIntegralInRange<int32_t>(1, 3);
  pb.dim = layout == 2 ? IndexKeyFp8::kDim : 16 * in.ConsumeIntegralInRange<int32_t>(1, 2);
  pb.topk = in.ConsumeIntegralInRange<int32_t>(1, 8);
  pb.key_column = layout == 0 ? 8 * in.ConsumeIntegralInRange<int32_t>(0, 1) : 0;
  pb.block_size = in.ConsumeBool() ? 8 : 16;
  for (int32_t b = 0; b < pb.batch; ++b) pb.kv_lens.push_back(pb.n + in.ConsumeIntegralInRange<int32_t>(0, 30));
  pb.kv_len = *std::max_element(pb.kv_lens.begin(), pb.kv_lens.end());
  std::mt19937_64 rng(in.ConsumeIntegral<uint32_t>());
  pb.q = testing::integer_values(pb.dtype, static_cast<size_t>(pb.batch) * pb.n * pb.heads * pb.dim, rng, 3);
  std::uniform_int_distribution<int> w(-2, 2);
  pb.weights.resize(static_cast<size_t>(pb.batch) * pb.n * pb.heads);
  for (float& x : pb.weights) x = static_cast<float>(w(rng));
  const int64_t row = pb.key_column + pb.dim;
  pb.capacity = pb.kv_len + in.ConsumeIntegralInRange<int32_t>(0, 4);
  std::vector<uint8_t> keys =
      testing::integer_values(pb.dtype, static_cast<size_t>(pb.batch * pb.capacity * row), rng, 3);
  if (pb.layout == IndexKeyLayout::kDense) {
    pb.k_cache = keys;
    return pb;
  }
  // The pool: every sequence's blocks in shuffled order, one spare block,
  // every table entry past a sequence's blocks outside the pool.
  pb.max_blocks = static_cast<int32_t>((pb.kv_len + pb.block_size - 1) / pb.block_size);
  std::vector<int32_t> ids(static_cast<size_t>(pb.batch) * pb.max_blocks + 1);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  pb.num_blocks = static_cast<int64_t>(ids.size());
  pb.table.assign(static_cast<size_t>(pb.batch) * pb.max_blocks, static_cast<int32_t>(pb.num_blocks) + 3);
  const size_t token_bytes = pb.format == IndexKeyFormat::kE4m3 ? IndexKeyFp8::kTokenBytes
                                                                : static_cast<size_t>(pb.dim) * dtype_size(pb.dtype);
  pb.pool.assign(static_cast<size_t>(pb.num_blocks) * pb.block_size * token_bytes, 0xFF);  // NaN where unwritten
  std::vector<int64_t> slots;
  std::vector<uint8_t> src;
  const size_t es = dtype_size(pb.dtype);
  size_t next = 0;
  for (int32_t b = 0; b < pb.batch; ++b) {
    const int64_t len = pb.kv_lens[static_cast<size_t>(b)];
    for (int64_t j = 0; j * pb.block_size < len; ++j)
      pb.table[static_cast<size_t>(b) * pb.max_blocks + j] = ids[next++];
    for (int64_t pos = 0; pos < len; ++pos) {
      const int32_t block = pb.table[static_cast<size_t>(b) * pb.max_blocks + pos / pb.block_size];
      slots.push_back(int64_t{block} * pb.block_size + pos % pb.block_size);
      const uint8_t* k = keys.data() + static_cast<size_t>((b * pb.capacity + pos) * row) * es;
      src.insert(src.end(), k, k + static_cast<size_t>(pb.dim) * es);
    }
  }
  write_index_keys_cpu(pb.paged(), pb.dim, pb.dtype, src.data(), pb.dim, slots.data(),
                       static_cast<int64_t>(slots.size()));
  return pb;
}

void fuzz_dsa_indexer(FuzzedDataProvider& in) {
  IndexerProblem pb = make_indexer_problem(in);
  const size_t rows = static_cast<size_t>(pb.batch) * pb.n;
  const auto run = [&](IndexerProblem& problem, DsaPrefillIndexer& indexer, std::vector<int32_t>& positions,
                       std::vector<int32_t>& counts, int32_t& error) {
    positions.assign(rows * pb.topk, -7);
    counts.assign(rows, -7);
    error = 0;
    return accepted([&] { indexer.run(problem.params(positions.data(), counts.data(), &error)); },
                    "DsaPrefillIndexer.run");
  };
  DsaPrefillIndexer fresh(Device::kCpu);
  std::vector<int32_t> positions, counts;
  int32_t error = 0;
  FUZZ_CHECK(run(pb, fresh, positions, counts, error), "DSA prefill indexer: the untouched call was refused");
  FUZZ_CHECK(error == 0, "DSA prefill indexer: the untouched call flagged " + std::to_string(error));
  for (int32_t b = 0; b < pb.batch; ++b) {
    for (int32_t t = 0; t < pb.n; ++t) {
      const size_t r = static_cast<size_t>(b) * pb.n + t;
      std::vector<int32_t> want = pb.rule(b, t);
      std::sort(want.begin(), want.end());
      const std::vector<int32_t> got(positions.begin() + static_cast<std::ptrdiff_t>(r * pb.topk),
                                     positions.begin() + static_cast<std::ptrdiff_t>(r * pb.topk + counts[r]));
      FUZZ_CHECK(counts[r] >= 0 && counts[r] <= pb.topk && got == want,
                 "DSA prefill indexer: token " + std::to_string(t) + " of sequence " + std::to_string(b) +
                     " keeps another set than the rule");
      for (int32_t i = counts[r]; i < pb.topk; ++i)
        FUZZ_CHECK(positions[r * pb.topk + i] == -1, "DSA prefill indexer: a row is not padded with -1");
    }
  }

  IndexerProblem bad = pb;
  const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, pb.batch - 1);
  bool refused = true;
  const int edit = in.ConsumeIntegralInRange<int>(0, 7);
  switch (edit) {
    case 0:  // a sequence shorter than its chunk, or past the bound
      bad.kv_lens[static_cast<size_t>(b)] =
          in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, pb.n - 1) : static_cast<int32_t>(pb.kv_len + 1);
      break;
    case 1: bad.topk = 0; break;
    case 2:
      bad.weights.clear();  // a null weights pointer
      break;
    case 3:  // dense: fewer rows than the chunk reaches; paged: a table too narrow
      if (pb.layout == IndexKeyLayout::kDense) {
        bad.capacity = pb.kv_len - 1;
      } else {
        bad.max_blocks = pb.max_blocks - 1;
      }
      break;
    case 4:  // paged: a block a live position reaches outside the pool (flagged, not thrown)
      if (pb.layout != IndexKeyLayout::kPaged) {
        refused = false;
        break;
      }
      bad.table[static_cast<size_t>(b) * pb.max_blocks +
                in.ConsumeIntegralInRange<int32_t>(0, (pb.kv_lens[static_cast<size_t>(b)] - 1) / pb.block_size)] =
          in.ConsumeBool() ? -1 : static_cast<int32_t>(pb.num_blocks);
      refused = false;
      break;
    default: refused = false; break;
  }
  DsaPrefillIndexer reused(Device::kCpu);
  std::vector<int32_t> bad_positions, bad_counts;
  int32_t bad_error = 0;
  if (edit == 2) {
    bad_positions.assign(rows * pb.topk, -7);
    bad_counts.assign(rows, -7);
    DsaPrefillIndexerParams q = bad.params(bad_positions.data(), bad_counts.data(), &bad_error);
    q.weights = nullptr;
    FUZZ_CHECK(!accepted([&] { reused.run(q); }, "DsaPrefillIndexer.run (edited)"),
               "DSA prefill indexer: null weights were accepted");
  } else {
    const bool ok = run(bad, reused, bad_positions, bad_counts, bad_error);
    FUZZ_CHECK(ok != refused, "DSA prefill indexer, edit " + std::to_string(edit) +
                                  (refused ? ": a hostile edit was accepted" : ": a flagged edit was refused"));
  }
  if (refused) {
    for (int32_t v : bad_positions) FUZZ_CHECK(v == -7, "DSA prefill indexer: a refused call wrote positions");
    for (int32_t v : bad_counts) FUZZ_CHECK(v == -7, "DSA prefill indexer: a refused call wrote counts");
    FUZZ_CHECK(bad_error == 0, "DSA prefill indexer: a refused call set the error word");
  } else if (edit == 4) {
    // Sequence b's rows either read no key of the bad block (as untouched)
    // or select nothing (count and positions -1) with the block bit set;
    // every other sequence's rows are as untouched.
    for (size_t r = 0; r < rows; ++r) {
      const bool same = std::equal(bad_positions.begin() + static_cast<std::ptrdiff_t>(r * pb.topk),
                                   bad_positions.begin() + static_cast<std::ptrdiff_t>((r + 1) * pb.topk),
                                   positions.begin() + static_cast<std::ptrdiff_t>(r * pb.topk)) &&
                        bad_counts[r] == counts[r];
      const bool marked =
          bad_counts[r] == -1 && std::all_of(bad_positions.begin() + static_cast<std::ptrdiff_t>(r * pb.topk),
                                             bad_positions.begin() + static_cast<std::ptrdiff_t>((r + 1) * pb.topk),
                                             [](int32_t v) { return v == -1; });
      const bool own = static_cast<int32_t>(r) / pb.n == b;
      FUZZ_CHECK(own ? same || (marked && (bad_error & kIndexErrorBlock) != 0) : same,
                 "DSA prefill indexer: a bad block gave row " + std::to_string(r) + " neither its set nor the mark");
    }
  } else {
    FUZZ_CHECK(bad_positions == positions && bad_counts == counts && bad_error == 0,
               "DSA prefill indexer: the untouched call ran differently on a second object");
  }
}

// ---- the block prefill indexer --------------------------------------------------

/// The block indexer over dense keys: each list must be a selection the
/// attention takes (distinct earlier blocks, the query block's own block
/// last, the forced local blocks kept, min(own, top_blocks) + 1 entries,
/// counts the positions covered), the same on a second object, and a
/// hostile call refused with nothing written.
void fuzz_block_indexer(FuzzedDataProvider& in) {
  const DType dtype = in.ConsumeBool() ? DType::kBF16 : DType::kF16;
  const int32_t batch = in.ConsumeIntegralInRange<int32_t>(1, 2);
  const int32_t heads = in.ConsumeIntegralInRange<int32_t>(1, 2);
  const int32_t dim = 16 * in.ConsumeIntegralInRange<int32_t>(1, 2);
  const int32_t bs = in.ConsumeIntegralInRange<int32_t>(1, 8);
  const int32_t n = in.ConsumeIntegralInRange<int32_t>(1, 3 * bs);
  const int32_t local = in.ConsumeIntegralInRange<int32_t>(1, 3);
  const int32_t top = local - 1 + in.ConsumeIntegralInRange<int32_t>(0, 3);
  std::vector<int32_t> kv_lens;
  for (int32_t b = 0; b < batch; ++b) kv_lens.push_back(n + bs * in.ConsumeIntegralInRange<int32_t>(0, 6));
  const int64_t kv_len = *std::max_element(kv_lens.begin(), kv_lens.end());
  const int64_t capacity = kv_len + in.ConsumeIntegralInRange<int32_t>(0, 3);
  std::mt19937_64 rng(in.ConsumeIntegral<uint32_t>());
  const std::vector<uint8_t> keys = testing::integer_values(dtype, static_cast<size_t>(batch * capacity * dim), rng, 3);
  const std::vector<uint8_t> q = testing::integer_values(dtype, static_cast<size_t>(batch) * n * heads * dim, rng, 3);
  const int32_t nqb = (n + bs - 1) / bs, width = top + 1;
  const size_t lists = static_cast<size_t>(batch) * nqb * heads;
  const auto params = [&](std::vector<int32_t>& lens, int32_t* ids, int32_t* counts) {
    BlockPrefillIndexerParams p;
    p.dtype = dtype;
    p.chunk = {batch, n, kv_len, lens.data()};
    p.num_kv_heads = heads;
    p.head_dim = dim;
    p.block_size = bs;
    p.top_blocks = top;
    p.local_blocks = local;
    p.index_keys = RowView::dense(keys.data(), 1, capacity, dim);
    p.index_keys.capacity = capacity;
    p.q_index = q.data();
    p.block_ids = ids;
    p.counts = counts;
    return p;
  };
  std::vector<int32_t> ids(lists * width, -7), counts(lists, -7);
  BlockPrefillIndexer fresh(Device::kCpu);
  FUZZ_CHECK(accepted([&] { fresh.run(params(kv_lens, ids.data(), counts.data())); }, "BlockPrefillIndexer.run"),
             "block prefill indexer: the untouched call was refused");
  for (size_t l = 0; l < lists; ++l) {
    const int32_t b = static_cast<int32_t>(l / (static_cast<size_t>(nqb) * heads));
    const int32_t i = static_cast<int32_t>(l / heads % nqb);
    const int64_t start = kv_lens[static_cast<size_t>(b)] - n;
    const int32_t own = static_cast<int32_t>(start / bs) + i;
    const int64_t own_end = std::min<int64_t>(int64_t{own + 1} * bs, kv_lens[static_cast<size_t>(b)]);
    const int32_t kept = std::min(own, top) + 1;
    const int32_t* list = ids.data() + l * width;
    const std::string where = "block prefill indexer: list " + std::to_string(l);
    FUZZ_CHECK(counts[l] == int64_t{kept - 1} * bs + (own_end - int64_t{own} * bs), where + ": count");
    FUZZ_CHECK(list[kept - 1] == own, where + ": the own block is not last");
    for (int32_t e = 0; e + 1 < kept; ++e) {
      FUZZ_CHECK(list[e] >= 0 && list[e] < own && (e == 0 || list[e] > list[e - 1]),
                 where + ": earlier blocks not distinct, increasing and before the own block");
    }
    for (int32_t j = std::max(0, own + 1 - local); j < own; ++j)
      FUZZ_CHECK(std::find(list, list + kept, j) != list + kept, where + ": a local block is missing");
  }
  // A second object over the same call; then one hostile call.
  std::vector<int32_t> ids2(lists * width, -7), counts2(lists, -7);
  BlockPrefillIndexer reused(Device::kCpu);
  std::vector<int32_t> bad_lens = kv_lens;
  BlockPrefillIndexerParams bad = params(bad_lens, ids2.data(), counts2.data());
  const int32_t b = in.ConsumeIntegralInRange<int32_t>(0, batch - 1);
  const int edit = in.ConsumeIntegralInRange<int>(0, 6);
  switch (edit) {
    case 0: bad_lens[static_cast<size_t>(b)] = in.ConsumeIntegralInRange<int32_t>(-1, n - 1); break;
    case 1: bad_lens[static_cast<size_t>(b)] += bs > 1 ? 1 : static_cast<int32_t>(kv_len + 1); break;
    case 2: bad.top_blocks = local - 2; break;
    case 3: bad.index_keys.capacity = kv_len - 1; break;
    case 4: bad.index_keys.dim = dim + 16; break;
    default: break;
  }
  const bool refused = edit <= 4;
  const bool ok = accepted([&] { reused.run(bad); }, "BlockPrefillIndexer.run (edited)");
  FUZZ_CHECK(ok != refused, "block prefill indexer, edit " + std::to_string(edit) +
                                (refused ? ": a hostile edit was accepted" : ": the untouched call was refused"));
  if (refused) {
    for (int32_t v : ids2) FUZZ_CHECK(v == -7, "block prefill indexer: a refused call wrote block ids");
    for (int32_t v : counts2) FUZZ_CHECK(v == -7, "block prefill indexer: a refused call wrote counts");
  } else {
    FUZZ_CHECK(ids2 == ids && counts2 == counts, "block prefill indexer: a second object selected otherwise");
  }
}

}  // namespace

void fuzz(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: fuzz_mla(in); break;
    case 1: fuzz_gqa(in); break;
    case 2: fuzz_dsa_indexer(in); break;
    default: fuzz_block_indexer(in); break;
  }
}

}  // namespace prefill_fuzz
}  // namespace sparsepage
