/* The epilogue passes on their own (template: see real_template.h; included
 * by drivers.h): what the micro-kernels do to a tile after its K loop, over
 * a product the host framework's GEMM computed (FMLP_GEMM_HOST), in chunks
 * on the caller's threads. */

#define EPILOGUE_CHUNK ((int64_t)1 << 14)

typedef struct {
  int64_t n;
  const STORE *pre, *up; /* up != NULL: the gated product */
  STORE *out;
  fmlp_activation activation;
} FN(epilogue_job);

/* out = act(pre), n values (out may be pre), formed in REAL a span at a
 * time and rounded once */
static void FN(activate_stored)(const STORE *pre, int64_t n, fmlp_activation activation,
                                STORE *out) {
  for (int64_t j0 = 0; j0 < n; j0 += GATE_PRODUCT_SPAN) {
    const int64_t count = n - j0 < GATE_PRODUCT_SPAN ? n - j0 : GATE_PRODUCT_SPAN;
    REAL span[GATE_PRODUCT_SPAN];
    for (int64_t j = 0; j < count; ++j) span[j] = to_real(pre[j0 + j]);
    FN(activate_span)(span, count, activation);
    for (int64_t j = 0; j < count; ++j) out[j0 + j] = to_store(span[j]);
  }
}

static void FN(epilogue_task)(void *context, int64_t begin, int64_t end) {
  const FN(epilogue_job) *job = context;
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int64_t start = chunk * EPILOGUE_CHUNK;
    const int64_t len = job->n - start < EPILOGUE_CHUNK ? job->n - start : EPILOGUE_CHUNK;
    if (job->up != NULL) {
      FN(gate_product_row)(job->pre + start, job->up + start, len, job->activation,
                           job->out + start);
      continue;
    }
    FN(activate_stored)(job->pre + start, len, job->activation, job->out + start);
  }
}

static fmlp_status FN(run_epilogue)(const FN(epilogue_job) *job,
                                    const fmlp_threading *threading) {
  FN(run_tasks)(FN(threading_for)(threading, job->n, PARALLEL_MIN_ELEMENTS),
                (job->n + EPILOGUE_CHUNK - 1) / EPILOGUE_CHUNK, (void *)job, FN(epilogue_task));
  return FMLP_OK;
}

fmlp_status FN(fmlp_cpu_activation_forward)(int64_t n, const void *pre,
                                            fmlp_activation activation, void *out,
                                            const fmlp_threading *threading) {
  const FN(epilogue_job) job = {n, pre, NULL, out, activation};
  return FN(run_epilogue)(&job, threading);
}

fmlp_status FN(fmlp_cpu_gated_product)(int64_t n, const void *gate, const void *up,
                                       fmlp_activation activation, void *product,
                                       const fmlp_threading *threading) {
  const FN(epilogue_job) job = {n, gate, up, product, activation};
  return FN(run_epilogue)(&job, threading);
}
