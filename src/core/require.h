// Argument checks whose message is built only when they fail. Checks on the
// launch path run on every step; building a std::string for each one that
// passes would cost microseconds of host time per launch.
#pragma once

#include <string>

#include "sparsepage/types.h"

/// Throws sparsepage::Error(prefix + message) when `ok` is false. `message`
/// (any expression convertible to std::string) is evaluated only then.
#define SPARSEPAGE_REQUIRE(ok, prefix, ...) \
  do { \
    if (!(ok)) throw ::sparsepage::Error(std::string(prefix) + std::string(__VA_ARGS__)); \
  } while (0)
