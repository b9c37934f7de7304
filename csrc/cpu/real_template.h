/* Shared by the per-precision kernel files: each defines REAL (float or
 * double) and REAL_SUFFIX (f32 or f64) and then includes the templates, so
 * one routine serves both precisions. */
#ifndef REAL
#error "define REAL and REAL_SUFFIX before including the CPU kernel templates"
#endif

#define FMLP_CAT_(a, b) a##_##b
#define FMLP_CAT(a, b) FMLP_CAT_(a, b)
#define FN(name) FMLP_CAT(name, REAL_SUFFIX)
