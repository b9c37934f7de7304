/* Cache-blocked GEMM with a fused epilogue (template: see docs/kernels.md;
 * the unit's micro-kernel header comes first and gives the block shape, the
 * packing and the micro-kernels this file drives).
 *
 * Goto/BLIS shape: the weight is packed into NR-wide column panels (in
 * parallel); MC x KC blocks of the input are packed into MR-tall row panels,
 * and for each NC x KC block of the weight a register-tiled micro-kernel
 * updates an MR x NR tile of the output. On the last K block the micro-kernel
 * adds the bias (started on the first), applies the activation and stores, so
 * the output is written once in its final form. The blocks are cut to the
 * caches (choose_blocks).
 *
 * Small row counts skip packing the weight (it would cost as much as the
 * product): units with FMLP_TRANSPOSED_KERNELS then compute the transposed
 * product, reading weight rows in place. Up to a few hundred rows (one row
 * block, drivers.h) the weight is not packed ahead either: each NC x KC block
 * of it is packed into a small per-thread buffer right before its tiles use
 * it (weight_blocks). */
#include <stdatomic.h>
#include <string.h>

#include "cache_sizes.h"
#include "fusedmlp/cpu.h"
#include "memory.h"

#ifndef FMLP_MICROKERNEL
#error "include the unit's micro-kernel header (microkernel_<kind>.h) before gemm.h"
#endif

/* Values of K a packed REAL slot holds, a parameter of the unit's packing:
 * 2 where the packs keep bfloat16 pairs (pack_k_pairs.h), so a panel over k
 * values of K takes ceil(k / 2) slot rows and K block pc starts pc / 2 rows
 * into it. */
#ifndef GEMM_PACKED_K_PER_SLOT
#define GEMM_PACKED_K_PER_SLOT 1
#endif

/* Slot rows of a panel over k values of K. */
static inline int64_t FN(panel_rows)(int64_t k) {
  return (k + GEMM_PACKED_K_PER_SLOT - 1) / GEMM_PACKED_K_PER_SLOT;
}

/* Bytes a packed value of K takes: the cache blocks count these. */
#define PACKED_VALUE_BYTES ((int64_t)sizeof(REAL) / GEMM_PACKED_K_PER_SLOT)

/* Slots of one packed MR-tall input panel over k values of K, each value
 * GEMM_INPUT_COPIES slots (tile.h). */
static inline int64_t FN(input_panel_slots)(int64_t k) {
  return FN(panel_rows)(k) * GEMM_MR * GEMM_INPUT_COPIES;
}

#if defined(FMLP_INPUT_IN_PLACE) && GEMM_INPUT_COPIES != 1
#error "input panels read in place hold each value once (GEMM_INPUT_COPIES 1)"
#endif

/* Where K block pc of the packed weight panel holding column col starts, in
 * slots from the packed weight's first. */
static inline int64_t FN(weight_panel_at)(int64_t col, int64_t k, int64_t pc) {
  return ((col / GEMM_NR) * FN(panel_rows)(k) + pc / GEMM_PACKED_K_PER_SLOT) * GEMM_NR;
}

/* The largest K block of a product of one weight: GEMM_KC unless the unit's
 * micro-kernel header cuts those finer (microkernel_simd.h); at most GEMM_KC,
 * which sizes the input block's scratch. */
#ifndef GEMM_LINEAR_KC
#define GEMM_LINEAR_KC GEMM_KC
#endif

/* The largest K a product of two weights (gate and up) runs in one K block,
 * a larger K cut into blocks of at most GEMM_KC: GEMM_KC unless the unit's
 * micro-kernel header allows more (microkernel_simd.h). */
#ifndef GEMM_GATED_ONE_BLOCK_K
#define GEMM_GATED_ONE_BLOCK_K GEMM_KC
#endif

/* Weight panels packed per parallel task. */
#define PACK_PANELS_PER_TASK ((int64_t)8)

/* Fork/join costs a few microseconds on an idle 2-core machine and far more
 * on a busy one; below this many multiply-adds (~20 us on one core) the
 * calling thread does the work alone. */
#define PARALLEL_MIN_MULTIPLY_ADDS ((int64_t)1 << 21)
/* Elements a parallel weight pack or pointwise pass needs to be worth it. At
 * 2^18 the host-GEMM path's pass over a 256 x 512 product ran on the calling
 * thread alone: fusedmlp.linear 256 x 512 -> 512 with bias took 45-49 us
 * (ReLU) and 271-281 us (GELU) more than its aten::mm, split over the two
 * threads 40-45 and 155-157 us, and that path's 256 x 512^3 training
 * forward went from 1.04-1.06x eager's time to 1.02x (FUSEDMLP_CPU_GEMM=aten,
 * Zen 3, 2 threads, medians of 21 rounds, builds alternating; the kernels'
 * training steps level). */
#define PARALLEL_MIN_ELEMENTS ((int64_t)1 << 16)

