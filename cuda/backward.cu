// backward stage for NVIDIA GPUs: the portable source in common/ compiled as CUDA.
#include "common/compat.h"
#include "common/backward.h"
