/* The reuse policy's candidate pool in C: one pass over a tier's pages instead of a mask,
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
    if ((out = PyMem_Malloc((total ? total : 1) * sizeof(int64_t))) == NULL ||
        (bits = PyMem_Malloc(total ? total : 1)) == NULL) { PyErr_NoMemory(); goto done; }
    Py_ssize_t k = 0;
    for (int o = 0; o < 3; o++) {
        qsort(heaps[o], size[o], sizeof(Entry), ascending);
        for (Py_ssize_t i = 0; i < size[o]; i++) {
            int64_t h = heaps[o][i].handle;
            Py_ssize_t j = 0;
            while (j < k && out[j] != h) j++;
            if (j == k) out[k] = h, bits[k++] = 0;
            bits[j] |= (uint8_t)(1u << o);
        }
    }
    result = Py_BuildValue("(y#y#)", (const char *)out, k * (Py_ssize_t)sizeof(int64_t), (const char *)bits, k);
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&cols[i]);
    for (int o = 0; o < 3; o++) PyMem_Free(heaps[o]);
    PyMem_Free(out);
    PyMem_Free(bits);
    return result;
}

static PyMethodDef methods[] = {
    {"pool", pool, METH_VARARGS,
     "pool(tier, lru, lfu, fifo, where, pins, recency, frequency, hits) -> (handles, bits) (see kvray/policy/reuse.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pool", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }
