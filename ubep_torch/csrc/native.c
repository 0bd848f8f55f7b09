/* ubep_torch._native: the TFF data path of ``ubep_torch.native_engine.NativeEngine`` in C.
 *
 * The block format, flag words and epoch rules are those of ``ubep_torch/protocol.py``; the Python engine
 * passes every size and offset in, so nothing here defines a protocol fact except the 512 B block with
 * its 32 B head (asserted against protocol.py when the engine loads).
 *
 * Arguments are raw addresses (``tensor.data_ptr()``) and sizes; the Python side checks dtypes, shapes,
 * contiguity and bounds before calling, so these loops trust them.
 *
 * Memory ordering. Each 512 B DataBlock is written in two steps: its head words 1..3 and payload with
 * plain stores, then its flag word (w0) with a release store. A receiver that reads w0 with an acquire
 * load and sees the flag of the current call therefore also sees every byte of that block: this is the
 * C11 release/acquire pairing, which on x86-64 (TSO) costs nothing beyond a compiler barrier and on
 * aarch64 becomes stlr/ldar. Unlike the torch path, which publishes the flags of a whole destination
 * after all its payload, every block is published as soon as it is complete.
 *
 * The outputs of Token-Reordering are written with plain (temporal) stores: they are read soon after the
 * call (by the experts, or a combine), so they should stay in cache. Streaming stores, which bypass the
 * cache, made a dispatch alone no faster here and the combine that read its rows afterwards about 1.5x
 * slower.
 *
 * Rows stored into slots (store_rows: a peer's, or this rank's own where a call routes its own rows through
 * them, as a low-latency call with a recv hook does; a send's time covers both, so the choice weighs them)
 * go one of two ways, chosen by measurement (store_policy):
 * plain stores, or streaming stores. A plain store to a line that the receiver's core holds (it read the
 * slot in the previous call) must first take the line from that core's cache. On a VM whose two vCPUs are
 * sometimes placed far apart (benchmarks/bench_stores.py's probe, a 2 MiB store and load between two
 * processes, switches between about 0.2 ms and 1 ms for minutes at a time, the store being the slow part)
 * that costs several times more. Streaming stores write whole lines without taking them, and then cost
 * about the same in both placements, but more than plain stores when the cores are close, and they leave
 * the lines in memory, where the receiver's copy or sum must fetch them, instead of in the writer's cache
 * (for normal calls the policy weighs that too). With
 * streaming stores a block is written with its flag word 0 ("not yet"), the row's stores are made visible
 * by an sfence, and only then is each block's flag written with a release store: a receiver that sees the
 * flag sees the block, as with plain stores (the sfence orders the weakly ordered streaming stores before
 * every later store; x86-64 only, other CPUs always take the plain path).
 *
 * Floating point: reductions are one multiply and one add per operand in a fixed order (the module is
 * built with -ffp-contract=off, so no fused multiply-add), float32 accumulators starting at +0.0, and
 * float32 -> bfloat16 rounding to nearest even with every NaN stored as 0xFFFF, which is what torch's
 * vectorized conversion stores. Outputs are therefore bit-identical to the torch path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define BLOCK_BYTES 512
#define FLAG_BYTES 32
#define PAYLOAD 480                    /* TFF payload bytes per block */
#define BF16_PER_BLOCK (PAYLOAD / 2)   /* 240 */
#define MAX_FIELDS 2
#define MAX_ROW_BLOCKS (1 << 20)         /* a row of 512 MiB: far past any hidden size a Buffer takes */
#define API_VERSION 29             /* bumped whenever a function's arguments or results change */

typedef struct {
    uintptr_t ptr;      /* source (send) or destination (receive) of row 0 */
    Py_ssize_t stride;  /* bytes between rows */
    Py_ssize_t nbytes;  /* payload bytes per row */
    Py_ssize_t block;   /* first block of the field inside a row */
} field_t;

static inline void publish(uint8_t *blk, int64_t flag) {
    __atomic_store_n((int64_t *)blk, flag, __ATOMIC_RELEASE);
}

static inline int64_t flag_of(const uint8_t *blk) {
    return __atomic_load_n((const int64_t *)blk, __ATOMIC_ACQUIRE);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    /* branch-free so the loops vectorize */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0xffffu : rounded);
}

/* A plain copy of a few hundred bytes (a block's payload, a meta block) with 16 B vector loads and stores:
 * memcpy's generic path for sizes like 480 B measured about 1.5x slower here when the destination lines
 * sit in another core's cache (a peer's slots). The tail below 16 B goes through memcpy. */
static inline void copy_plain(uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(__x86_64__)
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
    if (i < n) memcpy(dst + i, src + i, n - i);
#else
    memcpy(dst, src, n);
#endif
}

/* fields: a tuple of (address, row stride, payload bytes, first block) per field, of rows of nb blocks: every
 * field's blocks lie past the meta block (block 0) and inside the row, else ValueError */
static int parse_fields(PyObject *tuple, field_t *f, int *nf, Py_ssize_t nb) {
    if (nb < 1 || nb > MAX_ROW_BLOCKS) {
        PyErr_Format(PyExc_ValueError, "rows of %lld blocks (1 to %d)", (long long)nb, MAX_ROW_BLOCKS);
        return -1;
    }
    if (!PyTuple_Check(tuple)) {
        PyErr_SetString(PyExc_TypeError, "fields must be a tuple of (ptr, stride, nbytes, block) tuples");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    if (n > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "at most two fields per row");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long p;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(tuple, i), "Knnn", &p, &f[i].stride, &f[i].nbytes, &f[i].block))
            return -1;
        f[i].ptr = (uintptr_t)p;
        if (f[i].nbytes < 0 || f[i].block < 1 || f[i].block > nb - (f[i].nbytes + PAYLOAD - 1) / PAYLOAD) {
            PyErr_Format(PyExc_ValueError, "a field of %lld bytes from block %lld does not fit rows of %lld blocks",
                         (long long)f[i].nbytes, (long long)f[i].block, (long long)nb);
            return -1;
        }
    }
    *nf = (int)n;
    return 0;
}

/* Every index in idx[0, n) lies in [0, limit); else IndexError naming ``what``, and nothing is written. */
static int check_index(const int64_t *idx, Py_ssize_t n, int64_t limit, const char *what) {
    int64_t bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) bad |= (idx[i] < 0) | (idx[i] >= limit);
    if (!bad) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (idx[i] < 0 || idx[i] >= limit) {
            PyErr_Format(PyExc_IndexError, "%s %lld out of range [0, %lld)", what, (long long)idx[i],
                         (long long)limit);
            return -1;
        }
    return -1;
}

#if defined(__x86_64__)
/* n bytes (a multiple of 16) from src to the 16 B aligned dst with streaming stores */
static inline void stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
    for (size_t o = 0; o < n; o += 16)
        _mm_stream_si128((__m128i *)(dst + o), _mm_loadu_si128((const __m128i *)(src + o)));
}
#define STREAMING_STORES 1
#else
#define STREAMING_STORES 0
#endif

/* The stores of write_rows (below), for rows i in [0, n) of one destination.
 *
 * With plain stores (``stream`` 0) every block is written, then published by its flag, as soon as it is
 * complete. With streaming stores (``stream`` 1, x86-64, the destination 64 B aligned) every block of a row
 * is written whole with flag word 0 ("not yet"), then an sfence makes them visible, then every block's
 * flag is published in the same order. */
static inline __attribute__((always_inline)) void
store_rows_way(int stream, uint8_t *dst, Py_ssize_t n, Py_ssize_t nb, const int64_t *sel, const uint8_t *meta,
               const int32_t *patch, Py_ssize_t patch_items, long long rank, long long flag, const field_t *f,
               int nf) {
    const Py_ssize_t row_bytes = nb * BLOCK_BYTES;
    uint8_t buf[BLOCK_BYTES] __attribute__((aligned(64)));    /* a streamed block's bytes, where they differ */
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t t = sel ? sel[i] : (int64_t)i;
        const uint8_t *mblk = meta + t * BLOCK_BYTES;
        int64_t token;
        memcpy(&token, mblk + 8, 8);
        uint8_t *row = dst + i * row_bytes;
        if (stream) {
#if STREAMING_STORES
            memcpy(buf, mblk, BLOCK_BYTES);
            memset(buf, 0, 8);
            if (patch) memcpy(buf + FLAG_BYTES, patch + i * patch_items, (size_t)patch_items * 4);
            stream_copy(row, buf, BLOCK_BYTES);
#endif
        } else {
            copy_plain(row + 8, mblk + 8, BLOCK_BYTES - 8);
            if (patch) memcpy(row + FLAG_BYTES, patch + i * patch_items, (size_t)patch_items * 4);
            publish(row, flag);
        }
        for (int k = 0; k < nf; k++) {
            const uint8_t *src = (const uint8_t *)f[k].ptr + t * f[k].stride;
            Py_ssize_t left = f[k].nbytes;
            for (Py_ssize_t b = f[k].block; left > 0; b++) {
                uint8_t *blk = row + b * BLOCK_BYTES;
                const int64_t head[4] = {0, token, (int64_t)b, (int64_t)rank};
                const Py_ssize_t take = left < PAYLOAD ? left : PAYLOAD;
                if (stream) {
#if STREAMING_STORES
                    const uint8_t *from = src;
                    if (take < PAYLOAD) {    /* the last piece: zero padding, through the buffer */
                        memcpy(buf, src, (size_t)take);
                        memset(buf + take, 0, (size_t)(PAYLOAD - take));
                        from = buf;
                    }
                    stream_copy(blk, (const uint8_t *)head, sizeof(head));
                    stream_copy(blk + FLAG_BYTES, from, PAYLOAD);
#endif
                } else {
                    memcpy(blk + 8, head + 1, 3 * sizeof(int64_t));
                    copy_plain(blk + FLAG_BYTES, src, (size_t)take);
                    if (take < PAYLOAD) memset(blk + FLAG_BYTES + take, 0, (size_t)(PAYLOAD - take));
                    publish(blk, flag);
                }
                src += take;
                left -= take;
            }
        }
        if (stream) {
#if STREAMING_STORES
            _mm_sfence();
            publish(row, flag);
            for (int k = 0; k < nf; k++)
                for (Py_ssize_t b = f[k].block, e = f[k].block + (f[k].nbytes + PAYLOAD - 1) / PAYLOAD; b < e; b++)
                    publish(row + b * BLOCK_BYTES, flag);
#endif
        }
    }
}

/* ---------------------------------------------------------------- store policy
 * Which stores put rows into a peer's slots: POLICY_AUTO measures both and keeps the cheaper, per process
 * and per kind of send (the region in the flag word: normal dispatch and combine, low-latency dispatch and
 * combine store different row mixes; the placement of this core and the peers' cores decides, and it can
 * change while a job runs). Sends of fewer than AUTO_MIN_BYTES go unmeasured and take the way of their kind
 * in use (plain until a larger send of the kind measured otherwise); the first WARM_SENDS measured sends of
 * a kind take plain stores (first touches of the slots). Each measured send of the way in use
 * updates that way's estimate in ns per KiB (see store_measured); the way with the lower cost is used,
 * and the other is tried again after ``probe_every`` sends, an interval that doubles (to PROBE_MAX) each
 * time the try confirms the choice and falls back to PROBE_MIN when the choice flips.
 *
 * For normal dispatch and combine, whose rows every rank reads in the same call, a way's cost also counts
 * what reading rows stored that way costs their receivers: streamed lines come from memory, plain ones
 * from the writer's cache, and where the cores sit decides which is dearer. The first block of every
 * control message that send_exchange stores carries three head words for this (every other writer leaves
 * them 0, which says nothing): w1 the way of its rows (1 plain, 2 streaming), w2 and w3 what reading rows
 * of that kind stored each way has cost the sender, as a receiver of its peers' rows (ns per MiB, 0: not
 * measured yet). A receiver times its copies or sums of a source's rows and credits the way that source
 * named (store_read); the senders learn those estimates from the receivers' next control messages
 * (store_peer_reads), so a sender weighs what its own rows cost the ranks that read them, whatever the
 * traffic each way. A way's cost is the sender's store estimate plus, once its peers have reported reads
 * of both ways, their read estimate of that way. (A rank reports what reading all its peers' rows of a way
 * has cost it, and a sender averages its peers' reports: with two ranks that is exactly its own rows, with
 * more an average over the senders. A combine's sum, timed whole, also reads the receiver's own rows and
 * writes its output: the same for both ways, so it moves both estimates alike; a sum over rows of both
 * ways, from peers that stored them differently, is not timed, and without reports of both ways a sender
 * weighs its stores alone.) Low-latency sends, whose rows a recv hook may read much later, count their
 * stores only. */
enum { POLICY_AUTO = 0, POLICY_PLAIN = 1, POLICY_STREAM = 2 };
#define AUTO_MIN_BYTES (32 << 10)
#define PROBE_MIN 16
#define PROBE_MAX 256
#define WARM_SENDS 2
#define READ_MIN_BYTES (64 << 10)   /* fewer bytes read from one way in a call are not timed */
#define STALE_READS 8               /* reads of a kind after which a way's last read estimate is replaced */
#define STORE_KINDS 8               /* flag & 7: the region ids of protocol.py (1..4 send rows) */

typedef struct {
    int current;             /* 0 plain, 1 streaming: the way in use */
    double est[2];           /* stores, ns per KiB, 0 = not measured yet */
    /* normal calls, ns per KiB, 0 = not measured yet: this rank reading its peers' rows stored each way, and
     * its peers reading this rank's rows, as their control messages last reported it */
    double read[2], peer_read[2];
    long long seen, reads_seen, since_probe, probe_every;
    long long read_at[2];    /* reads_seen at this rank's last read of rows stored each way */
} store_kind_t;

/* kinds whose cost counts the receive side: normal dispatch and combine (protocol.py's REGION_DISPATCH and
 * REGION_COMBINE) */
#define READ_COUNTED(kind) ((kind) == 1 || (kind) == 2)

static struct {
    int policy;
    long long sends[2];      /* sends per way (with rows, measured or not) */
    store_kind_t kind[STORE_KINDS];
} stores = {POLICY_AUTO, {0, 0}, {{0}}};

static void stores_reset(int policy) {
    stores.policy = policy;
    stores.sends[0] = stores.sends[1] = 0;
    for (int k = 0; k < STORE_KINDS; k++) {
        memset(&stores.kind[k], 0, sizeof(store_kind_t));
        stores.kind[k].probe_every = PROBE_MIN;
    }
}

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The way the next send of ``bytes`` with flag word ``flag`` takes (1 = streaming); with the GIL held */
static int store_way(long long flag, Py_ssize_t bytes) {
#if STREAMING_STORES
    if (stores.policy == POLICY_PLAIN) return 0;
    if (stores.policy == POLICY_STREAM) return 1;
    const store_kind_t *k = &stores.kind[flag & (STORE_KINDS - 1)];
    if (bytes < AUTO_MIN_BYTES) return k->current;
    if (k->seen < WARM_SENDS) return 0;
    if (k->est[1] == 0.0 && k->est[0] > 0.0 && k->since_probe >= 2) return 1;    /* the first try of streaming */
    if (k->since_probe >= k->probe_every) return !k->current;
    return k->current;
#else
    (void)flag;
    (void)bytes;
    return 0;
#endif
}

/* A sample into an estimate: the first sets it; later ones make a running mean, each counting at most
 * twice the estimate (a send slowed by a preemption moves it by a quarter at most; a placement that makes
 * every send dearer moves it in a few sends) */
static void running_mean(double *e, double sample, int fresh) {
    if (fresh || *e == 0.0) {
        *e = sample;
        return;
    }
    const double capped = sample < 2.0 * *e ? sample : 2.0 * *e;
    *e = 0.75 * *e + 0.25 * capped;
}

/* What using ``way`` costs per KiB: its stores, and the peers reading them once both ways' reads are known */
static double way_cost(const store_kind_t *k, int way) {
    const int reads = k->peer_read[0] > 0.0 && k->peer_read[1] > 0.0;
    return k->est[way] + (reads ? k->peer_read[way] : 0.0);
}

/* The way with the lower cost becomes the one in use (``tried``: the last estimate came from a try of the
 * other way) */
static void store_choose(store_kind_t *k, int tried) {
    const int best = k->est[1] > 0.0 && way_cost(k, 1) < way_cost(k, 0) ? 1 : 0;
    if (best != k->current) {        /* a try found the other way cheaper, or the way in use got dearer */
        k->current = best;
        k->since_probe = 0;
        k->probe_every = PROBE_MIN;
    } else if (tried && k->probe_every < PROBE_MAX) {
        k->probe_every *= 2;         /* the try confirmed the choice: try less often */
    }
}

