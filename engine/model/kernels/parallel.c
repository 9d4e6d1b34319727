/* parallel_for (parallel.h) three ways, chosen when the library is built (engine/model/kernels/build.py):

   - OpenMP (Linux): the parts run on the OpenMP runtime's threads. PyTorch's Linux builds load libgomp.so.1 before
     this library, so the kernels' parallel regions run on the same runtime and threads as PyTorch's own.
   - pool (Windows, and any build without OpenMP): threads of our own. PyTorch for Windows brings an LLVM/Intel
     OpenMP runtime (libiomp5md.dll or libomp140.x86_64.dll); MinGW's -fopenmp would add GNU's libgomp beside it,
     two runtimes each keeping a thread per core and spinning after its regions. The pool needs nothing beyond
     KERNEL32 (or pthreads), each of its threads sleeps on a condition variable of its own once a short spin
     (GOMP_SPINCOUNT's, as libgomp's threads do here) finds no new work, and a call made while another thread's
     call holds the pool runs its parts itself rather than wait.
   - serial (STRATA_SERIAL): every part on the calling thread.

   In every case the parts and the operations within them are the same, so results do not depend on which. */
#include "parallel.h"

static int parts_for(int64_t n, int threads) {
    return n < 1 ? 0 : threads < 2 ? 1 : n < threads ? (int)n : threads;
}

static void run_here(int64_t n, int parts, Part fn, void *job) {
    for (int p = 0; p < parts; p++) fn(job, n * p / parts, n * (p + 1) / parts, p);
}

#if defined(_OPENMP)

const char *parallel_kind(void) { return "openmp"; }

void parallel_for(int64_t n, int threads, Part fn, void *job) {
    const int parts = parts_for(n, threads);
    if (parts <= 1) {
        run_here(n, parts, fn, job);
        return;
    }
    /* one part per iteration of this loop: every part runs even where the runtime grants fewer threads */
#pragma omp parallel for num_threads(parts) schedule(static, 1)
    for (int p = 0; p < parts; p++) fn(job, n * p / parts, n * (p + 1) / parts, p);
}

#elif defined(STRATA_SERIAL)

const char *parallel_kind(void) { return "serial"; }

void parallel_for(int64_t n, int threads, Part fn, void *job) { run_here(n, parts_for(n, threads), fn, job); }

#else

#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#include <stdlib.h>
#include <windows.h>
typedef SRWLOCK Mutex;
typedef CONDITION_VARIABLE Cond;
#define mutex_init(m) InitializeSRWLock(m)
#define cond_init(c) InitializeConditionVariable(c)
#define mutex_lock(m) AcquireSRWLockExclusive(m)
#define mutex_unlock(m) ReleaseSRWLockExclusive(m)
#define mutex_try(m) TryAcquireSRWLockExclusive(m)
#define cond_wait(c, m) SleepConditionVariableSRW((c), (m), INFINITE, 0)
#define cond_signal(c) WakeConditionVariable(c)
#else
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
typedef pthread_mutex_t Mutex;
typedef pthread_cond_t Cond;
#define mutex_init(m) pthread_mutex_init((m), NULL)
#define cond_init(c) pthread_cond_init((c), NULL)
#define mutex_lock(m) pthread_mutex_lock(m)
#define mutex_unlock(m) pthread_mutex_unlock(m)
#define mutex_try(m) (pthread_mutex_trylock(m) == 0)
#define cond_wait(c, m) pthread_cond_wait((c), (m))
#define cond_signal(c) pthread_cond_signal(c)
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define relax() __asm__ __volatile__("yield")
#else
#define relax() ((void)0)
#endif

#define MAX_WORKERS 255
/* Polls before a thread sleeps (the caller, waiting for the other parts, likewise): GOMP_SPINCOUNT's, as libgomp
   counts them, and 1,000 when it is unset or not a plain number. The engine sets 1,000 before PyTorch loads
   (engine/cli.py, sleeping_cpu_workers, which has the measurements): a decode step's products follow each other
   a few microseconds apart, and waking a sleeping thread costs more than that, but a thread that spins long
   takes a core from whatever else runs on a busy desktop. */
static long spins = -1;

static long spin_limit(void) {
    char text[32] = "";
#ifdef _WIN32
    /* the process environment, where Python's os.environ writes (this DLL's C runtime keeps its own copy) */
    const DWORD length = GetEnvironmentVariableA("GOMP_SPINCOUNT", text, sizeof text);
    if (length == 0 || length >= sizeof text) text[0] = 0;
#else
    const char *value = getenv("GOMP_SPINCOUNT");
    if (value && strlen(value) < sizeof text) strcpy(text, value);
#endif
    char *end;
    const long count = strtol(text, &end, 10);
    return text[0] && !*end && count >= 0 ? (count > 100000000 ? 100000000 : count) : 1000;
}

/* What one worker is handed, and where it sleeps: each has its own, so that a worker never reads another call's
   part, and waking several workers does not have them queue for one lock (one shared condition variable cost a
   1B-shaped model's decode step a third more than OpenMP on 8 threads: tools/kernel_builds_bench.c). */
