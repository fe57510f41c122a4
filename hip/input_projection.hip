// input_projection stage for AMD CDNA GPUs (matrix cores): input LayerNorm, the five input
// projections and the gating fused (issue 31). Its CUDA counterpart is cuda/input_projection.cu.
#include "common/compat.h"
#include "common/params.h"
#include "hip/mfma.h"
#include "hip/input_projection.h"
