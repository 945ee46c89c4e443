# veloxquant_target_warnings(<target>...): the project's warning flags for code built in this tree
# (tests, examples), plus -Werror when VELOXQUANT_WERROR is ON. Not part of the installed package.
#
# veloxquant_target_checks(<target>...): the warnings, plus the sanitizers named by
# VELOXQUANT_SANITIZE (e.g. "address,undefined,float-cast-overflow"; empty: none), compiled and
# linked into the target, halting on the first report. scripts/test.sh builds the test suite and
# the examples this way; the installed package never sees these flags.
#
# Library headers are included with -I (not -isystem) inside this tree, so warnings raised in them
# are reported too; Eigen and GoogleTest come in through imported targets as system headers.

set(VELOXQUANT_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Wconversion)
set(VELOXQUANT_SANITIZE "" CACHE STRING
    "Sanitizers for the tests and examples (-fsanitize=<list>), e.g. address,undefined")

function(veloxquant_target_warnings)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  foreach(target IN LISTS ARGN)
    target_compile_options(${target} PRIVATE ${VELOXQUANT_WARNING_FLAGS})
    if(VELOXQUANT_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  endforeach()
endfunction()

function(veloxquant_target_checks)
  veloxquant_target_warnings(${ARGN})
  if(VELOXQUANT_SANITIZE STREQUAL "" OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    return()
  endif()
  set(flags -fsanitize=${VELOXQUANT_SANITIZE} -fno-sanitize-recover=all -fno-omit-frame-pointer)
  foreach(target IN LISTS ARGN)
    get_target_property(type ${target} TYPE)
    target_compile_options(${target} PRIVATE ${flags})
    # GCC 12 reports false -Wmaybe-uninitialized inside libstdc++ under -fsanitize; the
    # uninstrumented Release objects (tests/headers) keep the warning as an error.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized)
    endif()
    if(type STREQUAL "EXECUTABLE")
      target_link_options(${target} PRIVATE ${flags})
    endif()
  endforeach()
endfunction()
