#include "sparsepage/log.h"

#include <cstdio>
#include <mutex>
#include <utility>

namespace sparsepage {
namespace {
std::mutex& sink_mutex() {
  static std::mutex mutex;
  return mutex;
}
LogSink& sink_slot() {
  static LogSink sink;
  return sink;
}
}  // namespace

void set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(sink_mutex());
  sink_slot() = std::move(sink);
}

void log_message(LogLevel level, const std::string& message) {
  LogSink sink;
  {
    std::lock_guard<std::mutex> lock(sink_mutex());
    sink = sink_slot();
  }
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  if (sink) sink(level, message);  // called unlocked: a sink may log in turn
}

}  // namespace sparsepage
