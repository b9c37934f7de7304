/* Storage = accumulator (template: see docs/kernels.md): a unit whose
 * STORE is its REAL reads and writes memory as it computes, and its
 * micro-kernels may keep partial sums between K blocks in the output. */
#define STORE_IS_REAL 1
#define STORE_ROUNDS_TO_BF16 0 /* activations as accurate as float allows */
#define to_real(s) (s)
#define to_store(r) (r)
#ifdef FMLP_SIMD_WIDTH
#define vs_load v_load
#define vs_load_first v_load_first
#define vs_store v_store
#define vs_store_first v_store_first
#define vs_round(v) (v) /* to what storage keeps: all of it */
#endif
