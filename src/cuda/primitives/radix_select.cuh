// Top-k selection helpers shared by the two indexers (block_indexer.cu,
// dsa_indexer.cu): the order-preserving key of an fp32 score and a
// CTA-wide radix select over unique 64-bit composites.
//
// Both indexers rank by (score descending, position ascending), so each item
// becomes one composite `(score key << P) | (2^P - 1 - position)`: distinct
// for distinct positions, larger for the item that ranks first. The top k
// composites are then exactly the top k items with ties broken to the lower
// position, and no separate tie pass is needed.
#pragma once

#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace sparsepage {
namespace cuda {

// Order-preserving key: a larger score has a larger key. NaN takes -inf's key
// (it ranks last, as in the CPU rules) and -0 takes +0's: the CPU rules compare
// scores with > and ==, so zeros of either sign (which the summation order
// decides) must tie.
__device__ __forceinline__ uint32_t score_key(float s) {
  if (s != s) s = __int_as_float(0xff800000);
  if (s == 0.0f) s = 0.0f;
  const uint32_t bits = __float_as_uint(s);
  return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

// Bits needed to write every value in [0, n): at least 1.
__host__ __device__ inline int position_bits(int64_t n) {
  int bits = 1;
  while ((int64_t{1} << bits) < n) ++bits;
  return bits;
}

// Which composites the select keeps: those with (x & mask) >= prefix.
struct RadixCut {
  uint64_t prefix = 0, mask = 0;
  __device__ bool keeps(uint64_t x) const { return (x & mask) >= prefix; }
};

// The k largest of n unique composites (bits [0, bits) used), most
// significant 8-bit digit first. Each pass histograms the items that share
// the digits chosen so far; CUB's block scan over the descending digit counts
// finds the digit holding the k-th largest. It stops early when every item
// with the chosen prefix is kept. `get(i)` returns item i (shared or global
// memory, recomputed each pass). All threads of the CTA must call it.
template <int kThreads>
struct RadixSelect {
  static constexpr int kBins = 256;
  static_assert(kThreads >= kBins, "one digit count per thread in the scan");
  using Scan = cub::BlockScan<int32_t, kThreads>;
  struct Storage {
    typename Scan::TempStorage scan;
    int32_t hist[kBins];
    int32_t digit, above, count;
  };

  template <typename Get>
  static __device__ RadixCut run(Get get, int32_t n, int32_t k, int bits, Storage& s) {
    RadixCut cut;
    if (k >= n) return cut;  // everything is kept: mask 0 keeps all
    int32_t remaining = k;
    for (int shift = ((bits + 7) / 8 - 1) * 8; shift >= 0; shift -= 8) {
      for (int i = threadIdx.x; i < kBins; i += kThreads) s.hist[i] = 0;
      __syncthreads();
      for (int32_t i = threadIdx.x; i < n; i += kThreads) {
        const uint64_t x = get(i);
        if ((x & cut.mask) == cut.prefix) {
          // Items sharing a prefix crowd few digits: one atomic per distinct
          // digit among the converged lanes, not one per item.
          const uint32_t digit = static_cast<uint32_t>(x >> shift) & 0xFFu;
          const uint32_t peers = __match_any_sync(__activemask(), digit);
          if (static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(&s.hist[digit], __popc(peers));
        }
      }
      __syncthreads();
      // Thread t holds digit 255 - t: the exclusive sum is the count in larger digits.
      const int32_t c = threadIdx.x < kBins ? s.hist[kBins - 1 - threadIdx.x] : 0;
      int32_t before;
      Scan(s.scan).ExclusiveSum(c, before);
      if (threadIdx.x < kBins && before < remaining && remaining <= before + c) {
        s.digit = kBins - 1 - threadIdx.x;
        s.above = before;
        s.count = c;
      }
      __syncthreads();
      cut.prefix |= static_cast<uint64_t>(s.digit) << shift;
      cut.mask |= uint64_t{0xFF} << shift;
      remaining -= s.above;
      if (s.count == remaining) break;  // CTA-uniform: the whole digit is kept
      // The next writes to hist, digit and the scan storage follow two more barriers.
    }
    __syncthreads();  // every thread has read digit/above/count before the storage is reused
    return cut;
  }
};

}  // namespace cuda
}  // namespace sparsepage
