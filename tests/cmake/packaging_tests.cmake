# Packaging tests, included from tests/CMakeLists.txt when VELOXQUANT_PACKAGING_TESTS is ON.
# Each test runs run_consumer.cmake, which builds a tiny consumer (tests/cmake/<mode>/ + main.cpp)
# unoptimised (-O0; run_consumer.cmake says why) in its own tree under <build>/tests/packaging/:
#
#   consumer.install           `cmake --install` of this build tree into a scratch prefix (fixture)
#   consumer.find_package      find_package(veloxquant CONFIG) against that prefix
#   consumer.pkg_config        $(pkg-config --cflags veloxquant) against that prefix, and a C
#                              program through veloxquant-c.pc (shared; static: --static against
#                              an archive-only copy, and -static) and veloxquant-c-static.pc
#   consumer.add_subdirectory  add_subdirectory(<source dir>)
#   consumer.fetchcontent      FetchContent_Declare(SOURCE_DIR <source dir>) + MakeAvailable

set(VELOXQUANT_PACKAGING_DIR ${CMAKE_CURRENT_BINARY_DIR}/packaging)
set(VELOXQUANT_PACKAGING_PREFIX ${VELOXQUANT_PACKAGING_DIR}/prefix)
get_filename_component(VELOXQUANT_EIGEN3_DIR "${Eigen3_DIR}" ABSOLUTE)

function(veloxquant_add_packaging_test name mode)
  add_test(NAME ${name}
    COMMAND ${CMAKE_COMMAND}
      -DMODE=${mode}
      -DVELOXQUANT_SOURCE_DIR=${PROJECT_SOURCE_DIR}
      -DVELOXQUANT_BINARY_DIR=${PROJECT_BINARY_DIR}
      -DCONFIG=$<CONFIG>
      -DPREFIX=${VELOXQUANT_PACKAGING_PREFIX}
      -DWORK_DIR=${VELOXQUANT_PACKAGING_DIR}/${mode}
      -DGENERATOR=${CMAKE_GENERATOR}
      -DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}
      -DCXX_COMPILER=${CMAKE_CXX_COMPILER}
      -DC_COMPILER=${CMAKE_C_COMPILER}
      -DEIGEN3_DIR=${VELOXQUANT_EIGEN3_DIR}
      -DEXPECTED_VERSION=${PROJECT_VERSION}
      -P ${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake)
  set_tests_properties(${name} PROPERTIES
    LABELS packaging TIMEOUT 300 SKIP_REGULAR_EXPRESSION "veloxquant-packaging: SKIPPED")
endfunction()

if(VELOXQUANT_INSTALL)
  veloxquant_add_packaging_test(consumer.install install)
  set_tests_properties(consumer.install PROPERTIES FIXTURES_SETUP veloxquant_installed)

  veloxquant_add_packaging_test(consumer.find_package find_package)
  veloxquant_add_packaging_test(consumer.pkg_config pkg-config)
  set_tests_properties(consumer.find_package consumer.pkg_config PROPERTIES
    FIXTURES_REQUIRED veloxquant_installed)
else()
  message(STATUS "veloxquant: VELOXQUANT_INSTALL is OFF: no install/find_package/pkg-config tests")
endif()

veloxquant_add_packaging_test(consumer.add_subdirectory add_subdirectory)
veloxquant_add_packaging_test(consumer.fetchcontent fetchcontent)
