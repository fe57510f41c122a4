// output_projection stage for AMD CDNA GPUs (matrix cores): output LayerNorm, gate and output
// projection fused. No CUDA twin: the CUDA backend runs output_norm and a cuBLASLt GEMM instead.
#include "common/compat.h"
#include "common/params.h"
#include "hip/mfma.h"
#include "hip/output_projection.h"
