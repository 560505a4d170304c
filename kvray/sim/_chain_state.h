/* The state the compiled chain writer (kvray/sim/_chain.c) works on: the Python objects of one
 * node (its CacheManager, PrefixIndex, LRUPolicy, SlotAllocators, SimNode and links), reached
 * through their own containers and written exactly as their Python methods write them:
 * the index's numpy columns through the buffer protocol, its key dict and free-handle list,
 * the slot heaps in heapq's own sift order, LRU's OrderedDicts, the metrics' Counters,
 * and an unqueued link's counters as Link.occupy keeps them (kvray/sim/links.py; those
 * bookings in _chain_links.h). Each function names the Python it transcribes; included once,
 * by _chain.c.
 */
#ifndef KVRAY_CHAIN_STATE_H
#define KVRAY_CHAIN_STATE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define NTIERS 4
#define DISK 2 /* Tier.DISK */
#define ROOT (-1)
#define NONE (-1)
#define NO_SLOT (-1)
#define ERR (-2)
#define REFUSALS_PER_RESERVE 32
#define MAX_KEPT 16

enum { C_TIER, C_SLOT, C_NODE, C_CHECKSUM, C_PINS, C_HITS, C_LAST, C_DEPTH, C_PARENT, C_FIRST, C_NEXT, C_PREV, NCOLS };
static const char *COL_NAMES[NCOLS] = {"tier", "slot", "node", "checksum", "pins", "hits", "last_access",
                                       "depth", "parent", "first_child", "next_sibling", "prev_sibling"};
static const Py_ssize_t COL_SIZES[NCOLS] = {1, 4, 4, 8, 4, 4, 8, 4, 4, 4, 4, 4};

/* set once at import: heapq.heappush (the links' pending heaps), the Tier
 * members by value, their labels and the metrics' "src->dst" move names, the kind "store" */
static PyObject *heappush, *TIER[NTIERS], *LABEL[NTIERS], *MOVE_NAME[NTIERS][NTIERS], *store_kind;
/* a generic policy's hooks (interned names) and kvray.core.placement.PageContext */
static PyObject *M_on_insert, *M_on_remove, *M_victim, *M_demote_target, *M_admit, *M_on_admitted, *PageContextType, *empty_tenant;
static PyObject *M_move_to_end; /* OrderedDict's, for the reuse policy's ghosts and S3-FIFO's (_chain_reuse.h, _chain_s3fifo.h) */
static PyObject *import(const char *module, const char *name); /* an attribute of a module, imported (_chain.c) */
static PyObject *A_queued, *A_bytes_by_kind, *A_busy_ms, *A_last_end_ms, *A_pending, *A_starts, *A_ends; /* Link's, interned */

#define MAX_LINKS 16
#define MAX_KINDS 4
#define MAX_ENDS 32
typedef struct {
    PyObject *link, *lane_starts, *lane_ends; /* a queued link's lanes: per lane, its bookings' sorted starts, ends */
    Py_ssize_t lanes;
    int queued, nkinds, nends;
    double busy, last, last0;
    PyObject *kinds[MAX_KINDS];
    long long kind_count[MAX_KINDS], end_count[MAX_ENDS];
    double ends[MAX_ENDS];
} LinkSums;

typedef struct Reuse Reuse; /* the reuse policy's columns, with native hooks (_chain_reuse.h) */

