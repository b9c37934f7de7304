/* Shared by the kernel units (kernels_<dtype>_<isa>.c): each defines REAL
 * (its element type) and REAL_SUFFIX (<dtype>_<isa>, as in the registry
 * fusedmlp/cpu_isas.def) and then includes the templates, so one routine
 * serves every unit. The contract (what a unit defines, what a SIMD header
 * provides, the include order, why names go through FN) is written down in
 * docs/kernels.md. */
#ifndef REAL
#error "define REAL and REAL_SUFFIX before including the CPU kernel templates"
#endif

/* name_<dtype>_<isa>: the entry points must differ per unit (they link into
 * one library); the static names do too, so profiles name the unit. */
#define FMLP_CAT_(a, b) a##_##b
#define FMLP_CAT(a, b) FMLP_CAT_(a, b)
#define FN(name) FMLP_CAT(name, REAL_SUFFIX)
