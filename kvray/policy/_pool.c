/* The reuse policy's candidate pool and its feature rows in C (a scoring's inputs): one pass over a tier's pages instead of a mask,
 * three partial sorts and a deduplication in numpy (docs/sim-eval/README.md, "Replay speed").
 *
 * A transcription of the Python gathering in kvray/policy/reuse_pool.py (gather_python and
 * first), which stays the reference (tests/policy/test_reuse_pool.py compares them on
 * random columns with ties): of the unpinned pages of the tier, the `lru` of lowest recency,
 * the `lfu` of lowest frequency key and the `fifo` never read of lowest recency, each
 * ordering's picks by (key, handle) ascending, concatenated in that order and deduplicated
 * (a page's first offer wins), with which orderings offered each page.
 *
 * pool(tier, lru, lfu, fifo, where, pins, recency, frequency, hits) -> (handles, bits)
 *   where int8, pins int32, recency int64, frequency and hits float64, by handle (the first
 *   min(len(where), len(pins)) handles are the cache's); handles: bytes of int64, bits: bytes
 *   of uint8 (bit i: ordering i offered the page).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    double key;
    int64_t handle;
} Entry;

typedef struct {
    int64_t handle;
    Py_ssize_t place;
} Slot;

static int worse(const Entry *a, const Entry *b) { /* a leaves before b: larger key, then larger handle */
    return a->key > b->key || (a->key == b->key && a->handle > b->handle);
}

/* A bounded max-heap of the `cap` best (smallest) entries seen. */
static inline void offer(Entry *heap, Py_ssize_t *size, Py_ssize_t cap, Entry e) {
    Py_ssize_t i;
    if (*size < cap) {
        i = (*size)++;
        while (i > 0) {
            Py_ssize_t up = (i - 1) / 2;
            if (!worse(&e, &heap[up])) break;
            heap[i] = heap[up];
            i = up;
        }
        heap[i] = e;
        return;
    }
    if (cap == 0 || !worse(&heap[0], &e)) return;
    i = 0;
    for (;;) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
        const Entry *top = &e;
        if (l < cap && worse(&heap[l], top)) m = l, top = &heap[l];
        if (r < cap && worse(&heap[r], top)) m = r;
        if (m == i) break;
        heap[i] = heap[m];
        i = m;
    }
    heap[i] = e;
}

/* Sort a full or partial heap of `size` entries ascending in place: pop the worst to the end,
 * size times (a heap sort; no allocation, unlike qsort). */
static void drain(Entry *heap, Py_ssize_t size) {
    for (Py_ssize_t end = size - 1; end > 0; end--) {
        Entry e = heap[end];
        heap[end] = heap[0];
        Py_ssize_t i = 0;
        for (;;) {
            Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
            const Entry *top = &e;
            if (l < end && worse(&heap[l], top)) m = l, top = &heap[l];
            if (r < end && worse(&heap[r], top)) m = r;
            if (m == i) break;
            heap[i] = heap[m];
            i = m;
        }
        heap[i] = e;
    }
}

static int column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "pool: column %s has items of %zd bytes, expected %zd", name, view->itemsize, itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The pool of `tier` (see the top of this file) into *out (handles) and *bits (which orderings
 * offered each), both PyMem_Malloc'ed; its size, or -1 with an exception set. */
