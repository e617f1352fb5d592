# Shared settings for every FCP target: warnings and, when asked, sanitizers.
# Applied per target (never through global flags) so FCP stays embeddable.
add_library(fcp_options INTERFACE)
add_library(fcp::options ALIAS fcp_options)
target_compile_options(fcp_options INTERFACE
  $<$<CXX_COMPILER_ID:GNU,Clang>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion
  -Wno-sign-conversion>
  # Every rank must compute the same plan: no compiler may fuse a*b+c differently from
  # another (Clang fuses by default). Kernel files that want FMA set it per file.
  $<$<CXX_COMPILER_ID:GNU,Clang>:-ffp-contract=off>)
if(FCP_SANITIZE)
  target_compile_options(fcp_options INTERFACE -fsanitize=address,undefined
                         -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(fcp_options INTERFACE -fsanitize=address,undefined)
endif()

# fcp_add_module(NAME SOURCES... DEPS...): a library fcp_NAME with alias fcp::NAME, public
# headers under include/, linking only what DESIGN.md lets the module use.
function(fcp_add_module name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(fcp_${name} ${ARG_SOURCES})
  add_library(fcp::${name} ALIAS fcp_${name})
  target_include_directories(fcp_${name} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>)
  target_link_libraries(fcp_${name} PUBLIC ${ARG_DEPS} PRIVATE fcp::options)
endfunction()
