/* The thread pool of the native step, built to stay steady when another process holds a core.
 *
 * Why barriers collapse: a decode step is ~30 short parallel phases (one per matrix); with a
 * static split and a barrier after each, every phase waits for its slowest thread, and a thread
 * that the kernel has descheduled (another process holds its core) stalls every phase for a
 * whole scheduler slice (milliseconds); spinning waiters make it worse by eating the core the
 * late thread needs. Measured before this pool: 1.6 ms/token at 1 thread, 293 at 2.
 *
 * What this pool does instead:
 *  - Chunks are claimed dynamically (a CAS per chunk). The caller thread works too, so a worker
 *    that never wakes costs nothing: the caller claims every chunk itself.
 *  - A worker computes its chunk into a private buffer and publishes it (copy or add) only if
 *    its claim still stands. When a claimed chunk is late (the worker was descheduled mid-chunk),
 *    the caller steals it (CAS CLAIMED -> OWNED) and computes it in place; the worker's result is
 *    then discarded. So no phase ever waits for a thread without a core: at most the steal
 *    delay (a few times the caller's own chunk time, >= STEAL_MIN_NS).
 *  - A job's context is copied into the pool (a late worker never reads a returned stack frame)
 *    and states carry the job's generation, so a worker waking late cannot claim a newer job's
 *    chunk with an older job's view.
 *  - A worker waits with a pause-spin, then (idle for SPIN_NS) a futex sleep; the caller only
 *    pause-spins, and only until its steal deadline. A worker never yields on a core it shares
 *    with another process: on 6.x (EEVDF) kernels each sched_yield pushes the yielder's deadline
 *    a slice back, so a worker yielding between phases got ~3% of the busy core instead of its
 *    fair half (measured: one core busy, the step at one thread's speed).
 *  - A worker that finds itself on the caller's core (the caller publishes sched_getcpu() with
 *    each job) cannot help there: it yields to the caller and, at most once per MOVE_NS, takes
 *    that core out of its affinity (the process's cores minus the caller's). Without this the
 *    load balancer, seeing 2 tasks against 1 either way, often left caller and worker sharing
 *    the free core while the busy process kept the other: one core for the whole step.
 *    With both: one core busy, the worker gets half of it and the caller the other core.
 *
 *  - Optional (off by default since the two points above: it then cost more than it saved, its
 *    solo stretches also spilling into quiet periods): it adapts to a core taken by another
 *    process. The caller keeps score over windows of phases:
 *    its own fastest time per unit, times the phase's units, is what the phase would cost it alone;
 *    the phase's wall time is what it cost with the workers. When a window's speedup falls below
 *    ADAPT_MIN_SPEEDUP (a worker kept losing its core, or shares the caller's), phases run on the
 *    caller alone for a while and the workers sleep at once instead of spinning: the caller then
 *    has a core to itself (the scheduler moves it off the busy core into the one the sleeping
 *    worker left idle), which is one thread's speed instead of a shared core's. It probes again
 *    after the solo stretch (ADAPT_SOLO_NS, doubling on each failed probe up to ADAPT_SOLO_GROWTH x),
 *    so the workers are back within milliseconds of the core coming free.
 *
 * One job runs at a time; a second caller thread (another Python thread stepping another
 * state) runs its job serially rather than wait.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "gen.h"

#define MAX_THREADS 64
#define MAX_CHUNKS 64
#define MOVE_NS 1000000LL       /* a worker moves off the caller's core at most once a ms */
#define SPIN_NS 2000000LL       /* an idle worker sleeps after 2 ms without work (the default of spin_ns) */
#define STEAL_MIN_NS 5000LL     /* a claimed chunk is stolen after max(5 us, 2x the caller's fastest chunk), */
#define STEAL_MAX_NS 200000LL   /* and never later than 200 us */
#define ADAPT_WINDOW 0                /* phases per verdict (0: never solo, the default; 32 is about one decode step of a small model) */
#define ADAPT_MIN_SPEEDUP 115         /* percent: a window below this runs solo for a while */
#define ADAPT_SKIP 2                  /* phases of a probe not scored (the workers are waking up) */
#define ADAPT_SOLO_NS 2000000LL       /* the first solo stretch: 2 ms, doubling on each failed */
#define ADAPT_SOLO_GROWTH 16          /* probe up to 16x that (32 ms) */

