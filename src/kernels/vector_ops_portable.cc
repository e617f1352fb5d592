// The portable instance of the kernels' vector code; target flags are set in CMakeLists.txt.
#define FCP_VECTOR_OPS_NAME vectorOpsPortable
#include "vector_ops_impl.h"
