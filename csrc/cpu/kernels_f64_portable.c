/* The CPU kernels in double precision: portable C on every CPU (the SIMD
 * kernels are float only). */
#define REAL double
#define REAL_SUFFIX f64_portable
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_portable.h"
#include "drivers.h"
#include "backward.h"