enum { FREE = 0, CLAIMED = 1, PUBLISHING = 2, DONE = 3, OWNED = 4 };

typedef struct {
    UnitsFn fn;
    unsigned char ctx[JOB_CTX_BYTES];
    int units, width, chunk_units, chunks, B, os, add, nthreads;
    float *out, *scratch;
    size_t stride, fn_scratch;
} Job;

static struct {
    _Atomic uint64_t gen;                 /* the current job's generation */
    _Atomic uint32_t seq;                 /* futex word: low bits of gen */
    _Atomic uint64_t state[MAX_CHUNKS];   /* gen << 3 | FREE..OWNED */
    _Atomic int chunks, nthreads, sleepers, busy, started;
    cpu_set_t allowed;                    /* the process's cores when the first worker started */
    _Atomic int caller_cpu;               /* where the caller last ran: a worker sharing its core yields */
    _Atomic int solo;                     /* the caller runs alone for now: idle workers sleep at once */
    _Atomic int resting;                  /* gen_pool_rest until the next phase: idle workers sleep at once */
    Job job;
    pthread_mutex_t run, spawn;
} P = {.run = PTHREAD_MUTEX_INITIALIZER, .spawn = PTHREAD_MUTEX_INITIALIZER};

/* The caller's score of the workers (read and written under P.run only). */
static struct {
    int window, min_speedup;              /* phases per verdict (0: never solo), percent */
    long long solo_min, solo_until, solo_ns;   /* the first solo stretch; run solo until; the next one */
    long long alone_ns, wall_ns;          /* this window: estimated cost alone, wall time */
    int phases, skip;
    long long stats[11];                  /* parallel phases, solo phases, windows, failed windows, alone ns, wall ns,
                                             chunks, chunks the caller ran, chunks it stole, ns it waited, ns of phases */
} A = {.window = ADAPT_WINDOW, .min_speedup = ADAPT_MIN_SPEEDUP, .solo_min = ADAPT_SOLO_NS, .solo_ns = ADAPT_SOLO_NS};

static inline long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static _Atomic long long spin_ns = SPIN_NS;   /* gen_pool_spin */

/* pool_quiesce's wait: pause for the first iterations, then give the core away. (A worker waits
 * in worker(): it yields only on the caller's core. Neither the caller nor a worker yields on a
 * core shared with another busy process: sched_yield would hand that process a whole slice.) */
static inline void wait_step(int i) {
    if (i < 64) relax(); else sched_yield();
}

static int claim(uint64_t g, int chunks, int as, int from_end) {
    for (int i = 0; i < chunks; i++) {
        int c = from_end ? chunks - 1 - i : i;
        uint64_t want = g << 3 | FREE;
        if (atomic_load_explicit(&P.state[c], memory_order_relaxed) == want &&
            atomic_compare_exchange_strong(&P.state[c], &want, g << 3 | (uint64_t)as))
            return c;
    }
    return -1;
}

static void chunk_range(const Job *j, int c, int *u0, int *u1) {
    *u0 = c * j->chunk_units;
    *u1 = *u0 + j->chunk_units < j->units ? *u0 + j->chunk_units : j->units;
}

