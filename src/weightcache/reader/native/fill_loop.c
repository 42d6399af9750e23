/* The staged fill's copy loop in native threads (weightcache.reader.native_fill builds and loads it).
 *
 * The pieces (source address, destination address, bytes, file; in file order) are packed into loads of at
 * most one window: a load is a run of one file's bytes that holds whole pieces or parts of them, cut where
 * the address is a multiple of the window size or a gap passes the next page. Loads are cut into tiles;
 * `threads` workers take the next tile wherever it is,
 * copy it out of the file's mapping into the load's window (one of `nwin` page-locked windows that stay in
 * the CPU cache), and the worker that copies a load's last tile queues its device copies and records the
 * window's event. A window is reused once the event of the load before it is done. No barrier per window,
 * no lock held while copying. With `cuda` 0 the "device copies" are host memcpys (tests without a GPU).
 * The CUDA driver is opened with dlopen: nothing to link at build time. wc_windows_make makes the windows
 * (transparent huge pages, faulted in by several threads, page-locked).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef int (*ctx_set_fn)(void *);
typedef int (*event_create_fn)(void **, unsigned);
typedef int (*event_record_fn)(void *, void *);
typedef int (*event_sync_fn)(void *);
typedef int (*event_destroy_fn)(void *);
typedef int (*memcpy_fn)(uint64_t, const void *, size_t, void *);
typedef int (*stream_sync_fn)(void *);
typedef int (*host_register_fn)(void *, size_t, unsigned);
typedef int (*host_unregister_fn)(void *);

static struct {
    int ready;
    ctx_set_fn ctx_set;
    event_create_fn event_create;
    event_record_fn event_record;
    event_sync_fn event_sync;
    event_destroy_fn event_destroy;
    memcpy_fn htod;
    stream_sync_fn stream_sync;
    host_register_fn host_register;
    host_unregister_fn host_unregister;
} cu;

static pthread_mutex_t cu_lock = PTHREAD_MUTEX_INITIALIZER;

/* 0 when the driver's entry points are there, else -1 */
int wc_fill_open_driver(void) {
    pthread_mutex_lock(&cu_lock);
    if (!cu.ready) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (h) {
            cu.ctx_set = (ctx_set_fn)dlsym(h, "cuCtxSetCurrent");
            cu.event_create = (event_create_fn)dlsym(h, "cuEventCreate");
            cu.event_record = (event_record_fn)dlsym(h, "cuEventRecord");
            cu.event_sync = (event_sync_fn)dlsym(h, "cuEventSynchronize");
            cu.event_destroy = (event_destroy_fn)dlsym(h, "cuEventDestroy_v2");
            cu.htod = (memcpy_fn)dlsym(h, "cuMemcpyHtoDAsync_v2");
            cu.stream_sync = (stream_sync_fn)dlsym(h, "cuStreamSynchronize");
            cu.host_register = (host_register_fn)dlsym(h, "cuMemHostRegister_v2");
            cu.host_unregister = (host_unregister_fn)dlsym(h, "cuMemHostUnregister");
            if (cu.ctx_set && cu.event_create && cu.event_record && cu.event_sync && cu.event_destroy &&
                cu.htod && cu.stream_sync && cu.host_register && cu.host_unregister)
                cu.ready = 1;
        }
    }
    pthread_mutex_unlock(&cu_lock);
    return cu.ready ? 0 : -1;
}

typedef struct {
    /* per load */
    uint64_t *load_src;   /* address of the load's first byte in its file's mapping */
    uint64_t *load_len;   /* bytes copied into the window */
    int64_t *load_part0;  /* its first part */
    int64_t *load_nparts;
    /* per part (a piece, or the share of one that falls in one load) */
    uint64_t *part_off; /* from the load's first byte */
    uint64_t *part_dst; /* device (or, without cuda, host) address */
    uint64_t *part_len;
    int64_t *part_piece; /* the piece it comes from */
    int64_t nloads;
    uint8_t *windows;
    uint64_t window_bytes;
    int nwin;
    uint64_t tile;
    int cuda;
    void *ctx;
    void *stream;
    /* shared state */
    int64_t *tile_load;
    uint64_t *tile_off;
    int64_t ntiles;
    atomic_llong next_tile;
    atomic_llong *left;
    atomic_int *queued;
    atomic_int *reclaimed;
    pthread_mutex_t *slot_lock;
    void **events;
    atomic_int abort;
    atomic_int err;
    atomic_llong err_load;
    atomic_ullong *done_bytes;
    int flags;
    uint64_t *stats; /* NULL, or WC_NSTATS counters (ns) */
    uint64_t t0;
} fill_t;

