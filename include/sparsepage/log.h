// The library's log sink. Every message goes to stderr and, when the host
// application installed one, to its sink as well.
#pragma once

#include <functional>
#include <string>

namespace sparsepage {

enum class LogLevel : int { kInfo = 0, kWarning = 1 };

/// Receives every message the library logs. Called from the thread that logs.
using LogSink = std::function<void(LogLevel level, const std::string& message)>;

/// Installs `sink`; an empty function removes it (stderr only).
void set_log_sink(LogSink sink);

/// Writes `message` to stderr and to the sink, if any.
void log_message(LogLevel level, const std::string& message);

}  // namespace sparsepage
