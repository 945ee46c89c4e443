# Driver of the packaging tests, run by CTest as `cmake -D... -P run_consumer.cmake`.
#
#   MODE                   install | find_package | add_subdirectory | fetchcontent | pkg-config
#   VELOXQUANT_SOURCE_DIR  the library's source tree
#   VELOXQUANT_BINARY_DIR  the library's build tree (MODE install: what `cmake --install` installs)
#   CONFIG                 configuration of that build tree (multi-config generators)
#   PREFIX                 install prefix shared by install, find_package and pkg-config
#   WORK_DIR               scratch directory of this test (wiped first)
#   GENERATOR, MAKE_PROGRAM, CXX_COMPILER, EIGEN3_DIR
#                          how the consumer is configured: same generator, compiler and Eigen as the
#                          library's build (Eigen through its CMake package, Eigen3_DIR)
#   EXPECTED_VERSION       the project version the package must report
#
# Consumers are built unoptimised (-O0) in their own tree: a few seconds of configure plus one
# compile. What these tests check is that each way of consuming the package finds it and builds
# and runs against it; the library at -O3 -DNDEBUG under -Werror is tests/headers' job (an -O3
# consumer took 60-90 s of CI per test, four tests, for nothing the -O0 build does not check).

cmake_minimum_required(VERSION 3.20)

