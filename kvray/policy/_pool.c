/* The reuse policy's scoring in C: its candidate pool and their feature rows (one pass over a tier's pages instead of a mask,
 * three partial sorts and a deduplication in numpy), the reuse model's scores of them (_pool_forward.h) and their ranking,
 * each callable alone and all four in one call, ranked_pool (docs/sim-eval/README.md, "Replay speed").
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
    Py_ssize_t size[3] = {0, 0, 0}, c[3], total;
    if (cap[0] < 0 || cap[1] < 0 || cap[2] < 0) {
        PyErr_SetString(PyExc_ValueError, "pool: negative pool size");
        return -1;
    }
    /* A heap never holds more than the cache's pages: sizes beyond that (2**60 from a model
     * file, say) would overflow the allocations below and change nothing. */
    for (int o = 0; o < 3; o++) c[o] = cap[o] < n ? cap[o] : n;
    total = c[0] + c[1] + c[2];
    for (int o = 0; o < 3; o++)
        if ((heaps[o] = PyMem_Malloc((c[o] ? c[o] : 1) * sizeof(Entry))) == NULL) { PyErr_NoMemory(); goto done; }
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
        if (c[0] && (size[0] < c[0] || r < heaps[0][0].key)) offer(heaps[0], &size[0], c[0], (Entry){r, h});
        if (c[1] && (size[1] < c[1] || frequency[h] < heaps[1][0].key)) offer(heaps[1], &size[1], c[1], (Entry){frequency[h], h});
        if (c[2] && hits[h] == 0.0 && (size[2] < c[2] || r < heaps[2][0].key)) offer(heaps[2], &size[2], c[2], (Entry){r, h});
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
#include "_pool_forward.h"

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

/* A row's width: the features, and which orderings offered the page when more than LRU offers. */
static Py_ssize_t row_width(const Py_ssize_t cap[3]) { return NFEATURES + (cap[1] || cap[2] ? NSOURCES : 0); }

/* The pool of `tier` (gather) into *out_p and its rows (row_width(cap) floats each) into *rows_p,
 * both PyMem_Malloc'ed; each candidate a leaf when first_child (int32) is -1. Its size, or -1
 * with an exception set. */
