/* The links' part of the compiled chain writer's state (kvray/sim/_chain.c): the bookings of
 * one store_chain call on the node's links, written as kvray/sim/links.py's Link.occupy,
 * Link.earliest and links.book write them, and SimNode's moves and stores booked on them
 * (kvray/sim/node.py). Split from _chain_state.h, whose State and LinkSums it works on;
 * included once, by _chain.c, after _chain_state.h.
 */
#ifndef KVRAY_CHAIN_LINKS_H
#define KVRAY_CHAIN_LINKS_H
#include "_chain_state.h"
/* -- links: an unqueued link's Link.occupy, added up over the call ---------------------------
 * Each booking adds its bytes to bytes_by_kind, its time to busy_ms (one float addition per
 * booking, in order, as Python does), raises last_end_ms and pushes (end, bytes) on the
 * pending heap that Link.utilisation drains. Those sums are kept here and written back before
 * any Python code runs (a writer, a listener, a queued booking) and when the call ends; the
 * bookings of one call that end together are pushed as one entry of their summed bytes, which
 * Link.utilisation counts alike (it only adds up the bytes that arrived by a time). */

static int flush_link(State *s, LinkSums *l) {
    PyObject *link = l->link, *by_kind = PyObject_GetAttr(link, A_bytes_by_kind), *pending = NULL, *v = NULL;
    int rc = -1;
    if (by_kind == NULL) return -1;
    for (int k = 0; k < l->nkinds; k++) {
        PyObject *had = PyDict_GetItemWithError(by_kind, l->kinds[k]);
        long long n = had ? PyLong_AsLongLong(had) : 0;
        if (PyErr_Occurred() || (v = PyLong_FromLongLong(n + l->kind_count[k] * s->nbytes)) == NULL) goto done;
        if (PyDict_SetItem(by_kind, l->kinds[k], v) < 0) goto done;
        Py_CLEAR(v);
    }
    l->nkinds = 0;
    if ((v = PyFloat_FromDouble(l->busy)) == NULL || PyObject_SetAttr(link, A_busy_ms, v) < 0) goto done;
    Py_CLEAR(v);
    if (l->last > l->last0 && ((v = PyFloat_FromDouble(l->last)) == NULL || PyObject_SetAttr(link, A_last_end_ms, v) < 0)) goto done;
    Py_CLEAR(v);
    l->last0 = l->last;
    if ((pending = PyObject_GetAttr(link, A_pending)) == NULL) goto done;
    for (int e = 0; e < l->nends; e++) {
        if ((v = Py_BuildValue("(dL)", l->ends[e], l->end_count[e] * s->nbytes)) == NULL) goto done;
        PyObject *r = PyObject_CallFunctionObjArgs(heappush, pending, v, NULL);
        if (r == NULL) goto done;
        Py_DECREF(r);
        Py_CLEAR(v);
    }
    l->nends = 0;
    rc = 0;
done:
    Py_XDECREF(v);
    Py_XDECREF(pending);
    Py_DECREF(by_kind);
    return rc;
}

/* Write every link's sums back (they start again from the link's values at its next booking). */
static int flush_links(State *s) {
    int rc = 0;
    for (int i = 0; i < s->nlinks; i++) {
        if (rc == 0) rc = flush_link(s, &s->links[i]);
        Py_DECREF(s->links[i].link);
        Py_XDECREF(s->links[i].lane_starts);
        Py_XDECREF(s->links[i].lane_ends);
    }
    s->nlinks = 0;
    return rc;
}

static LinkSums *link_sums(State *s, PyObject *link) {
    for (int i = 0; i < s->nlinks; i++)
        if (s->links[i].link == link) return &s->links[i];
    if (s->nlinks == MAX_LINKS && flush_links(s) < 0) return NULL;
    LinkSums *l = &s->links[s->nlinks];
    PyObject *queued = PyObject_GetAttr(link, A_queued), *busy = NULL, *last = NULL;
    if (queued == NULL) return NULL;
    l->queued = PyObject_IsTrue(queued);
    Py_DECREF(queued);
    if (l->queued < 0) return NULL;
    if ((busy = PyObject_GetAttr(link, A_busy_ms)) == NULL || (last = PyObject_GetAttr(link, A_last_end_ms)) == NULL) {
        Py_XDECREF(busy);
        return NULL;
    }
    l->busy = PyFloat_AsDouble(busy);
    l->last = l->last0 = PyFloat_AsDouble(last);
    Py_DECREF(busy);
    Py_DECREF(last);
    l->lane_starts = l->queued ? PyObject_GetAttr(link, A_starts) : NULL;
    l->lane_ends = l->queued && l->lane_starts ? PyObject_GetAttr(link, A_ends) : NULL;
    if (l->queued && (l->lane_ends == NULL || !PyList_Check(l->lane_starts) || !PyList_Check(l->lane_ends) ||
                      PyList_GET_SIZE(l->lane_starts) != PyList_GET_SIZE(l->lane_ends))) {
        Py_XDECREF(l->lane_starts);
        Py_XDECREF(l->lane_ends);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a queued link's lanes");
        return NULL;
    }
    if (PyErr_Occurred()) return NULL;
    l->lanes = l->queued ? PyList_GET_SIZE(l->lane_starts) : 0;
    l->nkinds = l->nends = 0;
    Py_INCREF(link);
    l->link = link;
    s->nlinks++;
    return l;
}

/* Link._fit: the earliest start at or after ready at which a lane (its sorted bookings) is
 * idle for duration; bisect_right's search. -1 with an error set if a booking is not a number. */
