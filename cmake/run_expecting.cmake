# Runs a command and checks both its exit code and its output, which ctest's
# PASS_REGULAR_EXPRESSION alone cannot do (it ignores the exit code).
#   cmake -DCMD=<;-list> -DEXPECT_EXIT=<code> -DREGEX=<regex> -P run_expecting.cmake
execute_process(COMMAND ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc STREQUAL "${EXPECT_EXIT}")
  message(FATAL_ERROR "exit code ${rc}, expected ${EXPECT_EXIT}")
endif()
string(REGEX MATCH "${REGEX}" hit "${out}${err}")
if(NOT hit)
  message(FATAL_ERROR "output does not match: ${REGEX}")
endif()