static Py_ssize_t gather(int tier, const Py_ssize_t cap[3], Py_buffer cols[5], int64_t **out_p, uint8_t **bits_p) {
    Entry *heaps[3] = {NULL, NULL, NULL};
    int64_t *out = NULL;
    uint8_t *bits = NULL;
    Slot *table = NULL;
    Py_ssize_t k = -1;
    const int8_t *where = cols[0].buf;
    const int32_t *pins = cols[1].buf;
    const int64_t *recency = cols[2].buf;
    const double *frequency = cols[3].buf, *hits = cols[4].buf;
    Py_ssize_t n = cols[0].len < cols[1].len / 4 ? cols[0].len : cols[1].len / 4;
    Py_ssize_t nrec = cols[2].len / 8, nfreq = cols[3].len / 8, nhits = cols[4].len / 8;
    Py_ssize_t size[3] = {0, 0, 0}, total = cap[0] + cap[1] + cap[2];
    if (cap[0] < 0 || cap[1] < 0 || cap[2] < 0) {
        PyErr_SetString(PyExc_ValueError, "pool: negative pool size");
        return -1;
    }
    for (int o = 0; o < 3; o++)
        if ((heaps[o] = PyMem_Malloc((cap[o] ? cap[o] : 1) * sizeof(Entry))) == NULL) { PyErr_NoMemory(); goto done; }
    Py_ssize_t keyed = nrec < nfreq ? nrec : nfreq; /* handles every ordering's column covers */
    if (nhits < keyed) keyed = nhits;
    for (Py_ssize_t h = keyed; h < n; h++) /* a page of the tier beyond them */
        if (where[h] == tier && pins[h] == 0) { PyErr_SetString(PyExc_IndexError, "pool: a column shorter than the cache"); goto done; }
    if (n > keyed) n = keyed;
    /* Handles ascend, so a key equal to a full heap's worst is worse (a larger handle): only a
     * smaller key enters, which each heap's top (its worst) tells without the call. */
    for (Py_ssize_t h = 0; h < n; h++) {
        if (where[h] != tier || pins[h] != 0) continue;
        double r = (double)recency[h];
        if (cap[0] && (size[0] < cap[0] || r < heaps[0][0].key)) offer(heaps[0], &size[0], cap[0], (Entry){r, h});
        if (cap[1] && (size[1] < cap[1] || frequency[h] < heaps[1][0].key)) offer(heaps[1], &size[1], cap[1], (Entry){frequency[h], h});
        if (cap[2] && hits[h] == 0.0 && (size[2] < cap[2] || r < heaps[2][0].key)) offer(heaps[2], &size[2], cap[2], (Entry){r, h});
    }
    /* the picks deduplicated through a small open-addressing table (handle -> place in out) */
    Py_ssize_t slots = 16;
    while (slots < 2 * total) slots <<= 1;
    if ((out = PyMem_Malloc((total ? total : 1) * sizeof(int64_t))) == NULL ||
        (bits = PyMem_Malloc(total ? total : 1)) == NULL || (table = PyMem_Malloc(slots * sizeof(Slot))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < slots; i++) table[i].handle = -1; /* handles are never negative */
    k = 0;
    for (int o = 0; o < 3; o++) {
        drain(heaps[o], size[o]);
        for (Py_ssize_t i = 0; i < size[o]; i++) {
            int64_t h = heaps[o][i].handle;
            Py_ssize_t at = (Py_ssize_t)(((uint64_t)h * 0x9E3779B97F4A7C15ull) >> 40) & (slots - 1);
            while (table[at].handle != -1 && table[at].handle != h) at = (at + 1) & (slots - 1);
            if (table[at].handle == -1) table[at].handle = h, table[at].place = k, out[k] = h, bits[k++] = 0;
            bits[table[at].place] |= (uint8_t)(1u << o);
        }
    }
    *out_p = out, *bits_p = bits;
    out = NULL, bits = NULL;
done:
    for (int o = 0; o < 3; o++) PyMem_Free(heaps[o]);
    PyMem_Free(out);
    PyMem_Free(bits);
    PyMem_Free(table);
    return k;
}

static const char *POOL_NAMES[5] = {"where", "pins", "recency", "frequency", "hits"};
static const Py_ssize_t POOL_SIZES[5] = {1, 4, 8, 8, 8};

static PyObject *pool(PyObject *module, PyObject *args) {
    (void)module;
    int tier;
    Py_ssize_t cap[3];
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "innnOOOOO", &tier, &cap[0], &cap[1], &cap[2], &objs[0], &objs[1], &objs[2], &objs[3], &objs[4]))
        return NULL;
    Py_buffer cols[5];
    int got = 0;
    PyObject *result = NULL;
    int64_t *out = NULL;
    uint8_t *bits = NULL;
    for (; got < 5; got++)
        if (column(objs[got], &cols[got], POOL_SIZES[got], POOL_NAMES[got]) < 0) goto done;
    Py_ssize_t k = gather(tier, cap, cols, &out, &bits);
    if (k >= 0) result = Py_BuildValue("(y#y#)", (const char *)out, k * (Py_ssize_t)sizeof(int64_t), (const char *)bits, k);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    PyMem_Free(out);
    PyMem_Free(bits);
    return result;
}

