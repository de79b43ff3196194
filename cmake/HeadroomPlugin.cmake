# headroom_add_plugin(<target> NAME <name> SOURCES <files...> [OUTPUT_DIRECTORY <dir>])
#
# Builds a headroom plugin: a MODULE library named <name>.so (no "lib" prefix: the file name is the
# plugin name the host looks for), compiled with hidden visibility and linked with a version script
# (headroom-plugin.map, beside this file) so that it exports only hr_plugin_entry, C or C++,
# against headroom::plugin_api and nothing else of headroom. Installed with the CMake package, so
# that third-party plugins build the same way.

# This file's folder, where the version script lies: in a function, CMAKE_CURRENT_LIST_DIR is the
# caller's.
set(HEADROOM_PLUGIN_VERSION_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/headroom-plugin.map)

function(headroom_add_plugin target)
  cmake_parse_arguments(PLUGIN "" "NAME;OUTPUT_DIRECTORY" "SOURCES" ${ARGN})
  if(NOT PLUGIN_NAME)
    message(FATAL_ERROR "headroom_add_plugin(${target}): NAME is required")
  endif()
  add_library(${target} MODULE ${PLUGIN_SOURCES})
  set_target_properties(${target} PROPERTIES
    PREFIX ""
    OUTPUT_NAME ${PLUGIN_NAME}
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
  if(PLUGIN_OUTPUT_DIRECTORY)
    set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${PLUGIN_OUTPUT_DIRECTORY})
  endif()
  if(TARGET headroom::plugin_api)
    target_link_libraries(${target} PRIVATE headroom::plugin_api)
  else()
    target_link_libraries(${target} PRIVATE headroom_plugin_api)
  endif()
  # The C math library (sqrt, fabs, exp, ...): with --no-undefined below, a plugin that calls one
  # must link it, and C does not by itself (C++ does, through libstdc++).
  if(UNIX AND NOT APPLE)
    target_link_libraries(${target} PRIVATE m)
  endif()
  # No undefined symbols: a plugin links to no host symbol, only to what the services table gives.
  target_link_options(${target} PRIVATE -Wl,--no-undefined)
  # hr_plugin_entry only: a C++ plugin's template instantiations from the C++ runtime are weak
  # symbols that hidden visibility leaves exported.
  if(UNIX AND NOT APPLE)
    target_link_options(${target} PRIVATE -Wl,--version-script=${HEADROOM_PLUGIN_VERSION_SCRIPT})
    set_property(TARGET ${target} APPEND PROPERTY LINK_DEPENDS ${HEADROOM_PLUGIN_VERSION_SCRIPT})
  endif()
endfunction()