foreach(var MODE VELOXQUANT_SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${var} is not set")
  endif()
endforeach()
set(consumers_dir "${CMAKE_CURRENT_LIST_DIR}")

# Runs a command, echoing it; stops the test with its output when it fails.
function(run_step)
  execute_process(COMMAND ${ARGN} COMMAND_ECHO STDOUT RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGN}")
  endif()
endfunction()

# Fails when `file` mentions the source or build tree (the installed package must be relocatable).
function(check_no_tree_paths file)
  file(READ "${file}" text)
  foreach(dir IN ITEMS "${VELOXQUANT_SOURCE_DIR}" "${VELOXQUANT_BINARY_DIR}")
    if(NOT dir STREQUAL "")
      string(FIND "${text}" "${dir}" at)
      if(NOT at EQUAL -1)
        message(FATAL_ERROR "${file} refers to ${dir}")
      endif()
    endif()
  endforeach()
endfunction()

# Configures, builds and runs the CMake consumer project in ${consumers_dir}/<project>.
function(build_and_run_cmake_consumer project)
  set(build "${WORK_DIR}/build")
  set(args -S "${consumers_dir}/${project}" -B "${build}" -DCMAKE_BUILD_TYPE=Debug
           -DCMAKE_CXX_FLAGS_DEBUG=-O0
           -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
  if(GENERATOR)
    list(APPEND args -G "${GENERATOR}")
  endif()
  if(MAKE_PROGRAM)
    list(APPEND args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  if(CXX_COMPILER)
    list(APPEND args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
  endif()
  if(C_COMPILER)
    list(APPEND args "-DCMAKE_C_COMPILER=${C_COMPILER}")
  endif()
  if(EIGEN3_DIR)
    list(APPEND args "-DEigen3_DIR=${EIGEN3_DIR}")
  endif()
  if(EXPECTED_VERSION)
    list(APPEND args "-DVELOXQUANT_EXPECTED_VERSION=${EXPECTED_VERSION}")
  endif()
  list(APPEND args ${ARGN})
  run_step("${CMAKE_COMMAND}" ${args})
  run_step("${CMAKE_COMMAND}" --build "${build}" --config Debug)

  find_program(consumer_exe consumer PATHS "${build}" "${build}/Debug" NO_DEFAULT_PATH
               NO_CACHE)
  if(NOT consumer_exe)
    message(FATAL_ERROR "the consumer executable was not built under ${build}")
  endif()
  run_step("${consumer_exe}")
  # Further consumers the project may build (find_package: the compiled libraries).
  foreach(extra consumer_compiled consumer_c consumer_c_static)
    find_program(extra_exe ${extra} PATHS "${build}" "${build}/Debug" NO_DEFAULT_PATH NO_CACHE)
    if(extra_exe)
      run_step("${extra_exe}")
    endif()
    unset(extra_exe)
  endforeach()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

if(MODE STREQUAL "install")
  # Fresh install of the current build tree into PREFIX.
  file(REMOVE_RECURSE "${PREFIX}")
  set(args --install "${VELOXQUANT_BINARY_DIR}" --prefix "${PREFIX}")
  if(CONFIG)
    list(APPEND args --config "${CONFIG}")
  endif()
  run_step("${CMAKE_COMMAND}" ${args})
  foreach(rel IN ITEMS include/veloxquant/cache.hpp include/veloxquant/cache/detail/simd/kernels.inl
                       share/cmake/veloxquant/veloxquantConfig.cmake
                       share/cmake/veloxquant/veloxquantConfigVersion.cmake
                       share/cmake/veloxquant/veloxquantTargets.cmake
                       share/pkgconfig/veloxquant.pc include/veloxquant/veloxquant.h)
    if(NOT EXISTS "${PREFIX}/${rel}")
      message(FATAL_ERROR "not installed: ${PREFIX}/${rel}")
    endif()
  endforeach()
  # The compiled libraries and the C ABI's pkg-config file (lib/ or lib64/, by GNUInstallDirs).
  foreach(pattern IN ITEMS "lib*/libveloxquant_c.so" "lib*/libveloxquant_c.a"
                           "lib*/libveloxquant_compiled.a" "lib*/pkgconfig/veloxquant-c.pc")
    file(GLOB found "${PREFIX}/${pattern}")
    if(NOT found)
      message(FATAL_ERROR "not installed: ${PREFIX}/${pattern}")
    endif()
  endforeach()
  file(GLOB_RECURSE package_files "${PREFIX}/share/*.cmake" "${PREFIX}/share/*.pc"
       "${PREFIX}/lib*/*.pc")
  foreach(f IN LISTS package_files)
    check_no_tree_paths("${f}")
  endforeach()
  message(STATUS "installed into ${PREFIX}")

elseif(MODE STREQUAL "find_package")
  # A C-only project (no C++ enabled, no Eigen) first: veloxquant::c and ::c_static.
  set(saved_work "${WORK_DIR}")
  set(WORK_DIR "${saved_work}/c_only")
  build_and_run_cmake_consumer(find_package_c "-DCMAKE_PREFIX_PATH=${PREFIX}"
                               -DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON)
  set(WORK_DIR "${saved_work}")
  build_and_run_cmake_consumer(find_package "-DCMAKE_PREFIX_PATH=${PREFIX}")
  # It must have used the fresh install, not some other copy of the package.
  file(STRINGS "${WORK_DIR}/build/CMakeCache.txt" dir_line REGEX "^veloxquant_DIR:")
  string(REGEX REPLACE "^[^=]*=" "" found_dir "${dir_line}")
  file(REAL_PATH "${found_dir}" found_dir)
  file(REAL_PATH "${PREFIX}/share/cmake/veloxquant" expected_dir)
  if(NOT found_dir STREQUAL expected_dir)
    message(FATAL_ERROR "find_package used ${found_dir}, expected ${expected_dir}")
  endif()

elseif(MODE STREQUAL "add_subdirectory")
  build_and_run_cmake_consumer(add_subdirectory "-DVELOXQUANT_SOURCE_DIR=${VELOXQUANT_SOURCE_DIR}")

elseif(MODE STREQUAL "fetchcontent")
  build_and_run_cmake_consumer(fetchcontent "-DVELOXQUANT_SOURCE_DIR=${VELOXQUANT_SOURCE_DIR}"
                               -DFETCHCONTENT_QUIET=OFF)

elseif(MODE STREQUAL "pkg-config")
  find_program(pkg_config NAMES pkg-config pkgconf NO_CACHE)
  if(NOT pkg_config)
    # Matched by the test's SKIP_REGULAR_EXPRESSION (Debian: apt-get install pkg-config).
    message(STATUS "veloxquant-packaging: SKIPPED: pkg-config is not installed")
    return()
  endif()
  if(NOT CXX_COMPILER)
    message(FATAL_ERROR "run_consumer.cmake: CXX_COMPILER is not set")
  endif()
  set(ENV{PKG_CONFIG_PATH} "${PREFIX}/share/pkgconfig:$ENV{PKG_CONFIG_PATH}")

  execute_process(COMMAND "${pkg_config}" --modversion veloxquant
                  OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE
                  COMMAND_ERROR_IS_FATAL ANY)
  if(EXPECTED_VERSION AND NOT version STREQUAL EXPECTED_VERSION)
    message(FATAL_ERROR "pkg-config reports veloxquant ${version}, expected ${EXPECTED_VERSION}")
  endif()
  execute_process(COMMAND "${pkg_config}" --cflags veloxquant
                  OUTPUT_VARIABLE cflags OUTPUT_STRIP_TRAILING_WHITESPACE
                  COMMAND_ERROR_IS_FATAL ANY)
  message(STATUS "pkg-config ${version}: --cflags veloxquant = ${cflags}")
  execute_process(COMMAND "${pkg_config}" --libs veloxquant
                  OUTPUT_VARIABLE libs OUTPUT_STRIP_TRAILING_WHITESPACE
                  COMMAND_ERROR_IS_FATAL ANY)
  separate_arguments(cflags UNIX_COMMAND "${cflags}")
  separate_arguments(libs UNIX_COMMAND "${libs}")

  # One -I must be the installed include directory (not the source tree).
  file(REAL_PATH "${PREFIX}/include" expected_include)
  set(found_include FALSE)
  foreach(flag IN LISTS cflags)
    if(flag MATCHES "^-I(.+)$")
      file(REAL_PATH "${CMAKE_MATCH_1}" dir)
      if(dir STREQUAL expected_include)
        set(found_include TRUE)
      endif()
    endif()
  endforeach()
  if(NOT found_include)
    message(FATAL_ERROR "pkg-config --cflags veloxquant lacks -I${expected_include}")
  endif()

  set(exe "${WORK_DIR}/consumer")
  run_step("${CXX_COMPILER}" -std=c++17 -O0 ${cflags} "${consumers_dir}/main.cpp"
           -o "${exe}" ${libs})
  run_step("${exe}")

  # The C ABI: veloxquant-c.pc (lib/pkgconfig), a C99 program built with the C compiler and linked
  #   shared       $(pkg-config --cflags --libs veloxquant-c): the shared library (its directory
  #                as the run path);
  #   static       $(pkg-config --cflags --libs veloxquant-c-static): the archive by its path;
  #   static_only  $(pkg-config --static --cflags --libs veloxquant-c) against a copy of the
  #                install that holds the archive and no shared library (Libs.private: the C++
  #                runtime the archive needs);
  #   all_static   `-static` and $(pkg-config --static --cflags --libs veloxquant-c) against the
  #                install (skipped, with a message, where the C compiler cannot link a static
  #                program: no libc.a).
  # The static ones must not load libveloxquant_c.so.
  if(NOT C_COMPILER)
    message(FATAL_ERROR "run_consumer.cmake: C_COMPILER is not set")
  endif()
  file(GLOB c_pc "${PREFIX}/lib*/pkgconfig/veloxquant-c.pc")
  get_filename_component(c_pc_dir "${c_pc}" DIRECTORY)
  get_filename_component(c_libdir "${c_pc_dir}" DIRECTORY)
  file(RELATIVE_PATH c_libdir_rel "${PREFIX}" "${c_libdir}")
  set(static_only "${WORK_DIR}/static_only")
  file(COPY "${PREFIX}/include/veloxquant/veloxquant.h" DESTINATION "${static_only}/include/veloxquant")
  file(COPY "${c_libdir}/libveloxquant_c.a" DESTINATION "${static_only}/${c_libdir_rel}")
  file(COPY "${c_pc}" DESTINATION "${static_only}/${c_libdir_rel}/pkgconfig")
  set(probe "${WORK_DIR}/static_probe")
  file(WRITE "${probe}.c" "int main(void) { return 0; }\n")
  execute_process(COMMAND "${C_COMPILER}" -static "${probe}.c" -o "${probe}" RESULT_VARIABLE probe_rc
                  OUTPUT_QUIET ERROR_QUIET)
  set(kinds shared static static_only all_static)
  if(NOT probe_rc EQUAL 0)
    message(STATUS "all_static skipped: ${C_COMPILER} -static cannot link a C program here")
    list(REMOVE_ITEM kinds all_static)
  endif()
  foreach(kind IN LISTS kinds)
    set(ENV{PKG_CONFIG_PATH} "${c_pc_dir}")
    set(pkg_args --cflags --libs veloxquant-c)
    set(link_flags "")
    if(kind STREQUAL "static")
      set(pkg_args --cflags --libs veloxquant-c-static)
    elseif(kind STREQUAL "static_only")
      set(ENV{PKG_CONFIG_PATH} "${static_only}/${c_libdir_rel}/pkgconfig")
      set(pkg_args --static --cflags --libs veloxquant-c)
    elseif(kind STREQUAL "all_static")
      set(pkg_args --static --cflags --libs veloxquant-c)
      set(link_flags -static)
    endif()
    execute_process(COMMAND "${pkg_config}" ${pkg_args}
                    OUTPUT_VARIABLE c_flags OUTPUT_STRIP_TRAILING_WHITESPACE
                    COMMAND_ERROR_IS_FATAL ANY)
    list(JOIN pkg_args " " shown)
    message(STATUS "${kind}: pkg-config ${shown} = ${c_flags}")
    if(kind STREQUAL "all_static" AND c_flags MATCHES "-fsanitize=")
      # A build with sanitizers in CMAKE_CXX_FLAGS passes them on in Libs (CMakeLists.txt).
      message(STATUS "all_static skipped: the library is built with sanitizers, whose runtimes "
                     "do not link into a fully static program")
      continue()
    endif()
    separate_arguments(c_flags UNIX_COMMAND "${c_flags}")
    if(kind STREQUAL "shared")
      foreach(flag IN LISTS c_flags)
        if(flag MATCHES "^-L(.+)$")
          list(APPEND link_flags "-Wl,-rpath,${CMAKE_MATCH_1}")
        endif()
      endforeach()
    endif()
    set(c_exe "${WORK_DIR}/consumer_c_${kind}")
    run_step("${C_COMPILER}" -std=c99 -Wall -Wextra -Werror -pedantic -O0 ${link_flags}
             "${consumers_dir}/main.c" -o "${c_exe}" ${c_flags})
    run_step("${c_exe}")
    if(NOT kind STREQUAL "shared")
      # Nothing of the shared library: the program runs with no libveloxquant_c.so to find.
      execute_process(COMMAND ldd "${c_exe}" OUTPUT_VARIABLE deps ERROR_QUIET
                      RESULT_VARIABLE ldd_rc)
      if(ldd_rc EQUAL 0 AND deps MATCHES "libveloxquant_c")
        message(FATAL_ERROR "${c_exe} loads the shared library:\n${deps}")
      endif()
    endif()
  endforeach()

else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}'")
endif()
