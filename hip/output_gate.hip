// output_gate stage for AMD GPUs: the portable source in common/ compiled as HIP.
#include "common/compat.h"
#include "common/params.h"
#include "common/output_gate.h"
