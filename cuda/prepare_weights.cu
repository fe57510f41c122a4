// prepare_weights for NVIDIA GPUs: the portable source in common/ compiled as CUDA.
#include "common/compat.h"
#include "common/params.h"
#include "common/prepare_weights.h"