/* -- the candidates' feature rows: PageFeatures.matrix (kvray/policy/page_features.py) --------
 *
 * rows(handles, leaf, tier, now, now_ms, decay, root_k, inserted, last, last_ms, gap1, gap2,
 *      counts, hits, depth, request_pages, root, ghost_age) -> bytearray of float32 (n x NFEATURES)
 *   handles int64, leaf bool, decay float64[NCOUNTS], counts float64 (pages x NCOUNTS), root
 *   int64, the other columns float64, by handle. Each value is computed in float64 with the
 *   same operations in the same order as numpy's, then rounded to float32; libm's exp and
 *   log1p may differ from numpy's vectorised ones in the last bit of the float64, which the
 *   rounding hides but for about one value in 10^8 (tests/policy/test_reuse_pool.py). */
#include <math.h>
#define NCOUNTS 3
#define NFEATURES 17

#define NSOURCES 3 /* SOURCES: which orderings offered a candidate, after the features when more than LRU offers */

/* PageFeatures' columns (F_DECAY .. F_GHOST in the argument order of rows and scored). */
enum { F_DECAY, F_INSERTED, F_LAST, F_LAST_MS, F_GAP1, F_GAP2, F_COUNTS, F_HITS, F_DEPTH, F_PAGES, F_ROOT, F_GHOST, NF };
static const char *F_NAMES[NF] = {"decay", "inserted", "last", "last_ms", "gap1", "gap2",
                                  "counts", "hits", "depth", "request_pages", "root", "ghost_age"};

typedef struct {
    Py_buffer cols[NF];
    int got;
    Py_ssize_t pages; /* handles every column covers */
    double now, now_ms;
    int root_k;
} Features;

static void release_features(Features *f) {
    for (int i = 0; i < f->got; i++) PyBuffer_Release(&f->cols[i]);
    f->got = 0;
}

static int load_features(Features *f, PyObject *const *objs) {
    for (f->got = 0; f->got < NF; f->got++)
        if (column(objs[f->got], &f->cols[f->got], 8, F_NAMES[f->got]) < 0) return -1;
    f->pages = f->cols[F_INSERTED].len / 8;
    for (int c = F_LAST; c < NF; c++) {
        Py_ssize_t len = f->cols[c].len / 8 / (c == F_COUNTS ? NCOUNTS : 1);
        if (len < f->pages) f->pages = len;
    }
    if (f->cols[F_DECAY].len / 8 < NCOUNTS || f->root_k < 0 || f->root_k >= NCOUNTS) {
        PyErr_SetString(PyExc_ValueError, "rows: decay or root_k out of range");
        return -1;
    }
    return 0;
}

#define COL(f, c) ((const double *)(f)->cols[c].buf)

/* The feature row of page h (the i-th of n candidates) in `row`; -1 with an exception set when
 * h or its root lies beyond the columns. */
static int write_row(const Features *f, float *row, int64_t h, int leaf, int tier, Py_ssize_t i, Py_ssize_t n) {
    const int64_t *root = f->cols[F_ROOT].buf;
    int64_t r = h >= 0 && h < f->pages ? root[h] : -1;
    if (h < 0 || h >= f->pages || r < 0 || r >= f->pages) {
        PyErr_SetString(PyExc_IndexError, "rows: a handle or its root beyond the columns");
        return -1;
    }
    const double *decay = COL(f, F_DECAY), *last = COL(f, F_LAST), *counts = COL(f, F_COUNTS);
    const double *depth = COL(f, F_DEPTH), *request_pages = COL(f, F_PAGES);
    double now = f->now, since = now - last[h];
    row[0] = (float)log1p(now - COL(f, F_INSERTED)[h]);
    row[1] = (float)log1p(since);
    row[2] = (float)log1p(COL(f, F_GAP1)[h]);
    row[3] = (float)log1p(COL(f, F_GAP2)[h]);
    double ms = f->now_ms - COL(f, F_LAST_MS)[h];
    row[4] = (float)log1p((ms > 0.0 ? ms : 0.0) / 1e3);
    for (int k = 0; k < NCOUNTS; k++) row[5 + k] = (float)log1p(counts[h * NCOUNTS + k] * exp(-(since * decay[k])));
    row[8] = (float)log1p(COL(f, F_HITS)[h]);
    row[9] = (float)log1p(depth[h]);
    row[10] = (float)(depth[h] / request_pages[h]);
    row[11] = leaf ? 1.0f : 0.0f;
    row[12] = (float)log1p(counts[r * NCOUNTS + f->root_k] * exp(-(now - last[r]) * decay[f->root_k]));
    row[13] = (float)log1p(COL(f, F_GHOST)[h]);
    row[14] = (float)log1p(request_pages[h]);
    row[15] = (float)tier;
    row[16] = (float)((double)i / (n > 1 ? (double)(n - 1) : 1.0));
    return 0;
}