/* A send of ``bytes`` with flag word ``flag`` by ``way`` took ``ns``; with the GIL held */
static void store_measured(long long flag, int way, Py_ssize_t bytes, int64_t ns) {
    if (bytes <= 0) return;
    stores.sends[way]++;
    store_kind_t *k = &stores.kind[flag & (STORE_KINDS - 1)];
    if (stores.policy != POLICY_AUTO || bytes < AUTO_MIN_BYTES) return;
    if (k->seen++ < WARM_SENDS) return;
    /* a try of the other way (or the first measured send) is an estimate of its own */
    running_mean(&k->est[way], (double)ns * 1024.0 / (double)bytes, way != k->current);
    const int tried = way != k->current;
    k->since_probe = tried ? 0 : k->since_probe + 1;
    store_choose(k, tried);
}

/* The receive side of a normal call of kind ``flag & 7`` read ``bytes`` of rows that their sender stored
 * by way ``code`` (1 plain, 2 streaming, as its control message names it; 0: not said) in ``ns`` (its
 * copies out of the slots, or its sum); with the GIL held */
static void store_read(long long flag, long long code, Py_ssize_t bytes, int64_t ns) {
    const int kind = (int)(flag & (STORE_KINDS - 1));
    if (stores.policy != POLICY_AUTO || !READ_COUNTED(kind) || code < 1 || code > 2 || bytes < READ_MIN_BYTES ||
        ns <= 0)
        return;
    store_kind_t *k = &stores.kind[kind];
    if (k->reads_seen++ < WARM_SENDS) return;   /* (the first calls' reads fault in their outputs' pages) */
    /* rows of a way the peers stored none of for a while (a try of the way they do not use) are a new
     * estimate, not one more sample of an old one */
    const int way = (int)code - 1, stale = k->reads_seen - k->read_at[way] > STALE_READS;
    k->read_at[way] = k->reads_seen;
    running_mean(&k->read[way], (double)ns * 1024.0 / (double)bytes, stale);
}

/* A read estimate as a control message's head word carries it: ns per MiB, rounded */
static int64_t read_word(double ns_per_kib) {
    return (int64_t)(ns_per_kib * 1024.0 + 0.5);
}

/* store_peer_reads(flag, plain, streaming): what the peers last reported reading this rank's rows of kind
 * ``flag & 7`` costs them, stored each way (ns per MiB, their control messages' head words 2 and 3, averaged
 * over the peers that reported; 0: not reported), for the store policy */
static void peer_reads(long long flag, double plain, double streaming) {
    const int kind = (int)(flag & (STORE_KINDS - 1));
    if (stores.policy == POLICY_AUTO && READ_COUNTED(kind)) {
        store_kind_t *k = &stores.kind[kind];
        if (plain > 0.0) k->peer_read[0] = plain / 1024.0;
        if (streaming > 0.0) k->peer_read[1] = streaming / 1024.0;
        store_choose(k, 0);
    }
}

static PyObject *store_peer_reads(PyObject *self, PyObject *args) {
    long long flag;
    double plain, streaming;
    if (!PyArg_ParseTuple(args, "Ldd", &flag, &plain, &streaming)) return NULL;
    peer_reads(flag, plain, streaming);
    Py_RETURN_NONE;
}

/* store_read(flag, way, bytes, ns): receive-side time of rows stored by ``way`` (1 plain, 2 streaming), as
 * the C loops below report theirs (for work done elsewhere) */
static PyObject *py_store_read(PyObject *self, PyObject *args) {
    long long flag, code, ns;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "LLnL", &flag, &code, &bytes, &ns)) return NULL;
    store_read(flag, code, bytes, ns);
    Py_RETURN_NONE;
}

/* store_policy(policy) -> (policy, plain sends, streaming sends, ((way in use, plain ns/KiB, streaming
 * ns/KiB, reading the peers' plain and streamed rows ns/KiB, the peers reading this rank's plain and streamed
 * rows ns/KiB) per kind, STORE_KINDS of them))
 * policy: -1 reads the state only; 0 auto, 1 plain, 2 streaming (counts and estimates start afresh). */
static PyObject *store_policy(PyObject *self, PyObject *args) {
    int policy;
    if (!PyArg_ParseTuple(args, "i", &policy)) return NULL;
    if (policy < -1 || policy > POLICY_STREAM) {
        PyErr_SetString(PyExc_ValueError, "store policy: 0 auto, 1 plain, 2 streaming (-1 reads it)");
        return NULL;
    }
    if (policy >= 0) stores_reset(policy);
    PyObject *kinds = PyTuple_New(STORE_KINDS);
    if (kinds == NULL) return NULL;
    for (int i = 0; i < STORE_KINDS; i++) {
        const store_kind_t *k = &stores.kind[i];
        PyObject *item = Py_BuildValue("(idddddd)", k->current, k->est[0], k->est[1], k->read[0], k->read[1],
                                       k->peer_read[0], k->peer_read[1]);
        if (item == NULL) {
            Py_DECREF(kinds);
            return NULL;
        }
        PyTuple_SET_ITEM(kinds, i, item);
    }
    return Py_BuildValue("iLLN", stores.policy, stores.sends[0], stores.sends[1], kinds);
}

/* The stores of one destination's rows, by ``way`` (1: streaming, where the CPU has them and the slots are
 * 64 B aligned) */
static void store_rows(int way, uint8_t *dst, Py_ssize_t n, Py_ssize_t nb, const int64_t *sel, const uint8_t *meta,
                       const int32_t *patch, Py_ssize_t patch_items, long long rank, long long flag,
                       const field_t *f, int nf) {
    if (STREAMING_STORES && way && ((uintptr_t)dst & 63) == 0)     /* (each call compiled for its constant) */
        store_rows_way(1, dst, n, nb, sel, meta, patch, patch_items, rank, flag, f, nf);
    else
        store_rows_way(0, dst, n, nb, sel, meta, patch, patch_items, rank, flag, f, nf);
}

/* write_rows(dst, n, nb, sel, limit, meta, meta_patch, patch_items, rank, flag, fields)
 *
 * The token group's stores: row i of the destination (``dst + i * nb * 512``) gets staging row
 * t = sel[i] (or i when sel is 0; every t must lie in [0, limit)): the 512 B meta block
 * ``meta + t * 512`` (its first patch_items meta items replaced by meta_patch[i * patch_items + j] when
 * meta_patch is given), then every field's payload in 480 B pieces, each block with head words (source
 * token = the meta block's word 1, block index, rank) and zeroed padding, each published by its flag. */
static PyObject *write_rows(PyObject *self, PyObject *args) {
    unsigned long long dst_p, sel_p, meta_p, patch_p;
    Py_ssize_t n, nb, limit, patch_items;
    long long rank, flag;
    PyObject *ftuple;
    field_t f[MAX_FIELDS];
    int nf = 0;
    if (!PyArg_ParseTuple(args, "KnnKnKKnLLO", &dst_p, &n, &nb, &sel_p, &limit, &meta_p, &patch_p, &patch_items,
                          &rank, &flag, &ftuple))
        return NULL;
    if (parse_fields(ftuple, f, &nf, nb) < 0) return NULL;
    if (patch_items < 0 || patch_items > (BLOCK_BYTES - FLAG_BYTES) / 4) {
        PyErr_SetString(PyExc_ValueError, "meta patch wider than a meta block");
        return NULL;
    }
    uint8_t *dst = (uint8_t *)(uintptr_t)dst_p;
    const int64_t *sel = (const int64_t *)(uintptr_t)sel_p;
    if (sel ? check_index(sel, n, limit, "staging row") < 0 : n > limit) {
        if (!sel) PyErr_SetString(PyExc_IndexError, "more rows than staging rows");
        return NULL;
    }
    const Py_ssize_t bytes = n * nb * BLOCK_BYTES;
    const int way = store_way(flag, bytes);
    int64_t took;
    Py_BEGIN_ALLOW_THREADS
    const int64_t t0 = now_ns();
    store_rows(way, dst, n, nb, sel, (const uint8_t *)(uintptr_t)meta_p, (const int32_t *)(uintptr_t)patch_p,
               patch_items, rank, flag, f, nf);
    took = now_ns() - t0;
    Py_END_ALLOW_THREADS
    store_measured(flag, way, bytes, took);
    Py_RETURN_NONE;
}

/* arrived(rows, n, nb, flag) -> whether every block of the n rows carries ``flag``
 *
 * The last block of the last row is probed first: senders store rows in order, so while it is missing
 * the poll returns at once instead of reading (and pulling from the writer's cache) the blocks that are
 * already there. Only when it is present are all blocks checked. */