static Py_ssize_t pool_rows(int tier, const Py_ssize_t cap[3], Py_buffer cols[5], const Py_buffer *fb, const Features *f,
                            int64_t **out_p, float **rows_p) {
    int64_t *out = NULL;
    uint8_t *bits = NULL;
    float *rows = NULL;
    Py_ssize_t k = gather(tier, cap, cols, &out, &bits), width = row_width(cap), nfirst = fb->len / 4;
    const int32_t *first = fb->buf;
    if (k < 0) return -1;
    if ((rows = PyMem_Malloc((k ? k : 1) * width * sizeof(float))) == NULL) { PyErr_NoMemory(); goto fail; }
    float *row = rows;
    for (Py_ssize_t i = 0; i < k; i++, row += width) {
        if (out[i] >= nfirst) { PyErr_SetString(PyExc_IndexError, "scored: first_child shorter than the cache"); goto fail; }
        if (write_row(f, row, out[i], first[out[i]] == -1, tier, i, k) < 0) goto fail;
        for (int o = 0; width > NFEATURES && o < NSOURCES; o++) row[NFEATURES + o] = (float)((bits[i] >> o) & 1);
    }
    PyMem_Free(bits);
    *out_p = out, *rows_p = rows;
    return k;
fail:
    PyMem_Free(out);
    PyMem_Free(bits);
    PyMem_Free(rows);
    return -1;
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
    float *rows_out = NULL;
    for (; got < 5; got++)
        if (column(pool_objs[got], &cols[got], POOL_SIZES[got], POOL_NAMES[got]) < 0) goto done;
    if (column(first_obj, &fb, 4, "first_child") < 0) goto done;
    have_first = 1;
    if (load_features(&f, objs) < 0) goto done;
    Py_ssize_t k = pool_rows(tier, cap, cols, &fb, &f, &out, &rows_out);
    if (k < 0) goto done;
    Py_ssize_t width = row_width(cap);
    if ((table = PyByteArray_FromStringAndSize((const char *)rows_out, k * width * (Py_ssize_t)sizeof(float))) == NULL) goto done;
    if ((handles = PyBytes_FromStringAndSize((const char *)out, k * (Py_ssize_t)sizeof(int64_t))) != NULL)
        result = PyTuple_Pack(2, handles, table);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    if (have_first) PyBuffer_Release(&fb);
    release_features(&f);
    Py_XDECREF(handles);
    Py_XDECREF(table);
    PyMem_Free(out);
    PyMem_Free(rows_out);
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

/* The n candidates in ranking order (PyMem_Malloc'ed), by depth (int32 by handle); NULL with an exception set. */
static Ranked *rank(const float *score, const int64_t *handles, Py_ssize_t n, const Py_buffer *depth_col) {
    const int32_t *depth = depth_col->buf;
    Py_ssize_t ndepth = depth_col->len / 4;
    Ranked *items = PyMem_Malloc((n ? n : 1) * sizeof(Ranked));
    if (items == NULL) return (Ranked *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (handles[i] < 0 || handles[i] >= ndepth) { PyErr_SetString(PyExc_IndexError, "ranking: a handle beyond depth"); break; }
        if (score[i] != score[i]) { PyErr_SetString(PyExc_ValueError, "ranking: a NaN score"); break; }
        items[i] = (Ranked){score[i], depth[handles[i]], i};
    }
    if (PyErr_Occurred()) {
        PyMem_Free(items);
        return NULL;
    }
    qsort(items, n, sizeof(Ranked), leaves_first);
    return items;
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
    Py_ssize_t n = cols[0].len / 4;
    const int64_t *handles = cols[1].buf;
    if (cols[1].len / 8 != n) { PyErr_SetString(PyExc_ValueError, "ranking: as many scores as handles"); goto done; }
    if ((items = rank(cols[0].buf, handles, n, &cols[2])) == NULL) goto done;
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

/* -- a whole scoring in one call: the pool, its rows, the model's scores and their ranking -------
 *
 * ranked_pool(tier, lru, lfu, fifo, where, pins, recency, frequency, first_child, depth, take,
 *             mean, scale, w1, b1, w2, b2, now, now_ms, decay, root_k, <PageFeatures' columns>)
 *   -> (ranked, scores)
 *   scored()'s pool and rows, forward()'s scores of them and ranking()'s order: ranked, the pool's
 *   handles in that order (a list); scores, the first `take` ranked's scores (a list of floats).
 *   ReusePolicy's scoring where nothing keeps the rows (no teacher, online refit or disk gate). */
static PyObject *ranked_pool(PyObject *module, PyObject *args) {
    (void)module;
    int tier;
    Py_ssize_t cap[3], take;
    PyObject *pool_objs[5], *first_obj, *depth_obj, *wobjs[6], *objs[NF];
    Features f = {.got = 0};
    if (!PyArg_ParseTuple(args, "innnOOOOOOnOOOOOOddOiOOOOOOOOOOO", &tier, &cap[0], &cap[1], &cap[2], &pool_objs[0],
                          &pool_objs[1], &pool_objs[2], &pool_objs[3], &first_obj, &depth_obj, &take, &wobjs[0], &wobjs[1],
                          &wobjs[2], &wobjs[3], &wobjs[4], &wobjs[5], &f.now, &f.now_ms, &objs[F_DECAY], &f.root_k,
                          &objs[F_INSERTED], &objs[F_LAST], &objs[F_LAST_MS], &objs[F_GAP1], &objs[F_GAP2], &objs[F_COUNTS],
                          &objs[F_HITS], &objs[F_DEPTH], &objs[F_PAGES], &objs[F_ROOT], &objs[F_GHOST]))
        return NULL;
    pool_objs[4] = objs[F_HITS];
    Py_buffer cols[5], fb, db, w[6];
    int got = 0, have = 0, wgot = 0;
    PyObject *order = NULL, *scores = NULL, *result = NULL;
    int64_t *out = NULL;
    float *rows = NULL, *score = NULL;
    Ranked *items = NULL;
    Model model;
    for (; got < 5; got++)
        if (column(pool_objs[got], &cols[got], POOL_SIZES[got], POOL_NAMES[got]) < 0) goto done;
    if (column(first_obj, &fb, 4, "first_child") < 0) goto done;
    have = 1;
    if (column(depth_obj, &db, 4, "depth") < 0) goto done;
    have = 2;
    for (; wgot < 6; wgot++)
        if (column(wobjs[wgot], &w[wgot], 4, MODEL_NAMES[wgot]) < 0) goto done;
    if (load_model(&model, w) < 0 || load_features(&f, objs) < 0) goto done;
    if (model.F != row_width(cap)) { PyErr_SetString(PyExc_ValueError, "ranked_pool: the model's features are not the pool's rows"); goto done; }
    Py_ssize_t k = pool_rows(tier, cap, cols, &fb, &f, &out, &rows);
    if (k < 0) goto done;
    if ((score = PyMem_Malloc((k ? k : 1) * sizeof(float))) == NULL) { PyErr_NoMemory(); goto done; }
    score_rows(&model, rows, k, score, 0);
    if ((items = rank(score, out, k, &db)) == NULL) goto done;
    Py_ssize_t first = take < k ? (take > 0 ? take : 0) : k;
    if ((order = PyList_New(k)) == NULL || (scores = PyList_New(first)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *h = PyLong_FromLongLong(out[items[i].at]);
        if (h == NULL) goto done;
        PyList_SET_ITEM(order, i, h);
        if (i < first) {
            PyObject *v = PyFloat_FromDouble(items[i].score);
            if (v == NULL) goto done;
            PyList_SET_ITEM(scores, i, v);
        }
    }
    result = PyTuple_Pack(2, order, scores);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    if (have > 0) PyBuffer_Release(&fb);
    if (have > 1) PyBuffer_Release(&db);
    for (int i = 0; i < wgot; i++) PyBuffer_Release(&w[i]);
    release_features(&f);
    Py_XDECREF(order);
    Py_XDECREF(scores);
    PyMem_Free(out);
    PyMem_Free(rows);
    PyMem_Free(score);
    PyMem_Free(items);
    return result;
}

/* -- the reuse model's forward pass (_pool_forward.h) ------------------------------------------
 *
 * forward(rows, mean, scale, w1, b1, w2, b2, portable=False) -> bytes of float32 (one score per row)
 *   rows float32 (n x F), the weights as _pool_forward.h reads them; `portable`: row by row in
 *   libm's fmaf on any CPU (the tests compare it with the AVX path). */
static PyObject *forward(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objs[7];
    int portable = 0;
    if (!PyArg_ParseTuple(args, "OOOOOOO|p", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &portable))
        return NULL;
    Py_buffer cols[7];
    int got = 0;
    Model model;
    PyObject *result = NULL;
    for (; got < 7; got++)
        if (column(objs[got], &cols[got], 4, got ? MODEL_NAMES[got - 1] : "rows") < 0) goto done;
    if (load_model(&model, cols + 1) < 0) goto done;
    if ((cols[0].len / 4) % model.F != 0) {
        PyErr_SetString(PyExc_ValueError, "forward: rows of F values each");
        goto done;
    }
    Py_ssize_t n = cols[0].len / 4 / model.F;
    if ((result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(float))) == NULL) goto done;
    score_rows(&model, cols[0].buf, n, (float *)PyBytes_AS_STRING(result), portable);
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
    {"ranked_pool", ranked_pool, METH_VARARGS,
     "ranked_pool(tier, lru, lfu, fifo, where, pins, recency, frequency, first_child, depth, take, mean, scale, w1, b1, w2, "
     "b2, <PageFeatures' row inputs>) -> (ranked handles, their first take scores): a whole scoring (see kvray/policy/reuse.py)"},
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
