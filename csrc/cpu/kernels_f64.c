/* The CPU kernels in double precision. */
#define REAL double
#define REAL_SUFFIX f64
#include "precision_kernels.h"
#include "real_template.h"
#include "drivers.h"