enum { WC_SKIP_HOST_COPY = 2, WC_SKIP_DEVICE_COPY = 4 }; /* flags, to measure each side alone */
/* stats: ns from the start to the threads running, the first and last window queued, the threads joined, the
 * stream synchronized; summed over the workers: ns waiting for a window, copying tiles, queueing copies */
enum { WC_STARTED, WC_FIRST_QUEUED, WC_LAST_QUEUED, WC_JOINED, WC_SYNCED, WC_WAITED, WC_COPYING, WC_QUEUEING,
       WC_LOADS /* a count, not ns */, WC_NSTATS };

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void stat_add(fill_t *f, int k, uint64_t ns) {
    if (f->stats) __atomic_fetch_add(&f->stats[k], ns, __ATOMIC_RELAXED);
}

static void stat_mark(fill_t *f, int k, int first) {
    if (!f->stats) return;
    uint64_t t = now_ns() - f->t0, zero = 0;
    if (first)
        __atomic_compare_exchange_n(&f->stats[k], &zero, t, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    else
        __atomic_store_n(&f->stats[k], t, __ATOMIC_RELAXED);
}

static uint64_t load_bytes(fill_t *f, int64_t L) {
    uint64_t n = 0;
    for (int64_t i = 0; i < f->load_nparts[L]; i++) n += f->part_len[f->load_part0[L] + i];
    return n;
}

static void fail(fill_t *f, int code, int64_t L) {
    int zero = 0;
    if (atomic_compare_exchange_strong(&f->err, &zero, code)) atomic_store(&f->err_load, L);
    atomic_store(&f->abort, 1);
}

/* 1 once load P's copies are done (its window free), 0 on abort */
static int reclaim(fill_t *f, int64_t P) {
    if (atomic_load_explicit(&f->reclaimed[P], memory_order_acquire)) return 1;
    while (!atomic_load_explicit(&f->queued[P], memory_order_acquire)) {
        if (atomic_load(&f->abort)) return 0;
        sched_yield();
    }
    int slot = (int)(P % f->nwin);
    pthread_mutex_lock(&f->slot_lock[slot]);
    if (!atomic_load(&f->reclaimed[P])) {
        if (f->cuda) {
            int rc = cu.event_sync(f->events[slot]);
            if (rc) {
                pthread_mutex_unlock(&f->slot_lock[slot]);
                fail(f, rc, P);
                return 0;
            }
        }
        atomic_fetch_add(f->done_bytes, load_bytes(f, P));
        atomic_store_explicit(&f->reclaimed[P], 1, memory_order_release);
    }
    pthread_mutex_unlock(&f->slot_lock[slot]);
    return 1;
}

static void issue(fill_t *f, int64_t L) {
    int slot = (int)(L % f->nwin);
    uint8_t *win = f->windows + (uint64_t)slot * f->window_bytes;
    uint64_t t = f->stats ? now_ns() : 0;
    for (int64_t i = 0; i < f->load_nparts[L] && !(f->flags & WC_SKIP_DEVICE_COPY); i++) {
        int64_t p = f->load_part0[L] + i;
        if (f->cuda) {
            int rc = cu.htod(f->part_dst[p], win + f->part_off[p], f->part_len[p], f->stream);
            if (rc) {
                fail(f, rc, L);
                return;
            }
        } else {
            memcpy((void *)(uintptr_t)f->part_dst[p], win + f->part_off[p], f->part_len[p]);
        }
    }
    if (f->cuda) {
        int rc = cu.event_record(f->events[slot], f->stream);
        if (rc) {
            fail(f, rc, L);
            return;
        }
    }
    atomic_store_explicit(&f->queued[L], 1, memory_order_release);
    if (f->stats) {
        stat_add(f, WC_QUEUEING, now_ns() - t);
        stat_mark(f, WC_FIRST_QUEUED, 1);
        stat_mark(f, WC_LAST_QUEUED, 0);
    }
}

static void *worker(void *arg) {
    fill_t *f = arg;
    if (f->cuda) {
        int rc = cu.ctx_set(f->ctx);
        if (rc) {
            fail(f, rc, -1);
            return NULL;
        }
    }
    for (;;) {
        if (atomic_load(&f->abort)) break;
        int64_t t = atomic_fetch_add(&f->next_tile, 1);
        if (t >= f->ntiles) break;
        int64_t L = f->tile_load[t];
        uint64_t t0 = f->stats ? now_ns() : 0;
        if (L >= f->nwin && !reclaim(f, L - f->nwin)) break;
        uint64_t t1 = f->stats ? now_ns() : 0;
        uint64_t off = f->tile_off[t];
        uint64_t n = f->load_len[L] - off < f->tile ? f->load_len[L] - off : f->tile;
        uint8_t *win = f->windows + (uint64_t)(L % f->nwin) * f->window_bytes;
        if (!(f->flags & WC_SKIP_HOST_COPY)) memcpy(win + off, (const void *)(uintptr_t)(f->load_src[L] + off), n);
        if (f->stats) {
            stat_add(f, WC_WAITED, t1 - t0);
            stat_add(f, WC_COPYING, now_ns() - t1);
        }
        if (atomic_fetch_sub(&f->left[L], 1) == 1) issue(f, L);
    }
    return NULL;
}

enum { PAGE = 4096 };

/* The pieces packed into loads and parts (f->load_*, f->part_*, f->nloads); 0, or -1 out of memory. A load
 * starts where the address is a multiple of the window size, the file changes, or a piece starts past the
 * page after the load's last byte (the bytes between are copied, not delivered). */
static int plan_loads(fill_t *f, const uint64_t *src, const uint64_t *dst, const uint64_t *len, const int64_t *file,
                      int64_t npieces) {
    const uint64_t w = f->window_bytes;
    int64_t most = 0;
    for (int64_t i = 0; i < npieces; i++)
        if (len[i]) most += (int64_t)((src[i] + len[i] - 1) / w - src[i] / w + 1);
    size_t n = (size_t)(most ? most : 1);
    f->load_src = malloc(n * sizeof(uint64_t)), f->load_len = malloc(n * sizeof(uint64_t));
    f->load_part0 = malloc(n * sizeof(int64_t)), f->load_nparts = malloc(n * sizeof(int64_t));
    f->part_off = malloc(n * sizeof(uint64_t)), f->part_dst = malloc(n * sizeof(uint64_t));
    f->part_len = malloc(n * sizeof(uint64_t)), f->part_piece = malloc(n * sizeof(int64_t));
    if (!f->load_src || !f->load_len || !f->load_part0 || !f->load_nparts || !f->part_off || !f->part_dst ||
        !f->part_len || !f->part_piece)
        return -1;
    int64_t L = -1, k = 0;
    uint64_t cut = 0, end = 0;
    int64_t in_file = 0;
    for (int64_t i = 0; i < npieces; i++) {
        uint64_t a = src[i], d = dst[i], left = len[i];
        while (left) {
            uint64_t here = a / w, m = (here + 1) * w - a;
            if (m > left) m = left;
            uint64_t next_page = (end + PAGE - 1) / PAGE * PAGE;
            if (L < 0 || here != cut || file[i] != in_file || a < f->load_src[L] || a / PAGE * PAGE > next_page) {
                L++;
                f->load_src[L] = a, f->load_part0[L] = k, f->load_nparts[L] = 0;
                cut = here, in_file = file[i], end = a;
            }
            if (a + m > end) end = a + m;
            f->load_len[L] = end - f->load_src[L];
            f->part_off[k] = a - f->load_src[L], f->part_dst[k] = d, f->part_len[k] = m, f->part_piece[k] = i;
            f->load_nparts[L]++, k++;
            a += m, d += m, left -= m;
        }
    }
    f->nloads = L + 1;
    return 0;
}

/* 0 on success; else the CUDA error (or -1: out of memory, -2: threads) and *err_piece the piece it hit
 * (the first of its load), -1 where it hit none. */
int wc_fill_run(const uint64_t *piece_src, const uint64_t *piece_dst, const uint64_t *piece_len,
                const int64_t *piece_file, int64_t npieces, uint8_t *windows, uint64_t window_bytes, int nwin,
                int threads, uint64_t tile, int cuda, void *ctx, void *stream, atomic_ullong *done_bytes,
                int64_t *err_piece, int flags, uint64_t *stats) {
    fill_t f;
    memset(&f, 0, sizeof f);
    f.flags = flags, f.stats = stats, f.t0 = now_ns();
    if (stats) memset(stats, 0, sizeof(uint64_t) * WC_NSTATS);
    f.windows = windows, f.window_bytes = window_bytes, f.nwin = nwin, f.tile = tile, f.cuda = cuda;
    f.ctx = ctx, f.stream = stream, f.done_bytes = done_bytes;
    *err_piece = -1;
    pthread_t *pool = NULL;
    int rc = 0, started = 0;
    if (plan_loads(&f, piece_src, piece_dst, piece_len, piece_file, npieces)) {
        rc = -1;
        goto out;
    }
    int64_t nloads = f.nloads;
    const uint64_t *load_len = f.load_len;
    if (stats) stats[WC_LOADS] = (uint64_t)nloads;
    if (nloads == 0) goto out;
    if (cuda && wc_fill_open_driver()) {
        rc = -3;
        goto out;
    }
    int64_t ntiles = 0;
    for (int64_t L = 0; L < nloads; L++) ntiles += (int64_t)((load_len[L] + tile - 1) / tile);
    f.ntiles = ntiles;
    f.tile_load = malloc(sizeof(int64_t) * (size_t)ntiles);
    f.tile_off = malloc(sizeof(uint64_t) * (size_t)ntiles);
    f.left = calloc((size_t)nloads, sizeof(atomic_llong));
    f.queued = calloc((size_t)nloads, sizeof(atomic_int));
    f.reclaimed = calloc((size_t)nloads, sizeof(atomic_int));
    f.slot_lock = calloc((size_t)nwin, sizeof(pthread_mutex_t));
    f.events = calloc((size_t)nwin, sizeof(void *));
    pool = calloc((size_t)threads, sizeof(pthread_t));
    if (!f.tile_load || !f.tile_off || !f.left || !f.queued || !f.reclaimed || !f.slot_lock || !f.events || !pool) {
        rc = -1;
        goto out;
    }
    int64_t t = 0;
    for (int64_t L = 0; L < nloads; L++) {
        int64_t k = 0;
        for (uint64_t off = 0; off < load_len[L]; off += tile, k++, t++) f.tile_load[t] = L, f.tile_off[t] = off;
        atomic_init(&f.left[L], k);
    }
    for (int i = 0; i < nwin; i++) pthread_mutex_init(&f.slot_lock[i], NULL);
    if (cuda) {
        if ((rc = cu.ctx_set(ctx))) goto out;
        for (int i = 0; i < nwin; i++)
            if ((rc = cu.event_create(&f.events[i], 2 /* CU_EVENT_DISABLE_TIMING */))) goto out;
    }
    for (int64_t L = 0; L < nloads; L++)  /* a load with nothing to copy is queued at once */
        if (load_len[L] == 0) issue(&f, L);
    for (; started < threads; started++)
        if (pthread_create(&pool[started], NULL, worker, &f)) {
            fail(&f, -2, -1);
            break;
        }
    stat_mark(&f, WC_STARTED, 0);
    for (int i = 0; i < started; i++) pthread_join(pool[i], NULL);
    stat_mark(&f, WC_JOINED, 0);
    if (cuda) {
        int s = cu.stream_sync(stream);  /* every copy queued is done before the windows go */
        if (s && !atomic_load(&f.err)) fail(&f, s, -1);
    }
    stat_mark(&f, WC_SYNCED, 0);
    if (!atomic_load(&f.err)) {
        for (int64_t L = 0; L < nloads; L++)
            if (!atomic_load(&f.reclaimed[L])) atomic_fetch_add(done_bytes, load_bytes(&f, L));
    }
    rc = atomic_load(&f.err);
    int64_t L = atomic_load(&f.err_load);
    if (L >= 0 && L < nloads) *err_piece = f.part_piece[f.load_part0[L]];
out:
    if (cuda && f.events)
        for (int i = 0; i < nwin; i++)
            if (f.events[i]) cu.event_destroy(f.events[i]);
    if (f.slot_lock)
        for (int i = 0; i < nwin; i++) pthread_mutex_destroy(&f.slot_lock[i]);
    free(f.tile_load), free(f.tile_off), free(f.left), free(f.queued), free(f.reclaimed), free(f.slot_lock);
    free(f.events), free(pool);
    free(f.load_src), free(f.load_len), free(f.load_part0), free(f.load_nparts);
    free(f.part_off), free(f.part_dst), free(f.part_len), free(f.part_piece);
    return rc;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

typedef struct {
    volatile uint8_t *base;
    uint64_t lo, hi;
} touch_t;

static void *toucher(void *arg) {
    touch_t *t = arg;
    for (uint64_t i = t->lo; i < t->hi; i += 4096) t->base[i] = 0;
    return NULL;
}

/* every page of [base, base + n) faulted in: by `threads` threads, or (0) by MADV_POPULATE_WRITE */
static void populate(uint8_t *base, uint64_t n, int threads) {
    if (threads <= 0) {
        if (madvise(base, n, MADV_POPULATE_WRITE) == 0) return;
        threads = 1; /* a kernel before 5.14 */
    }
    const uint64_t huge = 2ull << 20;
    if (threads > 64) threads = 64;
    uint64_t per = ((n + huge - 1) / huge + (uint64_t)threads - 1) / (uint64_t)threads * huge;
    touch_t parts[64];
    pthread_t pool[64];
    int started = 0;
    for (int i = 0; i < threads; i++) {
        uint64_t lo = (uint64_t)i * per, hi = lo + per < n ? lo + per : n;
        if (lo >= n) break;
        parts[i] = (touch_t){base, lo, hi};
        if (i == threads - 1 || pthread_create(&pool[started], NULL, toucher, &parts[i])) {
            toucher(&parts[i]);
        } else {
            started++;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(pool[i], NULL);
}

/* The windows' memory: `nbytes` of anonymous memory aligned to 2 MiB, in transparent huge pages where the
 * kernel has them, faulted in by `threads` threads (0: MADV_POPULATE_WRITE) and, with `lock`, page-locked
 * (portable) in context `ctx`. out: the mapping's address and length, the windows' address; ns (or NULL):
 * the ns mapping, faulting and page-locking took. 0, -1 (no memory), -3 (no driver) or the CUDA error. */
int wc_windows_make(uint64_t nbytes, int threads, int lock, void *ctx, uint64_t *out, uint64_t *ns) {
    const uint64_t huge = 2ull << 20;
    uint64_t t = now_ns(), len = nbytes + huge;
    void *map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) return -1;
    uint8_t *base = (uint8_t *)(((uintptr_t)map + huge - 1) & ~(uintptr_t)(huge - 1));
    madvise(base, nbytes, MADV_HUGEPAGE); /* where transparent huge pages are "madvise" */
    out[0] = (uint64_t)(uintptr_t)map, out[1] = len, out[2] = (uint64_t)(uintptr_t)base;
    uint64_t t1 = now_ns();
    populate(base, nbytes, threads);
    uint64_t t2 = now_ns();
    if (lock) {
        int rc = wc_fill_open_driver() ? -3 : cu.ctx_set(ctx);
        if (!rc) rc = cu.host_register(base, nbytes, 1 /* CU_MEMHOSTREGISTER_PORTABLE */);
        if (rc) {
            munmap(map, len);
            return rc;
        }
    }
    if (ns) ns[0] = t1 - t, ns[1] = t2 - t1, ns[2] = now_ns() - t2;
    return 0;
}

/* The windows unlocked (if `locked`) and unmapped. */
void wc_windows_free(uint64_t map, uint64_t len, uint64_t base, int locked, void *ctx) {
    if (locked && wc_fill_open_driver() == 0 && cu.ctx_set(ctx) == 0) cu.host_unregister((void *)(uintptr_t)base);
    munmap((void *)(uintptr_t)map, len);
}
