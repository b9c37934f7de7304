"""The machine's peak fp32 FMA throughput, measured: a tiny C loop of independent FMA chains
(the physical limit for a CPU GEMM), compiled at bench time with the flags of the instruction
set the kernels use (from the kernel registry) and run on as many threads as torch uses."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from fusedmlp.registry import cpu_isas

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef __AVX512F__
typedef __m512 vec;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#else
typedef __m256 vec;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#endif
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
/* Twelve independent chains cover the FMA latency on two pipes. */
static void *run(void *result) {
  const long iters = 20000000;
  vec b = SET1(1.0000001f), c = SET1(1e-7f);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    vec a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5);
    vec a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
    double t0 = now();
    for (long n = 0; n < iters; ++n) {
      __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3));
      a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c);
      a4 = FMA(a4, b, c); a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c);
      a8 = FMA(a8, b, c); a9 = FMA(a9, b, c); a10 = FMA(a10, b, c); a11 = FMA(a11, b, c);
    }
    double gflops = iters * 12.0 * LANES * 2 / (now() - t0) / 1e9;
    if (gflops > best) best = gflops;
    vec sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
    float lanes[LANES];
    __builtin_memcpy(lanes, &sum, sizeof lanes);
    if (lanes[0] == 1.25f) best += 1e-9; /* keeps the chains alive */
  }
  *(double *)result = best;
  return NULL;
}
int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  if (threads < 1 || threads > 1024) threads = 1;
  pthread_t ids[1024];
  double results[1024];
  for (int i = 0; i < threads; ++i) pthread_create(&ids[i], NULL, run, &results[i]);
  double total = 0;
  for (int i = 0; i < threads; ++i) {
    pthread_join(ids[i], NULL);
    total += results[i];
  }
  printf("%.3f\n", total);
  return 0;
}
"""


def measure_peak_gflops(isa: str, threads: int) -> float | None:
    """Peak fp32 GFLOP/s on `threads` threads with the ISA's vectors; None where it cannot
    be measured (no C compiler, an ISA built without flags: portable, vector, neon)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    flags = {entry.name: entry.compile_flags for entry in cpu_isas()}.get(isa)
    if compiler is None or not flags:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(PEAK_SOURCE)
        build = [compiler, "-O2", *flags, str(source), "-o", str(binary), "-lpthread"]
        if subprocess.run(build, capture_output=True).returncode != 0:
            return None
        result = subprocess.run([str(binary), str(threads)], capture_output=True, text=True)
        try:
            return float(result.stdout.strip())
        except ValueError:
            return None