typedef struct {
    Mutex lock;
    Cond wake;
    uint64_t ticket;  /* bumped for each part handed over (atomic) */
    uint64_t first;   /* the ticket when the thread started */
    Part fn;
    void *job;
    int64_t begin, end;
    int part;
} Slot;

static struct {
    Mutex owner;     /* held by the call whose parts the workers run */
    Mutex state;     /* guards the caller's sleep on done */
    Cond done;
    int remaining;   /* handed-over parts not finished (atomic) */
    int workers;     /* threads started (under owner) */
    int ready;       /* owner, state and done initialised (under once) */
    Slot slot[MAX_WORKERS + 1];
} pool;

const char *parallel_kind(void) { return "pool"; }

#ifdef _WIN32
static DWORD WINAPI worker(LPVOID arg) {
#else
static void *worker(void *arg) {
#endif
    Slot *slot = arg;
    uint64_t seen = slot->first;
    for (;;) {
        uint64_t now = __atomic_load_n(&slot->ticket, __ATOMIC_ACQUIRE);
        for (long spin = 0; now == seen && spin < spins; spin++) {
            relax();
            now = __atomic_load_n(&slot->ticket, __ATOMIC_ACQUIRE);
        }
        if (now == seen) {
            mutex_lock(&slot->lock);
            while ((now = __atomic_load_n(&slot->ticket, __ATOMIC_ACQUIRE)) == seen) cond_wait(&slot->wake, &slot->lock);
            mutex_unlock(&slot->lock);
        }
        seen = now;
        slot->fn(slot->job, slot->begin, slot->end, slot->part);
        if (__atomic_sub_fetch(&pool.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
            mutex_lock(&pool.state);
            cond_signal(&pool.done);
            mutex_unlock(&pool.state);
        }
    }
#ifdef _WIN32
    return 0;
#else
    return NULL;
#endif
}

/* Starts workers until there are `wanted`; returns how many there are (fewer where a thread could not start). */
static int start_workers(int wanted) {
    wanted = wanted > MAX_WORKERS ? MAX_WORKERS : wanted;
    while (pool.workers < wanted) {
        Slot *slot = &pool.slot[pool.workers + 1];
        mutex_init(&slot->lock);
        cond_init(&slot->wake);
        slot->first = __atomic_load_n(&slot->ticket, __ATOMIC_ACQUIRE);
#ifdef _WIN32
        HANDLE thread = CreateThread(NULL, 0, worker, slot, 0, NULL);
        if (!thread) break;
        CloseHandle(thread);
#else
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, slot)) break;
        pthread_detach(thread);
#endif
        pool.workers++;
    }
    return pool.workers;
}

static void init_pool(void) {
    mutex_init(&pool.owner);
    mutex_init(&pool.state);
    cond_init(&pool.done);
    pool.workers = 0;
}

#ifdef _WIN32
static INIT_ONCE once = INIT_ONCE_STATIC_INIT;
static BOOL CALLBACK init_once(PINIT_ONCE o, PVOID p, PVOID *c) {
    (void)o, (void)p, (void)c;
    init_pool();
    return TRUE;
}
#define ensure_pool() InitOnceExecuteOnce(&once, init_once, NULL, NULL)
#else
/* A child forked while the pool had threads has none of them (nor a lock another thread held): it starts anew. */
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void init_once(void) {
    init_pool();
    pthread_atfork(NULL, NULL, init_pool);
}
#define ensure_pool() pthread_once(&once, init_once)
#endif

void parallel_for(int64_t n, int threads, Part fn, void *job) {
    int parts = parts_for(n, threads);
    if (parts <= 1) {
        run_here(n, parts, fn, job);
        return;
    }
    ensure_pool();
    if (!mutex_try(&pool.owner)) {  /* the pool is another call's: this one runs its parts itself */
        run_here(n, parts, fn, job);
        return;
    }
    if (spins < 0) spins = spin_limit();  /* under owner: read once, before any worker starts */
    const int workers = start_workers(parts - 1);
    parts = workers + 1 < parts ? workers + 1 : parts;
    __atomic_store_n(&pool.remaining, parts - 1, __ATOMIC_RELAXED);
    for (int p = 1; p < parts; p++) {
        Slot *slot = &pool.slot[p];
        slot->fn = fn;
        slot->job = job;
        slot->begin = n * p / parts;
        slot->end = n * (p + 1) / parts;
        slot->part = p;
        mutex_lock(&slot->lock);  /* a worker checks its ticket under its lock before it sleeps */
        __atomic_add_fetch(&slot->ticket, 1, __ATOMIC_RELEASE);  /* publishes the fields above to it */
        cond_signal(&slot->wake);
        mutex_unlock(&slot->lock);
    }
    fn(job, 0, n / parts, 0);
    for (long spin = 0; __atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE) && spin < spins; spin++) relax();
    if (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE)) {
        mutex_lock(&pool.state);
        while (__atomic_load_n(&pool.remaining, __ATOMIC_ACQUIRE)) cond_wait(&pool.done, &pool.state);
        mutex_unlock(&pool.state);
    }
    mutex_unlock(&pool.owner);
}

#endif
