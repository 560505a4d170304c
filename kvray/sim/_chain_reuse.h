/* The reuse policy's own hooks in the compiled chain writer (kvray/sim/_chain.c, `native`): what
 * ReusePolicy (kvray/policy/reuse.py) keeps per page on each insert, removal and admission (its
 * orderings' columns, PageFeatures' history columns and ghosts, kvray/policy/page_features.py),
 * its admit and demote_target, and the pending ranking its victim calls pop, written here into
 * the same numpy columns, dicts and OrderedDict instead of ~5 Python calls per page moved
 * (docs/sim-eval/README.md, "Replay speed"). The scoring of a pool stays in Python (a victim
 * call when nothing ranked is pending), and so do the tripwire's advisors' hooks, called here in
 * the policy's order (an S3-FIFO's in C, _chain_s3fifo.h). Only where ReusePolicy.native_hooks says the transcription is the policy
 * (no teacher, online refit or disk gate: their hooks keep more); a page beyond the columns
 * (they grow in Python) is told to the policy's Python on_insert. The Python hooks stay the
 * reference: tests/policy/test_reuse_native.py replays through both.
 *
 * Included once, by _chain.c, after _chain_state.h.
 */
#ifndef KVRAY_CHAIN_REUSE_H
#define KVRAY_CHAIN_REUSE_H

enum { RB_WHERE, RB_RECENCY, RB_COUNT, RB_COUNTED, RB_FREQUENCY, /* the policy's */
       RB_INSERTED, RB_LAST, RB_LAST_MS, RB_GAP1, RB_GAP2, RB_COUNTS, RB_HITS, RB_DEPTH, RB_PAGES, RB_ROOT, RB_GHOST, NRB };
static const char *RB_NAMES[NRB] = {"_where", "_recency", "_count", "_counted", "_frequency", "inserted", "last", "last_ms",
                                    "gap1", "gap2", "counts", "hits", "depth", "request_pages", "root", "ghost_age"};
static const Py_ssize_t RB_SIZES[NRB] = {1, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8};
#define RB_COUNTERS 3 /* page_features.HALF_LIVES */
#define MAX_ADVISORS 8

/* set at the first native call: page_features.NEVER and PlacementPolicy.on_admitted */
static double NEVER_REQUESTS = -1.0;
static PyObject *base_on_admitted;

struct Reuse {
    PyObject *features, *advisors, *admitted, *ghosts, *key_of, *held, *pending; /* admitted: advisors that keep on_admitted */
    char s3fifo[MAX_ADVISORS]; /* which advisors are S3-FIFOs, their hooks run in C */
    Py_buffer b[NRB];
    int got;
    Py_ssize_t pages; /* handles every column covers */
    int8_t *where;
    int64_t *recency, *root;
    double *count, *counted, *frequency, *inserted, *last, *last_ms, *gap1, *gap2, *counts, *hits, *depth, *request_pages, *ghost;
    long long clock;
    double now, now_ms, pool_decay;
    long depth_scale, request_pages_now;
    Py_ssize_t ghost_capacity;
    long leaving; /* ReusePolicy._leaving: (leaving, leaving_key), or leaving == NONE */
    PyObject *leaving_key;
    int following; /* the tripwire follows a heuristic: victims are its (in Python) */
    long long disk_closed; /* ReusePolicy._disk_closed: this request's demotions into disk are dropped */
};

static void reuse_release_columns(Reuse *r) {
    for (int i = 0; i < r->got; i++) PyBuffer_Release(&r->b[i]);
    r->got = 0;
}

