/* bfloat16 storage, float accumulators (template: see docs/kernels.md): every
 * load widens (exact), every store rounds to nearest even as PyTorch does
 * (bf16.h; the SIMD headers' *_bf16 operations do the same a vector at a
 * time). Partial sums must not round-trip through bfloat16, so the
 * micro-kernels run the whole K in one block (STORE_IS_REAL 0). */
#include "bf16.h"

#define STORE_IS_REAL 0
/* Results round to 8 significant bits: vector_math.h may use its cheaper
 * activations, accurate to ~5e-6 relative, far inside half a bf16 ulp. */
#define STORE_ROUNDS_TO_BF16 1
#define to_real(s) fmlp_bf16_to_float(s)
#define to_store(r) fmlp_float_to_bf16(r)
#ifdef FMLP_SIMD_WIDTH
#define vs_load v_load_bf16
#define vs_load_first v_load_first_bf16
#define vs_store v_store_bf16
#define vs_store_first v_store_first_bf16
#define vs_round v_round_bf16 /* a float holding what a store would keep */
#endif