static PyObject *rows(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *handles_obj, *leaf_obj, *objs[NF];
    Features f = {.got = 0};
    int tier;
    if (!PyArg_ParseTuple(args, "OOiddOiOOOOOOOOOOO", &handles_obj, &leaf_obj, &tier, &f.now, &f.now_ms, &objs[F_DECAY],
                          &f.root_k, &objs[F_INSERTED], &objs[F_LAST], &objs[F_LAST_MS], &objs[F_GAP1], &objs[F_GAP2],
                          &objs[F_COUNTS], &objs[F_HITS], &objs[F_DEPTH], &objs[F_PAGES], &objs[F_ROOT], &objs[F_GHOST]))
        return NULL;
    Py_buffer hb, lb;
    PyObject *result = NULL;
    if (column(handles_obj, &hb, 8, "handles") < 0) return NULL;
    if (column(leaf_obj, &lb, 1, "leaf") < 0) { PyBuffer_Release(&hb); return NULL; }
    Py_ssize_t n = hb.len / 8;
    if (load_features(&f, objs) < 0) goto done;
    if (lb.len < n) { PyErr_SetString(PyExc_ValueError, "rows: leaf shorter than handles"); goto done; }
    if ((result = PyByteArray_FromStringAndSize(NULL, n * NFEATURES * (Py_ssize_t)sizeof(float))) == NULL) goto done;
    float *out = (float *)PyByteArray_AS_STRING(result);
    const int64_t *handles = hb.buf;
    const char *leaf = lb.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (write_row(&f, out + i * NFEATURES, handles[i], leaf[i], tier, i, n) < 0) { Py_CLEAR(result); goto done; }
done:
    release_features(&f);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&lb);
    return result;
}

/* -- a scoring's inputs in one call: the pool and its rows --------------------------------------
 *
 * scored(tier, lru, lfu, fifo, where, pins, recency, frequency, first_child, now, now_ms, decay,
 *        root_k, <PageFeatures' columns as rows takes them>) -> (handles, rows)
 *   what ReusePolicy._gather and PageFeatures.matrix give, with the orderings' columns after
 *   the features when lfu or fifo offer (np.hstack's): the pool of pool() (hits: PageFeatures'
 *   hits), each candidate a leaf when first_child (int32, the index's) is -1, its row written
 *   by write_row, as rows() writes it. handles: bytes of int64; rows: bytearray of float32
 *   (n x (NFEATURES [+ NSOURCES])). */
