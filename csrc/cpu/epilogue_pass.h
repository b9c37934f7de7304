/* The epilogue passes on their own (template: see real_template.h; included
 * by drivers.h): what the micro-kernels do to a tile before and after its K
 * loop, over a whole product the host framework's GEMM computes
 * (FMLP_GEMM_HOST), in chunks on the caller's threads. */

#define EPILOGUE_CHUNK ((int64_t)1 << 14)

/* One pass over n contiguous values. */
typedef struct {
  int64_t n;
  int64_t cols;          /* the copy pass: values a row */
  fmlp_input src;        /* the copy pass: what it copies into rows */
  const STORE *pre, *up; /* up != NULL: the gated product */
  STORE *out;
  fmlp_activation activation;
} FN(epilogue_job);

/* The end of chunks [begin, end): past the last value at most. */
static int64_t FN(chunks_end)(const FN(epilogue_job) *job, int64_t end) {
  return end * EPILOGUE_CHUNK < job->n ? end * EPILOGUE_CHUNK : job->n;
}

/* out's values in chunks [begin, end), each from src's value at its row and
 * column. */
static void FN(copy_task)(void *context, int64_t begin, int64_t end) {
  const FN(epilogue_job) *job = context;
  const fmlp_input src = job->src;
  const int64_t last = FN(chunks_end)(job, end);
  for (int64_t at = begin * EPILOGUE_CHUNK; at < last;) {
    const int64_t j0 = at % job->cols;
    const int64_t count = job->cols - j0 < last - at ? job->cols - j0 : last - at;
    const STORE *from = (const STORE *)src.data + at / job->cols * src.row_stride +
                        j0 * src.col_stride;
    if (src.col_stride == 1) {
      memcpy(job->out + at, from, (size_t)count * sizeof(STORE));
    } else {
      for (int64_t j = 0; j < count; ++j) job->out[at + j] = from[j * src.col_stride];
    }
    at += count;
  }
}

/* out = act(pre), or act(gate) * up, over chunks [begin, end): formed in REAL
 * and rounded once. */
static void FN(activation_task)(void *context, int64_t begin, int64_t end) {
  const FN(epilogue_job) *job = context;
  const int64_t first = begin * EPILOGUE_CHUNK, n = FN(chunks_end)(job, end) - first;
  STORE *out = job->out + first;
  if (job->up != NULL) {
    FN(gate_product_row)(job->pre + first, job->up + first, n, job->activation, out);
    return;
  }
#if STORE_IS_REAL
  if (job->pre == job->out) { /* in place, storage the accumulator: one sweep */
    FN(activate_span)(out, n, job->activation);
    return;
  }
#endif
  for (int64_t s = 0; s < n; s += GATE_PRODUCT_SPAN) {
    const int64_t count = n - s < GATE_PRODUCT_SPAN ? n - s : GATE_PRODUCT_SPAN;
    REAL v[GATE_PRODUCT_SPAN];
    for (int64_t j = 0; j < count; ++j) v[j] = to_real(job->pre[first + s + j]);
    FN(activate_span)(v, count, job->activation);
    for (int64_t j = 0; j < count; ++j) out[s + j] = to_store(v[j]);
  }
}

static fmlp_status FN(run_epilogue)(const FN(epilogue_job) *job, fmlp_task_fn task,
                                    const fmlp_threading *threading) {
  FN(run_tasks)(FN(threading_for)(threading, job->n, PARALLEL_MIN_ELEMENTS),
                (job->n + EPILOGUE_CHUNK - 1) / EPILOGUE_CHUNK, (void *)job, task);
  return FMLP_OK;
}

fmlp_status FN(fmlp_cpu_copy_rows)(int64_t rows, int64_t cols, fmlp_input src, void *out,
                                   const fmlp_threading *threading) {
  const FN(epilogue_job) job = {.n = rows * cols, /* counted by the public entry */
                                .cols = cols, .src = src, .out = out};
  return FN(run_epilogue)(&job, FN(copy_task), threading);
}

fmlp_status FN(fmlp_cpu_activation_forward)(int64_t n, const void *pre,
                                            fmlp_activation activation, void *out,
                                            const fmlp_threading *threading) {
  /* nothing to activate in place: the product is the output already */
  if (activation == FMLP_ACT_NONE && pre == out) return FMLP_OK;
  const FN(epilogue_job) job = {.n = n, .pre = pre, .out = out, .activation = activation};
  return FN(run_epilogue)(&job, FN(activation_task), threading);
}

fmlp_status FN(fmlp_cpu_gated_product)(int64_t n, const void *gate, const void *up,
                                       fmlp_activation activation, void *product,
                                       const fmlp_threading *threading) {
  const FN(epilogue_job) job = {
      .n = n, .pre = gate, .up = up, .out = product, .activation = activation};
  return FN(run_epilogue)(&job, FN(activation_task), threading);
}
