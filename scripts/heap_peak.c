/* An LD_PRELOAD shim for scripts/heap_peak.py: counts the heap bytes live in the process
 * (malloc_usable_size of every block) and their peak since heap_reset(). torch.profiler sees
 * only what torch allocates; this sees the C kernels' own scratch too. Measurement only. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

static _Atomic long long live, peak;
static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
/* dlsym itself calls calloc before real_calloc is known: those few bytes come from here */
static _Alignas(16) char bootstrap[1 << 16];
static size_t bootstrap_used;

static void resolve(void) {
  if (real_malloc != NULL) return;
  real_calloc = dlsym(RTLD_NEXT, "calloc");
  real_malloc = dlsym(RTLD_NEXT, "malloc");
  real_free = dlsym(RTLD_NEXT, "free");
  real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
  real_memalign = dlsym(RTLD_NEXT, "memalign");
  real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
}

static int from_bootstrap(const void *p) {
  return (const char *)p >= bootstrap && (const char *)p < bootstrap + sizeof bootstrap;
}

static void *counted(void *p) {
  if (p == NULL) return p;
  const long long now = live += (long long)malloc_usable_size(p);
  long long seen = peak;
  while (now > seen && !atomic_compare_exchange_weak(&peak, &seen, now)) {
  }
  return p;
}

static void uncount(void *p) {
  if (p != NULL && !from_bootstrap(p)) live -= (long long)malloc_usable_size(p);
}

void *malloc(size_t n) {
  resolve();
  return counted(real_malloc(n));
}

void *calloc(size_t count, size_t size) {
  if (real_calloc == NULL) { /* inside resolve()'s first dlsym */
    void *p = bootstrap + bootstrap_used;
    bootstrap_used += (count * size + 15) & ~(size_t)15;
    return bootstrap_used <= sizeof bootstrap ? p : NULL;
  }
  return counted(real_calloc(count, size));
}

void free(void *p) {
  if (p == NULL || from_bootstrap(p)) return;
  resolve();
  uncount(p);
  real_free(p);
}

void *realloc(void *p, size_t n) {
  resolve();
  if (from_bootstrap(p)) return NULL;
  if (p != NULL && n == 0) { /* glibc frees p */
    free(p);
    return NULL;
  }
  const long long before = p != NULL ? (long long)malloc_usable_size(p) : 0;
  void *moved = real_realloc(p, n);
  if (moved == NULL) return NULL; /* p is untouched */
  live -= before;
  return counted(moved);
}

void *aligned_alloc(size_t alignment, size_t n) {
  resolve();
  return counted(real_aligned_alloc(alignment, n));
}

void *memalign(size_t alignment, size_t n) {
  resolve();
  return counted(real_memalign(alignment, n));
}

int posix_memalign(void **out, size_t alignment, size_t n) {
  resolve();
  const int status = real_posix_memalign(out, alignment, n);
  if (status == 0) counted(*out);
  return status;
}

void heap_reset(void) { peak = live; }
long long heap_live(void) { return live; }
long long heap_peak(void) { return peak; }
