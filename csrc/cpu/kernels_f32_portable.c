/* The CPU kernels in single precision, portable C (any CPU; built without
 * -mavx flags). */
#define REAL float
#define REAL_SUFFIX f32_portable
#include "precision_kernels.h"
#include "real_template.h"
#include "microkernel_portable.h"
#include "drivers.h"
#include "backward.h"