typedef struct {
    PyObject *manager, *node, *index;
    /* index */
    PyObject *handles, *keys, *free_handles, *cols;
    Py_buffer buf[NCOLS];
    int have_buf;
    Py_ssize_t ncap;
    int8_t *tier;
    int32_t *slot, *node_col, *pins, *hits, *depth, *parent, *first, *next, *prev;
    uint64_t *checksum;
    int64_t *last;
    long long clock;
    /* policy: LRU's own state, or (generic) any policy through its Python hooks */
    PyObject *policy, *tenant;
    int generic;
    Reuse *reuse; /* a reuse policy whose own hooks run here (native), else NULL */
    int s3fifo; /* a generic policy whose insert and removal hooks are S3-FIFO's: they run here (_chain_s3fifo.h) */
    PyObject *order[NTIERS], *tier_of;
    int below[NTIERS]; /* demotion target present in this cache, or -1 */
    /* slots */
    PyObject *free_list[NTIERS];
    char *used[NTIERS];
    int present[NTIERS];
    /* listeners, metrics, node */
    PyObject *slot_freed, *page_placed, *page_dropped;
    PyObject *moved_pages, *stored_by_tier;
    long long stored, evicted;
    PyObject *moves, *stores, *clock_obj, *nbytes_obj, *move[NTIERS][NTIERS]; /* move: node._moves' entries, borrowed */
    long long nbytes;
    double node_clock, background;
    /* kept pages (the chain's parent, pages being moved) */
    long kept[MAX_KEPT];
    int kept_count[MAX_KEPT], nkept;
    LinkSums links[MAX_LINKS]; /* the links booked since the last write-back */
    int nlinks;
} State;

static int flush_links(State *s); /* before any Python code runs: see "links" below */
static int reuse_insert(State *s, long h, int t); /* _chain_reuse.h */
static int reuse_remove(State *s, long h, int t);
static long reuse_pending(State *s, int t);
static int reuse_demote_target(State *s, int t);
static int s3fifo_insert(State *s, PyObject *policy, long h, int t); /* _chain_s3fifo.h */
static int s3fifo_remove(State *s, PyObject *policy, long h, int t);

/* -- columns ------------------------------------------------------------------------- */
static void release_columns(State *s) {
    if (!s->have_buf) return;
    for (int i = 0; i < NCOLS; i++) PyBuffer_Release(&s->buf[i]);
    s->have_buf = 0;
}

static int load_columns(State *s) {
    release_columns(s);
    for (int i = 0; i < NCOLS; i++) {
        PyObject *col = PyDict_GetItemString(s->cols, COL_NAMES[i]);
        if (col == NULL || PyObject_GetBuffer(col, &s->buf[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            for (int j = 0; j < i; j++) PyBuffer_Release(&s->buf[j]);
            if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "index column %s", COL_NAMES[i]);
            return -1;
        }
        if (s->buf[i].itemsize != COL_SIZES[i]) {
            for (int j = 0; j <= i; j++) PyBuffer_Release(&s->buf[j]);
            PyErr_Format(PyExc_TypeError, "index column %s has items of %zd bytes", COL_NAMES[i], s->buf[i].itemsize);
            return -1;
        }
    }
    void **columns[NCOLS] = {(void **)&s->tier,   (void **)&s->slot,  (void **)&s->node_col, (void **)&s->checksum,
                             (void **)&s->pins,   (void **)&s->hits,  (void **)&s->last,     (void **)&s->depth,
                             (void **)&s->parent, (void **)&s->first, (void **)&s->next,     (void **)&s->prev};
    for (int i = 0; i < NCOLS; i++) *columns[i] = s->buf[i].buf; /* in COL_NAMES' order */
    s->have_buf = 1;
    s->ncap = s->buf[C_TIER].len;
    return 0;
}

/* -- SlotAllocator: heapq's sift order on its list of ints ------------------------------ */
static int item_lt(PyObject *a, PyObject *b, int *lt) {
    long x = PyLong_AsLong(a), y = PyLong_AsLong(b);
    if ((x == -1 || y == -1) && PyErr_Occurred()) return -1;
    *lt = x < y;
    return 0;
}

static int sift_down(PyObject *heap, Py_ssize_t start, Py_ssize_t pos) {
    PyObject *item = PyList_GET_ITEM(heap, pos);
    while (pos > start) {
        Py_ssize_t up = (pos - 1) >> 1;
        PyObject *parent = PyList_GET_ITEM(heap, up);
        int lt;
        if (item_lt(item, parent, &lt) < 0) return -1;
        if (!lt) break;
        PyList_SET_ITEM(heap, pos, parent);
        pos = up;
    }
    PyList_SET_ITEM(heap, pos, item);
    return 0;
}

static int sift_up(PyObject *heap, Py_ssize_t pos) {
    Py_ssize_t end = PyList_GET_SIZE(heap), start = pos, child = 2 * pos + 1;
    PyObject *item = PyList_GET_ITEM(heap, pos);
    while (child < end) {
        Py_ssize_t right = child + 1;
        int lt = 1;
        if (right < end && item_lt(PyList_GET_ITEM(heap, child), PyList_GET_ITEM(heap, right), &lt) < 0) return -1;
        if (right < end && !lt) child = right;
        PyList_SET_ITEM(heap, pos, PyList_GET_ITEM(heap, child));
        pos = child;
        child = 2 * pos + 1;
    }
    PyList_SET_ITEM(heap, pos, item);
    return sift_down(heap, start, pos);
}

static long alloc_slot(State *s, int t) {
    PyObject *heap = s->free_list[t];
    Py_ssize_t n = PyList_GET_SIZE(heap);
    if (n == 0) return NO_SLOT;
    PyObject *last = PyList_GET_ITEM(heap, n - 1), *out;
    Py_INCREF(last);
    if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) { Py_DECREF(last); return ERR; }
    if (n > 1) {
        out = PyList_GET_ITEM(heap, 0);
        PyList_SET_ITEM(heap, 0, last);
        if (sift_up(heap, 0) < 0) { Py_DECREF(out); return ERR; }
    } else {
        out = last;
    }
    long slot = PyLong_AsLong(out);
    Py_DECREF(out);
    if (slot == -1 && PyErr_Occurred()) return ERR;
    s->used[t][slot] = 1;
    return slot;
}

