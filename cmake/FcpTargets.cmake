# Shared settings for every FCP target: warnings and, when asked, sanitizers.
# Applied per target (never through global flags) so FCP stays embeddable.
include(GNUInstallDirs)

add_library(fcp_options INTERFACE)
add_library(fcp::options ALIAS fcp_options)
# Installed too (as fcp::options): static FCP libraries name it in their link interface as
# $<LINK_ONLY:fcp::options>, which carries only its link options (the sanitizers) to consumers.
set_target_properties(fcp_options PROPERTIES EXPORT_NAME options)
target_compile_options(fcp_options INTERFACE
  $<$<CXX_COMPILER_ID:GNU,Clang>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion
  -Wno-sign-conversion>
  # Every rank must compute the same plan: no compiler may fuse a*b+c differently from
  # another (Clang fuses by default). Kernel files that want FMA set it per file.
  $<$<CXX_COMPILER_ID:GNU,Clang>:-ffp-contract=off>)
if(FCP_SANITIZE STREQUAL "thread")
  set(fcp_sanitizers thread)
elseif(FCP_SANITIZE)
  set(fcp_sanitizers address,undefined)
endif()
if(FCP_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "FCP_BUILD_FUZZERS needs Clang (libFuzzer): configure with CXX=clang++")
  endif()
  # Coverage for libFuzzer in every FCP library; the fuzz targets link the fuzzer itself.
  target_compile_options(fcp_options INTERFACE -fsanitize=fuzzer-no-link)
  target_link_options(fcp_options INTERFACE -fsanitize=fuzzer-no-link)
endif()
if(fcp_sanitizers)
  target_compile_options(fcp_options INTERFACE -fsanitize=${fcp_sanitizers}
                         -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(fcp_options INTERFACE -fsanitize=${fcp_sanitizers})
endif()

# Public headers of target `target`: include/ of the source tree when building, of the install
# prefix once installed; C++20 for whoever includes them (they use std::span).
function(fcp_public_headers target)
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_features(${target} PUBLIC cxx_std_20)
endfunction()

# fcp_add_module(NAME SOURCES... DEPS...): a library fcp_NAME with alias fcp::NAME (also its
# name once installed: cmake/FcpInstall.cmake), public headers under include/, linking only
# what DESIGN.md lets the module use.
function(fcp_add_module name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(fcp_${name} ${ARG_SOURCES})
  add_library(fcp::${name} ALIAS fcp_${name})
  # Position-independent: the libraries link into the Python module and into callers' shared
  # libraries.
  set_target_properties(fcp_${name} PROPERTIES EXPORT_NAME ${name} POSITION_INDEPENDENT_CODE ON)
  fcp_public_headers(fcp_${name})
  target_link_libraries(fcp_${name} PUBLIC ${ARG_DEPS} PRIVATE fcp::options)
endfunction()