static PyObject *arrived(PyObject *self, PyObject *args) {
    unsigned long long rows_p;
    Py_ssize_t n, nb;
    long long flag;
    if (!PyArg_ParseTuple(args, "KnnL", &rows_p, &n, &nb, &flag)) return NULL;
    const uint8_t *rows = (const uint8_t *)(uintptr_t)rows_p;
    const Py_ssize_t total = n * nb;
    if (total && flag_of(rows + (total - 1) * BLOCK_BYTES) != flag) Py_RETURN_FALSE;
    for (Py_ssize_t b = 0; b < total; b++)
        if (flag_of(rows + b * BLOCK_BYTES) != flag) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* The end r of the run of complete rows from ``start``: rows [start, r) carry ``flag`` in every block and
 * row r (if r < n) does not. Each row's last block is probed first (see arrived). */
static Py_ssize_t complete_run(const uint8_t *rows, Py_ssize_t n, Py_ssize_t nb, long long flag, Py_ssize_t start) {
    Py_ssize_t r = start;
    for (; r < n; r++) {
        const uint8_t *row = rows + r * nb * BLOCK_BYTES;
        if (flag_of(row + (nb - 1) * BLOCK_BYTES) != flag) break;
        Py_ssize_t b = 0;
        while (b < nb - 1 && flag_of(row + b * BLOCK_BYTES) == flag) b++;
        if (b < nb - 1) break;
    }
    return r;
}

/* arrived_rows(rows, n, nb, flag, start) -> the end of the run of complete rows that begins at ``start``
 *
 * Rows [start, r) carry ``flag`` in every block and row r (if r < n) does not, so a receiver can reorder
 * the rows that are complete while the sender still writes the rest (streaming Token-Reordering). Each
 * row's last block is probed first, for the same reason as in ``arrived``. */
static PyObject *arrived_rows(PyObject *self, PyObject *args) {
    unsigned long long rows_p;
    Py_ssize_t n, nb, start;
    long long flag;
    if (!PyArg_ParseTuple(args, "KnnLn", &rows_p, &n, &nb, &flag, &start)) return NULL;
    return PyLong_FromSsize_t(complete_run((const uint8_t *)(uintptr_t)rows_p, n, nb, flag, start < 0 ? 0 : start));
}

/* Every field's payload of one arrived TFF row (480 B per block, past each 32 B head) into row o of the
 * field's destination. */
static inline void copy_payload(const uint8_t *row, const field_t *f, int nf, int64_t o) {
    for (int k = 0; k < nf; k++) {
        uint8_t *out = (uint8_t *)f[k].ptr + o * f[k].stride;
        Py_ssize_t left = f[k].nbytes;
        for (Py_ssize_t b = f[k].block; left > 0; b++) {
            const Py_ssize_t take = left < PAYLOAD ? left : PAYLOAD;
            copy_plain(out, row + b * BLOCK_BYTES + FLAG_BYTES, (size_t)take);
            out += take;
            left -= take;
        }
    }
}

/* unpack(rows, n, nb, dst_index, room, meta_out, meta_bytes, meta_stride, src_out, fields)
 *
 * Token-Reordering: row i's payload goes to row o = dst_index[i] (or i; o must lie in [0, room), the
 * rows every output has) of every field's destination,
 * its first meta_bytes of meta items to ``meta_out + o * meta_stride`` and its source token (head
 * word 1, as int32) to src_out[o]. Addresses of 0 skip that output. */
static PyObject *unpack(PyObject *self, PyObject *args) {
    unsigned long long rows_p, idx_p, meta_p, src_p;
    Py_ssize_t n, nb, room, meta_bytes, meta_stride;
    PyObject *ftuple;
    field_t f[MAX_FIELDS];
    int nf = 0;
    if (!PyArg_ParseTuple(args, "KnnKnKnnKO", &rows_p, &n, &nb, &idx_p, &room, &meta_p, &meta_bytes, &meta_stride,
                          &src_p, &ftuple))
        return NULL;
    if (parse_fields(ftuple, f, &nf, nb) < 0) return NULL;
    const uint8_t *rows = (const uint8_t *)(uintptr_t)rows_p;
    const int64_t *idx = (const int64_t *)(uintptr_t)idx_p;
    if (idx ? check_index(idx, n, room, "Token-Reordering target row") < 0 : n > room) {
        if (!idx) PyErr_Format(PyExc_IndexError, "Token-Reordering target row out of range [0, %lld)",
                               (long long)room);
        return NULL;
    }
    uint8_t *meta_out = (uint8_t *)(uintptr_t)meta_p;
    int32_t *src_out = (int32_t *)(uintptr_t)src_p;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *row = rows + i * nb * BLOCK_BYTES;
        const int64_t o = idx ? idx[i] : (int64_t)i;
        if (meta_out && meta_bytes) memcpy(meta_out + o * meta_stride, row + FLAG_BYTES, (size_t)meta_bytes);
        if (src_out) {
            int64_t token;
            memcpy(&token, row + 8, 8);
            src_out[o] = (int32_t)token;
        }
        copy_payload(row, f, nf, o);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* reorder_sources(nb, flag, min_run, room, meta_out, meta_bytes, meta_stride, src_out, fields, sources)
 *
 * One poll of streaming Token-Reordering over several sources: ``sources`` is a list of
 * [rows, n, offset, done, rank] lists, one per source still sending (its slots, its row count, where its
 * rows go in the outputs, the rows already reordered, its rank). For each, the run of complete rows from
 * ``done`` (as arrived_rows finds it) is reordered, as unpack does with dst_index 0, into output rows
 * offset + done.., once it reaches row n or holds at least min_run rows; ``done`` then advances. Every
 * source's rows [offset, offset + n) are checked against ``room`` (the rows every output has) before
 * anything is written. Returns the ranks of the sources that completed in this call.
 *
 * ``own`` (None, or (sel, n, limit, offset, meta_src, meta_src_stride, field_srcs)): the receiving rank's
 * own rows, which never went through the slots, copied first straight from the source tensors: output row
 * offset + i gets source row t = sel[i] (every t in [0, limit)) of every field (field_srcs: a (address,
 * row stride) per field, in the order of ``fields``), its meta items from ``meta_src + t * meta_src_stride``
 * (meta_bytes of them) and t as its source token. Checked with the sources, before anything is written.
 *
 * A source's list may carry a sixth item, the way its rows were stored (its control message's head word 1):
 * the copies of its rows are then timed for the store policy (store_read). */
typedef struct {
    PyObject *entry;    /* the source's list, referenced until its update (the caller's list may change) */
    const uint8_t *rows;
    Py_ssize_t n, offset, start, done, rank;
    long long way;      /* the stores its rows took, as its control message named them (0: not said) */
} stream_t;

/* A Token-Reordering step parsed and checked (reorder_parse), then run without the GIL (reorder_own,
 * reorder_pass), then reported (reorder_finish) */
typedef struct {
    Py_ssize_t nb, min_run, room, meta_bytes, meta_stride, ns;
    long long flag;
    field_t f[MAX_FIELDS];
    int nf;
    uint8_t *meta_out;
    int32_t *src_out;
    const int64_t *own_sel;
    const uint8_t *own_meta;
    Py_ssize_t own_n, own_limit, own_offset, own_meta_stride;
    field_t own_f[MAX_FIELDS];
    stream_t *st;       /* ns of them, PyMem_Calloc'd, each entry referenced: release with reorder_free */
    int64_t read_ns[3]; /* the copies of the rows stored each way (not the waits) */
    Py_ssize_t read_bytes[3];
} reorder_t;

static void reorder_free(reorder_t *r) {
    for (Py_ssize_t i = 0; i < r->ns; i++) Py_XDECREF(r->st[i].entry);
    PyMem_Free(r->st);
    r->st = NULL;
    r->ns = 0;
}

/* reorder_sources' arguments into r; 0, or -1 with the error set (and nothing to release) */
static int reorder_parse(PyObject *args, reorder_t *r) {
    unsigned long long meta_p, src_p;
    PyObject *ftuple, *sources;
    PyObject *own = Py_None;
    memset(r, 0, sizeof(*r));
    if (!PyArg_ParseTuple(args, "nLnnKnnKOO!|O", &r->nb, &r->flag, &r->min_run, &r->room, &meta_p, &r->meta_bytes,
                          &r->meta_stride, &src_p, &ftuple, &PyList_Type, &sources, &own))
        return -1;
    if (parse_fields(ftuple, r->f, &r->nf, r->nb) < 0) return -1;
    /* the own rows: sel, n, limit, offset, meta source and its row stride, one (address, stride) per field */
    unsigned long long own_sel_p = 0, own_meta_p = 0;
    if (own != Py_None) {
        PyObject *srcs;
        if (!PyTuple_Check(own)) {
            PyErr_SetString(PyExc_TypeError, "reorder_sources: own must be a tuple or None");
            return -1;
        }
        if (!PyArg_ParseTuple(own, "KnnnKnO!", &own_sel_p, &r->own_n, &r->own_limit, &r->own_offset, &own_meta_p,
                              &r->own_meta_stride, &PyTuple_Type, &srcs))
            return -1;
        if (PyTuple_GET_SIZE(srcs) != r->nf) {
            PyErr_SetString(PyExc_ValueError, "reorder_sources: own rows need one source per field");
            return -1;
        }
        for (int k = 0; k < r->nf; k++) {
            unsigned long long fp;
            PyObject *src = PyTuple_GET_ITEM(srcs, k);
            if (!PyTuple_Check(src)) {
                PyErr_SetString(PyExc_TypeError, "reorder_sources: own field sources must be (address, stride) tuples");
                return -1;
            }
            if (!PyArg_ParseTuple(src, "Kn", &fp, &r->own_f[k].stride)) return -1;
            r->own_f[k].ptr = (uintptr_t)fp;
            r->own_f[k].nbytes = r->f[k].nbytes;
        }
        if (r->own_n < 0 || r->own_offset < 0 || r->own_offset > r->room - r->own_n) {
            PyErr_Format(PyExc_IndexError, "Token-Reordering own rows [%lld, %lld) out of range [0, %lld)",
                         (long long)r->own_offset, (long long)(r->own_offset + r->own_n), (long long)r->room);
            return -1;
        }
        if (own_sel_p ? check_index((const int64_t *)(uintptr_t)own_sel_p, r->own_n, r->own_limit,
                                    "own source row") < 0
                      : r->own_n > r->own_limit) {
            if (!own_sel_p) PyErr_SetString(PyExc_IndexError, "more own rows than the source has");
            return -1;
        }
    }
    r->own_sel = (const int64_t *)(uintptr_t)own_sel_p;
    r->own_meta = (const uint8_t *)(uintptr_t)own_meta_p;
    const Py_ssize_t ns = PyList_GET_SIZE(sources);
    r->st = PyMem_Calloc(ns ? (size_t)ns : 1, sizeof(stream_t));
    if (r->st == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < ns; i++) {
        PyObject *e = PyList_GET_ITEM(sources, i);
        if (!PyList_Check(e) || (PyList_GET_SIZE(e) != 5 && PyList_GET_SIZE(e) != 6)) {
            PyErr_SetString(PyExc_TypeError,
                            "reorder_sources: sources must be [rows, n, offset, done, rank(, way)] lists");
            goto fail;
        }
        Py_INCREF(e);
        stream_t *t = &r->st[i];
        t->entry = e;
        r->ns = i + 1;
        t->rows = (const uint8_t *)(uintptr_t)PyLong_AsUnsignedLongLong(PyList_GET_ITEM(e, 0));
        t->n = PyLong_AsSsize_t(PyList_GET_ITEM(e, 1));
        t->offset = PyLong_AsSsize_t(PyList_GET_ITEM(e, 2));
        t->start = t->done = PyLong_AsSsize_t(PyList_GET_ITEM(e, 3));
        t->rank = PyLong_AsSsize_t(PyList_GET_ITEM(e, 4));
        t->way = PyList_GET_SIZE(e) == 6 ? PyLong_AsLongLong(PyList_GET_ITEM(e, 5)) : 0;
        if (PyErr_Occurred()) goto fail;
        if (t->n < 0 || t->offset < 0 || t->done < 0 || t->done > t->n || t->offset > r->room - t->n) {
            PyErr_Format(PyExc_IndexError, "Token-Reordering rows [%lld, %lld) out of range [0, %lld)",
                         (long long)t->offset, (long long)(t->offset + t->n), (long long)r->room);
            goto fail;
        }
    }
    r->meta_out = (uint8_t *)(uintptr_t)meta_p;
    r->src_out = (int32_t *)(uintptr_t)src_p;
    return 0;
fail:
    reorder_free(r);
    return -1;
}

/* The own rows, straight from the source tensors (no GIL needed) */
static void reorder_own(reorder_t *r) {
    for (Py_ssize_t i = 0; i < r->own_n; i++) {
        const int64_t t = r->own_sel ? r->own_sel[i] : (int64_t)i, at = (int64_t)(r->own_offset + i);
        if (r->meta_out && r->meta_bytes && r->own_meta)
            memcpy(r->meta_out + at * r->meta_stride, r->own_meta + t * r->own_meta_stride, (size_t)r->meta_bytes);
        if (r->src_out) r->src_out[at] = (int32_t)t;
        for (int k = 0; k < r->nf; k++)
            memcpy((uint8_t *)r->f[k].ptr + at * r->f[k].stride, (const uint8_t *)r->own_f[k].ptr + t * r->own_f[k].stride,
                   (size_t)r->f[k].nbytes);
    }
}

/* One pass over the sources: each one's newly complete rows, where they make a run worth copying (no GIL
 * needed); returns how many sources are complete */
static Py_ssize_t reorder_pass(reorder_t *r) {
    Py_ssize_t complete = 0;
    for (Py_ssize_t i = 0; i < r->ns; i++) {
        stream_t *t = &r->st[i];
        const Py_ssize_t n = t->n, done = t->done, e = complete_run(t->rows, n, r->nb, r->flag, done);
        if (e == done || (e < n && e - done < r->min_run)) {
            complete += done == n;
            continue;
        }
        const int64_t t0 = now_ns();
        for (Py_ssize_t k = done; k < e; k++) {
            const uint8_t *row = t->rows + k * r->nb * BLOCK_BYTES;
            const int64_t at = (int64_t)(t->offset + k);
            if (r->meta_out && r->meta_bytes) memcpy(r->meta_out + at * r->meta_stride, row + FLAG_BYTES, (size_t)r->meta_bytes);
            if (r->src_out) {
                int64_t token;
                memcpy(&token, row + 8, 8);
                r->src_out[at] = (int32_t)token;
            }
            copy_payload(row, r->f, r->nf, at);
        }
        if (t->way == 1 || t->way == 2) {
            r->read_ns[t->way] += now_ns() - t0;
            r->read_bytes[t->way] += (e - done) * r->nb * BLOCK_BYTES;
        }
        t->done = e;
        complete += e == n;
    }
    return complete;
}

/* The sources' lists advanced and the copies counted for the store policy (with the GIL); returns the ranks
 * of the sources that completed (a new list), or NULL with the error set. Releases r. */
static PyObject *reorder_finish(reorder_t *r) {
    for (int w = 1; w <= 2; w++) store_read(r->flag, w, r->read_bytes[w], r->read_ns[w]);
    PyObject *completed = PyList_New(0);
    if (completed == NULL) goto fail;
    for (Py_ssize_t i = 0; i < r->ns; i++) {
        PyObject *e = r->st[i].entry;      /* (referenced since the checks; another thread may have changed it) */
        if (PyList_GET_SIZE(e) < 5) {
            PyErr_SetString(PyExc_RuntimeError, "reorder_sources: a source's list changed during the call");
            goto fail;
        }
        if (r->st[i].done != r->st[i].start) {
            PyObject *v = PyLong_FromSsize_t(r->st[i].done);
            if (v == NULL) goto fail;
            PyList_SetItem(e, 3, v);
        }
        if (r->st[i].done == r->st[i].n && PyList_Append(completed, PyList_GET_ITEM(e, 4)) < 0) goto fail;
    }
    reorder_free(r);
    return completed;
fail:
    Py_XDECREF(completed);
    reorder_free(r);
    return NULL;
}

static PyObject *reorder_sources(PyObject *self, PyObject *args) {
    reorder_t r;
    if (reorder_parse(args, &r) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    reorder_own(&r);
    reorder_pass(&r);
    Py_END_ALLOW_THREADS
    return reorder_finish(&r);
}

/* unpack_items(rows, n, nb, K, base, cnt, E_local, room, info_out, k_out, fields)
 *
 * Low-latency Token-Reordering of rows that carry one token for every local expert it goes to: meta item
 * 0 of a row is its number of (expert, slot) pairs m <= K, items 1 + 2j and 2 + 2j are pair j's
 * (local expert e << 8 | top-k slot k) and its position p in the (source, e) segment. The payload goes
 * to output row base[e] + p of every field, the source token (head word 1) to info_out there and k to
 * k_out. Every item is checked first (m <= K, e < E_local, k < K, 0 <= p < cnt[e], the row inside
 * [0, room)); a bad one raises ValueError naming it and nothing is written. */
/* The first row of the n whose items unpack_items refuses (its pair in *bad_pair, -1 where its count m is
 * out of range), or -1 when every item is inside the announced segments */
static Py_ssize_t items_refused(const uint8_t *rows, Py_ssize_t n, Py_ssize_t nb, Py_ssize_t K, const int64_t *base,
                                const int64_t *cnt, Py_ssize_t E_local, Py_ssize_t room, int32_t *bad_pair) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const int32_t *items = (const int32_t *)(rows + i * nb * BLOCK_BYTES + FLAG_BYTES);
        const int32_t m = items[0];
        if (m < 0 || m > K) {
            *bad_pair = -1;
            return i;
        }
        for (int32_t j = 0; j < m; j++) {
            const int32_t ek = items[1 + 2 * j], p = items[2 + 2 * j];
            const int32_t e = ek >> 8, k = ek & 0xff;
            if (e < 0 || e >= E_local || k >= K || p < 0 || p >= cnt[e] || base[e] + p < 0 || base[e] + p >= room) {
                *bad_pair = j;
                return i;
            }
        }
    }
    return -1;
}

/* unpack_items' copies of n checked rows */
static void items_unpack(const uint8_t *rows, Py_ssize_t n, Py_ssize_t nb, const int64_t *base, int32_t *info,
                         int32_t *kout, const field_t *f, int nf) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *row = rows + i * nb * BLOCK_BYTES;
        const int32_t *items = (const int32_t *)(row + FLAG_BYTES);
        int64_t token;
        memcpy(&token, row + 8, 8);
        for (int32_t j = 0; j < items[0]; j++) {
            const int64_t o = base[items[1 + 2 * j] >> 8] + items[2 + 2 * j];
            if (info) info[o] = (int32_t)token;
            if (kout) kout[o] = items[1 + 2 * j] & 0xff;
            copy_payload(row, f, nf, o);
        }
    }
}

static PyObject *unpack_items(PyObject *self, PyObject *args) {
    unsigned long long rows_p, base_p, cnt_p, info_p, k_p;
    Py_ssize_t n, nb, K, E_local, room;
    PyObject *ftuple;
    field_t f[MAX_FIELDS];
    int nf = 0;
    if (!PyArg_ParseTuple(args, "KnnnKKnnKKO", &rows_p, &n, &nb, &K, &base_p, &cnt_p, &E_local, &room, &info_p,
                          &k_p, &ftuple))
        return NULL;
    if (parse_fields(ftuple, f, &nf, nb) < 0) return NULL;
    if (1 + 2 * K > (BLOCK_BYTES - FLAG_BYTES) / 4) {
        PyErr_SetString(PyExc_ValueError, "too many items for one meta block");
        return NULL;
    }
    const uint8_t *rows = (const uint8_t *)(uintptr_t)rows_p;
    const int64_t *base = (const int64_t *)(uintptr_t)base_p, *cnt = (const int64_t *)(uintptr_t)cnt_p;
    int32_t j;
    const Py_ssize_t i = items_refused(rows, n, nb, K, base, cnt, E_local, room, &j);
    if (i >= 0) {
        const int32_t *items = (const int32_t *)(rows + i * nb * BLOCK_BYTES + FLAG_BYTES);
        if (j < 0)
            PyErr_Format(PyExc_ValueError, "row %zd lists %d (expert, slot) pairs, at most %zd fit", i, (int)items[0],
                         K);
        else
            PyErr_Format(PyExc_ValueError, "row %zd pair %d names expert %d slot %d position %d, outside the "
                         "announced segments", i, (int)j, (int)(items[1 + 2 * j] >> 8), (int)(items[1 + 2 * j] & 0xff),
                         (int)items[2 + 2 * j]);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    items_unpack(rows, n, nb, base, (int32_t *)(uintptr_t)info_p, (int32_t *)(uintptr_t)k_p, f, nf);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* pair_order(topk, T, K, E, t_out, k_out, g_out, pos_out, counts_out) -> number of pairs n
 *
 * Low-latency routing in one pass. topk is [T, K] int64 with values in [-1, E) (-1: no expert); a token may
 * name an expert once. The n (token, slot) pairs with an expert, sorted by expert, then token, then slot
 * (a counting sort, stable in token-major order), go to t_out, k_out and g_out (int64, room for T * K);
 * pos_out ([T, K] int64) receives every pair's index in that order, 0 for empty slots; counts_out (int64,
 * E) the pairs per expert. A value out of range or an expert named twice by one token: ValueError,
 * nothing written. */
static PyObject *pair_order(PyObject *self, PyObject *args) {
    unsigned long long topk_p, t_p, k_p, g_p, pos_p, cnt_p;
    Py_ssize_t T, K, E;
    if (!PyArg_ParseTuple(args, "KnnnKKKKK", &topk_p, &T, &K, &E, &t_p, &k_p, &g_p, &pos_p, &cnt_p))
        return NULL;
    const int64_t *topk = (const int64_t *)(uintptr_t)topk_p;
    int64_t *t_out = (int64_t *)(uintptr_t)t_p, *k_out = (int64_t *)(uintptr_t)k_p;
    int64_t *g_out = (int64_t *)(uintptr_t)g_p, *pos = (int64_t *)(uintptr_t)pos_p;
    int64_t *counts = (int64_t *)(uintptr_t)cnt_p;
    for (Py_ssize_t t = 0; t < T; t++) {
        const int64_t *row = topk + t * K;
        for (Py_ssize_t k = 0; k < K; k++) {
            if (row[k] < -1 || row[k] >= E) {
                PyErr_Format(PyExc_ValueError, "topk_idx[%zd, %zd] = %lld is outside [-1, %zd)", t, k,
                             (long long)row[k], E);
                return NULL;
            }
            for (Py_ssize_t j = 0; j < k; j++)
                if (row[k] >= 0 && row[j] == row[k]) {
                    PyErr_Format(PyExc_ValueError, "topk_idx lists the same expert twice for one token "
                                 "(token %zd, expert %lld)", t, (long long)row[k]);
                    return NULL;
                }
        }
    }
    memset(counts, 0, sizeof(int64_t) * (size_t)E);
    for (Py_ssize_t i = 0; i < T * K; i++)
        if (topk[i] >= 0) counts[topk[i]]++;
    int64_t *next = PyMem_Malloc(sizeof(int64_t) * (size_t)(E ? E : 1));
    if (next == NULL) return PyErr_NoMemory();
    int64_t n = 0;
    for (Py_ssize_t e = 0; e < E; e++) {
        next[e] = n;
        n += counts[e];
    }
    for (Py_ssize_t t = 0; t < T; t++)
        for (Py_ssize_t k = 0; k < K; k++) {
            const int64_t v = topk[t * K + k];
            if (v < 0) {
                pos[t * K + k] = 0;
                continue;
            }
            const int64_t i = next[v]++;
            t_out[i] = t;
            k_out[i] = k;
            g_out[i] = v;
            pos[t * K + k] = i;
        }
    PyMem_Free(next);
    return PyLong_FromLongLong(n);
}

/* routing_layout(topk, T, K, E, R, ntpe, itr, ntpr, send_idx, send_head) -> (min id, max id)
 *
 * Normal-mode layout of a routing in one pass. topk is [T, K] int64. When every id lies in [-1, E) (E a
 * multiple of R), the outputs get: ntpe (int32, E) the slots per expert (a token that names an expert in
 * several slots counts once per slot, as DeepEP counts it: the received rows list the expert in each of
 * those slots), itr ([T, R] bool) whether each token goes to each rank (any of its experts
 * there), ntpr (int32, R) the tokens per rank, send_idx ([R, T] int64) rank r's tokens in order in its
 * first ntpr[r] entries (the rest untouched), send_head ([T, R] int32) each token's place in that list, -1
 * where it does not go. Returns the smallest and largest id (0, 0 when there are none); when one lies
 * outside [-1, E), nothing is written and the caller raises. */
static PyObject *routing_layout(PyObject *self, PyObject *args) {
    unsigned long long topk_p, ntpe_p, itr_p, ntpr_p, idx_p, head_p;
    Py_ssize_t T, K, E, R;
    if (!PyArg_ParseTuple(args, "KnnnnKKKKK", &topk_p, &T, &K, &E, &R, &ntpe_p, &itr_p, &ntpr_p, &idx_p, &head_p))
        return NULL;
    if (T < 0 || K < 0 || R < 1 || E < R || E % R) {
        PyErr_SetString(PyExc_ValueError, "routing_layout: bad sizes");
        return NULL;
    }
    const int64_t *topk = (const int64_t *)(uintptr_t)topk_p;
    int64_t lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < T * K; i++) {
        if (i == 0 || topk[i] < lo) lo = topk[i];
        if (i == 0 || topk[i] > hi) hi = topk[i];
    }
    if (lo < -1 || hi >= E) return Py_BuildValue("LL", (long long)lo, (long long)hi);
    int32_t *ntpe = (int32_t *)(uintptr_t)ntpe_p, *ntpr = (int32_t *)(uintptr_t)ntpr_p;
    int32_t *head = (int32_t *)(uintptr_t)head_p;
    uint8_t *itr = (uint8_t *)(uintptr_t)itr_p;
    int64_t *send_idx = (int64_t *)(uintptr_t)idx_p;
    const Py_ssize_t per_rank = E / R;
    memset(ntpe, 0, sizeof(int32_t) * (size_t)E);
    memset(ntpr, 0, sizeof(int32_t) * (size_t)R);
    memset(itr, 0, (size_t)(T * R));
    for (Py_ssize_t t = 0; t < T; t++) {
        uint8_t *in_rank = itr + t * R;
        for (Py_ssize_t k = 0; k < K; k++) {
            const int64_t e = topk[t * K + k];
            if (e < 0) continue;
            ntpe[e]++;
            in_rank[e / per_rank] = 1;
        }
        for (Py_ssize_t r = 0; r < R; r++) {
            if (in_rank[r]) {
                send_idx[r * T + ntpr[r]] = t;
                head[t * R + r] = ntpr[r]++;
            } else {
                head[t * R + r] = -1;
            }
        }
    }
    return Py_BuildValue("LL", (long long)lo, (long long)hi);
}