static PyObject *scored(PyObject *module, PyObject *args) {
    (void)module;
    int tier;
    Py_ssize_t cap[3];
    PyObject *pool_objs[5], *first_obj, *objs[NF];
    Features f = {.got = 0};
    if (!PyArg_ParseTuple(args, "innnOOOOOddOiOOOOOOOOOOO", &tier, &cap[0], &cap[1], &cap[2], &pool_objs[0], &pool_objs[1],
                          &pool_objs[2], &pool_objs[3], &first_obj, &f.now, &f.now_ms, &objs[F_DECAY], &f.root_k,
                          &objs[F_INSERTED], &objs[F_LAST], &objs[F_LAST_MS], &objs[F_GAP1], &objs[F_GAP2], &objs[F_COUNTS],
                          &objs[F_HITS], &objs[F_DEPTH], &objs[F_PAGES], &objs[F_ROOT], &objs[F_GHOST]))
        return NULL;
    pool_objs[4] = objs[F_HITS];
    Py_buffer cols[5], fb;
    int got = 0, have_first = 0;
    PyObject *handles = NULL, *table = NULL, *result = NULL;
    int64_t *out = NULL;
    uint8_t *bits = NULL;
    for (; got < 5; got++)
        if (column(pool_objs[got], &cols[got], POOL_SIZES[got], POOL_NAMES[got]) < 0) goto done;
    if (column(first_obj, &fb, 4, "first_child") < 0) goto done;
    have_first = 1;
    if (load_features(&f, objs) < 0) goto done;
    Py_ssize_t k = gather(tier, cap, cols, &out, &bits);
    if (k < 0) goto done;
    int sources = cap[1] || cap[2];
    Py_ssize_t width = NFEATURES + (sources ? NSOURCES : 0), nfirst = fb.len / 4;
    const int32_t *first = fb.buf;
    if ((table = PyByteArray_FromStringAndSize(NULL, k * width * (Py_ssize_t)sizeof(float))) == NULL) goto done;
    float *row = (float *)PyByteArray_AS_STRING(table);
    for (Py_ssize_t i = 0; i < k; i++, row += width) {
        if (out[i] >= nfirst) { PyErr_SetString(PyExc_IndexError, "scored: first_child shorter than the cache"); goto done; }
        if (write_row(&f, row, out[i], first[out[i]] == -1, tier, i, k) < 0) goto done;
        for (int o = 0; sources && o < NSOURCES; o++) row[NFEATURES + o] = (float)((bits[i] >> o) & 1);
    }
    if ((handles = PyBytes_FromStringAndSize((const char *)out, k * (Py_ssize_t)sizeof(int64_t))) != NULL)
        result = PyTuple_Pack(2, handles, table);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    if (have_first) PyBuffer_Release(&fb);
    release_features(&f);
    Py_XDECREF(handles);
    Py_XDECREF(table);
    PyMem_Free(out);
    PyMem_Free(bits);
    return result;
}

/* -- a scoring's ranking: np.lexsort((-depth[handles], -score)) -----------------------------------
 *
 * ranking(score, handles, depth) -> (ranked, order)
 *   score float32 and handles int64 (n each), depth int32 by handle (the index's); order: bytes
 *   of int64, the candidates' positions by score descending, then depth descending, then position
 *   (lexsort is stable); ranked: the handles in that order, a list. */
typedef struct {
    float score;
    int32_t depth;
    Py_ssize_t at;
} Ranked;

static int leaves_first(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->depth != y->depth) return x->depth > y->depth ? -1 : 1;
    return x->at < y->at ? -1 : x->at > y->at;
}

static PyObject *ranking(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO", &objs[0], &objs[1], &objs[2])) return NULL;
    static const char *names[3] = {"score", "handles", "depth"};
    static const Py_ssize_t sizes[3] = {4, 8, 4};
    Py_buffer cols[3];
    int got = 0;
    PyObject *ranked = NULL, *order = NULL, *result = NULL;
    Ranked *items = NULL;
    for (; got < 3; got++)
        if (column(objs[got], &cols[got], sizes[got], names[got]) < 0) goto done;
    Py_ssize_t n = cols[0].len / 4, ndepth = cols[2].len / 4;
    const float *score = cols[0].buf;
    const int64_t *handles = cols[1].buf;
    const int32_t *depth = cols[2].buf;
    if (cols[1].len / 8 != n) { PyErr_SetString(PyExc_ValueError, "ranking: as many scores as handles"); goto done; }
    if ((items = PyMem_Malloc((n ? n : 1) * sizeof(Ranked))) == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (handles[i] < 0 || handles[i] >= ndepth) { PyErr_SetString(PyExc_IndexError, "ranking: a handle beyond depth"); goto done; }
        if (score[i] != score[i]) { PyErr_SetString(PyExc_ValueError, "ranking: a NaN score"); goto done; }
        items[i] = (Ranked){score[i], depth[handles[i]], i};
    }
    qsort(items, n, sizeof(Ranked), leaves_first);
    if ((ranked = PyList_New(n)) == NULL || (order = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t))) == NULL) goto done;
    int64_t *at = (int64_t *)PyBytes_AS_STRING(order);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyLong_FromLongLong(handles[items[i].at]);
        if (h == NULL) goto done;
        PyList_SET_ITEM(ranked, i, h);
        at[i] = items[i].at;
    }
    result = PyTuple_Pack(2, ranked, order);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    PyMem_Free(items);
    Py_XDECREF(ranked);
    Py_XDECREF(order);
    return result;
}