static double lane_fit(PyObject *starts, PyObject *ends, double ready, double duration) {
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(ends), n = hi;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (ready < PyFloat_AsDouble(PyList_GET_ITEM(ends, mid))) hi = mid;
        else lo = mid + 1;
    }
    double start = ready;
    for (Py_ssize_t i = lo; i < n; i++) {
        if (start + duration <= PyFloat_AsDouble(PyList_GET_ITEM(starts, i))) break;
        double e = PyFloat_AsDouble(PyList_GET_ITEM(ends, i));
        if (e > start) start = e;
    }
    return PyErr_Occurred() ? -1.0 : start;
}

#define LANE(l, list, i) PyList_GET_ITEM((l)->lane_##list, i)

/* Link.earliest of a queued link: the earliest start at which some lane is idle. */
static double earliest(LinkSums *l, double ready, double duration) {
    double best = lane_fit(LANE(l, starts, 0), LANE(l, ends, 0), ready, duration);
    for (Py_ssize_t lane = 1; lane < l->lanes && best != ready && !PyErr_Occurred(); lane++) {
        double fits = lane_fit(LANE(l, starts, lane), LANE(l, ends, lane), ready, duration);
        if (fits < best) best = fits;
    }
    return best;
}

/* insort_right of x into a sorted list of floats. */
static int insort(PyObject *list, double x) {
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < PyFloat_AsDouble(PyList_GET_ITEM(list, mid))) hi = mid;
        else lo = mid + 1;
    }
    PyObject *v = PyFloat_FromDouble(x);
    int rc = v == NULL || PyErr_Occurred() ? -1 : PyList_Insert(list, lo, v);
    Py_XDECREF(v);
    return rc;
}

/* The lanes' part of Link.occupy: the first lane idle from start to end holds the booking. */
static int occupy_lane(LinkSums *l, double start, double end) {
    for (Py_ssize_t lane = 0; lane < l->lanes; lane++) {
        PyObject *starts = LANE(l, starts, lane), *ends = LANE(l, ends, lane);
        double fits = lane_fit(starts, ends, start, end - start);
        if (PyErr_Occurred()) return -1;
        if (fits > start) continue;
        Py_ssize_t n = PyList_GET_SIZE(ends);
        if (n == 0 || start >= PyFloat_AsDouble(PyList_GET_ITEM(ends, n - 1))) {
            PyObject *a = PyFloat_FromDouble(start), *b = PyFloat_FromDouble(end);
            int rc = a == NULL || b == NULL || PyErr_Occurred() || PyList_Append(starts, a) < 0 || PyList_Append(ends, b) < 0;
            Py_XDECREF(a);
            Py_XDECREF(b);
            return rc ? -1 : 0;
        }
        return insort(starts, start) < 0 || insort(ends, end) < 0 ? -1 : 0;
    }
    PyErr_Format(PyExc_ValueError, "link %R: no lane idle for a booking it was fitted into", l->link);
    return -1;
}

/* links.book at the node's clock: the earliest start at which every queued link of the path
 * has a lane idle throughout (an unqueued link never delays), then each link holds it. */
static int book(State *s, PyObject *path, double duration, PyObject *kind) {
    Py_ssize_t n = PyTuple_GET_SIZE(path);
    LinkSums *sums[MAX_LINKS];
    if (n > MAX_LINKS) return PyErr_SetString(PyExc_ValueError, "a path of too many links"), -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((sums[i] = link_sums(s, PyTuple_GET_ITEM(path, i))) == NULL) return -1;
    double start = s->node_clock;
    for (;;) {
        double latest = start;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!sums[i]->queued) continue;
            double fits = earliest(sums[i], start, duration);
            if (PyErr_Occurred()) return -1;
            if (fits > latest) latest = fits;
        }
        if (latest == start) break;
        start = latest;
    }
    double end = start + duration;
    for (Py_ssize_t i = 0; i < n; i++) {
        LinkSums *l = sums[i];
        if (l->queued && occupy_lane(l, start, end) < 0) return -1;
        int k = 0, e = 0;
        while (k < l->nkinds && l->kinds[k] != kind) k++;
        while (e < l->nends && l->ends[e] != end) e++;
        if (k == MAX_KINDS || e == MAX_ENDS) {
            if (flush_link(s, l) < 0) return -1;
            k = e = 0;
        }
        if (k == l->nkinds) l->nkinds++, l->kinds[k] = kind, l->kind_count[k] = 0;
        if (e == l->nends) l->nends++, l->ends[e] = end, l->end_count[e] = 0;
        l->kind_count[k]++;
        l->end_count[e]++;
        l->busy += end - start;
        if (end > l->last) l->last = end;
    }
    return 0;
}

/* SimNode.mover / _write_local: book node._moves[src, dst] or node._stores[tier]. */
static int book_move(State *s, int src, int dst) {
    PyObject *move = s->move[src][dst];
    if (move == NULL) {
        PyObject *pair = PyTuple_Pack(2, TIER[src], TIER[dst]);
        if (pair == NULL) return -1;
        move = s->move[src][dst] = PyDict_GetItemWithError(s->moves, pair);
        Py_DECREF(pair);
        if (move == NULL) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "no path for a move"); return -1; }
    }
    double duration = PyFloat_AsDouble(PyTuple_GET_ITEM(move, 1));
    if (duration == -1.0 && PyErr_Occurred()) return -1;
    if (book(s, PyTuple_GET_ITEM(move, 0), duration, PyTuple_GET_ITEM(move, 2)) < 0) return -1;
    s->background += duration;
    return 0;
}

#endif
