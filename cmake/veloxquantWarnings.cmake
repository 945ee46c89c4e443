# veloxquant_target_warnings(<target>...): the project's warning flags for code built in this tree
# (tests, examples), plus -Werror when VELOXQUANT_WERROR is ON. Not part of the installed package.
#
# Library headers are included with -I (not -isystem) inside this tree, so warnings raised in them
# are reported too; Eigen and GoogleTest come in through imported targets as system headers.

set(VELOXQUANT_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Wconversion)

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
