// The avx2 instance of the kernels' vector code; target flags are set in CMakeLists.txt.
#define FCP_VECTOR_OPS_NAME vectorOpsAvx2
#define FCP_VECTOR_BYTES 32
#include "vector_ops_impl.h"
