// backward stage for AMD GPUs: the portable source in common/ compiled as HIP.
#include "common/compat.h"
#include "common/backward.h"