static int free_slot(State *s, int t, long slot) {
    if (!s->used[t][slot]) {
        PyErr_Format(PyExc_ValueError, "slot %ld is not in use", slot);
        return -1;
    }
    s->used[t][slot] = 0;
    PyObject *heap = s->free_list[t], *item = PyLong_FromLong(slot);
    if (item == NULL || PyList_Append(heap, item) < 0) { Py_XDECREF(item); return -1; }
    Py_DECREF(item);
    if (sift_down(heap, 0, PyList_GET_SIZE(heap) - 1) < 0) return -1;
    if (s->slot_freed != Py_None) {
        if (flush_links(s) < 0) return -1;
        PyObject *r = PyObject_CallFunction(s->slot_freed, "Ol", TIER[t], slot);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* -- the policy's hooks: LRUPolicy's, transcribed, or a generic policy's own in Python ------ */
/* A generic policy's hook hook(h, Tier(t)) -> its result (new reference) or NULL. Policies
 * are not told of the links (a request's RequestInfo carries their utilisation), so the
 * link sums are not written back before a hook runs. */
static PyObject *hook(State *s, PyObject *name, long h, int t) {
    PyObject *hobj = PyLong_FromLong(h);
    if (hobj == NULL) return NULL;
    PyObject *r = PyObject_CallMethodObjArgs(s->policy, name, hobj, TIER[t], NULL);
    Py_DECREF(hobj);
    return r;
}

static int hook_none(State *s, PyObject *name, long h, int t) {
    PyObject *r = hook(s, name, h, t);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* A tier a policy named (None: -1), kept only when present in this cache (manager.slots). */
static int present_tier(State *s, PyObject *tier, int *out) {
    *out = -1;
    if (tier == Py_None) return 0;
    long t = PyLong_AsLong(tier);
    if (t == -1 && PyErr_Occurred()) return -1;
    if (t >= 0 && t < NTIERS && s->present[t]) *out = (int)t;
    return 0;
}

/* CacheManager._demote_target: where the policy demotes h from t, if present; -2 on error. */
static int demote_target(State *s, long h, int t) {
    if (s->reuse) return reuse_demote_target(s, t); /* no disk gate when native */
    if (!s->generic) return s->below[t];
    PyObject *r = hook(s, M_demote_target, h, t);
    int d;
    if (r == NULL) return -2;
    int rc = present_tier(s, r, &d);
    Py_DECREF(r);
    return rc < 0 ? -2 : d;
}

static int lru_insert(State *s, long h, int t) {
    if (s->reuse) return reuse_insert(s, h, t);
    if (s->s3fifo) return s3fifo_insert(s, s->policy, h, t);
    if (s->generic) return hook_none(s, M_on_insert, h, t);
    PyObject *key = PyLong_FromLong(h);
    if (key == NULL) return -1;
    int rc = PyObject_SetItem(s->order[t], key, Py_None);
    if (rc == 0) rc = PyDict_SetItem(s->tier_of, key, TIER[t]);
    Py_DECREF(key);
    return rc;
}

static int lru_remove(State *s, long h, int t) {
    if (s->reuse) return reuse_remove(s, h, t);
    if (s->s3fifo) return s3fifo_remove(s, s->policy, h, t);
    if (s->generic) return hook_none(s, M_on_remove, h, t);
    PyObject *key = PyLong_FromLong(h);
    if (key == NULL) return -1;
    int rc = PyObject_DelItem(s->order[t], key);
    if (rc == 0) rc = PyDict_DelItem(s->tier_of, key);
    Py_DECREF(key);
    return rc;
}

/* Whether h names a page of the index (and, t >= 0, of tier t): a handle that comes from
 * Python (a policy's victim, a caller's parent) is checked before a column is indexed by it. */
static int indexed(State *s, long h, int t) {
    return h >= 0 && h < PyList_GET_SIZE(s->keys) && h < s->ncap && PyList_GET_ITEM(s->keys, h) != Py_None &&
           (t < 0 || s->tier[h] == t);
}

/* LRU's victim: the first unpinned page of the tier's order; NONE when all are pinned. */
static long lru_victim(State *s, int t) {
    long pending = s->reuse ? reuse_pending(s, t) : NONE; /* reuse's last ranking, while it lasts */
    if (pending != NONE) return pending;
    if (s->generic) { /* policy.victim(tier): a handle or None */
        PyObject *r = PyObject_CallMethodObjArgs(s->policy, M_victim, TIER[t], NULL);
        if (r == NULL) return ERR;
        long h = r == Py_None ? NONE : PyLong_AsLong(r);
        Py_DECREF(r);
        if (h == -1 && PyErr_Occurred()) return ERR;
        if (h != NONE && !indexed(s, h, t)) {
            PyErr_Format(PyExc_IndexError, "%R.victim(%R) returned handle %ld, not a page of that tier", s->policy, TIER[t], h);
            return ERR;
        }
        return h;
    }
    PyObject *it = PyObject_GetIter(s->order[t]), *key;
    if (it == NULL) return ERR;
    long found = NONE;
    while ((key = PyIter_Next(it)) != NULL) {
        long h = PyLong_AsLong(key);
        Py_DECREF(key);
        if (h == -1 && PyErr_Occurred()) break;
        if (s->pins[h] == 0) { found = h; break; }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? ERR : found;
}

/* -- index -------------------------------------------------------------------------------- */
static int placed(State *s, long h, int t, long slot) {
    if (s->page_placed == Py_None) return 0;
    if (flush_links(s) < 0) return -1;
    PyObject *r = PyObject_CallFunction(s->page_placed, "OOlK", PyList_GET_ITEM(s->keys, h), TIER[t], slot,
                                        (unsigned long long)s->checksum[h]);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static long index_add(State *s, PyObject *key, int t, long slot, uint64_t checksum, long parent, long depth) {
    long h;
    Py_ssize_t nfree = PyList_GET_SIZE(s->free_handles);
    if (nfree) {
        PyObject *last = PyList_GET_ITEM(s->free_handles, nfree - 1);
        h = PyLong_AsLong(last);
        if (h == -1 && PyErr_Occurred()) return ERR;
        if (PyList_SetSlice(s->free_handles, nfree - 1, nfree, NULL) < 0) return ERR;
        Py_INCREF(key);
        if (PyList_SetItem(s->keys, h, key) < 0) return ERR;
    } else {
        h = (long)PyList_GET_SIZE(s->keys);
        if (PyList_Append(s->keys, key) < 0) return ERR;
        if (h >= s->ncap) { /* the index doubles its columns: take the new ones */
            release_columns(s);
            PyObject *r = PyObject_CallMethod(s->index, "_grow", NULL);
            if (r == NULL) return ERR;
            Py_DECREF(r);
            if (load_columns(s) < 0) return ERR;
        }
    }
    PyObject *hobj = PyLong_FromLong(h);
    if (hobj == NULL) return ERR;
    int rc = PyDict_SetItem(s->handles, key, hobj);
    Py_DECREF(hobj);
    if (rc < 0) return ERR;
    s->tier[h] = (int8_t)t;
    s->slot[h] = (int32_t)slot;
    s->node_col[h] = 0;
    s->checksum[h] = checksum;
    s->pins[h] = 0;
    s->hits[h] = 0;
    s->depth[h] = (int32_t)depth;
    s->parent[h] = (int32_t)parent;
    s->first[h] = s->prev[h] = s->next[h] = NONE;
    if (parent != ROOT) {
        int32_t first = s->first[parent];
        s->next[h] = first;
        if (first != NONE) s->prev[first] = (int32_t)h;
        s->first[parent] = (int32_t)h;
    }
    s->last[h] = ++s->clock;
    return h;
}

static int index_remove(State *s, long h) {
    if (s->pins[h] > 0 || s->first[h] != NONE) {
        PyErr_Format(PyExc_ValueError, "handle %ld is pinned or still has cached children", h);
        return -1;
    }
    int32_t prev = s->prev[h], next = s->next[h];
    if (prev != NONE) s->next[prev] = next;
    else if (s->parent[h] != ROOT) s->first[s->parent[h]] = next;
    if (next != NONE) s->prev[next] = prev;
    PyObject *key = PyList_GET_ITEM(s->keys, h), *hobj;
    Py_INCREF(key);
    int rc = PyDict_DelItem(s->handles, key);
    if (rc == 0 && s->page_dropped != Py_None && (rc = flush_links(s)) == 0) {
        PyObject *r = PyObject_CallOneArg(s->page_dropped, key);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(key);
    if (rc < 0) return -1;
    Py_INCREF(Py_None);
    if (PyList_SetItem(s->keys, h, Py_None) < 0) return -1;
    if ((hobj = PyLong_FromLong(h)) == NULL) return -1;
    rc = PyList_Append(s->free_handles, hobj);
    Py_DECREF(hobj);
    return rc;
}

/* -- kept pages and their lineages (the page and its ancestors) --------------------------- */
static int keep(State *s, long h) {
    for (int i = 0; i < s->nkept; i++)
        if (s->kept[i] == h) { s->kept_count[i]++; return 0; }
    if (s->nkept == MAX_KEPT) { PyErr_SetString(PyExc_RuntimeError, "too many kept pages"); return -1; }
    s->kept[s->nkept] = h;
    s->kept_count[s->nkept++] = 1;
    return 0;
}

static void release(State *s, long h) {
    for (int i = 0; i < s->nkept; i++)
        if (s->kept[i] == h && --s->kept_count[i] == 0) {
            s->kept[i] = s->kept[--s->nkept];
            s->kept_count[i] = s->kept_count[s->nkept];
            return;
        }
}

static int in_lineage(State *s, long h, long kept) {
    for (long up = kept; up != ROOT; up = s->parent[up])
        if (up == h) return 1;
    return 0;
}

static int keeps_descendant(State *s, long h) {
    for (int i = 0; i < s->nkept; i++)
        if (in_lineage(s, h, s->kept[i])) return 1;
    return 0;
}

static int count(PyObject *counter, PyObject *name) {
    PyObject *had = PyDict_GetItemWithError(counter, name);
    if (had == NULL && PyErr_Occurred()) return -1;
    long n = had ? PyLong_AsLong(had) : 0;
    PyObject *v = PyLong_FromLong(n + 1);
    int rc = v == NULL ? -1 : PyDict_SetItem(counter, name, v);
    Py_XDECREF(v);
    return rc;
}

#endif
