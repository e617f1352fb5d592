# `cmake --install <build> --prefix P`: the public headers, the static libraries and a CMake
# package, so that another project's find_package(fcp CONFIG REQUIRED) gives fcp::api,
# fcp::runtime, ... (examples/consumer shows one; tests/package builds it against an install).
include(CMakePackageConfigHelpers)

set(FCP_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/fcp)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/fcp
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")

install(TARGETS fcp_options fcp_core fcp_plan fcp_baselines fcp_sim fcp_kernels
                fcp_runtime_mpi fcp_runtime fcp_api
        EXPORT fcpTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

install(EXPORT fcpTargets
        NAMESPACE fcp::
        DESTINATION ${FCP_INSTALL_CMAKEDIR})

configure_package_config_file(
  ${CMAKE_CURRENT_LIST_DIR}/fcpConfig.cmake.in
  ${PROJECT_BINARY_DIR}/fcpConfig.cmake
  INSTALL_DESTINATION ${FCP_INSTALL_CMAKEDIR})
write_basic_package_version_file(
  ${PROJECT_BINARY_DIR}/fcpConfigVersion.cmake
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/fcpConfig.cmake ${PROJECT_BINARY_DIR}/fcpConfigVersion.cmake
        DESTINATION ${FCP_INSTALL_CMAKEDIR})