/* A worker's share of job g: claim, compute privately, publish if the claim still stands. */
static void work(uint64_t g, int tid) {
    if (tid >= atomic_load(&P.nthreads)) return;
    for (;;) {
        atomic_fetch_add(&P.busy, 1);
        int n = atomic_load(&P.chunks);
        int c = claim(g, n < MAX_CHUNKS ? n : MAX_CHUNKS, CLAIMED, 1);
        if (c < 0) { atomic_fetch_sub(&P.busy, 1); return; }
        Job j;
        memcpy(&j, &P.job, sizeof j);          /* stable while our claim stands (seqlock check next) */
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&P.state[c]) != (g << 3 | CLAIMED)) { atomic_fetch_sub(&P.busy, 1); continue; }
        int u0, u1;
        chunk_range(&j, c, &u0, &u1);
        float *mine = j.scratch + (size_t)tid * j.stride, *priv = mine + j.fn_scratch;
        int cols = (u1 - u0) * j.width;
        j.fn(j.ctx, u0, u1, priv, cols, 0, mine);
        uint64_t want = g << 3 | CLAIMED;
        if (atomic_compare_exchange_strong(&P.state[c], &want, g << 3 | PUBLISHING)) {
            for (int b = 0; b < j.B; b++) {
                float *home = j.out + (size_t)b * j.os + (size_t)u0 * j.width, *src = priv + (size_t)b * cols;
                if (j.add) for (int i = 0; i < cols; i++) home[i] += src[i];
                else memcpy(home, src, (size_t)cols * sizeof(float));
            }
            atomic_store_explicit(&P.state[c], g << 3 | DONE, memory_order_release);
        }
        atomic_fetch_sub(&P.busy, 1);
    }
}

/* A worker on the caller's core cannot help it: move off that core (at most once per MOVE_NS). */
static void leave_cpu(int cpu, long long *moved) {
    long long t = now_ns();
    if (cpu < 0 || cpu >= CPU_SETSIZE || t - *moved < MOVE_NS) return;
    *moved = t;
    cpu_set_t m = P.allowed;
    CPU_CLR(cpu, &m);
    if (CPU_COUNT(&m) > 0) sched_setaffinity(0, sizeof m, &m);
}

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg;
    long long moved = 0;
    uint64_t seen = atomic_load(&P.gen);
    for (;;) {
        uint64_t g;
        long long t0 = now_ns();
        for (int i = 0;; i++) {
            if ((g = atomic_load(&P.gen)) != seen) goto run;
            if ((i & 63) == 63 && (atomic_load_explicit(&P.solo, memory_order_relaxed) ||
                                  atomic_load_explicit(&P.resting, memory_order_relaxed) || now_ns() - t0 > atomic_load_explicit(&spin_ns, memory_order_relaxed))) break;
            if (i < 64) relax();
            else {
                int cpu = sched_getcpu();
                if (cpu != atomic_load_explicit(&P.caller_cpu, memory_order_relaxed)) relax();
                else { leave_cpu(cpu, &moved); sched_yield(); }
            }
        }
        atomic_fetch_add(&P.sleepers, 1);
        for (;;) {
            uint32_t s = atomic_load(&P.seq);
            if ((g = atomic_load(&P.gen)) != seen) break;
            syscall(SYS_futex, &P.seq, FUTEX_WAIT_PRIVATE, s, NULL, NULL, 0);
        }
        atomic_fetch_sub(&P.sleepers, 1);
    run:
        seen = g;
        work(g, tid);
    }
    return NULL;
}

static void spawn_workers(int nthreads) {
    if (atomic_load(&P.started) >= nthreads - 1) return;
    pthread_mutex_lock(&P.spawn);
    if (atomic_load(&P.started) == 0 && sched_getaffinity(0, sizeof P.allowed, &P.allowed) != 0) CPU_ZERO(&P.allowed);
    while (atomic_load(&P.started) < nthreads - 1 && atomic_load(&P.started) < MAX_THREADS - 1) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int tid = atomic_load(&P.started) + 1;
        if (pthread_create(&t, &a, worker, (void *)(intptr_t)tid) != 0) { pthread_attr_destroy(&a); break; }
        pthread_attr_destroy(&a);
        atomic_fetch_add(&P.started, 1);
    }
    pthread_mutex_unlock(&P.spawn);
}

