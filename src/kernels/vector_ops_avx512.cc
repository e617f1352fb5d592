// The avx512 instance of the kernels' vector code; target flags are set in CMakeLists.txt.
#define FCP_VECTOR_OPS_NAME vectorOpsAvx512
#define FCP_VECTOR_BYTES 64
#include "vector_ops_impl.h"
