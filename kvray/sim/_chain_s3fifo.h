/* S3-FIFO's insert and removal hooks in the compiled chain writer (kvray/sim/_chain.c): what
 * S3FIFOPolicy.on_insert and on_remove (kvray/policy/s3fifo.py) write, on its own OrderedDicts
 * (each tier's small, main and ghost queues) and frequency dict, instead of two Python calls per
 * page moved. They run where an S3-FIFO keeps the learned policy's tripwire company (its
 * advisor over the real cache, its shadow: kvray/policy/reuse_online.py) or serves a cache
 * alone; its victim stays Python's. The Python hooks stay the reference:
 * tests/sim/test_chain.py's s3fifo stores and tests/policy/test_reuse_native.py compare them.
 *
 * Included once, by _chain.c, after _chain_state.h.
 */
#ifndef KVRAY_CHAIN_S3FIFO_H
#define KVRAY_CHAIN_S3FIFO_H

static PyObject *s3fifo_insert_hook, *s3fifo_remove_hook; /* S3FIFOPolicy's, set at the first question */
static PyObject *A_queues, *A_frequency, *A_small, *A_main, *A_ghost, *A_ghost_capacity, *ZERO;

/* Whether policy's insert and removal hooks are S3FIFOPolicy's own: 1, 0, or -1 on error. */
static int is_s3fifo(PyObject *policy) {
    if (s3fifo_insert_hook == NULL) {
        PyObject *cls = import("kvray.policy.s3fifo", "S3FIFOPolicy");
        if (cls == NULL || (s3fifo_insert_hook = PyObject_GetAttrString(cls, "on_insert")) == NULL ||
            (s3fifo_remove_hook = PyObject_GetAttrString(cls, "on_remove")) == NULL ||
            (A_queues = PyUnicode_InternFromString("_queues")) == NULL ||
            (A_frequency = PyUnicode_InternFromString("_frequency")) == NULL ||
            (A_small = PyUnicode_InternFromString("small")) == NULL || (A_main = PyUnicode_InternFromString("main")) == NULL ||
            (A_ghost = PyUnicode_InternFromString("ghost")) == NULL ||
            (A_ghost_capacity = PyUnicode_InternFromString("ghost_capacity")) == NULL || (ZERO = PyLong_FromLong(0)) == NULL) {
            Py_XDECREF(cls);
            Py_CLEAR(s3fifo_insert_hook);
            return -1;
        }
        Py_DECREF(cls);
    }
    PyObject *insert = PyObject_GetAttrString((PyObject *)Py_TYPE(policy), "on_insert");
    PyObject *remove = insert ? PyObject_GetAttrString((PyObject *)Py_TYPE(policy), "on_remove") : NULL;
    int same = insert == s3fifo_insert_hook && remove == s3fifo_remove_hook;
    if (insert == NULL || remove == NULL) PyErr_Clear(); /* no such hooks: not S3-FIFO */
    Py_XDECREF(insert);
    Py_XDECREF(remove);
    return same;
}

/* The policy's queues of tier t and its frequency dict (borrowed from the policy: it holds them). */
static int s3fifo_state(PyObject *policy, int t, PyObject **small, PyObject **main, PyObject **ghost, PyObject **frequency) {
    PyObject *queues = PyObject_GetAttr(policy, A_queues), *q = queues ? PyDict_GetItemWithError(queues, TIER[t]) : NULL;
    Py_XDECREF(queues);
    if (q == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "S3-FIFO: no queues for the tier");
        return -1;
    }
    PyObject *objs[4] = {PyObject_GetAttr(q, A_small), PyObject_GetAttr(q, A_main), PyObject_GetAttr(q, A_ghost),
                         PyObject_GetAttr(policy, A_frequency)};
    int ok = objs[0] && objs[1] && objs[2] && objs[3];
    for (int i = 0; i < 4; i++) Py_XDECREF(objs[i]); /* _Queues and the policy hold them */
    if (!ok) return -1;
    *small = objs[0], *main = objs[1], *ghost = objs[2], *frequency = objs[3];
    return 0;
}

/* S3FIFOPolicy.on_insert: into the main queue when the key is a ghost of the tier, else the small one. */
static int s3fifo_insert(State *s, PyObject *policy, long h, int t) {
    PyObject *small, *main, *ghost, *frequency;
    if (s3fifo_state(policy, t, &small, &main, &ghost, &frequency) < 0) return -1;
    PyObject *key = PyList_GET_ITEM(s->keys, h), *hobj = PyLong_FromLong(h);
    if (hobj == NULL) return -1;
    int ghosted = PyDict_Contains(ghost, key), rc = ghosted < 0 ? -1 : 0;
    if (ghosted > 0) rc = PyObject_DelItem(ghost, key);
    if (rc == 0) rc = PyObject_SetItem(ghosted ? main : small, hobj, Py_None);
    if (rc == 0) rc = PyObject_SetItem(frequency, hobj, ZERO);
    Py_DECREF(hobj);
    return rc;
}

/* S3FIFOPolicy.on_remove: a page leaving the small queue leaves its key as the tier's newest ghost. */
static int s3fifo_remove(State *s, PyObject *policy, long h, int t) {
    PyObject *small, *main, *ghost, *frequency;
    if (s3fifo_state(policy, t, &small, &main, &ghost, &frequency) < 0) return -1;
    PyObject *hobj = PyLong_FromLong(h);
    if (hobj == NULL) return -1;
    int in_small = PyDict_Contains(small, hobj), rc = in_small < 0 ? -1 : PyObject_DelItem(in_small ? small : main, hobj);
    if (rc == 0 && in_small) { /* _Queues.remember(key) */
        PyObject *key = PyList_GET_ITEM(s->keys, h);
        int had = PyDict_Contains(ghost, key);
        rc = had < 0 ? -1 : PyObject_SetItem(ghost, key, Py_None);
        if (rc == 0 && had) {
            PyObject *done = PyObject_CallMethodObjArgs(ghost, M_move_to_end, key, NULL);
            rc = done == NULL ? -1 : 0;
            Py_XDECREF(done);
        }
        PyObject *q = NULL, *queues = rc == 0 ? PyObject_GetAttr(policy, A_queues) : NULL, *cap = NULL;
        if (queues != NULL && (q = PyDict_GetItemWithError(queues, TIER[t])) != NULL) cap = PyObject_GetAttr(q, A_ghost_capacity);
        Py_XDECREF(queues);
        long capacity = cap == NULL ? -1 : PyLong_AsLong(cap);
        Py_XDECREF(cap);
        if (rc == 0 && (cap == NULL || PyErr_Occurred())) rc = -1;
        if (rc == 0 && PyDict_GET_SIZE(ghost) > capacity) { /* popitem(last=False) */
            PyObject *it = PyObject_GetIter(ghost), *oldest = it ? PyIter_Next(it) : NULL;
            Py_XDECREF(it);
            rc = oldest == NULL ? -1 : PyObject_DelItem(ghost, oldest);
            Py_XDECREF(oldest);
            if (oldest == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "S3-FIFO: no ghost to forget");
        }
    }
    if (rc == 0) rc = PyObject_DelItem(frequency, hobj);
    Py_DECREF(hobj);
    return rc;
}

#endif