static void run_serial(UnitsFn fn, const void *ctx, int units, float *out, int os, int add, float *scratch) {
    fn(ctx, 0, units, out, os, add, scratch);
}

/* After a parallel phase: add it to the window; at the window's end, go solo if the workers did
 * not pay (see the header). per_unit: the caller's fastest ns per unit x 1024 (< 0: it ran none). */
static void score(long long start, long long end, long long per_unit, int units) {
    A.stats[0]++;
    if (A.window <= 0 || per_unit < 0) return;
    if (A.skip > 0) { A.skip--; return; }
    A.alone_ns += per_unit * units / 1024;
    A.wall_ns += end - start;
    if (++A.phases < A.window) return;
    A.stats[2]++;
    A.stats[4] += A.alone_ns;
    A.stats[5] += A.wall_ns;
    if (A.alone_ns * 100 < A.wall_ns * A.min_speedup) {
        A.stats[3]++;
        A.solo_until = end + A.solo_ns;
        A.solo_ns = A.solo_ns * 2 < A.solo_min * ADAPT_SOLO_GROWTH ? A.solo_ns * 2 : A.solo_min * ADAPT_SOLO_GROWTH;
        atomic_store(&P.solo, 1);
    } else {
        A.solo_ns = A.solo_min;
    }
    A.phases = 0;
    A.alone_ns = A.wall_ns = 0;
}

/* Tuning and counters (tests, benchmarks). window: phases per verdict (0: never solo);
 * min_speedup: percent; solo_ns: the first solo stretch. stats: see A.stats, reset after reading
 * when `reset`. */
void gen_pool_adapt(int window, int min_speedup, long long solo_ns) {
    pthread_mutex_lock(&P.run);
    A.window = window;
    A.min_speedup = min_speedup;
    A.phases = A.skip = 0;
    A.alone_ns = A.wall_ns = 0;
    A.solo_until = 0;
    A.solo_min = A.solo_ns = solo_ns;
    atomic_store(&P.solo, 0);
    pthread_mutex_unlock(&P.run);
}

/* The caller will leave the pool idle for a while (a server sampling and delivering tokens between
 * steps): idle workers go to sleep now instead of spinning for SPIN_NS, so their core serves the
 * process's other threads meanwhile. The next parallel phase wakes them (a futex wake), as after
 * any sleep. */
void gen_pool_rest(void) {
    atomic_store(&P.resting, 1);
}

/* Tests: how long an idle worker spins before it sleeps (ns; < 0: the default); how many workers
 * there are and how many of them sleep now. */
void gen_pool_spin(long long ns) {
    atomic_store(&spin_ns, ns < 0 ? SPIN_NS : ns);
}

void gen_pool_workers(int *out) {
    out[0] = atomic_load(&P.started);
    out[1] = atomic_load(&P.sleepers);
}

void gen_pool_stats(long long *out, int reset) {
    pthread_mutex_lock(&P.run);
    memcpy(out, A.stats, sizeof A.stats);
    if (reset) memset(A.stats, 0, sizeof A.stats);
    pthread_mutex_unlock(&P.run);
}

