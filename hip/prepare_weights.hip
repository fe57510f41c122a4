// prepare_weights for AMD GPUs: the portable source in common/ compiled as HIP.
#include "common/compat.h"
#include "common/params.h"
#include "common/prepare_weights.h"