static int reuse_columns(State *s, Reuse *r) {
    reuse_release_columns(r);
    r->pages = PY_SSIZE_T_MAX;
    for (; r->got < NRB; r->got++) {
        PyObject *owner = r->got < RB_INSERTED ? s->policy : r->features;
        PyObject *col = PyObject_GetAttrString(owner, RB_NAMES[r->got]);
        int rc = col == NULL ? -1 : PyObject_GetBuffer(col, &r->b[r->got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
        Py_XDECREF(col); /* the policy holds it; a column that grows is a new array, reloaded after */
        if (rc < 0) return -1;
        Py_buffer *b = &r->b[r->got];
        if (b->itemsize != RB_SIZES[r->got]) {
            r->got++;
            PyErr_Format(PyExc_TypeError, "reuse column %s has items of %zd bytes", RB_NAMES[r->got - 1], b->itemsize);
            return -1;
        }
        Py_ssize_t n = b->len / b->itemsize / (r->got == RB_COUNTS ? RB_COUNTERS : 1);
        if (n < r->pages) r->pages = n;
    }
    r->where = r->b[RB_WHERE].buf, r->recency = r->b[RB_RECENCY].buf, r->root = r->b[RB_ROOT].buf;
    r->count = r->b[RB_COUNT].buf, r->counted = r->b[RB_COUNTED].buf, r->frequency = r->b[RB_FREQUENCY].buf;
    r->inserted = r->b[RB_INSERTED].buf, r->last = r->b[RB_LAST].buf, r->last_ms = r->b[RB_LAST_MS].buf;
    r->gap1 = r->b[RB_GAP1].buf, r->gap2 = r->b[RB_GAP2].buf, r->counts = r->b[RB_COUNTS].buf, r->hits = r->b[RB_HITS].buf;
    r->depth = r->b[RB_DEPTH].buf, r->request_pages = r->b[RB_PAGES].buf, r->ghost = r->b[RB_GHOST].buf;
    return 0;
}

static int get_long(PyObject *obj, const char *name, long long *out) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    *out = v == NULL ? -1 : PyLong_AsLongLong(v);
    Py_XDECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int get_double(PyObject *obj, const char *name, double *out) {
    PyObject *v = PyObject_GetAttrString(obj, name);
    *out = v == NULL ? -1.0 : PyFloat_AsDouble(v);
    Py_XDECREF(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* The scalars Python keeps (the recency clock, _leaving), read in and written back around any
 * Python code that may read or write them (the policy's own on_insert) and at the end. */
static int reuse_read_scalars(State *s, Reuse *r) {
    PyObject *leaving = PyObject_GetAttrString(s->policy, "_leaving");
    if (leaving == NULL || get_long(s->policy, "_clock", &r->clock) < 0) { Py_XDECREF(leaving); return -1; }
    Py_CLEAR(r->leaving_key);
    r->leaving = NONE;
    if (leaving != Py_None) {
        if (!PyTuple_Check(leaving) || PyTuple_GET_SIZE(leaving) != 2) {
            Py_DECREF(leaving);
            PyErr_SetString(PyExc_TypeError, "ReusePolicy._leaving: (handle, key) or None");
            return -1;
        }
        r->leaving = PyLong_AsLong(PyTuple_GET_ITEM(leaving, 0));
        r->leaving_key = Py_NewRef(PyTuple_GET_ITEM(leaving, 1));
    }
    Py_DECREF(leaving);
    return PyErr_Occurred() ? -1 : 0;
}

static int reuse_write_scalars(State *s, Reuse *r) {
    PyObject *clock = PyLong_FromLongLong(r->clock), *leaving = r->leaving == NONE ? Py_NewRef(Py_None)
                                                                                 : Py_BuildValue("(lO)", r->leaving, r->leaving_key);
    int rc = clock == NULL || leaving == NULL || PyObject_SetAttrString(s->policy, "_clock", clock) < 0 ||
                     PyObject_SetAttrString(s->policy, "_leaving", leaving) < 0
                 ? -1
                 : 0;
    Py_XDECREF(clock);
    Py_XDECREF(leaving);
    return rc;
}

static int reuse_load(State *s, Reuse *r) {
    if (NEVER_REQUESTS < 0.0) {
        PyObject *never = import("kvray.policy.page_features", "NEVER"), *base = import("kvray.core.placement", "PlacementPolicy");
        NEVER_REQUESTS = never == NULL ? -1.0 : PyFloat_AsDouble(never);
        base_on_admitted = base == NULL ? NULL : PyObject_GetAttrString(base, "on_admitted");
        Py_XDECREF(never);
        Py_XDECREF(base);
        if (base_on_admitted == NULL || NEVER_REQUESTS < 0.0) {
            NEVER_REQUESTS = -1.0;
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "kvray.policy.page_features.NEVER");
            return -1;
        }
    }
    long long scale, pages, capacity;
    PyObject *wire = NULL;
    if ((r->features = PyObject_GetAttrString(s->policy, "features")) == NULL ||
        (r->advisors = PyObject_GetAttrString(s->policy, "_advisors")) == NULL ||
        (r->ghosts = PyObject_GetAttrString(r->features, "_ghosts")) == NULL ||
        (r->key_of = PyObject_GetAttrString(s->policy, "_key_of")) == NULL ||
        (r->held = PyObject_GetAttrString(s->policy, "_held")) == NULL ||
        (r->pending = PyObject_GetAttrString(s->policy, "_pending")) == NULL || (r->admitted = PyList_New(0)) == NULL ||
        (wire = PyObject_GetAttrString(s->policy, "_tripwire")) == NULL)
        return -1;
    if (!PyList_Check(r->advisors) || !PyDict_Check(r->ghosts) || !PyDict_Check(r->key_of) || !PyList_Check(r->held) ||
        PyList_GET_SIZE(r->held) < NTIERS || !PyDict_Check(r->pending)) {
        Py_DECREF(wire);
        PyErr_SetString(PyExc_TypeError, "store_chain(native=True): not a ReusePolicy");
        return -1;
    }
    if (PyList_GET_SIZE(r->advisors) > MAX_ADVISORS) {
        Py_DECREF(wire);
        PyErr_SetString(PyExc_ValueError, "store_chain(native=True): too many advisors");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->advisors); i++) { /* which are S3-FIFOs, which keep per-page context */
        int s3 = is_s3fifo(PyList_GET_ITEM(r->advisors, i));
        if (s3 < 0) { Py_DECREF(wire); return -1; }
        r->s3fifo[i] = (char)s3;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->advisors); i++) { /* those that keep per-page context */
        PyObject *advisor = PyList_GET_ITEM(r->advisors, i), *hook = PyObject_GetAttrString((PyObject *)Py_TYPE(advisor), "on_admitted");
        int keeps = hook != NULL && hook != base_on_admitted;
        Py_XDECREF(hook);
        if (hook == NULL || (keeps && PyList_Append(r->admitted, advisor) < 0)) { Py_DECREF(wire); return -1; }
    }
    r->following = 0;
    if (wire != Py_None) {
        PyObject *following = PyObject_GetAttrString(wire, "following");
        r->following = following != NULL && following != Py_None;
        Py_XDECREF(following);
    }
    Py_DECREF(wire);
    if (PyErr_Occurred() || get_long(s->policy, "depth_scale", &scale) < 0 || get_long(s->policy, "_request_pages", &pages) < 0 ||
        get_long(r->features, "ghost_capacity", &capacity) < 0 || get_double(s->policy, "_pool_decay", &r->pool_decay) < 0 ||
        get_double(r->features, "now", &r->now) < 0 || get_double(r->features, "now_ms", &r->now_ms) < 0 ||
        get_long(s->policy, "_disk_closed", &r->disk_closed) < 0 ||
        reuse_read_scalars(s, r) < 0)
        return -1;
    r->depth_scale = (long)scale, r->request_pages_now = (long)pages, r->ghost_capacity = (Py_ssize_t)capacity;
    return reuse_columns(s, r);
}

/* The write-back at the end of a call, also after an error (as the Python hooks would have left it). */
static int reuse_unload(State *s, Reuse *r) {
    int rc = r->features != NULL && r->got == NRB ? reuse_write_scalars(s, r) : 0;
    reuse_release_columns(r);
    Py_CLEAR(r->features); Py_CLEAR(r->advisors); Py_CLEAR(r->admitted); Py_CLEAR(r->ghosts); Py_CLEAR(r->key_of);
    Py_CLEAR(r->held); Py_CLEAR(r->pending); Py_CLEAR(r->leaving_key);
    return rc;
}

/* Each advisor's hook(h, Tier(t)), in the list's order. */
static int advisors_hook(State *s, PyObject *name, long h, int t) {
    PyObject *advisors = s->reuse->advisors;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(advisors); i++) {
        PyObject *advisor = PyList_GET_ITEM(advisors, i);
        if (s->reuse->s3fifo[i]) {
            if ((name == M_on_insert ? s3fifo_insert(s, advisor, h, t) : s3fifo_remove(s, advisor, h, t)) < 0) return -1;
            continue;
        }
        PyObject *hobj = PyLong_FromLong(h), *r = hobj ? PyObject_CallMethodObjArgs(advisor, name, hobj, TIER[t], NULL) : NULL;
        Py_XDECREF(hobj);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    return 0;
}

static int add_held(Reuse *r, int t, long d) { /* ReusePolicy._held[t] += d */
    long n = PyLong_AsLong(PyList_GET_ITEM(r->held, t));
    PyObject *v = n == -1 && PyErr_Occurred() ? NULL : PyLong_FromLong(n + d);
    return v == NULL ? -1 : PyList_SetItem(r->held, t, v);
}

/* OrderedDict.pop(key, None) as a new reference (None when absent). */
static PyObject *ghost_pop(PyObject *ghosts, PyObject *key) {
    PyObject *left = PyDict_GetItemWithError(ghosts, key);
    if (left == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_INCREF(left);
    if (PyObject_DelItem(ghosts, key) < 0) { Py_DECREF(left); return NULL; }
    return left;
}

/* ReusePolicy.demote_target without a gate: one tier down, none into a disk closed to this request. */
static int reuse_demote_target(State *s, int t) {
    int below = s->below[t];
    return below == DISK && s->reuse->disk_closed ? NONE : below;
}

/* ReusePolicy.on_insert (without teacher, gate or labels) and PageFeatures.insert of one page. */
static int reuse_insert(State *s, long h, int t) {
    Reuse *r = s->reuse;
    if (h >= r->pages) { /* beyond the columns: the policy's Python grows them */
        if (reuse_write_scalars(s, r) < 0 || hook_none(s, M_on_insert, h, t) < 0 || reuse_read_scalars(s, r) < 0) return -1;
        return reuse_columns(s, r);
    }
    if (advisors_hook(s, M_on_insert, h, t) < 0) return -1;
    r->where[h] = (int8_t)t;
    if (add_held(r, t, 1) < 0) return -1;
    r->recency[h] = ++r->clock;
    PyObject *key = PyList_GET_ITEM(s->keys, h);
    int moved = 0;
    if (r->leaving == h && (moved = PyObject_RichCompareBool(r->leaving_key, key, Py_EQ)) < 0) return -1;
    if (moved) { /* moved between tiers: the same page, its history stays (PageFeatures.returned) */
        PyObject *left = ghost_pop(r->ghosts, key);
        if (left == NULL) return -1;
        Py_DECREF(left);
    } else {
        double now = r->now;
        r->count[h] = 1.0, r->counted[h] = now, r->frequency[h] = r->pool_decay * now;
        PyObject *hobj = PyLong_FromLong(h);
        int rc = hobj == NULL ? -1 : PyDict_SetItem(r->key_of, hobj, key);
        Py_XDECREF(hobj);
        if (rc < 0) return -1;
        long parent = s->parent[h];
        int64_t root = parent == ROOT ? h : r->root[parent];
        r->inserted[h] = now, r->last[h] = now, r->last_ms[h] = r->now_ms;
        r->gap1[h] = NEVER_REQUESTS, r->gap2[h] = NEVER_REQUESTS;
        for (int k = 0; k < RB_COUNTERS; k++) r->counts[h * RB_COUNTERS + k] = 0.0;
        r->hits[h] = 0.0;
        r->depth[h] = (double)((long long)s->depth[h] * r->depth_scale);
        r->request_pages[h] = (double)(r->request_pages_now > 1 ? r->request_pages_now : 1);
        r->root[h] = root;
        r->ghost[h] = NEVER_REQUESTS;
        PyObject *left = ghost_pop(r->ghosts, key);
        if (left == NULL) return -1;
        if (left != Py_None) r->ghost[h] = now - PyFloat_AsDouble(left);
        Py_DECREF(left);
        if (PyErr_Occurred()) return -1;
    }
    r->leaving = NONE;
    Py_CLEAR(r->leaving_key);
    return 0;
}

/* ReusePolicy.on_remove and PageFeatures.left: the key is a ghost, the newest. */
static int reuse_remove(State *s, long h, int t) {
    Reuse *r = s->reuse;
    if (advisors_hook(s, M_on_remove, h, t) < 0) return -1;
    if (h >= r->pages) { PyErr_SetString(PyExc_IndexError, "reuse: a removed page beyond the columns"); return -1; }
    r->where[h] = -1;
    if (add_held(r, t, -1) < 0) return -1;
    PyObject *hobj = PyLong_FromLong(h), *key = hobj ? PyDict_GetItemWithError(r->key_of, hobj) : NULL;
    Py_XDECREF(hobj);
    if (key == NULL) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "reuse: handle %ld has no key", h);
        return -1;
    }
    Py_INCREF(key);
    PyObject *now = PyFloat_FromDouble(r->now);
    int had = now == NULL ? -1 : PyDict_Contains(r->ghosts, key), rc = had < 0 ? -1 : PyObject_SetItem(r->ghosts, key, now);
    Py_XDECREF(now);
    if (rc == 0 && had) { /* move_to_end: a new key is already the newest */
        PyObject *done = PyObject_CallMethodObjArgs(r->ghosts, M_move_to_end, key, NULL);
        rc = done == NULL ? -1 : 0;
        Py_XDECREF(done);
    }
    if (rc == 0 && PyDict_GET_SIZE(r->ghosts) > r->ghost_capacity) { /* popitem(last=False): the oldest goes */
        PyObject *it = PyObject_GetIter(r->ghosts), *oldest = it ? PyIter_Next(it) : NULL;
        Py_XDECREF(it);
        rc = oldest == NULL ? -1 : PyObject_DelItem(r->ghosts, oldest);
        Py_XDECREF(oldest);
        if (oldest == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "reuse: no ghost to forget");
    }
    if (rc < 0) { Py_DECREF(key); return -1; }
    Py_XSETREF(r->leaving_key, key);
    r->leaving = h;
    return 0;
}

/* ReusePolicy.on_admitted: the page's request length (PageContext.request_pages = the chain's). */
static int reuse_admitted(State *s, long h, Py_ssize_t request_pages, PyObject *ctx) {
    Reuse *r = s->reuse;
    long long n = (long long)request_pages * r->depth_scale;
    if (h >= r->pages) { PyErr_SetString(PyExc_IndexError, "reuse: an admitted page beyond the columns"); return -1; }
    r->request_pages[h] = (double)(n > 1 ? n : 1);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(r->admitted); i++) {
        PyObject *hobj = PyLong_FromLong(h), *res = hobj ? PyObject_CallMethodObjArgs(PyList_GET_ITEM(r->admitted, i), M_on_admitted, hobj, ctx, NULL) : NULL;
        Py_XDECREF(hobj);
        if (res == NULL) return -1;
        Py_DECREF(res);
    }
    return 0;
}

/* ReusePolicy.victim's first part: the next of the last ranking's pages still in the tier and
 * unpinned; NONE when none is pending (the caller asks the policy, which scores a pool). */
static long reuse_pending(State *s, int t) {
    Reuse *r = s->reuse;
    if (r->following) return NONE;
    PyObject *pending = PyDict_GetItemWithError(r->pending, TIER[t]);
    if (pending == NULL) return PyErr_Occurred() ? ERR : NONE;
    if (!PyList_Check(pending)) { PyErr_SetString(PyExc_TypeError, "reuse: a pending ranking is a list"); return ERR; }
    for (Py_ssize_t n = PyList_GET_SIZE(pending); n > 0; n--) {
        long h = PyLong_AsLong(PyList_GET_ITEM(pending, n - 1));
        if ((h == -1 && PyErr_Occurred()) || PyList_SetSlice(pending, n - 1, n, NULL) < 0) return ERR;
        if (h < 0 || h >= r->pages || h >= s->ncap) { PyErr_SetString(PyExc_IndexError, "reuse: a pending page beyond the columns"); return ERR; }
        if (r->where[h] == t && s->pins[h] == 0) return h;
    }
    return NONE;
}

#endif
