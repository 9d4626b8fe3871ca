// Asserting on the library's errors by what they say: a hostile input must
// come back as sparsepage::Error naming the argument, not as a crash, a
// std::length_error or a silent success.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "sparsepage/types.h"

namespace sparsepage::testing {

/// Runs `call`; passes when it throws sparsepage::Error whose message holds
/// `needle`. Any other outcome (no throw, another exception type, another
/// message) fails with what happened.
template <typename Call>
::testing::AssertionResult throws_error_naming(Call&& call, const std::string& needle) {
  try {
    call();
  } catch (const Error& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "Error without \"" << needle << "\": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "not a sparsepage::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "no error; expected one naming \"" << needle << "\"";
}

}  // namespace sparsepage::testing
