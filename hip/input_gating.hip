// input_gating stage for AMD GPUs: the portable source in common/ compiled as HIP.
#include "common/compat.h"
#include "common/params.h"
#include "common/input_gating.h"
