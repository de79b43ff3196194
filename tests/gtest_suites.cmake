# Registers one CTest test per GoogleTest suite of a test program, where gtest_discover_tests
# registers one per test. Included by ctest when it reads the tests (tests/CMakeLists.txt writes
# the file that sets the variables below and includes this one), so the list is the program's as
# built. Each test runs `PROGRAM --gtest_filter=SUITE.*` in HEADROOM_SUITES_WORKDIR; its COST is
# the suite's number of tests, so that ctest starts the long suites first on a clean checkout. A
# skipped test leaves its suite passed: scripts/test-skips reads GoogleTest's own "[  SKIPPED ]"
# lines from LastTest.log.
#
#   HEADROOM_SUITES_PROGRAM  the test program
#   HEADROOM_SUITES_WORKDIR  the working directory of its tests
if(NOT EXISTS "${HEADROOM_SUITES_PROGRAM}")
  add_test(headroom_tests_NOT_BUILT "${HEADROOM_SUITES_PROGRAM}")
  return()
endif()
# Its stderr is kept out of ctest's own output (the test below shows it when the listing fails).
execute_process(COMMAND "${HEADROOM_SUITES_PROGRAM}" --gtest_list_tests
                WORKING_DIRECTORY "${HEADROOM_SUITES_WORKDIR}"
                OUTPUT_VARIABLE listing RESULT_VARIABLE status ERROR_VARIABLE errors)
if(NOT status EQUAL 0)
  # A test that fails with the program's own words, rather than no tests at all.
  add_test(headroom_tests_LIST_FAILED "${HEADROOM_SUITES_PROGRAM}" --gtest_list_tests)
  return()
endif()
# The listing: a suite's line ("Suite." or "Prefix/Suite.", maybe "  # TypeParam = ..."), then its
# tests, indented. Parameters' descriptions after '#' may hold any character: only the names are
# kept, and ';' and brackets never reach CMake's lists.
string(REGEX REPLACE "#[^\n]*" "" listing "${listing}")
string(REGEX REPLACE "[][;]" "" listing "${listing}")
string(REPLACE "\n" ";" lines "${listing}")
set(suite "")
set(suites "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([^ ]+)\\.[ ]*$")
    set(suite "${CMAKE_MATCH_1}")
    list(APPEND suites "${suite}")
    set(count_${suite} 0)
  elseif(line MATCHES "^  [^ ]" AND NOT suite STREQUAL "")
    math(EXPR count_${suite} "${count_${suite}} + 1")
  endif()
endforeach()
foreach(suite IN LISTS suites)
  add_test("${suite}" "${HEADROOM_SUITES_PROGRAM}" "--gtest_filter=${suite}.*")
  set_tests_properties("${suite}" PROPERTIES WORKING_DIRECTORY "${HEADROOM_SUITES_WORKDIR}"
                       COST "${count_${suite}}")
endforeach()
