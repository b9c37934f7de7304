"""The machine's peak throughput for the benchmarked dtype, measured: a tiny C loop of independent
multiply-add chains (the physical limit for a CPU GEMM), compiled once per bench run and run on
as many threads as torch uses: at the start (the best of three windows) and beside each GEMM-
bound case's timings (single windows, which get the CPU share the case got, so that a case's
fraction of the peak does not move with the shared machine's load); every window follows a 50 ms
lead-in, so that the loop's threads, new each time, are timed at their steady share. float32
times fp32 FMAs with the flags of the instruction set the kernels use (from the kernel
registry), or at the portable level on x86-64 SSE2's multiply then add (that unit's vectors:
x86-64's baseline has no FMA); bfloat16 times what its kernels multiply on at that level: AMX
tiles at avx512_amx (tdpbf16ps: 16 x 16 x 32 products x 2 flops), the AVX512-BF16 dot product at
avx512_bf16 (vdpbf16ps: 16 lanes x 2 products x 2 flops), else the float32 loop of the level,
which bf16 kernels then run on."""

from __future__ import annotations

import contextlib
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from fusedmlp.registry import HOST_GEMM_PREFIX, cpu_isas, detected_cpu_isa

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if defined(PEAK_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(PEAK_BF16) || defined(PEAK_AMX)
typedef __m512 vec;
#define FLOPS_PER_STEP 64 /* 16 lanes x 2 bf16 products x 2 flops */
#define SET1 _mm512_set1_ps
#define BF16X32(bits) ((__m512bh)_mm512_set1_epi16(bits))
#define OPERANDS __m512bh b = BF16X32(0x3f80), c = BF16X32(0x3380) /* 1.0, 2^-24 */
#define STEP(a) _mm512_dpbf16_ps(a, b, c)
#elif defined(PEAK_SSE2)
typedef __m128 vec; /* SSE2, x86-64's baseline: no FMA, a multiply then an add */
#define FLOPS_PER_STEP 8
#define SET1 _mm_set1_ps
#define OPERANDS vec b = SET1(1.0000001f), c = SET1(1e-7f)
#define STEP(a) _mm_add_ps(_mm_mul_ps(a, b), c)
#elif defined(__AVX512F__)
typedef __m512 vec;
#define FLOPS_PER_STEP 32
#define SET1 _mm512_set1_ps
#define OPERANDS vec b = SET1(1.0000001f), c = SET1(1e-7f)
#define STEP(a) _mm512_fmadd_ps(a, b, c)
#else
typedef __m256 vec;
#define FLOPS_PER_STEP 16
#define SET1 _mm256_set1_ps
#define OPERANDS vec b = SET1(1.0000001f), c = SET1(1e-7f)
#define STEP(a) _mm256_fmadd_ps(a, b, c)
#endif
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
#if defined(PEAK_AMX)
#define CHUNK 1024
#define FLOPS_PER_ITERATION (4.0 * 16 * 16 * 32 * 2)
#else
#define CHUNK 16384
#define FLOPS_PER_ITERATION (12.0 * FLOPS_PER_STEP)
#endif
/* On the loaded machine a new process's threads get less than their steady share of the CPUs
 * for their first ~100 ms (50 ms windows read ~100 GFLOP/s right away, ~122 after 30 ms of
 * lead-in, ~135 after 100 ms, against ~150 from threads that had been running), while a case's
 * threads time back-to-back calls. So every thread first leads in for LEAD_SECONDS and until
 * all threads have, computing all along, and only then times its window. */
#define LEAD_SECONDS 0.05
struct team {
  double seconds; /* each thread's timed window */
  int threads;
  atomic_int led_in; /* threads done leading in */
};
struct job {
  struct team *team;
  double lead_start, start, end; /* start: 0 while leading in */
  int led_in;
  long iterations; /* within the window */
};
/* Called after each chunk of CHUNK iterations (tens of microseconds): counts the chunk if it
 * ran in the window; 0 when the window is over. */
static int next_chunk(struct job *job) {
  struct team *team = job->team;
  double t = now();
  if (job->start > 0) {
    job->iterations += CHUNK;
    job->end = t;
    return t - job->start < team->seconds;
  }
  if (!job->led_in && t - job->lead_start >= LEAD_SECONDS) {
    job->led_in = 1;
    atomic_fetch_add(&team->led_in, 1);
  }
  if (job->led_in && atomic_load(&team->led_in) == team->threads) job->start = t;
  return 1;
}
#if defined(PEAK_AMX)
/* Four independent tile accumulations (2 A x 2 B tiles into 4 C tiles, the kernels' 2 x 2
 * blocking) without loads: the tile multiplier's own rate. */
static void *run(void *arg) {
  struct job *job = arg;
  struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
  } config = {1};
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  __asm__ volatile("" ::: "memory"); /* GCC 12's _tile_loadconfig reads only 8 bytes, it says */
  _tile_loadconfig(&config);
  job->lead_start = now();
  do {
    for (long n = 0; n < CHUNK; ++n) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  } while (next_chunk(job));
  _tile_release();
  return NULL;
}
#else
/* Twelve independent chains cover the latency on two pipes. */
static void *run(void *arg) {
  struct job *job = arg;
  OPERANDS;
  vec a0 = SET1(0), a1 = SET1(1), a2 = SET1(2), a3 = SET1(3), a4 = SET1(4), a5 = SET1(5);
  vec a6 = SET1(6), a7 = SET1(7), a8 = SET1(8), a9 = SET1(9), a10 = SET1(10), a11 = SET1(11);
  job->lead_start = now();
  do {
    for (long n = 0; n < CHUNK; ++n) {
      __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3));
      a0 = STEP(a0); a1 = STEP(a1); a2 = STEP(a2); a3 = STEP(a3);
      a4 = STEP(a4); a5 = STEP(a5); a6 = STEP(a6); a7 = STEP(a7);
      a8 = STEP(a8); a9 = STEP(a9); a10 = STEP(a10); a11 = STEP(a11);
    }
  } while (next_chunk(job));
  vec sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
  float lanes[sizeof(vec) / sizeof(float)];
  __builtin_memcpy(lanes, &sum, sizeof lanes);
  if (lanes[0] == 1.25f) job->iterations += 1; /* keeps the chains alive */
  return NULL;
}
#endif
/* peak THREADS SECONDS REPS: the GFLOP/s of THREADS threads timed over a window of SECONDS
 * each, as all their work in their windows over the time from the first window's start to the
 * last's end (threads the load keeps from running side by side count as a parallel GEMM's
 * would), the best of REPS such runs. */
