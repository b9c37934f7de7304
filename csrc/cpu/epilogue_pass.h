/* The epilogue passes on their own (template: see real_template.h; included
 * by drivers.h): what the micro-kernels do to a tile after its K loop, over
 * a product the host framework's GEMM computed (FMLP_GEMM_HOST), in chunks
 * on the caller's threads. */

#define EPILOGUE_CHUNK ((int64_t)1 << 14)

/* A rows x cols product, contiguous; bias and bias_up (cols values each) NULL
 * for none. */
typedef struct {
  int64_t rows, cols;
  STORE *pre, *up; /* up != NULL: the gated product */
  const STORE *bias, *bias_up;
  STORE *out;
  fmlp_activation activation;
} FN(epilogue_job);

/* v = x + bias in REAL over n values, the sums rounded back into `keep` where
 * it is not NULL (a saved pre-activation the output does not overwrite); v = x
 * for bias NULL. */
static void FN(biased_span)(const STORE *x, const STORE *bias, int64_t n, STORE *keep, REAL *v) {
  for (int64_t j = 0; j < n; ++j) v[j] = to_real(x[j]);
  if (bias == NULL) return;
  for (int64_t j = 0; j < n; ++j) v[j] += to_real(bias[j]);
  if (keep == NULL) return;
  for (int64_t j = 0; j < n; ++j) keep[j] = to_store(v[j]);
}

/* The job's values [at, at + n) of one row, from its column j0: biases added,
 * then out = act(pre) or act(gate) * up, formed in REAL a span at a time and
 * rounded once. */
static void FN(epilogue_segment)(const FN(epilogue_job) *job, int64_t at, int64_t j0, int64_t n) {
#if STORE_IS_REAL
  if (job->up == NULL && job->pre == job->out) {
    /* in place, storage the accumulator: two sweeps over the segment where
     * going through v took four */
    STORE *out = job->out + at;
    if (job->bias != NULL) {
      const STORE *bias = job->bias + j0;
      for (int64_t j = 0; j < n; ++j) out[j] += bias[j];
    }
    FN(activate_span)(out, n, job->activation);
    return;
  }
#endif
  for (int64_t s = 0; s < n; s += GATE_PRODUCT_SPAN) {
    const int64_t count = n - s < GATE_PRODUCT_SPAN ? n - s : GATE_PRODUCT_SPAN;
    STORE *pre = job->pre + at + s, *out = job->out + at + s;
    REAL v[GATE_PRODUCT_SPAN], u[GATE_PRODUCT_SPAN];
    FN(biased_span)(pre, job->bias != NULL ? job->bias + j0 + s : NULL, count,
                    pre != out ? pre : NULL, v);
    FN(activate_span)(v, count, job->activation);
    if (job->up == NULL) {
      for (int64_t j = 0; j < count; ++j) out[j] = to_store(v[j]);
      continue;
    }
    STORE *up = job->up + at + s;
    FN(biased_span)(up, job->bias_up != NULL ? job->bias_up + j0 + s : NULL, count,
                    up != out ? up : NULL, u);
    for (int64_t j = 0; j < count; ++j) out[j] = to_store(v[j] * u[j]);
  }
}

/* Chunks [begin, end) of EPILOGUE_CHUNK values, each walked a row's segment at
 * a time (the biases go by column). */
static void FN(epilogue_task)(void *context, int64_t begin, int64_t end) {
  const FN(epilogue_job) *job = context;
  const int64_t n = job->rows * job->cols;
  const int64_t last = end * EPILOGUE_CHUNK < n ? end * EPILOGUE_CHUNK : n;
  for (int64_t at = begin * EPILOGUE_CHUNK; at < last;) {
    const int64_t j0 = at % job->cols;
    const int64_t count = job->cols - j0 < last - at ? job->cols - j0 : last - at;
    FN(epilogue_segment)(job, at, j0, count);
    at += count;
  }
}

static fmlp_status FN(run_epilogue)(const FN(epilogue_job) *job,
                                    const fmlp_threading *threading) {
  const int64_t n = job->rows * job->cols; /* counted by the public entry */
  FN(run_tasks)(FN(threading_for)(threading, n, PARALLEL_MIN_ELEMENTS),
                (n + EPILOGUE_CHUNK - 1) / EPILOGUE_CHUNK, (void *)job, FN(epilogue_task));
  return FMLP_OK;
}

fmlp_status FN(fmlp_cpu_activation_forward)(int64_t rows, int64_t cols, void *pre,
                                            const void *bias, fmlp_activation activation,
                                            void *out, const fmlp_threading *threading) {
  /* nothing to add or activate in place: the product is the output already */
  if (bias == NULL && activation == FMLP_ACT_NONE && pre == out) return FMLP_OK;
  const FN(epilogue_job) job = {rows, cols, pre, NULL, bias, NULL, out, activation};
  return FN(run_epilogue)(&job, threading);
}

fmlp_status FN(fmlp_cpu_gated_product)(int64_t rows, int64_t cols, void *gate,
                                       const void *bias_gate, void *up, const void *bias_up,
                                       fmlp_activation activation, void *product,
                                       const fmlp_threading *threading) {
  const FN(epilogue_job) job = {rows, cols, gate, up, bias_gate, bias_up, product, activation};
  return FN(run_epilogue)(&job, threading);
}