/* -- the reuse model's forward pass: ReuseModel.predict (kvray/policy/reuse_model.py) -----------
 *
 * forward(rows, mean, scale, w1, b1, w2, b2, portable=False) -> bytes of float32 (one score per row)
 *   rows float32 (n x F), mean and scale float32 (F), w1 float32 (F x H), b1 and w2 float32 (H),
 *   b2 float32 (1). Each row standardised as numpy does it ((x - mean) / scale, in float32),
 *   its hidden units as fused multiply-adds over the features in order from 0 (what OpenBLAS's
 *   small sgemm kernels do on this repository's machines), plus b1, ReLU, and the output as
 *   fused multiply-adds over the hidden units in order, plus b2. numpy's product of the hidden
 *   layer and w2 is a BLAS gemv whose sums run in another, CPU-dependent order, so a score can
 *   differ from predict's in its last bits (tests/policy/test_reuse_pool.py bounds it, and checks
 *   that a replay's decisions are the same). Compiled with -ffp-contract=off (setup.py): the
 *   compiler fuses nothing else. Where the CPU has AVX and FMA, in AVX (forward_fma), else (or
 *   with `portable`) row by row in libm's fmaf: the same scores, bit for bit. */
#define MAX_WIDTH 256 /* features or hidden units of a row */
#define BLOCK_ROWS 4 /* rows scored together in AVX: independent sums for the CPU to overlap */
#define BLOCK_UNITS 8 /* hidden units summed together (one AVX vector) */

typedef struct {
    Py_ssize_t F, H;
    const float *mean, *scale, *w1, *b1, *w2;
    float b2;
} Model;

/* The scores of n rows into out, one row at a time (forward_fma below: the same operations, in AVX). */
static inline __attribute__((always_inline)) void forward_rows(const Model *m, const float *rows, Py_ssize_t n, float *out) {
    float x[MAX_WIDTH], hidden[MAX_WIDTH];
    Py_ssize_t F = m->F, H = m->H;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float *row = rows + i * F;
        for (Py_ssize_t f = 0; f < F; f++) x[f] = (row[f] - m->mean[f]) / m->scale[f];
        for (Py_ssize_t j = 0; j < H; j++) hidden[j] = 0.0f;
        for (Py_ssize_t f = 0; f < F; f++) /* by feature: each unit's sum still in feature order */
            for (Py_ssize_t j = 0; j < H; j++) hidden[j] = fmaf(x[f], m->w1[f * H + j], hidden[j]);
        float score = 0.0f;
        for (Py_ssize_t j = 0; j < H; j++) {
            float v = hidden[j] + m->b1[j];
            score = fmaf(v > 0.0f || v != v ? v : 0.0f, m->w2[j], score); /* np.maximum(v, 0): NaN stays */
        }
        out[i] = score + m->b2;
    }
}

/* libm's fmaf is exact wherever it runs (in software without the instruction): the same scores, slower */
static void forward_any(const Model *m, const float *rows, Py_ssize_t n, float *out) { forward_rows(m, rows, n, out); }
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FORWARD_DISPATCH 1
#include <immintrin.h>
/* forward_rows in AVX: eight hidden units of four rows per step, each lane the same fused
 * multiply-add (vfmadd's lanes round as fmaf does) in the same feature order. */