int main(int argc, char **argv) {
  if (argc != 4) return 2;
  int threads = atoi(argv[1]);
  double seconds = atof(argv[2]);
  int reps = atoi(argv[3]);
  if (threads < 1 || threads > 1024 || !(seconds > 0 && seconds < 60) || reps < 1 || reps > 100)
    return 2;
#if defined(PEAK_AMX)
  /* Linux grants the tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 1;
#endif
  pthread_t ids[1024];
  struct job jobs[1024];
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    struct team team = {seconds, threads, 0};
    for (int i = 0; i < threads; ++i) {
      jobs[i] = (struct job){.team = &team};
      if (pthread_create(&ids[i], NULL, run, &jobs[i]) != 0) return 1;
    }
    double iterations = 0, start = 0, end = 0;
    for (int i = 0; i < threads; ++i) {
      pthread_join(ids[i], NULL);
      iterations += jobs[i].iterations;
      if (i == 0 || jobs[i].start < start) start = jobs[i].start;
      if (jobs[i].end > end) end = jobs[i].end;
    }
    double gflops = iterations * FLOPS_PER_ITERATION / (end - start) / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("%.3f\n", best);
  return 0;
}
"""

# The registry's FMLP_BF16_NATIVE levels (their bfloat16 units multiply on other than FMAs) ->
# what the loop times and which loop of PEAK_SOURCE it is.
BF16_LOOPS = {
    "avx512_bf16": ("bf16 dot product", ("-DPEAK_BF16",)),
    "avx512_amx": ("bf16 AMX tiles", ("-DPEAK_AMX",)),
}


class PeakLoop(NamedTuple):
    kind: str  # what the loop times, as the bench prints it
    compile_flags: tuple[str, ...]
    defines: tuple[str, ...] = ()  # which loop of PEAK_SOURCE


def _isa_flags() -> dict[str, tuple[str, ...]]:
    return {entry.name: entry.compile_flags for entry in cpu_isas()}


def fma_loop(isa: str) -> PeakLoop | None:
    """fp32 FMAs with the vectors of `isa`; None for an ISA built without flags (portable,
    neon), which has no x86 FMA loop to time."""
    flags = _isa_flags().get(isa)
    return PeakLoop("fp32 FMA", flags) if flags else None


PORTABLE_ISA = "portable"  # the registry's level built without flags
SSE2_LOOP = PeakLoop("fp32 SSE2 mul+add", (), ("-DPEAK_SSE2",))


def sse2_loop(isa: str) -> PeakLoop | None:
    """SSE2 multiplies and adds (4 lanes, no FMA) for the portable level on x86-64, whose
    float32 and bfloat16 units are the vector-extension kernel built without flags; else
    None."""
    x86_64 = platform.machine().lower() in ("x86_64", "amd64")
    return SSE2_LOOP if isa == PORTABLE_ISA and x86_64 else None


def bf16_loop(isa: str) -> PeakLoop | None:
    """What the bfloat16 unit of `isa` multiplies on, when that is not FMAs (BF16_LOOPS),
    built with that level's flags; else None."""
    flags = _isa_flags().get(isa) if isa in BF16_LOOPS else None
    if not flags:
        return None
    kind, defines = BF16_LOOPS[isa]
    return PeakLoop(kind, flags, defines)


def peak_loop(dtype: torch.dtype, isa: str) -> PeakLoop | None:
    """The loop whose throughput bounds `dtype`'s GEMMs on this CPU running `isa`'s kernels
    (for "aten+<level>", ATen's GEMM: the detected level's), or None where none is measured
    (float64, float16, neon and off-x86 portable): bfloat16's units multiply on FMAs except
    at the levels of BF16_LOOPS, and like float32's at the portable level."""
    if isa.startswith(HOST_GEMM_PREFIX):
        isa = detected_cpu_isa(cpu_isas())
    if dtype == torch.bfloat16:
        return bf16_loop(isa) or fma_loop(isa) or sse2_loop(isa)
    return (fma_loop(isa) or sse2_loop(isa)) if dtype == torch.float32 else None


START_SECONDS, START_REPS = 0.04, 3  # the start-of-run peak: the best of three 40 ms windows
SAMPLE_SECONDS = 0.05  # a load-matched sample's window, taken beside a case's timings


class PeakSampler:
    """A compiled peak loop: each call runs it on `threads` threads for `seconds` and returns
    their GFLOP/s (all their work over the time from the first's start to the last's end), the
    best of `reps` such runs; one run is the rate the load left it. None if the run fails."""

    def __init__(self, binary: Path, threads: int) -> None:
        self.binary, self.threads = binary, threads

    def __call__(self, seconds: float, reps: int = 1) -> float | None:
        command = [str(self.binary), str(self.threads), f"{seconds:.6f}", str(reps)]
        result = subprocess.run(command, capture_output=True, text=True)
        try:
            return float(result.stdout.strip()) if result.returncode == 0 else None
        except ValueError:
            return None


@contextlib.contextmanager
def peak_sampler(loop: PeakLoop | None, threads: int) -> Iterator[PeakSampler | None]:
    """`loop` compiled once, to be run as often as wanted until the context exits; None where
    there is no loop or it cannot be built (no C compiler, a compiler without the loop's
    flags)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if loop is None or compiler is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(PEAK_SOURCE)
        build = [compiler, "-O2", *loop.compile_flags, *loop.defines, str(source),
                 "-o", str(binary), "-lpthread"]
        built = subprocess.run(build, capture_output=True).returncode == 0
        yield PeakSampler(binary, threads) if built else None