/* threading, or NULL (serial) when `work` is below `minimum`. */
static const fmlp_threading *FN(threading_for)(const fmlp_threading *threading, int64_t work,
                                               int64_t minimum) {
  return work >= minimum ? threading : NULL;
}

/* Tasks handed out one at a time from a shared counter: a thread slowed by
 * another process on its core (or a slower core) takes fewer of them, where
 * the pool's static split would make everyone wait for it. */
typedef struct {
  atomic_llong next;
  int64_t n_tasks;
  void *job;
  fmlp_task_fn fn;
} FN(task_queue);

static void FN(drain_task_queue)(void *context, int64_t begin, int64_t end) {
  FN(task_queue) *queue = context;
  (void)begin;
  (void)end;
  for (;;) {
    const int64_t task = (int64_t)atomic_fetch_add(&queue->next, 1);
    if (task >= queue->n_tasks) return;
    queue->fn(queue->job, task, task + 1);
  }
}

static void FN(run_tasks)(const fmlp_threading *threading, int64_t n_tasks, void *job,
                          fmlp_task_fn fn) {
  if (threading == NULL || threading->parallel_for == NULL || threading->n_threads <= 1 ||
      n_tasks <= 1) {
    fn(job, 0, n_tasks);
    return;
  }
  FN(task_queue) queue = {.n_tasks = n_tasks, .job = job, .fn = fn};
  atomic_init(&queue.next, 0);
  const int64_t workers = threading->n_threads < n_tasks ? threading->n_threads : n_tasks;
  threading->parallel_for(threading->pool, workers, &queue, FN(drain_task_queue));
}

/* `panels` weight panels of `count` rows of src (zero past count) over k
 * values of K, one after another (panel_rows(k) x NR slots each): through
 * the unit's FMLP_PACK_WEIGHT_PANELS where it packs several panels together
 * (pack_k_pairs.h), else FMLP_PACK_WEIGHT_PANEL a panel at a time. */
static void FN(pack_panels)(const STORE *src, int64_t rs, int64_t cs, int64_t count,
                            int64_t panels, int64_t k, REAL *dst) {
#ifdef FMLP_PACK_WEIGHT_PANELS
  FMLP_PACK_WEIGHT_PANELS(src, rs, cs, count, panels, k, dst);
#else
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t left = count - p * GEMM_NR;
    FMLP_PACK_WEIGHT_PANEL(src + p * GEMM_NR * rs, rs, cs, left < GEMM_NR ? left : GEMM_NR,
                           GEMM_NR, k, dst + p * FN(panel_rows)(k) * GEMM_NR);
  }
#endif
}

static void FN(pack_weight_panels)(void *context, int64_t begin, int64_t end) {
  const FN(packed_weight) *packed = context;
  const int64_t n = packed->n, k = packed->k, n_panels = (n + GEMM_NR - 1) / GEMM_NR;
  const int64_t rs = packed->source.row_stride, cs = packed->source.col_stride;
  const int64_t first = begin * PACK_PANELS_PER_TASK;
  const int64_t last = end * PACK_PANELS_PER_TASK < n_panels ? end * PACK_PANELS_PER_TASK
                                                             : n_panels;
  if (first >= last) return;
  FN(pack_panels)((const STORE *)packed->source.data + first * GEMM_NR * rs, rs, cs,
                  n - first * GEMM_NR, last - first, k,
                  packed->data + first * FN(panel_rows)(k) * GEMM_NR);
}

/* Whether a weight multiplied into `rows` rows is read in place. */
static int FN(weight_stays_unpacked)(fmlp_input w, int64_t rows) {
  return rows <= GEMM_UNPACKED_MAX_ROWS && w.col_stride == 1;
}

/* Elements a weight of n rows over K = k takes packed; -1 on overflow. */
static int64_t FN(packed_weight_elems)(int64_t n, int64_t k) {
  int64_t count;
  if (!fmlp_checked_mul((n + GEMM_NR - 1) / GEMM_NR, FN(panel_rows)(k), &count) ||
      !fmlp_checked_mul(count, GEMM_NR, &count)) {
    return -1;
  }
  return count;
}

/* w packed into `buffer` (packed_weight_elems(n, k) elements, the caller's)
 * or, buffer NULL, into scratch allocated here (the caller frees it);
 * packed->data stays NULL for a weight read in place. */
static fmlp_status FN(pack_weight)(fmlp_input w, int64_t n, int64_t k, int64_t rows,
                                   const fmlp_threading *threading, REAL *buffer,
                                   FN(packed_weight) *packed) {
  *packed = (FN(packed_weight)){.data = NULL, .source = w, .n = n, .k = k};
  if (FN(weight_stays_unpacked)(w, rows) || n == 0 || k == 0) return FMLP_OK;
  const int64_t count = FN(packed_weight_elems)(n, k);
  if (count < 0) return FMLP_ERR_SIZE_OVERFLOW;
  packed->data = buffer != NULL ? buffer : fmlp_alloc_scratch(count, sizeof(REAL));
  if (packed->data == NULL) return FMLP_ERR_OUT_OF_MEMORY;
  const int64_t n_panels = (n + GEMM_NR - 1) / GEMM_NR;
  FN(run_tasks)(FN(threading_for)(threading, count, PARALLEL_MIN_ELEMENTS),
                (n_panels + PACK_PANELS_PER_TASK - 1) / PACK_PANELS_PER_TASK, packed,
                FN(pack_weight_panels));
  return FMLP_OK;
}

/* A product's weights (1, or gate and up) packed a block at a time into a
 * small buffer of the calling thread (weight_block_elems), as the tiles are
 * about to use them, rather than whole into a weight-sized buffer ahead of
 * the product: with one row block, every weight block is used by one pass of
 * the input's rows, so packing it in place of the ahead-of-time pack costs
 * the same copy, without the weight-sized buffer's page faults and its trip
 * through memory (drivers.h's GEMM_JIT_MAX_ROWS says when). for_each_tile
 * packs columns [jc, jc + panels * NR) over K block [pc, pc + kc) into
 * data, weight after weight. */
typedef struct {
  const FN(packed_weight) *w[2];
  REAL *data;
  int64_t jc, kc, panels;
} FN(weight_blocks);

/* Where weight `which`'s panel of column col (a panel's first) lies in the
 * block packed just in time. */
static inline REAL *FN(block_panel)(const FN(weight_blocks) *blocks, int64_t which,
                                    int64_t col) {
  return blocks->data +
         (which * blocks->panels + (col - blocks->jc) / GEMM_NR) * FN(panel_rows)(blocks->kc) *
             GEMM_NR;
}

/* Where the tiles of column col (a panel's first) and K block pc find weight
 * `which`'s panel: in the whole packed weight, or (blocks not NULL) in the
 * block packed just in time. */
static inline const REAL *FN(weight_panel)(const FN(packed_weight) *w,
                                           const FN(weight_blocks) *blocks, int64_t which,
                                           int64_t col, int64_t pc) {
  return blocks == NULL ? w->data + FN(weight_panel_at)(col, w->k, pc)
                        : FN(block_panel)(blocks, which, col);
}

/* Packs the block of blocks->w's columns [jc, jc + nc) over K [pc, pc + kc). */
static void FN(pack_weight_block)(FN(weight_blocks) *blocks, int64_t n_weights, int64_t jc,
                                  int64_t nc, int64_t pc, int64_t kc) {
  blocks->jc = jc;
  blocks->kc = kc;
  blocks->panels = (nc + GEMM_NR - 1) / GEMM_NR;
  for (int64_t which = 0; which < n_weights; ++which) {
    const FN(packed_weight) *w = blocks->w[which];
    const STORE *src = w->source.data;
    const int64_t rs = w->source.row_stride, cs = w->source.col_stride;
    FN(pack_panels)(src + jc * rs + pc * cs, rs, cs, w->n - jc, blocks->panels, kc,
                    FN(block_panel)(blocks, which, jc));
  }
}

/* w's columns [j0, j0 + count): j0 a whole panel's first where w is packed. */
static FN(packed_weight) FN(weight_columns)(const FN(packed_weight) *w, int64_t j0,
                                            int64_t count) {
  const int64_t rs = w->source.row_stride;
  return (FN(packed_weight)){
      w->data != NULL ? w->data + FN(weight_panel_at)(j0, w->k, 0) : NULL,
      {(const STORE *)w->source.data + j0 * rs, rs, w->source.col_stride},
      count,
      w->k};
}

/* Units whose micro-kernels can read whole MR-row panels of the input where
 * they lie (tile_epilogue's a_row_stride) define FMLP_INPUT_IN_PLACE(x, kc):
 * whether they do for input x in K blocks of kc. Those panels are then not
 * packed. */
static int FN(input_in_place)(fmlp_input x, int64_t kc) {
#ifdef FMLP_INPUT_IN_PLACE
  return FMLP_INPUT_IN_PLACE(x, kc);
#else
  (void)x;
  (void)kc;
  return 0;
#endif
}

/* Rows [0, mc) and columns [pc, pc + kc) of x into MR-tall panels,
 * zero-padded past mc, panel_rows(kc) x MR slots apart (element (i, kk) of
 * a K-major float panel at dst[(i / MR) * kc * MR + kk * MR + i % MR]);
 * whole panels skipped when read in place. */
static void FN(pack_input_block)(fmlp_input x, int64_t mc, int64_t pc, int64_t kc,
                                 int in_place, REAL *dst) {
  const STORE *src = x.data;
  for (int64_t ir = in_place ? mc / GEMM_MR * GEMM_MR : 0; ir < mc; ir += GEMM_MR) {
    FMLP_PACK_INPUT_PANEL(src + ir * x.row_stride + pc * x.col_stride, x.row_stride,
                          x.col_stride, mc - ir < GEMM_MR ? mc - ir : GEMM_MR, GEMM_MR, kc,
                          dst + (ir / GEMM_MR) * FN(input_panel_slots)(kc));
  }
}

/* With K == 0 the product is empty: the output is act(bias), or act(0),
 * computed in REAL a span at a time. */
#define EMPTY_PRODUCT_SPAN 64
static void FN(fill_empty_product)(int64_t rows, int64_t n, const STORE *bias,
                                   fmlp_activation activation, STORE *c, int64_t ldc, STORE *pre,
                                   int64_t pre_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j0 = 0; j0 < n; j0 += EMPTY_PRODUCT_SPAN) {
      const int64_t count = n - j0 < EMPTY_PRODUCT_SPAN ? n - j0 : EMPTY_PRODUCT_SPAN;
      REAL span[EMPTY_PRODUCT_SPAN];
      for (int64_t j = 0; j < count; ++j) {
        span[j] = bias != NULL ? to_real(bias[j0 + j]) : (REAL)0;
        if (pre != NULL) pre[i * pre_stride + j0 + j] = to_store(span[j]);
      }
      FN(activate_span)(span, count, activation);
      for (int64_t j = 0; j < count; ++j) c[i * ldc + j0 + j] = to_store(span[j]);
    }
  }
}

/* The blocks of a product over K = k whose tiles read `weights` packed
 * weights (2: gate and up). The micro-kernel's input panel (MR x kc) stays in
 * L1 while it sweeps the weight block (nc x kc, a weight's share of half the
 * L2), whose panels stream from L2; the input block (mc x kc) takes a quarter
 * of the L2, so the weight blocks come from farther once per mc rows (the
 * AVX2 float unit's shares differ, tile_avx2.h, and units that run K whole
 * give it the whole L2, GEMM_INPUT_L2_SHARE). K is
 * cut into equal blocks of at most GEMM_KC (GEMM_LINEAR_KC for one weight:
 * see microkernel_simd.h for why those are finer; two weights' K up to
 * GEMM_GATED_ONE_BLOCK_K in one block: see tile_avx512.h). Measured on the
 * Xeon (48 KiB L1d, 2 MiB L2; C harness, one thread's CPU time with the drivers' 2-thread
 * row blocks, loaded machine, medians of 7-9 alternating runs): 2048 x (768
 * -> 3072 -> 3072 -> 768) GELU ran 600-610 ms at kc 384-512 and nc 512-768,
 * against 622-670 ms with the input panels streaming past a weight panel
 * reused from L2 (kc 1024, nc 1024, mc 48: the blocks before) and 650-700 ms
 * with the weight block at the whole L2 (kc 512 x nc 1024, kc 256 x nc 2048);
 * with these blocks 480 x 3072 -> 3072 ran 79 ms against 89, 4096 x 1024 ->
 * 4096 GELU 274 against 288, the GeGLU block at 1024 tokens 134 against 144.
 * The input block's quarter counts its packed bytes (bfloat16 pairs: 2 a
 * value of K, twice the rows of float), the weight block its REAL slots (for
 * bfloat16, a quarter of the L2). The AMX unit (K in one block), one thread's
 * 512-row block, medians of 10-12 alternating runs, loaded machine:
 * 1024 -> 4096 GELU 16.2 ms against 17.7 with the input block counted in
 * REALs, gate and up 768 -> 3072 GELU(tanh) 16.9 against 18.6; counting the
 * weight block's bytes too made 3072 -> 768 3.3 ms against 2.8 (at large K
 * the input block is GEMM_MC rows, past its quarter). */
typedef struct {
  int64_t kc, mc, nc;
} FN(blocks);

/* The input block takes 1 / GEMM_INPUT_L2_SHARE of the L2 and, where the
 * weights are packed ahead, the weight block 1 / GEMM_AHEAD_WEIGHT_L2_SHARE
 * (a unit's tile header may set both: tile_avx2.h); weights packed just in
 * time keep half the L2 for their block, the rows being one input block
 * whatever its size. A unit that runs K whole (storage narrower than REAL:
 * microkernel_simd.h's GEMM_KC) gives its input block the whole L2: at K
 * 3072 a quarter held 48 rows, so a row block of 240 (the study MLP's at
 * 2048 rows, two threads) brought each weight block from L3 five times.
 * scripts/simd_ab.py, one thread, medians of 7-9 alternating rounds, loaded
 * machine, time against a quarter: AVX512-BF16 unit 4096 x 3072 -> 3072
 * GELU 0.957, the study MLP 0.948 (its 3072 -> 3072 layer 0.948), GeGLU at
 * 4096 tokens 0.980, just-in-time products level (0.98-1.01); bfloat16 AVX2
 * unit 0.839, 0.902 (0.847); the bfloat16 AVX-512 unit, whose packs are
 * float, level (0.97-1.01). Twice the L2 (341 rows) gained no more (study
 * MLP 0.968). */
#ifndef GEMM_INPUT_L2_SHARE
#define GEMM_INPUT_L2_SHARE (STORE_IS_REAL ? 4 : 1)
#endif
#ifndef GEMM_AHEAD_WEIGHT_L2_SHARE
#define GEMM_AHEAD_WEIGHT_L2_SHARE 2
#endif
#define GEMM_JUST_IN_TIME_WEIGHT_L2_SHARE 2

static FN(blocks) FN(choose_blocks)(int64_t k, int64_t weights, int just_in_time) {
  const int64_t most_k = weights == 1                  ? GEMM_LINEAR_KC
                         : k <= GEMM_GATED_ONE_BLOCK_K ? k
                                                       : GEMM_KC;
  const int64_t l2 = fmlp_cpu_l2_bytes(), elem = (int64_t)sizeof(REAL);
  const int64_t n_k_blocks = k > most_k ? (k + most_k - 1) / most_k : 1;
  const int64_t kc = k > 0 ? (k + n_k_blocks - 1) / n_k_blocks : 1;
  const int64_t weight_share =
      just_in_time ? GEMM_JUST_IN_TIME_WEIGHT_L2_SHARE : GEMM_AHEAD_WEIGHT_L2_SHARE;
  const int64_t mc =
      l2 / GEMM_INPUT_L2_SHARE / PACKED_VALUE_BYTES / GEMM_INPUT_COPIES / kc / GEMM_MR * GEMM_MR;
  const int64_t nc = l2 / weight_share / elem / weights / kc / GEMM_NR * GEMM_NR;
  return (FN(blocks)){kc, mc > GEMM_MC ? mc : GEMM_MC, nc > GEMM_NR ? nc : GEMM_NR};
}

/* Elements of scratch one thread needs for gemm_rows over up to `rows` rows
 * with K up to max_k; -1 on overflow. Sized to the problem, not to the cache
 * blocks: a small call then gets a small buffer from the allocator's free
 * lists, not a fresh mmap with page faults. An input block is at most mc x kc
 * of some K's blocks: GEMM_MC rows, or its share of the L2. */
static int64_t FN(input_pack_elems)(int64_t rows, int64_t max_k) {
  int64_t unpacked = 0, packed, most;
  if (rows <= GEMM_UNPACKED_MAX_ROWS && !fmlp_checked_mul(max_k, GEMM_NR, &unpacked)) return -1;
  const int64_t most_k = GEMM_GATED_ONE_BLOCK_K > GEMM_KC ? GEMM_GATED_ONE_BLOCK_K : GEMM_KC;
  const int64_t slots = FN(input_panel_slots)(max_k < most_k ? max_k : most_k);
  if (!fmlp_checked_mul((rows + GEMM_MR - 1) / GEMM_MR, slots, &packed) ||
      !fmlp_checked_mul((GEMM_MC + GEMM_MR - 1) / GEMM_MR, slots, &most)) {
    return -1;
  }
  /* choose_blocks' mc x kc: the input block's share of the L2 in packed
   * values of K, each at most a slot (its copies counted in its bytes) */
  const int64_t l2_share = fmlp_cpu_l2_bytes() / GEMM_INPUT_L2_SHARE / PACKED_VALUE_BYTES;
  if (most < l2_share) most = l2_share;
  if (packed > most) packed = most;
  return unpacked > packed ? unpacked : packed;
}

/* Elements of the weight block for a product over K = k of `weights`
 * weights (choose_blocks' nc x kc of each); -1 on overflow. */
static int64_t FN(weight_block_elems)(int64_t k, int64_t weights) {
  const FN(blocks) b = FN(choose_blocks)(k, weights, 1);
  int64_t count;
  if (!fmlp_checked_mul(b.nc, FN(panel_rows)(b.kc), &count) ||
      !fmlp_checked_mul(count, weights, &count)) {
    return -1;
  }
  return count;
}

/* Elements of input pack for products over up to `rows` rows and K up to
 * max_k whose weights are packed just in time: all the rows make one input
 * block (for_each_tile), so that each weight block is packed once; -1 on
 * overflow. */
static int64_t FN(whole_input_pack_elems)(int64_t rows, int64_t max_k) {
  const int64_t most_k = GEMM_GATED_ONE_BLOCK_K > GEMM_KC ? GEMM_GATED_ONE_BLOCK_K : GEMM_KC;
  int64_t count;
  if (!fmlp_checked_mul((rows + GEMM_MR - 1) / GEMM_MR,
                        FN(input_panel_slots)(max_k < most_k ? max_k : most_k), &count)) {
    return -1;
  }
  return count;
}

/* An input of `rows` rows over K = k packed whole for a product of
 * `weights` weights whose weights are packed just in time (the rows one
 * input block): pack_input_block's panels of each K block (choose_blocks),
 * K block after K block, each whole_input_pack_elems(rows, kc) apart. Tasks
 * that split a product's columns pack it once between them and share it
 * (drivers.h's shared_input), where each would pack all of it. */
static int64_t FN(shared_input_elems)(int64_t rows, int64_t k, int64_t weights) {
  const FN(blocks) b = FN(choose_blocks)(k, weights, 1);
  const int64_t n_k_blocks = (k + b.kc - 1) / b.kc;
  int64_t count;
  if (!fmlp_checked_mul((rows + GEMM_MR - 1) / GEMM_MR, FN(input_panel_slots)(b.kc), &count) ||
      !fmlp_checked_mul(count, n_k_blocks, &count)) {
    return -1;
  }
  return count;
}

/* Where K block pc's panels lie in an input packed whole (shared_input_elems). */
static inline int64_t FN(shared_input_block_at)(int64_t rows, int64_t pc, int64_t block_kc) {
  return pc / block_kc * ((rows + GEMM_MR - 1) / GEMM_MR) * FN(input_panel_slots)(block_kc);
}

/* Unit `unit` of an input packed whole (shared_input_elems): the MR-row
 * panel unit % panels (panels: rows / MR rounded up) of K block unit /
 * panels, skipped where the tiles read it in place. */
static void FN(pack_shared_input_panel)(fmlp_input x, int64_t rows, int64_t k, int64_t weights,
                                        int64_t unit, REAL *dst) {
  const FN(blocks) b = FN(choose_blocks)(k, weights, 1);
  const int64_t panels = (rows + GEMM_MR - 1) / GEMM_MR;
  const int64_t pc = unit / panels * b.kc, ir = unit % panels * GEMM_MR;
  const int64_t kc = k - pc < b.kc ? k - pc : b.kc;
  const int64_t tile_rows = rows - ir < GEMM_MR ? rows - ir : GEMM_MR;
  if (FN(input_in_place)(x, b.kc) && tile_rows == GEMM_MR) return;
  FMLP_PACK_INPUT_PANEL((const STORE *)x.data + ir * x.row_stride + pc * x.col_stride,
                        x.row_stride, x.col_stride, tile_rows, GEMM_MR, kc,
                        dst + FN(shared_input_block_at)(rows, pc, b.kc) +
                            ir / GEMM_MR * FN(input_panel_slots)(kc));
}

/* Units (panels of K blocks) of an input packed whole: pack_shared_input_panel's. */
static int64_t FN(shared_input_units)(int64_t rows, int64_t k, int64_t weights) {
  const FN(blocks) b = FN(choose_blocks)(k, weights, 1);
  return (rows + GEMM_MR - 1) / GEMM_MR * ((k + b.kc - 1) / b.kc);
}

/* The Goto/BLIS loops over a weight of n columns and K = k: for each
 * MC x KC input block (packed here into input_pack) and NC x KC block of the
 * weights, every MR x NR tile goes to tile_fn with its input panel (packed,
 * a_row_stride 0; or, read in place, x's first row of the panel at the K
 * block, unit column stride, a_row_stride x's row stride), its first row and
 * column, and its K block; the tiles of an input panel run one after another
 * (see choose_blocks). The weights are packed ahead (blocks NULL) or, a
 * block at a time, into blocks->data (weight_block_elems(k, weights)) right
 * before the block's tiles, the rows then one input block (input_pack:
 * whole_input_pack_elems(rows, k), unused where packed_x, x packed whole
 * for these weights (shared_input_elems), is given). */
typedef void (*FN(tile_fn))(const void *context, void *state, const REAL *a_panel,
                            int64_t a_row_stride, int64_t row, int64_t col, int64_t pc,
                            int64_t kc, int64_t rows, int64_t cols);

static void FN(for_each_tile)(fmlp_input x, const REAL *packed_x, int64_t rows, int64_t n,
                              int64_t k, int64_t weights, REAL *input_pack,
                              FN(tile_fn) tile_fn, const void *context,
                              FN(weight_blocks) *blocks) {
  const STORE *x_data = x.data;
  FN(blocks) b = FN(choose_blocks)(k, weights, blocks != NULL);
  if (blocks != NULL || packed_x != NULL) b.mc = rows;
  const int in_place = FN(input_in_place)(x, b.kc);
  /* what the unit's micro-kernels carry from tile to tile (AMX: a tile whose
   * epilogue is still to run), set up by FMLP_MICROKERNEL_BEGIN and finished
   * by FMLP_MICROKERNEL_END (AMX: the tile configuration too) */
#ifdef FMLP_MICROKERNEL_STATE
  FMLP_MICROKERNEL_STATE unit_state;
  void *const state = &unit_state;
#else
  void *const state = NULL;
#endif
#ifdef FMLP_MICROKERNEL_BEGIN
  FMLP_MICROKERNEL_BEGIN(state);
#endif
  for (int64_t ic = 0; ic < rows; ic += b.mc) {
    const int64_t mc = rows - ic < b.mc ? rows - ic : b.mc;
    const fmlp_input block = {x_data + ic * x.row_stride, x.row_stride, x.col_stride};
    for (int64_t pc = 0; pc < k; pc += b.kc) {
      const int64_t kc = k - pc < b.kc ? k - pc : b.kc;
      const REAL *panels = input_pack;
      if (packed_x != NULL) {
        panels = packed_x + FN(shared_input_block_at)(rows, pc, b.kc);
      } else {
        FN(pack_input_block)(block, mc, pc, kc, in_place, input_pack);
      }
      for (int64_t jc = 0; jc < n; jc += b.nc) {
        const int64_t nc = n - jc < b.nc ? n - jc : b.nc;
        if (blocks != NULL) FN(pack_weight_block)(blocks, weights, jc, nc, pc, kc);
        for (int64_t ir = 0; ir < mc; ir += GEMM_MR) {
          const int64_t tile_rows = mc - ir < GEMM_MR ? mc - ir : GEMM_MR;
          const int64_t a_row_stride = in_place && tile_rows == GEMM_MR ? x.row_stride : 0;
          const REAL *a_panel =
              a_row_stride != 0
                  ? (const REAL *)(x_data + (ic + ir) * x.row_stride + pc)
                  : panels + (ir / GEMM_MR) * FN(input_panel_slots)(kc);
          for (int64_t jr = 0; jr < nc; jr += GEMM_NR) {
            tile_fn(context, state, a_panel, a_row_stride, ic + ir, jc + jr, pc, kc,
                    tile_rows, nc - jr < GEMM_NR ? nc - jr : GEMM_NR);
          }
        }
      }
    }
  }
#ifdef FMLP_MICROKERNEL_END
  FMLP_MICROKERNEL_END(state);
#endif
}

typedef struct {
  const FN(packed_weight) *w;
  const FN(weight_blocks) *blocks; /* NULL: w packed ahead */
  const STORE *bias;
  fmlp_activation activation;
  STORE *c, *pre;
  int64_t ldc, pre_stride;
} FN(linear_tiles);

static void FN(linear_tile)(const void *context, void *state, const REAL *a_panel,
                            int64_t a_row_stride, int64_t row, int64_t col, int64_t pc,
                            int64_t kc, int64_t rows, int64_t cols) {
  const FN(linear_tiles) *t = context;
  const int64_t k = t->w->k;
  const FN(tile_epilogue) ep = {
      .bias = t->bias != NULL ? t->bias + col : NULL,
      .pre = t->pre != NULL ? t->pre + row * t->pre_stride + col : NULL,
      .pre_stride = t->pre_stride,
      .activation = t->activation,
      .first_k_block = pc == 0,
      .last_k_block = pc + kc >= k,
      .a_row_stride = a_row_stride,
      .state = state,
  };
  const REAL *b_panel = FN(weight_panel)(t->w, t->blocks, 0, col, pc);
  FMLP_MICROKERNEL(kc, a_panel, b_panel, t->c + row * t->ldc + col, t->ldc, rows, cols, &ep);
}

/* Whether w, not packed ahead, is read in place by `rows` rows (else it is
 * packed a block at a time). */
static int FN(reads_weight_in_place)(const FN(packed_weight) *w, int64_t rows) {
  return w->data == NULL && FN(weight_stays_unpacked)(w->source, rows);
}

/* c[rows, n] = act(x[rows, k] @ W.T + bias); pre (optional) gets the
 * pre-activation. Single-threaded; callers split rows or columns across
 * threads. w is packed ahead, read in place (reads_weight_in_place), or
 * else packed a block at a time into weight_block (weight_block_elems(k, 1)
 * elements; unused for the other two); input_pack holds
 * input_pack_elems(rows, k) elements, or whole_input_pack_elems(rows, k)
 * for a weight packed a block at a time, unless x comes packed whole
 * (packed_x, see shared_input_elems; NULL: packed here). */
static void FN(gemm_rows_shared)(fmlp_input x, const REAL *packed_x, int64_t rows,
                                 const FN(packed_weight) *w, const STORE *bias,
                                 fmlp_activation activation, STORE *c, int64_t ldc, STORE *pre,
                                 int64_t pre_stride, REAL *input_pack, REAL *weight_block) {
  const int64_t n = w->n, k = w->k;
  if (n == 0 || rows == 0) return; /* an empty weight is never packed: nothing to read */
  if (k == 0) {
    FN(fill_empty_product)(rows, n, bias, activation, c, ldc, pre, pre_stride);
    return;
  }
  if (FN(reads_weight_in_place)(w, rows)) {
#if FMLP_TRANSPOSED_KERNELS
    const FN(product_out) out = {.c = c, .pre = pre, .ldc = ldc, .pre_stride = pre_stride};
    FN(transposed_rows)(x, NULL, rows, w, bias, activation, out, input_pack);
#endif
    return;
  }
  FN(weight_blocks) blocks = {.w = {w, NULL}, .data = weight_block};
  FN(weight_blocks) *jit = w->data == NULL ? &blocks : NULL;
  const FN(linear_tiles) tiles = {w, jit, bias, activation, c, pre, ldc, pre_stride};
  FN(for_each_tile)(x, packed_x, rows, n, k, 1, input_pack, FN(linear_tile), &tiles, jit);
}

/* gemm_rows_shared of a weight packed ahead or read in place (the
 * backward's products over many rows). */
static void FN(gemm_rows)(fmlp_input x, int64_t rows, const FN(packed_weight) *w,
                          const STORE *bias, fmlp_activation activation, STORE *c, int64_t ldc,
                          STORE *pre, int64_t pre_stride, REAL *input_pack) {
  FN(gemm_rows_shared)(x, NULL, rows, w, bias, activation, c, ldc, pre, pre_stride, input_pack,
                       NULL);
}

#if FMLP_GATED_KERNEL
/* ---- gate and up together ---- */

typedef struct {
  const FN(packed_weight) *gate_w, *up_w;
  const FN(weight_blocks) *blocks; /* NULL: both packed ahead */
  const STORE *bias_gate, *bias_up;
  fmlp_activation activation;
  STORE *gate, *up, *product;
  int64_t stride; /* of gate, up and product */
  int save_gate_up;
} FN(gated_tiles);

/* The MR x NR tile as GATED_MR x GATED_NR parts (the parts wholly outside
 * rows x cols skipped). */
static void FN(gated_tile)(const void *context, void *state, const REAL *a_panel,
                           int64_t a_row_stride, int64_t row, int64_t col, int64_t pc,
                           int64_t kc, int64_t rows, int64_t cols) {
  const FN(gated_tiles) *t = context;
  const int64_t k = t->gate_w->k;
  const REAL *gate_panel = FN(weight_panel)(t->gate_w, t->blocks, 0, col, pc);
  const REAL *up_panel = FN(weight_panel)(t->up_w, t->blocks, 1, col, pc);
  for (int64_t i0 = 0; i0 < rows; i0 += GATED_MR) {
    const int64_t part_rows = rows - i0 < GATED_MR ? rows - i0 : GATED_MR;
    for (int64_t j0 = 0; j0 < cols; j0 += GATED_NR) {
      const int64_t at = (row + i0) * t->stride + col + j0;
      const FN(gated_tile_epilogue) ep = {
          .bias_gate = t->bias_gate != NULL ? t->bias_gate + col + j0 : NULL,
          .bias_up = t->bias_up != NULL ? t->bias_up + col + j0 : NULL,
          .gate = t->gate + at,
          .up = t->up + at,
          .gate_up_stride = t->stride,
          .product = t->product + at,
          .product_stride = t->stride,
          .activation = t->activation,
          .first_k_block = pc == 0,
          .last_k_block = pc + kc >= k,
          .save_gate_up = t->save_gate_up,
          .a_row_stride = a_row_stride,
          .state = state,
      };
      FMLP_MICROKERNEL_GATED(kc, a_panel + i0 * GEMM_INPUT_COPIES, gate_panel + j0,
                             up_panel + j0, part_rows,
                             cols - j0 < GATED_NR ? cols - j0 : GATED_NR, &ep);
    }
  }
}

/* product[rows, h] = act(x @ Wg.T + bg) * (x @ Wu.T + bu) in one pass over
 * x, both weights packed ahead or else both packed a block at a time into
 * weight_block (weight_block_elems(k, 2); see gemm_rows_shared), x also
 * given packed whole for 2 weights (packed_x, see shared_input_elems; NULL:
 * packed here); gate and up (rows x h, same stride) receive the
 * pre-activations when save_gate_up, and serve as scratch between K blocks. */
static void FN(gemm_gated_rows)(fmlp_input x, const REAL *packed_x, int64_t rows,
                                const FN(packed_weight) *gate_w,
                                const FN(packed_weight) *up_w, const STORE *bias_gate,
                                const STORE *bias_up, fmlp_activation activation, STORE *gate,
                                STORE *up, STORE *product, int64_t stride, int save_gate_up,
                                REAL *input_pack, REAL *weight_block) {
  FN(weight_blocks) blocks = {.w = {gate_w, up_w}, .data = weight_block};
  FN(weight_blocks) *jit = gate_w->data == NULL ? &blocks : NULL;
  const FN(gated_tiles) tiles = {.gate_w = gate_w,
                                 .up_w = up_w,
                                 .blocks = jit,
                                 .bias_gate = bias_gate,
                                 .bias_up = bias_up,
                                 .activation = activation,
                                 .gate = gate,
                                 .up = up,
                                 .product = product,
                                 .stride = stride,
                                 .save_gate_up = save_gate_up};
  FN(for_each_tile)(x, packed_x, rows, gate_w->n, gate_w->k, 2, input_pack, FN(gated_tile),
                    &tiles, jit);
}
#endif