/* meta_items(topk, T, K, w, wsz, out): normal dispatch's meta items of T tokens, K + K * wsz int32 words
 * per row: the K expert ids of topk (int64, values in [-1, E)) as int32, then the K weights' bits (wsz
 * 32-bit words each, from the contiguous [T, K] weights at w; none when w is 0). */
static PyObject *meta_items(PyObject *self, PyObject *args) {
    unsigned long long topk_p, w_p, out_p;
    Py_ssize_t T, K, wsz;
    if (!PyArg_ParseTuple(args, "KnnKnK", &topk_p, &T, &K, &w_p, &wsz, &out_p)) return NULL;
    const int64_t *topk = (const int64_t *)(uintptr_t)topk_p;
    const int32_t *w = (const int32_t *)(uintptr_t)w_p;
    int32_t *out = (int32_t *)(uintptr_t)out_p;
    const Py_ssize_t width = K + (w ? K * wsz : 0);
    for (Py_ssize_t t = 0; t < T; t++) {
        int32_t *o = out + t * width;
        for (Py_ssize_t k = 0; k < K; k++) o[k] = (int32_t)topk[t * K + k];
        if (w) memcpy(o + K, w + t * K * wsz, sizeof(int32_t) * (size_t)(K * wsz));
    }
    Py_RETURN_NONE;
}

/* local_topk's loop (see there). Masks, not selects: nothing branches on the routing, which is random;
 * the unsigned compare checks 0 <= l < E_local at once (an id of -1 gives a negative l). Inlined twice,
 * for K = 8 (a constant the compiler unrolls: DeepSeek's top-k) and for any K. */
static inline __attribute__((always_inline)) void
local_topk_rows(const int32_t *restrict meta, Py_ssize_t rows, Py_ssize_t mw, Py_ssize_t K, Py_ssize_t wsz,
                Py_ssize_t lo, Py_ssize_t E_local, Py_ssize_t valid_rows, int64_t *restrict idx,
                int32_t *restrict w) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const int32_t *restrict m = meta + r * mw;
        int64_t *restrict o = idx + r * K;
        const int64_t valid = r < valid_rows;
        for (Py_ssize_t k = 0; k < K; k++) {
            const int64_t l = (int64_t)m[k] - lo;
            const int64_t ok = valid & ((uint64_t)l < (uint64_t)E_local);
            o[k] = (l + 1) * ok - 1;
            if (w && wsz == 1)      /* (float32 weights: one word each) */
                w[r * K + k] = m[K + k] & -(int32_t)ok;
            else if (w)
                for (Py_ssize_t j = 0; j < wsz; j++) w[(r * K + k) * wsz + j] = m[K + k * wsz + j] & -(int32_t)ok;
        }
    }
}

/* local_topk(meta, rows, meta_words, K, wsz, lo, E_local, valid_rows, idx_out, w_out)
 *
 * Normal dispatch's received routing: row r's meta items (int32, meta_words per row) hold K global expert
 * ids, then K weights of wsz 32-bit words each. idx_out[r, k] (int64) becomes the id minus lo when that
 * lies in [0, E_local) and r < valid_rows, else -1; w_out[r, k] (K * wsz words per row; skipped when 0)
 * the weight's bits, or zero where the id is -1. */
static PyObject *local_topk(PyObject *self, PyObject *args) {
    unsigned long long meta_p, idx_p, w_p;
    Py_ssize_t rows, mw, K, wsz, lo, E_local, valid_rows;
    if (!PyArg_ParseTuple(args, "KnnnnnnnKK", &meta_p, &rows, &mw, &K, &wsz, &lo, &E_local, &valid_rows, &idx_p,
                          &w_p))
        return NULL;
    if (K + K * wsz > mw || wsz < 0) {
        PyErr_SetString(PyExc_ValueError, "local_topk: K ids and weights do not fit the meta items");
        return NULL;
    }
    const int32_t *meta = (const int32_t *)(uintptr_t)meta_p;
    int64_t *idx = (int64_t *)(uintptr_t)idx_p;
    int32_t *w = (int32_t *)(uintptr_t)w_p;
    if (K == 8)
        local_topk_rows(meta, rows, mw, 8, wsz, lo, E_local, valid_rows, idx, w);
    else
        local_topk_rows(meta, rows, mw, K, wsz, lo, E_local, valid_rows, idx, w);
    Py_RETURN_NONE;
}

/* segment_rows(first, counts, nseg, out, n): segment s holds counts[s] rows starting at row first[s];
 * their row indices, segments end to end, go to out (int64, n = sum of counts, checked). */
static PyObject *segment_rows(PyObject *self, PyObject *args) {
    unsigned long long first_p, cnt_p, out_p;
    Py_ssize_t nseg, n;
    if (!PyArg_ParseTuple(args, "KKnKn", &first_p, &cnt_p, &nseg, &out_p, &n)) return NULL;
    const int64_t *first = (const int64_t *)(uintptr_t)first_p, *counts = (const int64_t *)(uintptr_t)cnt_p;
    int64_t *out = (int64_t *)(uintptr_t)out_p;
    int64_t total = 0;
    for (Py_ssize_t s = 0; s < nseg; s++) {
        if (counts[s] < 0) {
            PyErr_SetString(PyExc_ValueError, "segment_rows: a negative count");
            return NULL;
        }
        total += counts[s];
    }
    if (total != n) {
        PyErr_Format(PyExc_ValueError, "segment_rows: counts sum to %lld, not %zd", (long long)total, n);
        return NULL;
    }
    for (Py_ssize_t s = 0; s < nseg; s++)
        for (int64_t i = 0; i < counts[s]; i++) *out++ = first[s] + i;
    Py_RETURN_NONE;
}

/* token_rows(t_idx, k_idx, g, n, T, E_local, R, K, tokens, items, rows_per_dest) -> number of rows
 *
 * The sender's side of one-row-per-token low-latency dispatch. The n (token, top-k slot, expert) pairs
 * come sorted by expert, then token. Each (destination rank, token) gets one row, destinations in rank
 * order and tokens ascending within one; ``tokens`` (int64) receives each row's token and ``items``
 * (int32, 1 + 2K per row, room for R * T rows, zeroed here) its meta items: the number m of the token's pairs on that
 * rank, then per pair, experts ascending, (local expert << 8 | slot) and the pair's position among that
 * expert's pairs. rows_per_dest (int64, R) receives the rows of every destination. Every index is
 * checked first (ValueError). */
static PyObject *token_rows(PyObject *self, PyObject *args) {
    unsigned long long t_p, k_p, g_p, tok_p, items_p, rpd_p;
    Py_ssize_t n, T, E_local, R, K;
    if (!PyArg_ParseTuple(args, "KKKnnnnnKKK", &t_p, &k_p, &g_p, &n, &T, &E_local, &R, &K, &tok_p, &items_p,
                          &rpd_p))
        return NULL;
    const int64_t *t_idx = (const int64_t *)(uintptr_t)t_p, *k_idx = (const int64_t *)(uintptr_t)k_p;
    const int64_t *g = (const int64_t *)(uintptr_t)g_p;
    int64_t *tokens = (int64_t *)(uintptr_t)tok_p, *rpd = (int64_t *)(uintptr_t)rpd_p;
    int32_t *items = (int32_t *)(uintptr_t)items_p;
    const Py_ssize_t width = 1 + 2 * K;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (t_idx[j] < 0 || t_idx[j] >= T || g[j] < 0 || g[j] >= E_local * R || k_idx[j] < 0 || k_idx[j] >= K ||
            K > 255 || (j && g[j] < g[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "token_rows: pairs out of range or not sorted by expert");
            return NULL;
        }
    }
    int64_t *row_of = PyMem_Malloc(sizeof(int64_t) * (size_t)(T ? T : 1));
    if (row_of == NULL) return PyErr_NoMemory();
    memset(items, 0, sizeof(int32_t) * (size_t)(R * T * width));
    Py_ssize_t rows = 0, j = 0;
    for (Py_ssize_t d = 0; d < R; d++) {
        const Py_ssize_t lo = j;
        while (j < n && g[j] / E_local == d) j++;
        for (Py_ssize_t t = 0; t < T; t++) row_of[t] = -1;
        for (Py_ssize_t i = lo; i < j; i++) row_of[t_idx[i]] = 0;
        const Py_ssize_t first = rows;
        for (Py_ssize_t t = 0; t < T; t++)
            if (row_of[t] == 0) {
                row_of[t] = rows;
                tokens[rows++] = t;
            }
        rpd[d] = rows - first;
        Py_ssize_t seg = lo;    /* first pair of the current expert */
        for (Py_ssize_t i = lo; i < j; i++) {
            if (g[i] != g[seg]) seg = i;
            int32_t *it = items + row_of[t_idx[i]] * width;
            const int32_t m = it[0]++;
            if (m >= K) {       /* a token with one expert twice: refused by the caller's checks */
                PyMem_Free(row_of);
                PyErr_SetString(PyExc_ValueError, "token_rows: a token has more than K pairs on one rank");
                return NULL;
            }
            it[1 + 2 * m] = (int32_t)(((g[i] % E_local) << 8) | k_idx[i]);
            it[2 + 2 * m] = (int32_t)(i - seg);
        }
    }
    PyMem_Free(row_of);
    return PyLong_FromSsize_t(rows);
}

/* copy_rows(src, src_stride, idx, n, limit, dst, dst_stride, at, room, nbytes)
 *
 * Plain row gather-scatter: dst row at[i] (or i) gets src row idx[i] (or i), nbytes each, for i < n;
 * every idx lies in [0, limit) and every at in [0, room), checked before anything is copied. */
static PyObject *copy_rows(PyObject *self, PyObject *args) {
    unsigned long long src_p, idx_p, dst_p, at_p;
    Py_ssize_t src_stride, n, limit, dst_stride, room, nbytes;
    if (!PyArg_ParseTuple(args, "KnKnnKnKnn", &src_p, &src_stride, &idx_p, &n, &limit, &dst_p, &dst_stride, &at_p,
                          &room, &nbytes))
        return NULL;
    const int64_t *idx = (const int64_t *)(uintptr_t)idx_p, *at = (const int64_t *)(uintptr_t)at_p;
    if (idx ? check_index(idx, n, limit, "source row") < 0 : n > limit) {
        if (!idx) PyErr_SetString(PyExc_IndexError, "more rows than the source has");
        return NULL;
    }
    if (at ? check_index(at, n, room, "target row") < 0 : n > room) {
        if (!at) PyErr_SetString(PyExc_IndexError, "more rows than the target has");
        return NULL;
    }
    const uint8_t *src = (const uint8_t *)(uintptr_t)src_p;
    uint8_t *dst = (uint8_t *)(uintptr_t)dst_p;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(dst + (at ? at[i] : i) * dst_stride, src + (idx ? idx[i] : i) * src_stride, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- control messages (count group)
 * A control message is nctrl blocks, each a 32 B head (w0 = flag; w1..w3 = 0, but for what send_exchange
 * says in the first block's for the store policy) and 60 int64 payload words. */
#define CTRL_WORDS ((BLOCK_BYTES - FLAG_BYTES) / 8)

/* One control message: payload words [0, nwords) into consecutive block bodies (the rest zero), head words
 * 1..3 of the first block ``notes`` (what the store policy tells the receiver, or NULL for zeros), every
 * block published by its flag. */
static void store_ctrl(uint8_t *dst, Py_ssize_t nctrl, const int64_t *payload, Py_ssize_t n, long long flag,
                       const int64_t *notes) {
    for (Py_ssize_t b = 0; b < nctrl; b++) {
        uint8_t *blk = dst + b * BLOCK_BYTES;
        memset(blk + 8, 0, BLOCK_BYTES - 8);
        if (b == 0 && notes) memcpy(blk + 8, notes, 3 * sizeof(int64_t));
        const Py_ssize_t lo = b * CTRL_WORDS, hi = n < lo + CTRL_WORDS ? n : lo + CTRL_WORDS;
        if (hi > lo) memcpy(blk + FLAG_BYTES, payload + lo, (size_t)(hi - lo) * 8);
        publish(blk, flag);
    }
}

/* write_ctrl(dst, nctrl, payload, n, flag): payload words [0, n) into consecutive block bodies (the rest
 * zero), every block published by its flag */
static PyObject *write_ctrl(PyObject *self, PyObject *args) {
    unsigned long long dst_p, payload_p;
    Py_ssize_t nctrl, n;
    long long flag;
    if (!PyArg_ParseTuple(args, "KnKnL", &dst_p, &nctrl, &payload_p, &n, &flag)) return NULL;
    if (n > nctrl * CTRL_WORDS) {
        PyErr_SetString(PyExc_ValueError, "control payload does not fit its blocks");
        return NULL;
    }
    store_ctrl((uint8_t *)(uintptr_t)dst_p, nctrl, (const int64_t *)(uintptr_t)payload_p, n, flag, NULL);
    Py_RETURN_NONE;
}

/* out[i] = v in a list just made with PyList_New: 0, or -1 with the list released and the error set */
static int set_int(PyObject *out, Py_ssize_t i, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) {
        Py_DECREF(out);
        return -1;
    }
    PyList_SET_ITEM(out, i, o);
    return 0;
}

/* read_ctrl(src, nctrl, n) -> the first n payload words as a list of ints */
static PyObject *read_ctrl(PyObject *self, PyObject *args) {
    unsigned long long src_p;
    Py_ssize_t nctrl, n;
    if (!PyArg_ParseTuple(args, "Knn", &src_p, &nctrl, &n)) return NULL;
    if (n > nctrl * CTRL_WORDS) n = nctrl * CTRL_WORDS;
    const uint8_t *src = (const uint8_t *)(uintptr_t)src_p;
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v;
        memcpy(&v, src + (i / CTRL_WORDS) * BLOCK_BYTES + FLAG_BYTES + (i % CTRL_WORDS) * 8, 8);
        if (set_int(out, i, v) < 0) return NULL;
    }
    return out;
}

#define MAX_CTRL 8                  /* control blocks per message at most (protocol.MAX_CTRL_BLOCKS) */
#define MAX_DESTS 1024

/* One destination of send_exchange, parsed and checked before anything is stored. */
typedef struct {
    uint8_t *rows;
    Py_ssize_t n;
    const int64_t *sel;
    uint8_t *ctrl;
    const int32_t *patch;
    Py_ssize_t nctrl, nwords, patch_items;
    int64_t words[MAX_CTRL * CTRL_WORDS];
} dest_t;

/* send_exchange(nb, limit, meta, rank, flag, fields, dests)
 *
 * A TFF send phase in one call: ``dests`` is a tuple of (rows, n, sel, ctrl, nctrl, words, patch,
 * patch_items) per destination, in send order: its slots, the number of rows and their staging rows (sel,
 * or 0 for 0..n-1; each in [0, limit)), its control blocks, the control message's payload words (a
 * sequence of ints) and write_rows' meta patch (0 for none). Every
 * destination is parsed and checked first (an error stores nothing); then, as TorchEngine.send_phase
 * does, every control message is stored, then every destination's rows (write_rows' stores). */
/* A send phase parsed and checked (send_parse), then stored (send_run, without the GIL) */
typedef struct {
    Py_ssize_t nb, limit, nd, bytes;
    const uint8_t *meta;
    long long rank, flag;
    field_t f[MAX_FIELDS];
    int nf, way;
    int64_t notes[3];
    dest_t *d;          /* nd of them, PyMem_Calloc'd: free with PyMem_Free */
} send_t;

/* send_exchange's arguments into s; 0, or -1 with the error set (and nothing to free) */
static int send_parse(PyObject *args, send_t *s) {
    unsigned long long meta_p;
    PyObject *ftuple, *dtuple;
    s->d = NULL;
    s->nf = 0;
    if (!PyArg_ParseTuple(args, "nnKLLOO!", &s->nb, &s->limit, &meta_p, &s->rank, &s->flag, &ftuple, &PyTuple_Type,
                          &dtuple))
        return -1;
    if (parse_fields(ftuple, s->f, &s->nf, s->nb) < 0) return -1;
    const Py_ssize_t nd = PyTuple_GET_SIZE(dtuple);
    if (nd > MAX_DESTS) {
        PyErr_SetString(PyExc_ValueError, "send_exchange: too many destinations");
        return -1;
    }
    dest_t *d = PyMem_Calloc(nd ? (size_t)nd : 1, sizeof(dest_t));
    if (d == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        unsigned long long rows_p, sel_p, ctrl_p, patch_p;
        PyObject *words;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(dtuple, i), "KnKKnOKn", &rows_p, &d[i].n, &sel_p, &ctrl_p, &d[i].nctrl,
                              &words, &patch_p, &d[i].patch_items))
            goto fail;
        d[i].patch = (const int32_t *)(uintptr_t)patch_p;
        if (d[i].patch_items < 0 || d[i].patch_items > (BLOCK_BYTES - FLAG_BYTES) / 4) {
            PyErr_SetString(PyExc_ValueError, "meta patch wider than a meta block");
            goto fail;
        }
        d[i].rows = (uint8_t *)(uintptr_t)rows_p;
        d[i].sel = (const int64_t *)(uintptr_t)sel_p;
        d[i].ctrl = (uint8_t *)(uintptr_t)ctrl_p;
        if (d[i].nctrl < 1 || d[i].nctrl > MAX_CTRL || d[i].n < 0) {
            PyErr_SetString(PyExc_ValueError, "send_exchange: bad control block or row count");
            goto fail;
        }
        PyObject *seq = PySequence_Tuple(words);   /* a tuple of its own: converting an item cannot resize it */
        if (seq == NULL) goto fail;
        d[i].nwords = PyTuple_GET_SIZE(seq);
        if (d[i].nwords > d[i].nctrl * CTRL_WORDS) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "control payload does not fit its blocks");
            goto fail;
        }
        for (Py_ssize_t j = 0; j < d[i].nwords; j++) {
            d[i].words[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, j));
            if (d[i].words[j] == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                goto fail;
            }
        }
        Py_DECREF(seq);
        if (d[i].sel ? check_index(d[i].sel, d[i].n, s->limit, "staging row") < 0 : d[i].n > s->limit) {
            if (!d[i].sel) PyErr_SetString(PyExc_IndexError, "more rows than staging rows");
            goto fail;
        }
    }
    s->d = d;
    s->nd = nd;
    s->meta = (const uint8_t *)(uintptr_t)meta_p;
    s->bytes = 0;
    for (Py_ssize_t i = 0; i < nd; i++) s->bytes += d[i].n * s->nb * BLOCK_BYTES;
    s->way = store_way(s->flag, s->bytes);
    /* (each message names the stores its rows take, see store_rows, and what reading this kind of rows has
     * cost this rank) */
    const store_kind_t *kind = &stores.kind[s->flag & (STORE_KINDS - 1)];
    s->notes[0] = 1;
    s->notes[1] = read_word(kind->read[0]);
    s->notes[2] = read_word(kind->read[1]);
    return 0;
fail:
    PyMem_Free(d);
    return -1;
}

/* Every control message, then every destination's rows (no GIL needed); returns the ns the rows took */
static int64_t send_run(send_t *s) {
    for (Py_ssize_t i = 0; i < s->nd; i++) {
        s->notes[0] = STREAMING_STORES && s->way && ((uintptr_t)s->d[i].rows & 63) == 0 ? 2 : 1;
        store_ctrl(s->d[i].ctrl, s->d[i].nctrl, s->d[i].words, s->d[i].nwords, s->flag, s->notes);
    }
    const int64_t t0 = now_ns();
    for (Py_ssize_t i = 0; i < s->nd; i++)
        store_rows(s->way, s->d[i].rows, s->d[i].n, s->nb, s->d[i].sel, s->meta, s->d[i].patch, s->d[i].patch_items,
                   s->rank, s->flag, s->f, s->nf);
    return now_ns() - t0;
}

static PyObject *send_exchange(PyObject *self, PyObject *args) {
    send_t s;
    if (send_parse(args, &s) < 0) return NULL;
    int64_t took;
    Py_BEGIN_ALLOW_THREADS
    took = send_run(&s);
    Py_END_ALLOW_THREADS
    store_measured(s.flag, s.way, s.bytes, took);
    PyMem_Free(s.d);
    Py_RETURN_NONE;
}

/* exchange_reorder(send, ctrl, reorder, spin_ns) -> 0, 1, 2 or 3
 *
 * A normal dispatch's exchange in one call, for a caller that expects the control messages of the last one
 * again: send_exchange(*send); then, polling for up to spin_ns in all (the CPU yielded between polls), every
 * source's control message, whose first m payload words must equal the expected ones; then the sources'
 * rows, reordered as they come as reorder_sources(*reorder) does. ``ctrl`` = (base, stride, nctrl, R, m,
 * expected, skip[, free_lo, free_hi, words]): source s's control blocks lie at base + s * stride,
 * ``expected`` holds R * m int64 words (bytes), ``skip`` is a bit mask of word indices not compared, words
 * [free_lo, free_hi) are not compared either, and ``words`` (an address, 0 for none) receives every
 * source's m words, R * m int64, once all came as expected: the words a caller reads instead of expecting
 * them (a dispatch's per-expert counts and rank matrix, which change with the routing while the rows each
 * source sends, and so the outputs' sizes, may not).
 *
 * 0: every message as expected and every row reordered; the sources' lists are advanced, each source's
 * copies count for the store policy by the way its message names (head word 1 of its first block), and the
 * reports of every source but the send's rank (head words 2 and 3) are averaged into it, as the engine's
 * peer_reads does. 1: a message not as expected; 2: rows missing; 3: a message missing. Then only the send
 * counts: the outputs may hold some rows, nothing else was recorded, and the caller receives the call the
 * general way (control blocks and rows stay as they arrived). */
/* The control messages a one-step exchange expects (exchange_reorder's ``ctrl``) */
typedef struct {
    const uint8_t *base;
    Py_ssize_t stride, nctrl, R, m;
    const int64_t *want;      /* R * m words, in the caller's bytes object */
    unsigned long long skip;
    Py_ssize_t free_lo, free_hi;   /* words read, not compared */
    int64_t *words;           /* R * m words out, or NULL */
} expect_t;

static int expect_parse(PyObject *ctrl_args, expect_t *e) {
    unsigned long long base_p, words_p = 0;
    PyObject *expected;
    e->free_lo = e->free_hi = 0;
    if (!PyArg_ParseTuple(ctrl_args, "KnnnnO!K|nnK", &base_p, &e->stride, &e->nctrl, &e->R, &e->m, &PyBytes_Type,
                          &expected, &e->skip, &e->free_lo, &e->free_hi, &words_p))
        return -1;
    if (e->nctrl < 1 || e->nctrl > MAX_CTRL || e->m < 0 || e->m > e->nctrl * CTRL_WORDS || e->R < 1 ||
        e->free_lo < 0 || e->free_hi < e->free_lo || e->free_hi > e->m ||
        PyBytes_GET_SIZE(expected) != (Py_ssize_t)(e->R * e->m * 8)) {
        PyErr_SetString(PyExc_ValueError, "one-step exchange: bad control blocks or expected words");
        return -1;
    }
    e->base = (const uint8_t *)(uintptr_t)base_p;
    e->want = (const int64_t *)PyBytes_AS_STRING(expected);
    e->words = (int64_t *)(uintptr_t)words_p;
    return 0;
}

/* Word i of source s's control message (its blocks all carry the call's flag) */
static inline int64_t expect_word(const expect_t *e, Py_ssize_t s, Py_ssize_t i) {
    int64_t v;
    memcpy(&v, e->base + s * e->stride + (i / CTRL_WORDS) * BLOCK_BYTES + FLAG_BYTES + (i % CTRL_WORDS) * 8, 8);
    return v;
}

/* Every source's control message of ``flag``, polled until t0 + spin_ns (the CPU yielded between polls), and
 * compared with the expected words (no GIL needed): 0 when all came as expected, 1 when one came otherwise, 3
 * when one had not come by then */
static int expect_wait(const expect_t *e, long long flag, int64_t t0, long long spin_ns) {
    for (Py_ssize_t s = 0; s < e->R;) {      /* every message: all its blocks carry the flag */
        const uint8_t *src = e->base + s * e->stride;
        Py_ssize_t b = 0;
        while (b < e->nctrl && flag_of(src + b * BLOCK_BYTES) == flag) b++;
        if (b == e->nctrl) {
            for (Py_ssize_t i = 0; i < e->m; i++) {
                if ((i < 64 && (e->skip >> i & 1)) || (i >= e->free_lo && i < e->free_hi)) continue;
                if (expect_word(e, s, i) != e->want[s * e->m + i]) return 1;
            }
            s++;
            continue;
        }
        if (now_ns() - t0 > spin_ns) return 3;
        sched_yield();
    }
    if (e->words)
        for (Py_ssize_t s = 0; s < e->R; s++)
            for (Py_ssize_t i = 0; i < e->m; i++) e->words[s * e->m + i] = expect_word(e, s, i);
    return 0;
}

/* Head word ``w`` (1..3) of source s's first control block: the way its rows were stored, what reading rows
 * has cost it */
static int64_t expect_note(const expect_t *e, Py_ssize_t s, int w) {
    int64_t v;
    memcpy(&v, e->base + s * e->stride + 8 * w, 8);
    return v;
}

/* The reports of every source but ``rank`` (head words 2 and 3) averaged into the store policy, as the
 * engine's peer_reads does (with the GIL) */
static void expect_peer_reads(const expect_t *e, long long flag, long long rank) {
    double plain = 0.0, streaming = 0.0;
    int np = 0, nst = 0;
    for (Py_ssize_t s = 0; s < e->R; s++) {
        if (s == rank) continue;
        const int64_t p = expect_note(e, s, 2), q = expect_note(e, s, 3);
        if (p > 0) plain += (double)p, np++;
        if (q > 0) streaming += (double)q, nst++;
    }
    if (np || nst) peer_reads(flag, np ? plain / np : 0.0, nst ? streaming / nst : 0.0);
}

static PyObject *exchange_reorder(PyObject *self, PyObject *args) {
    PyObject *send_args, *ctrl_args, *reorder_args;
    long long spin_ns;
    expect_t e;
    if (!PyArg_ParseTuple(args, "O!O!O!L", &PyTuple_Type, &send_args, &PyTuple_Type, &ctrl_args, &PyTuple_Type,
                          &reorder_args, &spin_ns))
        return NULL;
    if (expect_parse(ctrl_args, &e) < 0) return NULL;
    send_t snd;
    reorder_t r;
    if (send_parse(send_args, &snd) < 0) return NULL;
    if (reorder_parse(reorder_args, &r) < 0) {
        PyMem_Free(snd.d);
        return NULL;
    }
    const long long flag = snd.flag;
    int status;
    int64_t took;
    Py_BEGIN_ALLOW_THREADS
    took = send_run(&snd);
    const int64_t t0 = now_ns();
    status = expect_wait(&e, flag, t0, spin_ns);
    if (status == 0) {
        for (Py_ssize_t i = 0; i < r.ns; i++)    /* (the way each source's rows took, as its message says) */
            r.st[i].way = r.st[i].rank >= 0 && r.st[i].rank < e.R ? expect_note(&e, r.st[i].rank, 1) : 0;
        reorder_own(&r);
        while (reorder_pass(&r) < r.ns) {
            if (now_ns() - t0 > spin_ns) {
                status = 2;
                break;
            }
            sched_yield();
        }
    }
    Py_END_ALLOW_THREADS
    store_measured(flag, snd.way, snd.bytes, took);
    PyMem_Free(snd.d);
    if (status) {
        reorder_free(&r);
        return PyLong_FromLong(status);
    }
    expect_peer_reads(&e, flag, snd.rank);
    PyObject *completed = reorder_finish(&r);
    if (completed == NULL) return NULL;
    Py_DECREF(completed);
    return PyLong_FromLong(0);
}

/* poll_ctrl(base, stride, nctrl, flag, words) -> the sources still missing, as a list
 *
 * Source s's control message is the nctrl blocks at base + s * stride. For every s where words[s] (a list,
 * one entry per source) is None: if all its blocks carry ``flag`` (acquire loads), words[s] becomes its
 * payload words (nctrl * 60 ints), else s is missing. */
static PyObject *poll_ctrl(PyObject *self, PyObject *args) {
    unsigned long long base_p;
    Py_ssize_t stride, nctrl;
    long long flag;
    PyObject *words;
    if (!PyArg_ParseTuple(args, "KnnLO!", &base_p, &stride, &nctrl, &flag, &PyList_Type, &words)) return NULL;
    const uint8_t *base = (const uint8_t *)(uintptr_t)base_p;
    PyObject *missing = PyList_New(0);
    if (missing == NULL) return NULL;
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(words); s++) {
        if (PyList_GET_ITEM(words, s) != Py_None) continue;
        const uint8_t *src = base + s * stride;
        Py_ssize_t b = 0;
        while (b < nctrl && flag_of(src + b * BLOCK_BYTES) == flag) b++;
        PyObject *item;
        if (b < nctrl) {
            item = PyLong_FromSsize_t(s);
            if (item == NULL || PyList_Append(missing, item) < 0) {
                Py_XDECREF(item);
                Py_DECREF(missing);
                return NULL;
            }
            Py_DECREF(item);
            continue;
        }
        const Py_ssize_t n = nctrl * CTRL_WORDS;
        item = PyList_New(n);
        if (item == NULL) {
            Py_DECREF(missing);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t v;
            memcpy(&v, src + (i / CTRL_WORDS) * BLOCK_BYTES + FLAG_BYTES + (i % CTRL_WORDS) * 8, 8);
            if (set_int(item, i, v) < 0) {
                Py_DECREF(missing);
                return NULL;
            }
        }
        PyList_SetItem(words, s, item);   /* steals item, releases the None */
    }
    return missing;
}

/* ll_calcumsum(ctrl, R, stride, first, E_local, N, out, layout_range, recv_count) -> [rows per source]
 *
 * CalCumSum of low-latency dispatch, from the arrived control messages of all R sources: source s's
 * message starts at ctrl + s * stride, its per-expert counts are payload words [first, first + E_local).
 * Writes out (int64 [3][R][E_local]): the counts, each (source, expert) segment's begin in recv_x[expert]
 * (the counts of lower sources summed) and its flat row in recv_x (expert * R * N + begin); layout_range
 * (int64 [E_local][R]: begin << 32 | count) and recv_count (int32 [E_local]: rows per expert). Returns
 * each source's count sum. A count outside [0, N] raises ValueError before anything is written. */
/* ll_calcumsum's prefix sums of the counts cnt ([R][E], each in [0, N]): begin and flat (cnt + R * E and
 * cnt + 2 * R * E), layout_range and recv_count */
