/* The CPU kernels in single precision. */
#define REAL float
#define REAL_SUFFIX f32
#include "precision_kernels.h"
#include "real_template.h"
#include "drivers.h"
