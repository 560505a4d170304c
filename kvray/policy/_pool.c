/* The reuse policy's candidate pool and its feature rows in C (a scoring's inputs): one pass over a tier's pages instead of a mask,
 * three partial sorts and a deduplication in numpy (docs/sim-eval/README.md, "Replay speed").
 *
 * A transcription of the Python gathering in kvray/policy/reuse.py (ReusePolicy.victim and
 * _first), which stays the reference (tests/policy/test_reuse_pool.py compares them on
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
static void offer(Entry *heap, Py_ssize_t *size, Py_ssize_t cap, Entry e) {
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

static int ascending(const void *a, const void *b) {
    const Entry *x = a, *y = b;
    return worse(x, y) ? 1 : worse(y, x) ? -1 : 0;
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

static PyObject *pool(PyObject *module, PyObject *args) {
    (void)module;
    int tier;
    Py_ssize_t cap[3];
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "innnOOOOO", &tier, &cap[0], &cap[1], &cap[2], &objs[0], &objs[1], &objs[2], &objs[3], &objs[4]))
        return NULL;
    static const char *names[5] = {"where", "pins", "recency", "frequency", "hits"};
    static const Py_ssize_t sizes[5] = {1, 4, 8, 8, 8};
    Py_buffer cols[5];
    int got = 0;
    PyObject *result = NULL;
    Entry *heaps[3] = {NULL, NULL, NULL};
    int64_t *out = NULL;
    uint8_t *bits = NULL;
    Slot *table = NULL;
    for (; got < 5; got++)
        if (cap[0] < 0 || cap[1] < 0 || cap[2] < 0 || column(objs[got], &cols[got], sizes[got], names[got]) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pool: negative pool size");
            goto done;
        }
    const int8_t *where = cols[0].buf;
    const int32_t *pins = cols[1].buf;
    const int64_t *recency = cols[2].buf;
    const double *frequency = cols[3].buf, *hits = cols[4].buf;
    Py_ssize_t n = cols[0].len < cols[1].len / 4 ? cols[0].len : cols[1].len / 4;
    Py_ssize_t nrec = cols[2].len / 8, nfreq = cols[3].len / 8, nhits = cols[4].len / 8;
    Py_ssize_t size[3] = {0, 0, 0}, total = cap[0] + cap[1] + cap[2];
    for (int o = 0; o < 3; o++)
        if ((heaps[o] = PyMem_Malloc((cap[o] ? cap[o] : 1) * sizeof(Entry))) == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t h = 0; h < n; h++) {
        if (where[h] != tier || pins[h] != 0) continue;
        if (h >= nrec || h >= nfreq || h >= nhits) { PyErr_SetString(PyExc_IndexError, "pool: a column shorter than the cache"); goto done; }
        Entry by_recency = {(double)recency[h], h};
        offer(heaps[0], &size[0], cap[0], by_recency);
        if (cap[1]) offer(heaps[1], &size[1], cap[1], (Entry){frequency[h], h});
        if (cap[2] && hits[h] == 0.0) offer(heaps[2], &size[2], cap[2], by_recency);
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
    Py_ssize_t k = 0;
    for (int o = 0; o < 3; o++) {
        qsort(heaps[o], size[o], sizeof(Entry), ascending);
        for (Py_ssize_t i = 0; i < size[o]; i++) {
            int64_t h = heaps[o][i].handle;
            Py_ssize_t at = (Py_ssize_t)(((uint64_t)h * 0x9E3779B97F4A7C15ull) >> 40) & (slots - 1);
            while (table[at].handle != -1 && table[at].handle != h) at = (at + 1) & (slots - 1);
            if (table[at].handle == -1) table[at].handle = h, table[at].place = k, out[k] = h, bits[k++] = 0;
            bits[table[at].place] |= (uint8_t)(1u << o);
        }
    }
    result = Py_BuildValue("(y#y#)", (const char *)out, k * (Py_ssize_t)sizeof(int64_t), (const char *)bits, k);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    for (int o = 0; o < 3; o++) PyMem_Free(heaps[o]);
    PyMem_Free(out);
    PyMem_Free(bits);
    PyMem_Free(table);
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

enum { R_HANDLES, R_LEAF, R_DECAY, R_INSERTED, R_LAST, R_LAST_MS, R_GAP1, R_GAP2, R_COUNTS, R_HITS, R_DEPTH, R_PAGES, R_ROOT, R_GHOST, NR };

static PyObject *rows(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *objs[NR];
    int tier, root_k;
    double now, now_ms;
    if (!PyArg_ParseTuple(args, "OOiddOiOOOOOOOOOOO", &objs[R_HANDLES], &objs[R_LEAF], &tier, &now, &now_ms, &objs[R_DECAY],
                          &root_k, &objs[R_INSERTED], &objs[R_LAST], &objs[R_LAST_MS], &objs[R_GAP1], &objs[R_GAP2],
                          &objs[R_COUNTS], &objs[R_HITS], &objs[R_DEPTH], &objs[R_PAGES], &objs[R_ROOT], &objs[R_GHOST]))
        return NULL;
    static const char *names[NR] = {"handles", "leaf", "decay", "inserted", "last", "last_ms", "gap1",
                                    "gap2", "counts", "hits", "depth", "request_pages", "root", "ghost_age"};
    static const Py_ssize_t sizes[NR] = {8, 1, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8};
    Py_buffer cols[NR];
    int got = 0;
    PyObject *result = NULL;
    for (; got < NR; got++)
        if (column(objs[got], &cols[got], sizes[got], names[got]) < 0) goto done;
    Py_ssize_t n = cols[R_HANDLES].len / 8, pages = cols[R_INSERTED].len / 8;
    for (int c = R_LAST; c < NR; c++) {
        Py_ssize_t len = cols[c].len / 8 / (c == R_COUNTS ? NCOUNTS : 1);
        if (len < pages) pages = len;
    }
    if (cols[R_LEAF].len < n || cols[R_DECAY].len / 8 < NCOUNTS || root_k < 0 || root_k >= NCOUNTS) {
        PyErr_SetString(PyExc_ValueError, "rows: leaf shorter than handles, or decay/root_k out of range");
        goto done;
    }
    const int64_t *handles = cols[R_HANDLES].buf, *root = cols[R_ROOT].buf;
    const char *leaf = cols[R_LEAF].buf;
    const double *decay = cols[R_DECAY].buf, *inserted = cols[R_INSERTED].buf, *last = cols[R_LAST].buf;
    const double *last_ms = cols[R_LAST_MS].buf, *gap1 = cols[R_GAP1].buf, *gap2 = cols[R_GAP2].buf;
    const double *counts = cols[R_COUNTS].buf, *hits = cols[R_HITS].buf, *depth = cols[R_DEPTH].buf;
    const double *request_pages = cols[R_PAGES].buf, *ghost = cols[R_GHOST].buf;
    if ((result = PyByteArray_FromStringAndSize(NULL, n * NFEATURES * (Py_ssize_t)sizeof(float))) == NULL) goto done;
    float *out = (float *)PyByteArray_AS_STRING(result);
    double last_position = n > 1 ? (double)(n - 1) : 1.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t h = handles[i], r = h >= 0 && h < pages ? root[h] : -1;
        if (h < 0 || h >= pages || r < 0 || r >= pages) {
            Py_CLEAR(result);
            PyErr_SetString(PyExc_IndexError, "rows: a handle or its root beyond the columns");
            goto done;
        }
        float *row = out + i * NFEATURES;
        double since = now - last[h];
        row[0] = (float)log1p(now - inserted[h]);
        row[1] = (float)log1p(since);
        row[2] = (float)log1p(gap1[h]);
        row[3] = (float)log1p(gap2[h]);
        double ms = now_ms - last_ms[h];
        row[4] = (float)log1p((ms > 0.0 ? ms : 0.0) / 1e3);
        for (int k = 0; k < NCOUNTS; k++) row[5 + k] = (float)log1p(counts[h * NCOUNTS + k] * exp(-(since * decay[k])));
        row[8] = (float)log1p(hits[h]);
        row[9] = (float)log1p(depth[h]);
        row[10] = (float)(depth[h] / request_pages[h]);
        row[11] = leaf[i] ? 1.0f : 0.0f;
        row[12] = (float)log1p(counts[r * NCOUNTS + root_k] * exp(-(now - last[r]) * decay[root_k]));
        row[13] = (float)log1p(ghost[h]);
        row[14] = (float)log1p(request_pages[h]);
        row[15] = (float)tier;
        row[16] = (float)((double)i / last_position);
    }
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pool", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }
