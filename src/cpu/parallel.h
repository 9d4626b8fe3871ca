// A minimal parallel loop for the CPU backend: static blocks of the index
// range over the hardware threads. Work items are independent, so no
// synchronization beyond the join is needed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace sparsepage::cpu {

template <typename Body>
void parallel_for(int64_t count, Body&& body) {
  const int64_t threads =
      std::min<int64_t>(count, std::max<unsigned>(1, std::thread::hardware_concurrency()));
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    // Interleaved assignment balances requests of different lengths.
    pool.emplace_back([&, t] {
      for (int64_t i = t; i < count; i += threads) body(i);
    });
  }
  for (auto& thread : pool) thread.join();
}

}  // namespace sparsepage::cpu
