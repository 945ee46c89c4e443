# Runs every program of PROGRAMS (a ;-list; through EMULATOR when set) and fails unless they all
# print the same text, and that text has the line "scalar <digest>" with the digest in EXPECTED.
file(STRINGS "${EXPECTED}" expected REGEX "^[0-9a-f]+$")
set(first "")
foreach(p IN LISTS PROGRAMS)
  execute_process(COMMAND ${EMULATOR} ${p} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${p} failed (${rc}): ${err}")
  endif()
  message(STATUS "${p}:\n${out}")
  if(first STREQUAL "")
    set(first "${out}")
  elseif(NOT out STREQUAL first)
    message(FATAL_ERROR "results differ between builds:\n${first}\nvs\n${out}")
  endif()
endforeach()
if(NOT first MATCHES "(^|\n)scalar ${expected}\n")
  message(FATAL_ERROR "the scalar digest is not the recorded ${expected} (${EXPECTED}): the results "
                      "differ from the recorded machine's. If the computation changed on purpose, "
                      "record the new digest (docs/design.md 7.2).")
endif()