static void calcumsum_fill(Py_ssize_t R, Py_ssize_t E, Py_ssize_t N, int64_t *cnt, int64_t *lr, int32_t *rc) {
    int64_t *begin = cnt + R * E, *flat = begin + R * E;
    for (Py_ssize_t e = 0; e < E; e++) {
        int64_t run = 0;     /* at most R * N rows: fits the 32 bits layout_range gives it */
        for (Py_ssize_t s = 0; s < R; s++) {
            const int64_t c = cnt[s * E + e];
            begin[s * E + e] = run;
            flat[s * E + e] = (int64_t)e * R * N + run;
            lr[e * R + s] = (run << 32) | c;
            run += c;
        }
        rc[e] = (int32_t)run;
    }
}

static PyObject *ll_calcumsum(PyObject *self, PyObject *args) {
    unsigned long long ctrl_p, out_p, lr_p, rc_p;
    Py_ssize_t R, stride, first, E, N;
    if (!PyArg_ParseTuple(args, "KnnnnnKKK", &ctrl_p, &R, &stride, &first, &E, &N, &out_p, &lr_p, &rc_p))
        return NULL;
    const uint8_t *ctrl = (const uint8_t *)(uintptr_t)ctrl_p;
    int64_t *cnt = (int64_t *)(uintptr_t)out_p;
    int64_t *lr = (int64_t *)(uintptr_t)lr_p;
    int32_t *rc = (int32_t *)(uintptr_t)rc_p;
    for (Py_ssize_t s = 0; s < R; s++)
        for (Py_ssize_t e = 0; e < E; e++) {
            const Py_ssize_t i = first + e;
            int64_t v;
            memcpy(&v, ctrl + s * stride + (i / CTRL_WORDS) * BLOCK_BYTES + FLAG_BYTES + (i % CTRL_WORDS) * 8, 8);
            if (v < 0 || v > N) {
                PyErr_Format(PyExc_ValueError, "rank %zd announced %lld rows for local expert %zd, outside [0, %zd]",
                             s, (long long)v, e, N);
                return NULL;
            }
            cnt[s * E + e] = v;
        }
    PyObject *sums = PyList_New(R);
    if (sums == NULL) return NULL;
    for (Py_ssize_t s = 0; s < R; s++) {
        int64_t total = 0;
        for (Py_ssize_t e = 0; e < E; e++) total += cnt[s * E + e];
        if (set_int(sums, s, total) < 0) return NULL;
    }
    calcumsum_fill(R, E, N, cnt, lr, rc);
    return sums;
}

/* ll_dispatch_receive(ctrl, rows, fields, own, outs, spin_ns) -> 0, 1, 2 or 3
 *
 * A low-latency dispatch's receive in one call, for TFF rows of one row per token (Buffer.low_latency_dispatch
 * with the C stores). Polling for up to spin_ns in all (the CPU yielded between polls): every source's control
 * message, as exchange_reorder expects it (``ctrl``, m = 6 + E_local words, every word the caller reads instead
 * of expecting copied to ``words``); CalCumSum of its counts (ll_calcumsum's outputs); then every source's rows,
 * reordered as they arrive as unpack_items does, and this rank's own pairs copied from its plain rows.
 *   rows = (base, stride, nb, flag, N, K, E_local, me): source s's slot rows at base + s * stride, nb blocks each;
 *   fields: the outputs' fields (unpack_items's), E_local * R * N rows each;
 *   own = () where this rank's rows came through its slots like a peer's, else (idx, pk, n, limit, sources):
 *     its n pairs in dispatch order (by local expert, then token), their tokens (rows of its plain rows, of which
 *     there are limit) and top-k slots, and ((address, row stride) of those rows per field);
 *   outs = (cnt [3][R][E_local] int64, layout_range, recv_count, info, k_out, return_slot (int64 [R]),
 *     wait_ns (int64 [R], added to: the ns from the start until each source's rows were in)).
 * 0: done. 1: something not as expected (a compared word; a count outside [0, N], rows or return slots that do
 * not fit the counts, an item outside the announced segments); 2: rows missing; 3: a message missing. Then the
 * outputs may hold part of the call's data and the caller receives it the general way, which names what was
 * wrong (the slots are read, never written). */
static int ll_layout(const expect_t *e, Py_ssize_t N, Py_ssize_t K, Py_ssize_t E, int64_t *cnt, int64_t *lr,
                     int32_t *rc, int64_t *slot, int64_t *nrows) {
    const Py_ssize_t R = e->R;
    for (Py_ssize_t s = 0; s < R; s++) {
        const int64_t *w = e->words + s * e->m;
        int64_t pairs = 0;
        for (Py_ssize_t x = 0; x < E; x++) {
            const int64_t v = w[6 + x];
            if (v < 0 || v > N) return 1;
            cnt[s * E + x] = v;
            pairs += v;
        }
        const int64_t n = w[0];
        if (!((n == 0 && pairs == 0) || (n > 0 && n <= N && n <= pairs && pairs <= n * K))) return 1;
        if (w[3] < 0 || w[3] > N * K - pairs) return 1;      /* (not w[3] + pairs: it could overflow) */
        nrows[s] = n;
        slot[s] = w[3];
    }
    calcumsum_fill(R, E, N, cnt, lr, rc);
    return 0;
}

static PyObject *ll_dispatch_receive(PyObject *self, PyObject *args) {
    PyObject *ctrl_args, *ftuple, *own_args, *src_tuple = NULL;
    unsigned long long rows_p, cnt_p, lr_p, rc_p, info_p, k_p, slot_p, wait_p, idx_p = 0, pk_p = 0;
    Py_ssize_t rows_stride, nb, N, K, E, me, n_own = 0, limit = 0;
    long long flag, spin_ns;
    expect_t e;
    field_t f[MAX_FIELDS];
    uintptr_t src_ptr[MAX_FIELDS];
    Py_ssize_t src_stride[MAX_FIELDS];
    int nf = 0;
    if (!PyArg_ParseTuple(args, "O!(KnnLnnnn)O!O!(KKKKKKK)L", &PyTuple_Type, &ctrl_args, &rows_p, &rows_stride, &nb,
                          &flag, &N, &K, &E, &me, &PyTuple_Type, &ftuple, &PyTuple_Type, &own_args, &cnt_p, &lr_p,
                          &rc_p, &info_p, &k_p, &slot_p, &wait_p, &spin_ns))
        return NULL;
    if (expect_parse(ctrl_args, &e) < 0 || parse_fields(ftuple, f, &nf, nb) < 0) return NULL;
    const Py_ssize_t R = e.R;
    if (e.m != 6 + E || e.words == NULL || E < 1 || N < 1 || K < 1 || 1 + 2 * K > (BLOCK_BYTES - FLAG_BYTES) / 4 ||
        me < 0 || me >= R || R > MAX_DESTS) {
        PyErr_SetString(PyExc_ValueError, "ll_dispatch_receive: bad sizes or control words");
        return NULL;
    }
    const int have_own = PyTuple_GET_SIZE(own_args) > 0;
    if (have_own) {
        if (!PyArg_ParseTuple(own_args, "KKnnO!", &idx_p, &pk_p, &n_own, &limit, &PyTuple_Type, &src_tuple))
            return NULL;
        if (PyTuple_GET_SIZE(src_tuple) != nf || n_own < 0) {
            PyErr_SetString(PyExc_ValueError, "ll_dispatch_receive: own rows need one source per field");
            return NULL;
        }
        for (int k = 0; k < nf; k++) {
            unsigned long long p;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(src_tuple, k), "Kn", &p, &src_stride[k])) return NULL;
            src_ptr[k] = (uintptr_t)p;
        }
        if (check_index((const int64_t *)(uintptr_t)idx_p, n_own, limit, "own row") < 0) return NULL;
    }
    int64_t *nrows = PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)R);
    if (nrows == NULL) return PyErr_NoMemory();
    int64_t *progress = nrows + R;
    int64_t *cnt = (int64_t *)(uintptr_t)cnt_p, *wait = (int64_t *)(uintptr_t)wait_p;
    const int64_t *flat = cnt + 2 * R * E;
    int32_t *info = (int32_t *)(uintptr_t)info_p, *kout = (int32_t *)(uintptr_t)k_p;
    const Py_ssize_t room = E * R * N;
    int status;
    Py_BEGIN_ALLOW_THREADS
    const int64_t t0 = now_ns();
    status = expect_wait(&e, flag, t0, spin_ns);
    if (status == 0)
        status = ll_layout(&e, N, K, E, cnt, (int64_t *)(uintptr_t)lr_p, (int32_t *)(uintptr_t)rc_p,
                           (int64_t *)(uintptr_t)slot_p, nrows);
    for (Py_ssize_t s = 0; s < R; s++) progress[s] = s == me && have_own ? -1 : 0;   /* -1: done */
    if (status == 0 && have_own) {     /* this rank's own pairs, expert by expert, straight from its rows */
        const int64_t *idx = (const int64_t *)(uintptr_t)idx_p, *pk = (const int64_t *)(uintptr_t)pk_p;
        Py_ssize_t j = 0;
        for (Py_ssize_t x = 0; x < E; x++) j += cnt[me * E + x];
        if (j != n_own) status = 1;
        j = 0;
        for (Py_ssize_t x = 0; status == 0 && x < E; x++)
            for (int64_t i = 0; i < cnt[me * E + x]; i++, j++) {
                const int64_t o = flat[me * E + x] + i;
                for (int k = 0; k < nf; k++)
                    copy_plain((uint8_t *)f[k].ptr + o * f[k].stride,
                               (const uint8_t *)src_ptr[k] + idx[j] * src_stride[k], (size_t)f[k].nbytes);
                info[o] = (int32_t)idx[j];
                kout[o] = (int32_t)pk[j];
            }
        wait[me] += now_ns() - t0;
    }
    while (status == 0) {    /* every source's rows, runs of complete ones as they come */
        Py_ssize_t left = 0;
        for (Py_ssize_t s = 0; status == 0 && s < R; s++) {
            if (progress[s] < 0) continue;
            const uint8_t *src = (const uint8_t *)(uintptr_t)rows_p + s * rows_stride;
            const Py_ssize_t start = progress[s], end = complete_run(src, nrows[s], nb, flag, start);
            if (end > start) {
                const uint8_t *run = src + start * nb * BLOCK_BYTES;
                int32_t bad;
                if (items_refused(run, end - start, nb, K, flat + s * E, cnt + s * E, E, room, &bad) >= 0) {
                    status = 1;
                    break;
                }
                items_unpack(run, end - start, nb, flat + s * E, info, kout, f, nf);
            }
            if (end == nrows[s]) {
                progress[s] = -1;
                wait[s] += now_ns() - t0;
            } else {
                progress[s] = end;
                left++;
            }
        }
        if (status || !left) break;
        if (now_ns() - t0 > spin_ns) status = 2;
        else sched_yield();
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(nrows);
    return PyLong_FromLong(status);
}

/* layout_rows(layout_range, E_local, R, N, out, n) -> [rows per source]
 *
 * The rows of low-latency combine's x that go back to each source, from a dispatch's layout_range
 * (int64 [E_local][R]: begin << 32 | count): source by source, expert by expert, the count rows of
 * segment (expert, source) starting at flat row expert * R * N + begin, into out (int64, n rows). Returns
 * each source's row count. Counts that do not sum to n raise ValueError before anything is written. */
static PyObject *layout_rows(PyObject *self, PyObject *args) {
    unsigned long long lr_p, out_p;
    Py_ssize_t E, R, N, n;
    if (!PyArg_ParseTuple(args, "KnnnKn", &lr_p, &E, &R, &N, &out_p, &n)) return NULL;
    const int64_t *lr = (const int64_t *)(uintptr_t)lr_p;
    int64_t *out = (int64_t *)(uintptr_t)out_p;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < E * R; i++) total += lr[i] & 0xFFFFFFFF;
    if (total != n) {
        PyErr_Format(PyExc_ValueError, "layout_range counts sum to %lld rows, not %zd", (long long)total, n);
        return NULL;
    }
    PyObject *per = PyList_New(R);
    if (per == NULL) return NULL;
    for (Py_ssize_t s = 0; s < R; s++) {
        int64_t rows = 0;
        for (Py_ssize_t e = 0; e < E; e++) {
            const int64_t v = lr[e * R + s], first = (int64_t)e * R * N + (v >> 32), c = v & 0xFFFFFFFF;
            for (int64_t i = 0; i < c; i++) *out++ = first + i;
            rows += c;
        }
        if (set_int(per, s, rows) < 0) return NULL;
    }
    return per;
}

/* ---------------------------------------------------------------- bf16 reductions
 * The sums of bf16 rows in float32, in two forms that make the same operations in the same order, so their
 * bits agree: pair_loop (used) reads two neighbouring elements as one 32-bit word, whose low element is
 * (w << 16) and high one (w & 0xffff0000) as float32 bits, and writes both rounded halves back as one word:
 * nothing crosses vector lanes, so GCC vectorizes it at any width, and it is compiled for AVX-512, AVX2 and
 * the baseline ISA, the loader picking the one this CPU runs. sum_loop goes element by element (the
 * reference; use_pair_sums(False) selects it). On 128 rows of 7168 in cache, two operands, the pair loops
 * took 0.6-0.7x the time of the hand-written AVX-512 element loop they replaced, and 0.7-0.95x with more
 * operands or weights (benchmarks/bench_sums.py times both forms as the combine makes its sums). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HOT
#endif

/* A token's operands (addresses a[0, K), 0 where none): the first and last present (-1: none), how many, and
 * the first's and last's weights (from w, its K weights, or 1.0 where w is NULL) */
typedef struct {
    Py_ssize_t first, last, count;
    float wf, wl;
} operands_t;

static inline operands_t operands_of(const int64_t *a, Py_ssize_t K, const float *w) {
    operands_t op = {-1, -1, 0, 1.0f, 1.0f};
    for (Py_ssize_t k = 0; k < K; k++)
        if (a[k]) {
            if (op.first < 0) op.first = k;
            op.last = k;
            op.count++;
        }
    if (w && op.first >= 0) {
        op.wf = w[op.first];
        op.wl = w[op.last];
    }
    return op;
}

/* One pass over the tokens: out[t] = bf16(sum over the operands of t, in order), the sum starting at
 * +0.0 in float32; operand (t, k) is the bf16 row at addr[t * K + k] (0: none, adds nothing), its elements
 * in pieces of 240 ``step[t * K + k]`` bytes apart (a plain row: 480; a slot row: 512), each multiplied by
 * w[t * K + k] first when w is given (by 1.0 otherwise, which changes no bit of the bf16 result). Per token
 * and piece, the first operand is added to +0.0 and the last one is added while rounding into out, so two
 * operands take one pass and more use a piece-sized accumulator that stays in L1. A missing operand adds
 * nothing, as adding +0.0 would not either: a sum that starts at +0.0 and only adds never holds -0.0. */
static inline __attribute__((always_inline)) void
sum_loop(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step, const float *w,
         uint16_t *restrict out) {
    float acc[BF16_PER_BLOCK];
    for (Py_ssize_t t = 0; t < T; t++) {
        const int64_t *a = addr + t * K, *st = step + t * K;
        const operands_t op = operands_of(a, K, w ? w + t * K : NULL);
        const Py_ssize_t first = op.first, last = op.last, count = op.count;
        const float wf = op.wf, wl = op.wl;
        uint16_t *restrict o = out + t * H;
        for (Py_ssize_t j0 = 0, b = 0; j0 < H; j0 += BF16_PER_BLOCK, b++) {
            const Py_ssize_t m = H - j0 < BF16_PER_BLOCK ? H - j0 : BF16_PER_BLOCK;
            if (count == 0) {
                for (Py_ssize_t j = 0; j < m; j++) o[j0 + j] = 0;
                continue;
            }
            const uint16_t *restrict pf = (const uint16_t *)(uintptr_t)(a[first] + b * st[first]);
            if (count == 1) {
                for (Py_ssize_t j = 0; j < m; j++) o[j0 + j] = f32_to_bf16(0.0f + bf16_to_f32(pf[j]) * wf);
                continue;
            }
            const uint16_t *restrict pl = (const uint16_t *)(uintptr_t)(a[last] + b * st[last]);
            if (count == 2) {
                for (Py_ssize_t j = 0; j < m; j++)
                    o[j0 + j] = f32_to_bf16((0.0f + bf16_to_f32(pf[j]) * wf) + bf16_to_f32(pl[j]) * wl);
                continue;
            }
            for (Py_ssize_t j = 0; j < m; j++) acc[j] = 0.0f + bf16_to_f32(pf[j]) * wf;
            for (Py_ssize_t k = first + 1; k < last; k++) {
                if (!a[k]) continue;
                const float wk = w ? w[t * K + k] : 1.0f;
                const uint16_t *restrict p = (const uint16_t *)(uintptr_t)(a[k] + b * st[k]);
                for (Py_ssize_t j = 0; j < m; j++) acc[j] = acc[j] + bf16_to_f32(p[j]) * wk;
            }
            for (Py_ssize_t j = 0; j < m; j++) o[j0 + j] = f32_to_bf16(acc[j] + bf16_to_f32(pl[j]) * wl);
        }
    }
}

