// A minimal parallel loop for the CPU backend: static blocks of the index
// range over the hardware threads. Work items are independent, so no
// synchronization beyond the join is needed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace sparsepage::cpu {

/// The machine's hardware threads (at least 1), read once per process:
/// std::thread::hardware_concurrency reads sysfs on every call, which was
/// two file opens per CPU decode call.
inline int32_t hardware_threads() {
  static const int32_t threads = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  return threads;
}

/// Runs body(i) for i in [0, count). The first exception a worker throws is
/// rethrown here after every thread has joined, so nothing escapes a thread.
template <typename Body>
void parallel_for(int64_t count, Body&& body) {
  const int64_t threads = std::min<int64_t>(count, hardware_threads());
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto worker = [&](int64_t t) {
    try {
      // Interleaved assignment balances requests of different lengths.
      for (int64_t i = t; i < count; i += threads) body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  try {
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker, t);
  } catch (...) {  // could not start a thread: finish with those we have
    for (auto& thread : pool) thread.join();
    throw;
  }
  worker(0);
  for (auto& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace sparsepage::cpu
