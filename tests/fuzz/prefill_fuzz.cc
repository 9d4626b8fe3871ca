// Target 12 of the fuzzer: the sparse prefill's own entry points
// (sparsepage/prefill.h), which an engine may call directly as it would
// FlashMLA's flash_mla_sparse_fwd:
//   - MlaSparsePrefill over per-token index rows (bf16 or 656-byte FP8
//     rows, -1 padding, duplicates, per-token counts, an attention sink,
//     tokens that select nothing, sequences of different lengths);
//   - GqaBlockPrefill over block lists per query block, per KV head or per
//     query head, in bf16, f16 or f32.
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
//     writes the same bits as a fresh object.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fuzz/fuzz_support.h"
#include "sparsepage/prefill.h"
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
}

// ---- GQA over blocks ---------------------------------------------------------

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
}

}  // namespace

void fuzz(FuzzedDataProvider& in) {
  if (in.ConsumeBool()) {
    fuzz_mla(in);
  } else {
    fuzz_gqa(in);
  }
}

}  // namespace prefill_fuzz
}  // namespace sparsepage