/* Two bf16 elements as one 32-bit word (any alignment: rows of an odd width start on 2 B), each element's
 * float32 value, and two rounded results packed back into a word */
static inline uint32_t load_pair(const uint16_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline float low_of(uint32_t w) {
    return bf16_to_f32((uint16_t)w);
}

static inline float high_of(uint32_t w) {
    const uint32_t u = w & 0xffff0000u;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store_pair(uint16_t *p, float low, float high) {
    const uint32_t v = (uint32_t)f32_to_bf16(low) | (uint32_t)f32_to_bf16(high) << 16;
    memcpy(p, &v, 4);
}

/* sum_loop's sums, two elements at a time (see above): the same operations per element, in the same order;
 * a piece of odd length ends with one element done alone */
static inline __attribute__((always_inline)) void
pair_loop(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step, const float *w,
          uint16_t *restrict out) {
    float lo[BF16_PER_BLOCK / 2], hi[BF16_PER_BLOCK / 2];
    for (Py_ssize_t t = 0; t < T; t++) {
        const int64_t *a = addr + t * K, *st = step + t * K;
        const operands_t op = operands_of(a, K, w ? w + t * K : NULL);
        const Py_ssize_t first = op.first, last = op.last, count = op.count;
        const float wf = op.wf, wl = op.wl;
        for (Py_ssize_t j0 = 0, b = 0; j0 < H; j0 += BF16_PER_BLOCK, b++) {
            const Py_ssize_t m = H - j0 < BF16_PER_BLOCK ? H - j0 : BF16_PER_BLOCK, np = m / 2, e = m - 1;
            uint16_t *restrict o = out + t * H + j0;
            if (count == 0) {
                memset(o, 0, (size_t)m * 2);
                continue;
            }
            const uint16_t *restrict pf = (const uint16_t *)(uintptr_t)(a[first] + b * st[first]);
            if (count == 1) {
                for (Py_ssize_t j = 0; j < np; j++) {
                    const uint32_t x = load_pair(pf + 2 * j);
                    store_pair(o + 2 * j, 0.0f + low_of(x) * wf, 0.0f + high_of(x) * wf);
                }
                if (m & 1) o[e] = f32_to_bf16(0.0f + bf16_to_f32(pf[e]) * wf);
                continue;
            }
            const uint16_t *restrict pl = (const uint16_t *)(uintptr_t)(a[last] + b * st[last]);
            if (count == 2) {
                for (Py_ssize_t j = 0; j < np; j++) {
                    const uint32_t x = load_pair(pf + 2 * j), y = load_pair(pl + 2 * j);
                    store_pair(o + 2 * j, (0.0f + low_of(x) * wf) + low_of(y) * wl,
                               (0.0f + high_of(x) * wf) + high_of(y) * wl);
                }
                if (m & 1) o[e] = f32_to_bf16((0.0f + bf16_to_f32(pf[e]) * wf) + bf16_to_f32(pl[e]) * wl);
                continue;
            }
            float odd = 0.0f + bf16_to_f32(pf[e]) * wf;     /* (element e, used where m is odd) */
            for (Py_ssize_t j = 0; j < np; j++) {
                const uint32_t x = load_pair(pf + 2 * j);
                lo[j] = 0.0f + low_of(x) * wf;
                hi[j] = 0.0f + high_of(x) * wf;
            }
            for (Py_ssize_t k = first + 1; k < last; k++) {
                if (!a[k]) continue;
                const float wk = w ? w[t * K + k] : 1.0f;
                const uint16_t *restrict p = (const uint16_t *)(uintptr_t)(a[k] + b * st[k]);
                for (Py_ssize_t j = 0; j < np; j++) {
                    const uint32_t x = load_pair(p + 2 * j);
                    lo[j] = lo[j] + low_of(x) * wk;
                    hi[j] = hi[j] + high_of(x) * wk;
                }
                odd = odd + bf16_to_f32(p[e]) * wk;
            }
            for (Py_ssize_t j = 0; j < np; j++) {
                const uint32_t x = load_pair(pl + 2 * j);
                store_pair(o + 2 * j, lo[j] + low_of(x) * wl, hi[j] + high_of(x) * wl);
            }
            if (m & 1) o[e] = f32_to_bf16(odd + bf16_to_f32(pl[e]) * wl);
        }
    }
}

/* each loop compiled apart for the unweighted sum, where the weights are the constant 1.0 (no multiplies) */
HOT static void plain_pairs(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step,
                            uint16_t *restrict out) {
    pair_loop(T, K, H, addr, step, NULL, out);
}

HOT static void weighted_pairs(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step,
                               const float *w, uint16_t *restrict out) {
    pair_loop(T, K, H, addr, step, w, out);
}

static void plain_elements(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step,
                           uint16_t *restrict out) {
    sum_loop(T, K, H, addr, step, NULL, out);
}

static void weighted_elements(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step,
                              const float *w, uint16_t *restrict out) {
    sum_loop(T, K, H, addr, step, w, out);
}

/* 1: the pair loops; 0: the element loops (use_pair_sums) */
static int pair_sums = 1;

static void plain_sum(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step,
                      uint16_t *restrict out) {
    if (pair_sums)
        plain_pairs(T, K, H, addr, step, out);
    else
        plain_elements(T, K, H, addr, step, out);
}

static void weighted_sum(Py_ssize_t T, Py_ssize_t K, Py_ssize_t H, const int64_t *addr, const int64_t *step,
                         const float *w, uint16_t *restrict out) {
    if (pair_sums)
        weighted_pairs(T, K, H, addr, step, w, out);
    else
        weighted_elements(T, K, H, addr, step, w, out);
}

/* use_pair_sums(on) -> on: the sums take the pair loops (True, the default) or the element loops (False);
 * tests compare the two, and benchmarks/bench_sums.py times both */
static PyObject *use_pair_sums(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    pair_sums = on;
    return PyBool_FromLong(pair_sums);
}

/* combine_rows_bf16(T, H, sources, out[, flag, way, bytes])
 *
 * Normal combine of one token range: out[t] = bf16(sum of the rows of token t, sources in order) into the
 * contiguous bf16 out [T, H]. ``sources``: a tuple of (base, stride, step, tok, n) per source: its row r
 * starts at base + r * stride (elements in pieces of 240, ``step`` bytes apart: see sum_loop) and belongs
 * to token tok[r] (an int64 array of n distinct tokens in [0, T); tok 0: row r is token r, n == T). Every
 * token is checked before anything is read or written (IndexError). With ``flag`` (the combine's flag
 * word), ``way`` and ``bytes``: the sum read ``bytes`` of rows that their senders stored by ``way``, and is
 * timed for the store policy (store_read). */
/* The sum's operands of combine_rows_bf16's sources: addr[t * S + s] and step[t * S + s] (S sources, both
 * arrays zeroed by the caller) for every row of every source; each source a tuple whose first five items are
 * (base, stride, step, tok, n). 0, or -1 with the error set. */
static int sum_operands(PyObject *sources, Py_ssize_t T, int64_t *addr, int64_t *step) {
    const Py_ssize_t S = PyTuple_GET_SIZE(sources);
    for (Py_ssize_t s = 0; s < S; s++) {
        unsigned long long base, tok_p, more;
        Py_ssize_t stride, stp, n, more2;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(sources, s), "KnnKn|Kn", &base, &stride, &stp, &tok_p, &n, &more, &more2))
            return -1;
        const int64_t *tok = (const int64_t *)(uintptr_t)tok_p;
        if ((tok == NULL && n != T) || n < 0 || n > T) {
            PyErr_Format(PyExc_ValueError, "source %zd has %zd rows for %zd tokens", s, n, T);
            return -1;
        }
        for (Py_ssize_t r = 0; r < n; r++) {
            const int64_t t = tok ? tok[r] : r;
            if (t < 0 || t >= T || addr[t * S + s]) {
                PyErr_Format(PyExc_IndexError, "source %zd: combine token %lld out of range [0, %zd) or repeated", s,
                             (long long)t, T);
                return -1;
            }
            addr[t * S + s] = (int64_t)(base + (uint64_t)(r * stride));
            step[t * S + s] = stp;
        }
    }
    return 0;
}

static PyObject *combine_rows_bf16(PyObject *self, PyObject *args) {
    Py_ssize_t T, H;
    PyObject *sources;
    unsigned long long out_p;
    long long flag = 0, way = 0;
    Py_ssize_t read_bytes = 0;
    if (!PyArg_ParseTuple(args, "nnO!K|LLn", &T, &H, &PyTuple_Type, &sources, &out_p, &flag, &way, &read_bytes))
        return NULL;
    const Py_ssize_t S = PyTuple_GET_SIZE(sources);
    int64_t *addr = PyMem_Calloc(2 * (size_t)(T * S > 0 ? T * S : 1), sizeof(int64_t));
    if (addr == NULL) return PyErr_NoMemory();
    int64_t *step = addr + T * S;
    if (sum_operands(sources, T, addr, step) < 0) {
        PyMem_Free(addr);
        return NULL;
    }
    int64_t took;
    Py_BEGIN_ALLOW_THREADS
    const int64_t t0 = now_ns();
    plain_sum(T, S, H, addr, step, (uint16_t *)(uintptr_t)out_p);
    took = now_ns() - t0;
    Py_END_ALLOW_THREADS
    store_read(flag, way, read_bytes, took);
    PyMem_Free(addr);
    Py_RETURN_NONE;
}

/* exchange_combine(send, ctrl, T, H, sources, out, spin_ns) -> 0, 1, 2 or 3
 *
 * A normal combine's exchange in one call, for a caller that expects the control messages of the last one
 * again (as exchange_reorder): send_exchange(*send); every source's control message as expected (``ctrl``
 * as exchange_reorder takes it); then, once every peer's rows carry the send's flag in every block, out =
 * the sum combine_rows_bf16(T, H, sources, out) makes. ``sources``: (base, stride, step, tok, n, rows, rank)
 * per source, the first five as combine_rows_bf16 takes them; ``rows`` 0 for rows that are there (this
 * rank's own), else the address of the peer's first slot row (nb blocks of 512 B each, nb the send's), and
 * ``rank`` the source's rank. 0: summed; the sum is timed for the store policy where every peer's message
 * names the same way (the bytes its rows take), and the peers' reports are taken in (as exchange_reorder).
 * 1: a message not as expected; 2: rows missing; 3: a message missing: then only the send has happened (out
 * is not written) and the caller receives the call the general way. */
/* Every block of each of the n runs of rows (runs[i][0]: the address of its first row of nb blocks, runs[i][1]:
 * its rows) polled until it carries ``flag``, until t0 + spin_ns at most (the CPU yielded between polls): 0 when
 * all came, 2 when rows were missing then. A complete row stays so until this rank acknowledges. */
static int runs_wait(const uint64_t (*runs)[3], Py_ssize_t n, Py_ssize_t nb, long long flag, int64_t t0,
                     long long spin_ns) {
    Py_ssize_t got = 0;     /* complete rows of run i so far */
    for (Py_ssize_t i = 0; i < n;) {
        got = complete_run((const uint8_t *)(uintptr_t)runs[i][0], (Py_ssize_t)runs[i][1], nb, flag, got);
        if (got == (Py_ssize_t)runs[i][1]) {
            i++;
            got = 0;
            continue;
        }
        if (now_ns() - t0 > spin_ns) return 2;
        sched_yield();
    }
    return 0;
}

static PyObject *exchange_combine(PyObject *self, PyObject *args) {
    PyObject *send_args, *ctrl_args, *sources;
    Py_ssize_t T, H;
    unsigned long long out_p;
    long long spin_ns;
    expect_t e;
    if (!PyArg_ParseTuple(args, "O!O!nnO!KL", &PyTuple_Type, &send_args, &PyTuple_Type, &ctrl_args, &T, &H,
                          &PyTuple_Type, &sources, &out_p, &spin_ns))
        return NULL;
    if (expect_parse(ctrl_args, &e) < 0) return NULL;
    const Py_ssize_t S = PyTuple_GET_SIZE(sources);
    if (S > MAX_DESTS || T < 0 || H < 0) {
        PyErr_SetString(PyExc_ValueError, "exchange_combine: bad sources or sizes");
        return NULL;
    }
    uint64_t peers[MAX_DESTS][3];      /* rows address, n, rank of each peer source */
    Py_ssize_t np = 0;
    for (Py_ssize_t s = 0; s < S; s++) {
        unsigned long long base, tok_p, rows_p = 0;
        Py_ssize_t stride, stp, n, rank = -1;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(sources, s), "KnnKnKn", &base, &stride, &stp, &tok_p, &n, &rows_p, &rank))
            return NULL;
        if (rows_p) {
            peers[np][0] = rows_p;
            peers[np][1] = (uint64_t)(n < 0 ? 0 : n);
            peers[np][2] = (uint64_t)rank;
            np++;
        }
    }
    int64_t *addr = PyMem_Calloc(2 * (size_t)(T * S > 0 ? T * S : 1), sizeof(int64_t));
    if (addr == NULL) return PyErr_NoMemory();
    int64_t *step = addr + T * S;
    send_t snd;
    if (sum_operands(sources, T, addr, step) < 0 || send_parse(send_args, &snd) < 0) {
        PyMem_Free(addr);
        return NULL;
    }
    const long long flag = snd.flag;
    const Py_ssize_t nb = snd.nb;
    int status;
    int64_t took, summed = 0;
    Py_BEGIN_ALLOW_THREADS
    took = send_run(&snd);
    const int64_t t0 = now_ns();
    status = expect_wait(&e, flag, t0, spin_ns);
    if (status == 0) status = runs_wait((const uint64_t(*)[3])peers, np, nb, flag, t0, spin_ns);
    if (status == 0) {
        const int64_t t1 = now_ns();
        plain_sum(T, S, H, addr, step, (uint16_t *)(uintptr_t)out_p);
        summed = now_ns() - t1;
    }
    Py_END_ALLOW_THREADS
    store_measured(flag, snd.way, snd.bytes, took);
    PyMem_Free(snd.d);
    PyMem_Free(addr);
    if (status) return PyLong_FromLong(status);
    long long way = -1;
    Py_ssize_t bytes = 0;
    for (Py_ssize_t i = 0; i < np; i++) {      /* (one way named by every peer: the sum's read of those rows) */
        const int64_t w = (int64_t)peers[i][2] < e.R ? expect_note(&e, (Py_ssize_t)peers[i][2], 1) : 0;
        way = way < 0 || way == w ? w : 0;
        bytes += (Py_ssize_t)peers[i][1] * nb * BLOCK_BYTES;
    }
    if (way > 0) store_read(flag, way, bytes, summed);
    expect_peer_reads(&e, flag, snd.rank);
    return PyLong_FromLong(0);
}

/* weighted_combine_bf16(T, K, H, topk, pos, weights, out, rows, nrows, row_bytes, payload_off,
 *                       local, local_stride, lo, hi, local_rows, local_limit)
 *
 * Low-latency combine: out[t] = bf16(sum over k in order of (valid ? f32(x_tk) * w[t, k] : +0.0)) from an
 * accumulator starting at +0.0. Slot (t, k) is masked when topk[t, k] < 0. Otherwise its row is slot
 * p = pos[t, k]: row p of the slots at ``rows`` (nrows rows of row_bytes, the payload's first block at
 * payload_off, 240 elements per 512 B block), except slots lo <= p < hi, which were not written: their
 * row is row local_rows[p - lo] of the plain bf16 rows at ``local`` (local_limit rows, local_stride bytes
 * apart). Every row index is checked before anything is read (IndexError). One pass over the rows: a
 * block-sized float32 accumulator per token stays in L1. */
/* weighted_combine_bf16's operands from its arguments (a tuple): every slot's row address and block step in
 * *addr (2 * T * K int64, PyMem_Malloc'd: the caller frees it), the sizes, weights and output; -1 with the error
 * set (IndexError for a row out of range) and nothing allocated */
typedef struct {
    Py_ssize_t T, K, H;
    int64_t *addr;
    const float *w;
    uint16_t *out;
} weighted_t;