void pool_run(int nthreads, UnitsFn fn, const void *ctx, size_t ctx_bytes, int units, int width,
              int chunk_units, int B, float *out, int os, int add,
              float *scratch, size_t stride, size_t fn_scratch) {
    int chunks = (units + chunk_units - 1) / chunk_units;
    if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
    if (nthreads <= 1 || chunks <= 1 || chunks > MAX_CHUNKS || ctx_bytes > JOB_CTX_BYTES ||
        pthread_mutex_trylock(&P.run) != 0) {
        run_serial(fn, ctx, units, out, os, add, scratch);
        return;
    }
    long long start = now_ns();
    if (start < A.solo_until) {
        run_serial(fn, ctx, units, out, os, add, scratch);
        A.stats[1]++;
        pthread_mutex_unlock(&P.run);
        return;
    }
    if (atomic_load_explicit(&P.solo, memory_order_relaxed)) {   /* a probe: wake the workers, score later */
        atomic_store(&P.solo, 0);
        A.skip = ADAPT_SKIP;
    }
    atomic_store(&P.resting, 0);   /* before the job is published: its workers spin again after it */
    spawn_workers(nthreads);
    atomic_store_explicit(&P.caller_cpu, sched_getcpu(), memory_order_relaxed);
    uint64_t g = atomic_load(&P.gen) + 1;
    Job *j = &P.job;
    j->fn = fn;
    memcpy(j->ctx, ctx, ctx_bytes);
    j->units = units; j->width = width; j->chunk_units = chunk_units; j->chunks = chunks;
    j->B = B; j->os = os; j->add = add; j->nthreads = nthreads;
    j->out = out; j->scratch = scratch; j->stride = stride; j->fn_scratch = fn_scratch;
    for (int c = 0; c < chunks; c++) atomic_store_explicit(&P.state[c], g << 3 | FREE, memory_order_relaxed);
    atomic_store(&P.chunks, chunks);
    atomic_store(&P.nthreads, nthreads);
    atomic_store(&P.gen, g);
    atomic_store(&P.seq, (uint32_t)g);
    if (atomic_load(&P.sleepers) > 0) syscall(SYS_futex, &P.seq, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);

    /* The caller's share: claim from the front, compute in place. */
    long long fastest = -1, per_unit = -1;   /* ns; per_unit: x 1024 */
    int c;
    while ((c = claim(g, chunks, OWNED, 0)) >= 0) {
        int u0, u1;
        chunk_range(j, c, &u0, &u1);
        long long t0 = now_ns();
        fn(j->ctx, u0, u1, out + (size_t)u0 * width, os, add, scratch);
        long long took = now_ns() - t0, pu = took * 1024 / (u1 - u0);
        if (fastest < 0 || took < fastest) fastest = took;   /* the fastest: blind to our own preemption */
        if (per_unit < 0 || pu < per_unit) per_unit = pu;
        atomic_store_explicit(&P.state[c], g << 3 | DONE, memory_order_release);
        A.stats[7]++;
    }
    long long waited = now_ns();
    int stolen = 0;
    /* Wait for the workers' chunks; steal one that is late. */
    long long steal_after = 2 * fastest;
    if (steal_after < STEAL_MIN_NS) steal_after = STEAL_MIN_NS;
    if (steal_after > STEAL_MAX_NS) steal_after = STEAL_MAX_NS;
    for (c = 0; c < chunks; c++) {
        long long t0 = 0;
        for (int i = 0;; i++) {
            uint64_t s = atomic_load_explicit(&P.state[c], memory_order_acquire);
            if ((s & 7) == DONE) break;
            if ((s & 7) == CLAIMED) {
                if (t0 == 0) t0 = now_ns();
                else if ((i & 15) == 15 && now_ns() - t0 > steal_after) {
                    uint64_t want = g << 3 | CLAIMED;
                    if (atomic_compare_exchange_strong(&P.state[c], &want, g << 3 | OWNED)) {
                        int u0, u1;
                        chunk_range(j, c, &u0, &u1);
                        fn(j->ctx, u0, u1, out + (size_t)u0 * width, os, add, scratch);
                        atomic_store_explicit(&P.state[c], g << 3 | DONE, memory_order_release);
                        stolen++;
                        break;
                    }
                }
            }
            relax();
        }
    }
    long long end = now_ns();
    A.stats[6] += chunks;
    A.stats[7] += stolen;
    A.stats[8] += stolen;
    A.stats[9] += end - waited;
    A.stats[10] += end - start;
    score(start, end, per_unit, units);
    pthread_mutex_unlock(&P.run);
}

void pool_quiesce(void) {
    for (int i = 0; atomic_load(&P.busy) != 0; i++) wait_step(i);
}
