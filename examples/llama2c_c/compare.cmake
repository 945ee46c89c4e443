# cmake -DC_RUN=<llama2c_c_run> -DARGS="a|b|..." [-DCPP_RUN=<llama2c_generate> -DFIXTURES=<dir>]
#       [-DEXPECT_ERROR=<regex>] -P compare.cmake
#
# Without EXPECT_ERROR: runs `C_RUN ARGS` and `CPP_RUN --fixtures FIXTURES --queries ARGS` and
# fails, showing both outputs, unless both succeed with the same non-empty stdout, byte for byte.
# With EXPECT_ERROR: runs `C_RUN ARGS` only and fails unless it exits non-zero with stderr
# matching the regex and nothing on stdout. ARGS separates the arguments with '|'.
cmake_minimum_required(VERSION 3.20)  # the policies of the project (CMP0054: no double dereference)
string(REPLACE "|" ";" args "${ARGS}")
list(JOIN args "' '" shown)

function(run_program prefix)
  execute_process(COMMAND ${ARGN} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  set(${prefix}_out "${out}" PARENT_SCOPE)
  set(${prefix}_err "${err}" PARENT_SCOPE)
  set(${prefix}_rc "${rc}" PARENT_SCOPE)
endfunction()

run_program(c "${C_RUN}" ${args})
string(CONCAT c_report "C: ${C_RUN} '${shown}'\n"
       "exit: ${c_rc}\n--- stdout ---\n${c_out}--- stderr ---\n${c_err}")

if(DEFINED EXPECT_ERROR)
  if(c_rc EQUAL 0 OR NOT c_err MATCHES "${EXPECT_ERROR}" OR NOT c_out STREQUAL "")
    message("${c_report}")  # unformatted, as the program wrote it
    message(FATAL_ERROR "expected a non-zero exit, nothing on stdout and stderr matching "
                        "'${EXPECT_ERROR}' (the run is shown above)")
  endif()
  message(STATUS "failed as expected: ${c_err}")
  return()
endif()

run_program(cpp "${CPP_RUN}" --fixtures "${FIXTURES}" --queries ${args})
string(CONCAT cpp_report "C++: ${CPP_RUN} --fixtures ${FIXTURES} --queries '${shown}'\n"
       "exit: ${cpp_rc}\n--- stdout ---\n${cpp_out}--- stderr ---\n${cpp_err}")
string(STRIP "${c_out}" c_text)
if(NOT c_rc EQUAL 0 OR NOT cpp_rc EQUAL 0 OR c_text STREQUAL "" OR NOT c_out STREQUAL cpp_out)
  message("${c_report}\n${cpp_report}")  # unformatted, as the programs wrote them
  message(FATAL_ERROR "the C program's text differs from llama2c_generate's, or a run failed or "
                      "printed nothing (both runs are shown above)")
endif()
message(STATUS "identical text:\n${c_out}${c_err}${cpp_err}")