static int weighted_parse(PyObject *args, weighted_t *c) {
    unsigned long long topk_p, pos_p, w_p, out_p, rows_p, local_p, lrows_p;
    Py_ssize_t T, K, H, nrows, row_bytes, payload_off, local_stride, lo, hi, local_limit;
    if (!PyArg_ParseTuple(args, "nnnKKKKKnnnKnnnKn", &T, &K, &H, &topk_p, &pos_p, &w_p, &out_p, &rows_p, &nrows,
                          &row_bytes, &payload_off, &local_p, &local_stride, &lo, &hi, &lrows_p, &local_limit))
        return -1;
    const int64_t *topk = (const int64_t *)(uintptr_t)topk_p, *pos = (const int64_t *)(uintptr_t)pos_p;
    const int64_t *lrows = (const int64_t *)(uintptr_t)lrows_p;
    int64_t *addr = PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)(T * K > 0 ? T * K : 1));
    if (addr == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int64_t *step = addr + T * K;
    for (Py_ssize_t i = 0; i < T * K; i++) {
        addr[i] = 0;
        if (topk[i] < 0) continue;
        const int64_t p = pos[i];
        if (p >= lo && p < hi) {
            const int64_t r = lrows[p - lo];
            if (r < 0 || r >= local_limit) {
                PyErr_Format(PyExc_IndexError, "local combine row %lld out of range [0, %lld)", (long long)r,
                             (long long)local_limit);
                PyMem_Free(addr);
                return -1;
            }
            addr[i] = (int64_t)local_p + r * local_stride;
            step[i] = BF16_PER_BLOCK * 2;
        } else {
            if (p < 0 || p >= nrows) {
                PyErr_Format(PyExc_IndexError, "combine slot %lld out of range [0, %lld)", (long long)p,
                             (long long)nrows);
                PyMem_Free(addr);
                return -1;
            }
            addr[i] = (int64_t)rows_p + p * row_bytes + payload_off;
            step[i] = BLOCK_BYTES;
        }
    }
    c->T = T;
    c->K = K;
    c->H = H;
    c->addr = addr;
    c->w = (const float *)(uintptr_t)w_p;
    c->out = (uint16_t *)(uintptr_t)out_p;
    return 0;
}

static PyObject *weighted_combine_bf16(PyObject *self, PyObject *args) {
    weighted_t c;
    if (weighted_parse(args, &c) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    weighted_sum(c.T, c.K, c.H, c.addr, c.addr + c.T * c.K, c.w, c.out);
    Py_END_ALLOW_THREADS
    PyMem_Free(c.addr);
    Py_RETURN_NONE;
}

/* ll_combine_receive(ctrl, rows, weighted, spin_ns) -> 0, 1, 2 or 3
 *
 * A low-latency combine's receive in one call, for TFF rows (Buffer.low_latency_combine with the C stores):
 * polling for up to spin_ns in all (the CPU yielded between polls), every source's control message as
 * exchange_reorder expects it (``ctrl``); then, once the runs of slots the hosts write carry the call's flag in
 * every block, the weighted sum weighted_combine_bf16(*weighted) makes. rows = (base, nb, flag, runs): the
 * slots at base, nb blocks each, and (first slot, slots) of every run to wait for. 0: summed; 1: a message not
 * as expected; 2: rows missing; 3: a message missing: then out is not written and the caller receives the call
 * the general way. */
static PyObject *ll_combine_receive(PyObject *self, PyObject *args) {
    PyObject *ctrl_args, *runs, *wargs;
    unsigned long long base_p;
    Py_ssize_t nb;
    long long flag, spin_ns;
    expect_t e;
    weighted_t c;
    if (!PyArg_ParseTuple(args, "O!(KnLO!)O!L", &PyTuple_Type, &ctrl_args, &base_p, &nb, &flag, &PyTuple_Type, &runs,
                          &PyTuple_Type, &wargs, &spin_ns))
        return NULL;
    if (expect_parse(ctrl_args, &e) < 0) return NULL;
    const Py_ssize_t nr = PyTuple_GET_SIZE(runs);
    if (nr > MAX_DESTS || nb < 1 || nb > MAX_ROW_BLOCKS) {
        PyErr_SetString(PyExc_ValueError, "ll_combine_receive: bad runs or row size");
        return NULL;
    }
    uint64_t run[MAX_DESTS][3];      /* (address, slots) of every run, as runs_wait takes them */
    for (Py_ssize_t i = 0; i < nr; i++) {
        Py_ssize_t first, n;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(runs, i), "nn", &first, &n)) return NULL;
        if (first < 0 || n < 0) {
            PyErr_SetString(PyExc_ValueError, "ll_combine_receive: a run of negative slots");
            return NULL;
        }
        run[i][0] = (uint64_t)base_p + (uint64_t)first * (uint64_t)nb * BLOCK_BYTES;
        run[i][1] = (uint64_t)n;
    }
    if (weighted_parse(wargs, &c) < 0) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    const int64_t t0 = now_ns();
    status = expect_wait(&e, flag, t0, spin_ns);
    if (status == 0) status = runs_wait((const uint64_t(*)[3])run, nr, nb, flag, t0, spin_ns);
    if (status == 0) weighted_sum(c.T, c.K, c.H, c.addr, c.addr + c.T * c.K, c.w, c.out);
    Py_END_ALLOW_THREADS
    PyMem_Free(c.addr);
    return PyLong_FromLong(status);
}

/* ---------------------------------------------------------------- fp8 e4m3 quantization
 * float32 -> float8_e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; largest finite 448, 0x7f
 * NaN), saturating at +-448 and rounding to nearest even. Normal results (|f| >= 2^-6) keep the float's top
 * 3 mantissa bits after adding half a unit of the last kept place, less one when that place is even (ties
 * to even), with the exponent rebiased from 127 to 7. Smaller values are multiples of 2^-9: adding 2^14,
 * whose unit in the last place is 2^-9, makes the float adder round them to that grid with ties to even,
 * and the low bits then hold the multiple. Every NaN becomes 0x7f, whatever its sign (torch's operators do
 * not settle it): its magnitude is replaced by 480's, whose bits the normal path turns into 0x7f, and its
 * sign dropped. Branch-free (masks and a minimum, no conditional jumps), so the loops around it vectorize. */
static inline uint8_t f32_to_e4m3(float f) {
    int32_t u;
    memcpy(&u, &f, 4);
    const int32_t a = u & 0x7fffffff;
    const int32_t nan = -(int32_t)(a > 0x7f800000);
    const int32_t sat = a < 0x43e00000 ? a : 0x43e00000;                /* 0x43e00000: 448 */
    const int32_t c = (sat & ~nan) | (0x43f00000 & nan);                /* 0x43f00000: 480 */
    const int32_t normal = (c + 0x7ffff + ((c >> 20) & 1) - (120 << 23)) >> 20;
    float cf;
    memcpy(&cf, &c, 4);
    const float r = cf + 16384.0f;
    int32_t rb;
    memcpy(&rb, &r, 4);
    const int32_t tiny = -(int32_t)(c < (121 << 23));                   /* below 2^-6 */
    return (uint8_t)(((rb - 0x46800000) & tiny) | (normal & ~tiny) | ((u >> 24) & 0x80 & ~nan));
}

/* exact 2^ceil(log2(s)) of a positive float from its bits (DeepEP's power-of-two scales); a non-finite s
 * gives +inf */
static inline float ceil_pow2(float s) {
    uint32_t u;
    memcpy(&u, &s, 4);
    int32_t e = (int32_t)((u >> 23) & 0xffu) - 127 + ((u & 0x7fffffu) != 0);
    if (e > 128) e = 128;
    const uint32_t b = (uint32_t)(e + 127) << 23;
    float r;
    memcpy(&r, &b, 4);
    return r;
}

/* fp8_cast(src, rows, H, src_kind, q_out, scale_out, mode)
 *
 * Per-128-channel e4m3 quantization of contiguous rows [rows, H] (H a multiple of 128; src_kind 0: bf16,
 * 1: float32) into q_out (uint8 [rows, H]) and scale_out (float32 [rows, H/128]). Per group: amax = the
 * largest magnitude, at least 1e-4 (NaN if the group has one); mode bit 0 = power-of-two scales, bit 1 =
 * the rounding of DeepEP's test helper instead of its kernel:
 *   kernel: scale = amax * float(1/448), values times 448/amax (rounded: scale = 2^ceil(log2(scale)),
 *           values times 1/scale);
 *   helper: scale = amax / 448, values times (1/amax) * 448 (rounded: scale = 2^ceil(log2(amax/448))).
 * Then saturated at +-448 and rounded to e4m3: each step one float32 operation, the same ones and in the
 * same order as ubep_torch/fp8.py's torch code, so the bits agree with it. */
/* the groups of fp8_cast; compiled for AVX-512, AVX2 and the baseline ISA like the sums (HOT) */
HOT static void cast_groups(const void *src, Py_ssize_t groups, int kind, int rounded, int helper, uint8_t *q,
                            float *scales) {
    const uint16_t *src16 = (const uint16_t *)src;
    const float *src32 = (const float *)src;
    const float inv448 = (float)(1.0 / 448.0);
    float v[128];
    for (Py_ssize_t g = 0; g < groups; g++) {
        /* amax from the magnitudes' bits: for non-negative floats the integer order is the float order,
         * with NaN above infinity */
        uint32_t mbits;
        if (kind == 0) {
            const uint16_t *in = src16 + g * 128;
            int16_t m = 0;
            for (int j = 0; j < 128; j++) {
                const int16_t a = (int16_t)(in[j] & 0x7fff);
                m = a > m ? a : m;
            }
            for (int j = 0; j < 128; j++) v[j] = bf16_to_f32(in[j]);
            mbits = (uint32_t)(uint16_t)m << 16;
        } else {
            memcpy(v, src32 + g * 128, sizeof v);
            int32_t m = 0;
            for (int j = 0; j < 128; j++) {
                int32_t a;
                memcpy(&a, &v[j], 4);
                a &= 0x7fffffff;
                m = a > m ? a : m;
            }
            mbits = (uint32_t)m;
        }
        float amax;
        memcpy(&amax, &mbits, 4);
        if (mbits > 0x7f800000u) amax = __builtin_nanf("");        /* (one NaN, as torch's amax gives) */
        else if (amax < 1e-4f) amax = 1e-4f;
        float scale = helper ? amax / 448.0f : amax * inv448, mult;
        if (rounded) {
            scale = ceil_pow2(scale);
            mult = 1.0f / scale;
        } else {
            mult = helper ? (1.0f / amax) * 448.0f : 448.0f / amax;
        }
        scales[g] = scale;
        uint8_t *o = q + g * 128;
        for (int j = 0; j < 128; j++) o[j] = f32_to_e4m3(v[j] * mult);
    }
}

static PyObject *fp8_cast(PyObject *self, PyObject *args) {
    unsigned long long src_p, q_p, s_p;
    Py_ssize_t rows, H;
    int kind, mode;
    if (!PyArg_ParseTuple(args, "KnniKKi", &src_p, &rows, &H, &kind, &q_p, &s_p, &mode)) return NULL;
    if (H <= 0 || H % 128 || rows < 0 || (kind != 0 && kind != 1) || mode < 0 || mode > 3) {
        PyErr_SetString(PyExc_ValueError, "fp8_cast: H must be a positive multiple of 128, kind 0 or 1, mode 0..3");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    cast_groups((const void *)(uintptr_t)src_p, rows * (H / 128), kind, mode & 1, (mode >> 1) & 1,
                (uint8_t *)(uintptr_t)q_p, (float *)(uintptr_t)s_p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* e4m3 byte -> float32, every value exact (the NaN entries, 0x7f and 0xff, hold a NaN) */
static float e4m3_value[256];

static void fill_e4m3_values(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? (float)m / 512.0f : (1.0f + (float)m / 8.0f) * (float)(1 << e) / 128.0f;
        if (e == 15 && m == 7) v = __builtin_nanf("");
        e4m3_value[b] = (b & 0x80) ? -v : v;
    }
}

/* the groups of fp8_dequant (HOT: see cast_groups) */
HOT static void dequant_groups(const uint8_t *src, Py_ssize_t groups, const float *scales, uint16_t *out) {
    for (Py_ssize_t g = 0; g < groups; g++) {
        const float sc = scales[g];
        const uint8_t *in = src + g * 128;
        uint16_t *o = out + g * 128;
        for (int j = 0; j < 128; j++) o[j] = f32_to_bf16(e4m3_value[in[j]] * sc);
    }
}

/* fp8_dequant(src, groups, scales, out)
 *
 * out (bf16) = float32(e4m3 value) * scale of its group, rounded to bf16 as torch does (f32_to_bf16), for
 * ``groups`` runs of 128 contiguous bytes of src, one float32 scale each. */
static PyObject *fp8_dequant(PyObject *self, PyObject *args) {
    unsigned long long src_p, s_p, out_p;
    Py_ssize_t groups;
    if (!PyArg_ParseTuple(args, "KnKK", &src_p, &groups, &s_p, &out_p)) return NULL;
    if (groups < 0) {
        PyErr_SetString(PyExc_ValueError, "fp8_dequant: negative group count");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    dequant_groups((const uint8_t *)(uintptr_t)src_p, groups, (const float *)(uintptr_t)s_p,
                   (uint16_t *)(uintptr_t)out_p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"write_rows", write_rows, METH_VARARGS, "TFF token-group stores into a peer's slots"},
    {"write_ctrl", write_ctrl, METH_VARARGS, "count-group store of one control message"},
    {"read_ctrl", read_ctrl, METH_VARARGS, "payload words of an arrived control message"},
    {"store_policy", store_policy, METH_VARARGS, "how rows reach a peer's slots: read or set (auto, plain, streaming)"},
    {"store_read", py_store_read, METH_VARARGS, "count the receive side of a normal call for the store policy"},
    {"store_peer_reads", store_peer_reads, METH_VARARGS, "what the peers report reading this rank's rows costs"},
    {"send_exchange", send_exchange, METH_VARARGS, "TFF send phase: every destination's counts, then rows"},
    {"exchange_reorder", exchange_reorder, METH_VARARGS, "a normal dispatch's exchange expected to repeat the last"},
    {"poll_ctrl", poll_ctrl, METH_VARARGS, "arrived control messages of every missing source"},
    {"arrived", arrived, METH_VARARGS, "whether every block of the rows carries the flag"},
    {"arrived_rows", arrived_rows, METH_VARARGS, "end of the run of complete rows from a start row"},
    {"unpack", unpack, METH_VARARGS, "copy arrived rows' payload, meta items and source tokens out"},
    {"reorder_sources", reorder_sources, METH_VARARGS, "one poll of streaming Token-Reordering of several sources"},
    {"copy_rows", copy_rows, METH_VARARGS, "row gather-scatter between plain tensors"},
    {"pair_order", pair_order, METH_VARARGS, "low-latency (token, slot) pairs sorted by expert"},
    {"routing_layout", routing_layout, METH_VARARGS, "normal-mode layout of a routing: counts, ranks, send lists"},
    {"meta_items", meta_items, METH_VARARGS, "normal dispatch's meta items: expert ids and weight bits"},
    {"local_topk", local_topk, METH_VARARGS, "received global expert ids and weights to this rank's"},
    {"segment_rows", segment_rows, METH_VARARGS, "row indices of segments laid end to end"},
    {"layout_rows", layout_rows, METH_VARARGS, "rows of low-latency combine's x that go back to each source"},
    {"ll_calcumsum", ll_calcumsum, METH_VARARGS, "low-latency CalCumSum from the arrived control messages"},
    {"ll_dispatch_receive", ll_dispatch_receive, METH_VARARGS, "a low-latency dispatch's receive in one call"},
    {"token_rows", token_rows, METH_VARARGS, "rows and meta items of one-row-per-token low-latency dispatch"},
    {"unpack_items", unpack_items, METH_VARARGS, "low-latency Token-Reordering of one-row-per-token rows"},
    {"combine_rows_bf16", combine_rows_bf16, METH_VARARGS, "bf16 normal combine of any number of sources"},
    {"exchange_combine", exchange_combine, METH_VARARGS, "a normal combine's exchange expected to repeat the last"},
    {"weighted_combine_bf16", weighted_combine_bf16, METH_VARARGS, "bf16 low-latency weighted combine"},
    {"ll_combine_receive", ll_combine_receive, METH_VARARGS, "a low-latency combine's receive in one call"},
    {"fp8_cast", fp8_cast, METH_VARARGS, "per-128-channel e4m3 quantization of bf16 or float32 rows"},
    {"fp8_dequant", fp8_dequant, METH_VARARGS, "e4m3 rows times their per-128-channel scales, to bf16"},
    {"use_pair_sums", use_pair_sums, METH_VARARGS, "sum bf16 rows two elements a word (True) or one by one (False)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_native", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    fill_e4m3_values();
    stores_reset(POLICY_AUTO);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "BLOCK_BYTES", BLOCK_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "FLAG_BYTES", FLAG_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