__attribute__((target("avx,fma"))) static void forward_fma(const Model *m, const float *rows, Py_ssize_t n, float *out) {
    Py_ssize_t F = m->F, H = m->H;
    if (H % BLOCK_UNITS != 0) {
        forward_rows(m, rows, n, out);
        return;
    }
    float x[BLOCK_ROWS][MAX_WIDTH], hidden[BLOCK_ROWS][MAX_WIDTH];
    for (Py_ssize_t i = 0; i < n; i += BLOCK_ROWS) {
        Py_ssize_t take = n - i < BLOCK_ROWS ? n - i : BLOCK_ROWS;
        for (Py_ssize_t r = 0; r < BLOCK_ROWS; r++) {
            const float *row = rows + (i + (r < take ? r : 0)) * F; /* a block's missing rows repeat its first */
            for (Py_ssize_t f = 0; f < F; f++) x[r][f] = (row[f] - m->mean[f]) / m->scale[f];
        }
        for (Py_ssize_t j0 = 0; j0 < H; j0 += BLOCK_UNITS) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (Py_ssize_t f = 0; f < F; f++) {
                __m256 w = _mm256_loadu_ps(m->w1 + f * H + j0);
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(x[0][f]), w, a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(x[1][f]), w, a1);
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(x[2][f]), w, a2);
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(x[3][f]), w, a3);
            }
            _mm256_storeu_ps(hidden[0] + j0, a0);
            _mm256_storeu_ps(hidden[1] + j0, a1);
            _mm256_storeu_ps(hidden[2] + j0, a2);
            _mm256_storeu_ps(hidden[3] + j0, a3);
        }
        float score[BLOCK_ROWS] = {0.0f};
        for (Py_ssize_t j = 0; j < H; j++)
            for (int r = 0; r < BLOCK_ROWS; r++) {
                float v = hidden[r][j] + m->b1[j];
                score[r] = fmaf(v > 0.0f || v != v ? v : 0.0f, m->w2[j], score[r]);
            }
        for (Py_ssize_t r = 0; r < take; r++) out[i + r] = score[r] + m->b2;
    }
}
#else
#define FORWARD_DISPATCH 0
#endif

static PyObject *forward(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objs[7];
    int portable = 0; /* the scalar path on any CPU (the tests compare the two) */
    if (!PyArg_ParseTuple(args, "OOOOOOO|p", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &portable))
        return NULL;
    static const char *names[7] = {"rows", "mean", "scale", "w1", "b1", "w2", "b2"};
    Py_buffer cols[7];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 7; got++)
        if (column(objs[got], &cols[got], 4, names[got]) < 0) goto done;
    Py_ssize_t F = cols[1].len / 4, H = cols[4].len / 4;
    if (F < 1 || F > MAX_WIDTH || H < 1 || H > MAX_WIDTH || cols[2].len / 4 != F || cols[3].len / 4 != F * H ||
        cols[5].len / 4 != H || cols[6].len / 4 < 1 || (cols[0].len / 4) % F != 0) {
        PyErr_SetString(PyExc_ValueError, "forward: rows (n x F), mean and scale (F), w1 (F x H), b1 and w2 (H), b2 (1)");
        goto done;
    }
    Py_ssize_t n = cols[0].len / 4 / F;
    const float *rows = cols[0].buf, *mean = cols[1].buf, *scale = cols[2].buf, *w1 = cols[3].buf, *b1 = cols[4].buf;
    const float *w2 = cols[5].buf, b2 = ((const float *)cols[6].buf)[0];
    if ((result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(float))) == NULL) goto done;
    Model model = {F, H, mean, scale, w1, b1, w2, b2};
    float *out = (float *)PyBytes_AS_STRING(result);
#if FORWARD_DISPATCH
    if (!portable && __builtin_cpu_supports("avx") && __builtin_cpu_supports("fma")) forward_fma(&model, rows, n, out);
    else
#endif
        forward_any(&model, rows, n, out);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"pool", pool, METH_VARARGS,
     "pool(tier, lru, lfu, fifo, where, pins, recency, frequency, hits) -> (handles, bits) (see kvray/policy/reuse.py)"},
    {"rows", rows, METH_VARARGS,
     "rows(handles, leaf, tier, now, now_ms, decay, root_k, <PageFeatures' columns>) -> float32 feature rows (see "
     "kvray/policy/page_features.py)"},
    {"scored", scored, METH_VARARGS,
     "scored(tier, lru, lfu, fifo, where, pins, recency, frequency, first_child, now, now_ms, decay, root_k, <PageFeatures' "
     "columns>) -> (handles, rows): the pool and its feature rows in one call (see kvray/policy/reuse.py)"},
    {"forward", forward, METH_VARARGS,
     "forward(rows, mean, scale, w1, b1, w2, b2, portable=False) -> float32 scores: ReuseModel.predict, sums in a fixed order (see "
     "kvray/policy/reuse_model.py)"},
    {"ranking", ranking, METH_VARARGS,
     "ranking(score, handles, depth) -> (ranked handles, order): np.lexsort((-depth[handles], -score)) (see "
     "kvray/policy/reuse.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pool", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }
