/* The simulator's chain writer in C: CacheManager.store_chain, with its whole eviction cascade
 * (reserve, demote, drop) and the node's link bookings, in one call per request instead of ~60
 * Python calls per stored page (docs/design.md, "Replay speed"). Under LRU its hooks run here
 * too; under any other policy (generic) the policy's own hooks (admit, victim, demote_target,
 * on_insert, on_remove, on_admitted) are called from here where the manager's Python calls them.
 *
 * It is a transcription of kvray/core/manager.py (store_chain, _reserve_under, _make_room,
 * _held_with, evict, relocate, drop), kvray/core/index.py (add, remove, move, subtree),
 * LRUPolicy's hooks (kvray/core/placement.py), SlotAllocator (kvray/core/tiers/slots.py,
 * heapq's own sift order) and the unqueued case of kvray/sim/links.py's book, working on
 * those objects' own state (the index's numpy columns, its key dict, the policy's
 * OrderedDicts, the allocators' heaps), so that Python code before and after a call sees
 * exactly what the Python path leaves. The Python path stays the reference:
 * kvray.sim.node.SimNode.store_chain calls this only where it is a faithful copy (no page kept
 * outside the call, a policy whose demote_target may be asked in another order), and
 * tests/sim/test_replay_fingerprint.py replays every recorded cell through both paths.
 *
 * store_chain(manager, node, keys, write, parent, start, stop, tenant="", generic=False, native=False) -> pages stored
 *   write: None for the node's own engine (node._stores' booking, checksum 0), else the
 *   Python writer; moves book node._moves[src, dst] (links.book's search of the lanes of
 *   queued links included).
 */
#include "_chain_state.h"
#include "_chain_links.h"
#include "_chain_s3fifo.h"
#include "_chain_reuse.h"

/* -- the cascade ---------------------------------------------------------------------------- */
static long make_room(State *s, int t);

/* CacheManager.drop of one victim: pages dropped (0: it or a descendant is pinned or kept). */
static long drop(State *s, long victim) {
    long n = 1, cap = 16, *doomed = PyMem_Malloc(cap * sizeof(long)), *stack = NULL;
    if (doomed == NULL) { PyErr_NoMemory(); return ERR; }
    doomed[0] = victim;
    if (s->first[victim] == NONE) {
        for (int i = 0; i < s->nkept; i++)
            if (s->kept[i] == victim) { PyMem_Free(doomed); return 0; }
        if (s->pins[victim] > 0) { PyMem_Free(doomed); return 0; }
    } else {
        if (keeps_descendant(s, victim)) { PyMem_Free(doomed); return 0; }
        /* index.subtree: depth first, children before parents */
        long top = 0, scap = 16;
        stack = PyMem_Malloc(scap * sizeof(long));
        if (stack == NULL) { PyMem_Free(doomed); PyErr_NoMemory(); return ERR; }
        stack[top++] = victim;
        n = 0;
        while (top) {
            long h = stack[--top];
            if (n == cap && (doomed = PyMem_Realloc(doomed, (cap *= 2) * sizeof(long))) == NULL) goto nomem;
            doomed[n++] = h;
            for (long child = s->first[h]; child != NONE; child = s->next[child]) {
                if (top == scap && (stack = PyMem_Realloc(stack, (scap *= 2) * sizeof(long))) == NULL) goto nomem;
                stack[top++] = child;
            }
        }
        PyMem_Free(stack);
        for (long i = 0; i < n / 2; i++) { long x = doomed[i]; doomed[i] = doomed[n - 1 - i]; doomed[n - 1 - i] = x; }
        for (long i = 0; i < n; i++)
            if (s->pins[doomed[i]] > 0) { PyMem_Free(doomed); return 0; }
    }
    for (long i = 0; i < n; i++) {
        long h = doomed[i];
        int t = s->tier[h];
        long slot = s->slot[h];
        if (lru_remove(s, h, t) < 0 || index_remove(s, h) < 0 || free_slot(s, t, slot) < 0) { PyMem_Free(doomed); return ERR; }
    }
    PyMem_Free(doomed);
    s->evicted += n;
    return n;
nomem:
    PyMem_Free(doomed);
    PyMem_Free(stack);
    PyErr_NoMemory();
    return ERR;
}

/* CacheManager.relocate: 1 moved, 0 the page stays (no room below), -1 error. */
static int relocate(State *s, long h, int dst) {
    int src = s->tier[h];
    long src_slot = s->slot[h], dst_slot = alloc_slot(s, dst);
    if (dst_slot == ERR) return -1;
    if (dst_slot == NO_SLOT) {
        if (keep(s, h) < 0) return -1;
        dst_slot = make_room(s, dst);
        release(s, h);
        if (dst_slot == ERR) return -1;
        if (dst_slot == NO_SLOT) return 0;
    }
    if (book_move(s, src, dst) < 0) return -1;
    if (lru_remove(s, h, src) < 0) return -1;
    s->tier[h] = (int8_t)dst;
    s->slot[h] = (int32_t)dst_slot;
    if (placed(s, h, dst, dst_slot) < 0 || lru_insert(s, h, dst) < 0 || free_slot(s, src, src_slot) < 0) return -1;
    return count(s->moved_pages, MOVE_NAME[src][dst]) < 0 ? -1 : 1;
}

/* Pin ``h`` as refused for this reservation (unpinned when make_room returns). */
static int refuse(long **refused, long *nrefused, long *cap, State *s, long h) {
    if (*nrefused == *cap) {
        long *more = PyMem_Realloc(*refused, (*cap = *cap ? 2 * *cap : 64) * sizeof(long));
        if (more == NULL) { PyErr_NoMemory(); return -1; }
        *refused = more;
    }
    s->pins[h]++;
    (*refused)[(*nrefused)++] = h;
    return 0;
}

/* CacheManager._make_room: a slot of tier t by evicting; NO_SLOT if none can leave. */
static long make_room(State *s, int t) {
    long *refused = NULL, nrefused = 0, cap = 0, result = NO_SLOT;
    for (;;) {
        long victim = lru_victim(s, t);
        if (victim == ERR) { result = ERR; break; }
        if (victim == NONE || nrefused >= REFUSALS_PER_RESERVE) break;
        int target = demote_target(s, victim, t), moved = 0;
        if (target == -2) { result = ERR; break; }
        if (target >= 0 && (moved = relocate(s, victim, target)) < 0) { result = ERR; break; }
        if (!moved) {
            long dropped = drop(s, victim);
            if (dropped == ERR) { result = ERR; break; }
            moved = dropped > 0;
        }
        if (moved) {
            long slot = alloc_slot(s, t);
            if (slot == ERR || slot != NO_SLOT) { result = slot; break; }
            continue;
        }
        /* _held_with: the victim, and when a kept page is it or below it every unpinned page
         * of t in a kept lineage that the policy demotes nowhere or where the victim's demotion
         * failed (LRU demotes every page of a tier to the same tier), refuse together; pinned
         * as they are found, so a page in two lineages counts once (a generic policy's
         * demote_target must not depend on pins or on the order it is asked in: SimNode) */
        int lineages = keeps_descendant(s, victim);
        long before = nrefused;
        for (int i = -1; i < (lineages ? s->nkept : 0); i++)
            for (long up = i < 0 ? victim : s->kept[i]; up != ROOT; up = i < 0 ? ROOT : s->parent[up]) {
                if (s->tier[up] != t || s->pins[up] != 0) continue;
                if (s->generic && up != victim) {
                    int dst = demote_target(s, up, t);
                    if (dst == -2) { result = ERR; goto out; }
                    if (dst >= 0 && dst != target) continue;
                }
                if (refuse(&refused, &nrefused, &cap, s, up) < 0) { result = ERR; goto out; }
            }
        /* none held (a generic policy named a pinned page): the victim itself, as the Python
         * path does (``held or [victim]``), so the refusals count and the loop ends */
        if (nrefused == before && refuse(&refused, &nrefused, &cap, s, victim) < 0) { result = ERR; goto out; }
    }
out:
    for (long i = 0; i < nrefused; i++) s->pins[refused[i]]--;
    PyMem_Free(refused);
    return result;
}

/* CacheManager._reserve_under: a slot for a child of parent, which is kept meanwhile. */
static long reserve_under(State *s, long parent, int t) {
    long slot = alloc_slot(s, t);
    if (slot != NO_SLOT || parent == ROOT) return slot == NO_SLOT ? make_room(s, t) : slot;
    if (keep(s, parent) < 0) return ERR;
    slot = make_room(s, t);
    release(s, parent);
    return slot;
}

static long store_pages(State *s, PyObject *keys, PyObject *write, long parent, Py_ssize_t start, Py_ssize_t stop, int admit) {
    long stored = 0;
    for (Py_ssize_t depth = start; depth < stop; depth++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, depth);
        PyObject *hobj = PyDict_GetItemWithError(s->handles, key);
        if (hobj != NULL) {
            if ((parent = PyLong_AsLong(hobj)) == -1 && PyErr_Occurred()) return ERR;
            continue;
        }
        if (PyErr_Occurred()) return ERR;
        PyObject *ctx = NULL;
        int context = s->generic && (s->reuse == NULL || PyList_GET_SIZE(s->reuse->admitted)); /* reuse's: for advisors only */
        if (context) { /* CacheManager.admit(PageContext(depth, request_pages, 0, tenant, key)) */
            PyObject *args = Py_BuildValue("(nniOO)", depth, PySequence_Fast_GET_SIZE(keys), 0, s->tenant, key);
            ctx = args == NULL ? NULL : PyObject_Call(PageContextType, args, NULL);
            Py_XDECREF(args);
            if (ctx == NULL) return ERR;
        }
        if (s->generic && s->reuse == NULL) { /* reuse admits into its first tier (PlacementPolicy.admit) */
            PyObject *tier = PyObject_CallMethodObjArgs(s->policy, M_admit, ctx, NULL);
            if (tier == NULL) { Py_DECREF(ctx); return ERR; }
            int rc = present_tier(s, tier, &admit);
            Py_DECREF(tier);
            if (rc < 0) { Py_DECREF(ctx); return ERR; }
            if (admit < 0) { Py_DECREF(ctx); break; }
        }
        long slot = reserve_under(s, parent, admit);
        if (slot == ERR || slot == NO_SLOT) Py_XDECREF(ctx);
        if (slot == ERR) return ERR;
        if (slot == NO_SLOT) break;
        uint64_t checksum = 0;
        if (write == Py_None) { /* SimNode._write_local */
            PyObject *path = PyDict_GetItemWithError(s->stores, TIER[admit]);
            if (path != NULL) book(s, PyTuple_GET_ITEM(path, 0), PyFloat_AsDouble(PyTuple_GET_ITEM(path, 1)), store_kind);
            else if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "no path for a store");
        } else {
            PyObject *r = flush_links(s) < 0 ? NULL : PyObject_CallFunction(write, "nOOll", depth, key, TIER[admit], slot, parent);
            if (r != NULL) checksum = PyLong_AsUnsignedLongLongMask(r);
            Py_XDECREF(r);
        }
        if (PyErr_Occurred()) { /* abort_store: the slot goes back, the error on */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            free_slot(s, admit, slot);
            PyErr_Restore(type, value, tb);
            Py_XDECREF(ctx);
            return ERR;
        }
        long h = index_add(s, key, admit, slot, checksum, parent, (long)depth);
        if (h == ERR || placed(s, h, admit, slot) < 0 || lru_insert(s, h, admit) < 0) { Py_XDECREF(ctx); return ERR; }
        if (s->reuse && reuse_admitted(s, h, PySequence_Fast_GET_SIZE(keys), ctx) < 0) { Py_XDECREF(ctx); return ERR; }
        if (ctx != NULL && s->reuse) Py_CLEAR(ctx);
        if (ctx != NULL) { /* policy.on_admitted(handle, ctx) */
            PyObject *hobj = PyLong_FromLong(h), *r = hobj ? PyObject_CallMethodObjArgs(s->policy, M_on_admitted, hobj, ctx, NULL) : NULL;
            Py_XDECREF(hobj);
            Py_DECREF(ctx);
            if (r == NULL) return ERR;
            Py_DECREF(r);
        }
        s->stored++;
        if (count(s->stored_by_tier, LABEL[admit]) < 0) return ERR;
        stored++;
        parent = h;
    }
    return stored;
}

/* -- the call: gather the objects' state, run, write the scalars back -------------------------- */
#define GET(dst, obj, name) if ((dst = PyObject_GetAttrString(obj, name)) == NULL) goto fail
#define TIER_ITEM(dict, t) PyDict_GetItemWithError(dict, TIER[t])

static int add_long(PyObject *obj, const char *name, long long n) {
    PyObject *had = PyObject_GetAttrString(obj, name), *sum = NULL, *d = PyLong_FromLongLong(n);
    int rc = -1;
    if (had != NULL && d != NULL && (sum = PyNumber_Add(had, d)) != NULL) rc = PyObject_SetAttrString(obj, name, sum);
    Py_XDECREF(had); Py_XDECREF(sum); Py_XDECREF(d);
    return rc;
}

static PyObject *store_chain(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *manager, *node, *keys_arg, *write, *tenant = NULL;
    long parent;
    Py_ssize_t start, stop;
    int generic = 0, native = 0;
    if (!PyArg_ParseTuple(args, "OOOOlnn|Opp", &manager, &node, &keys_arg, &write, &parent, &start, &stop, &tenant, &generic, &native))
        return NULL;
    State s;
    Reuse reuse;
    memset(&s, 0, sizeof(s));
    memset(&reuse, 0, sizeof(reuse));
    reuse.leaving = NONE;
    s.generic = generic || native;
    for (int t = 0; t < NTIERS; t++) s.below[t] = -1;
    PyObject *policy = NULL, *slots = NULL, *metrics = NULL, *order = NULL, *below = NULL, *ptiers = NULL;
    PyObject *keys = NULL, *clock = NULL, *bg = NULL, *result = NULL;
    long stored = ERR;
    int admit = -1, ran = 0;
    s.manager = manager, s.node = node;
    if ((keys = PySequence_Fast(keys_arg, "keys must be a sequence")) == NULL) return NULL;
    if (stop > PySequence_Fast_GET_SIZE(keys) || start < 0) { PyErr_SetString(PyExc_IndexError, "start/stop"); goto fail; }
    GET(s.index, manager, "index"); GET(policy, manager, "policy"); GET(slots, manager, "slots");
    GET(metrics, manager, "metrics"); GET(s.slot_freed, manager, "slot_freed");
    GET(s.page_placed, manager, "page_placed"); GET(s.page_dropped, manager, "page_dropped");
    GET(s.handles, s.index, "_handles"); GET(s.keys, s.index, "_keys"); GET(s.free_handles, s.index, "_free_handles");
    GET(s.cols, s.index, "_cols"); GET(clock, s.index, "clock");
    if (generic) { /* the policy's own hooks: no LRU state to read */
        order = PyDict_New(), s.tier_of = PyDict_New();
        if (order == NULL || s.tier_of == NULL) goto fail;
    } else {
        GET(order, policy, "_order"); GET(s.tier_of, policy, "_tier_of");
    }
    GET(below, policy, "_below"); GET(ptiers, policy, "tiers");
    s.policy = policy;
    s.tenant = tenant != NULL ? tenant : empty_tenant;
    GET(s.moved_pages, metrics, "moved_pages"); GET(s.stored_by_tier, metrics, "stored_by_tier");
    GET(s.moves, node, "_moves"); GET(s.stores, node, "_stores"); GET(s.clock_obj, node, "clock");
    GET(s.nbytes_obj, node, "page_nbytes"); GET(bg, node, "background_ms");
    if (!PyList_Check(s.keys) || !PyList_Check(s.free_handles) || !PyDict_Check(s.handles) || !PyDict_Check(s.cols) ||
        !PyDict_Check(s.tier_of) || !PyDict_Check(slots) || !PyDict_Check(order) || !PyDict_Check(below) ||
        !PyDict_Check(s.moved_pages) || !PyDict_Check(s.stored_by_tier) || !PyDict_Check(s.moves) ||
        !PyDict_Check(s.stores) || PyList_GET_SIZE(ptiers) == 0) {
        PyErr_SetString(PyExc_TypeError, "store_chain: not a CacheManager under LRUPolicy and a SimNode");
        goto fail;
    }
    if ((s.clock = PyLong_AsLongLong(clock)) == -1 && PyErr_Occurred()) goto fail;
    if ((s.node_clock = PyFloat_AsDouble(s.clock_obj)) == -1.0 && PyErr_Occurred()) goto fail;
    if ((s.background = PyFloat_AsDouble(bg)) == -1.0 && PyErr_Occurred()) goto fail;
    if ((s.nbytes = PyLong_AsLongLong(s.nbytes_obj)) == -1 && PyErr_Occurred()) goto fail;
    for (int t = 0; t < NTIERS; t++) {
        PyObject *alloc = TIER_ITEM(slots, t), *used = NULL;
        if (!generic && (s.order[t] = TIER_ITEM(order, t)) == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "LRU order of a tier");
            goto fail;
        }
        if (alloc == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        GET(s.free_list[t], alloc, "_free");
        GET(used, alloc, "_used");
        int ok = PyList_Check(s.free_list[t]) && PyByteArray_Check(used);
        s.used[t] = ok ? PyByteArray_AS_STRING(used) : NULL;
        Py_DECREF(used); /* the allocator holds it */
        if (!ok) { PyErr_SetString(PyExc_TypeError, "slot allocator"); goto fail; }
        s.present[t] = 1;
    }
    for (int t = 0; t < NTIERS; t++) {
        PyObject *dst = TIER_ITEM(below, t);
        long d = dst == NULL || dst == Py_None ? -1 : PyLong_AsLong(dst);
        if (PyErr_Occurred()) goto fail;
        s.below[t] = d >= 0 && d < NTIERS && s.present[d] ? (int)d : -1;
    }
    admit = (int)PyLong_AsLong(PyList_GET_ITEM(ptiers, 0));
    if (admit < 0 || admit >= NTIERS || PyErr_Occurred()) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "tier"); goto fail; }
    if (load_columns(&s) < 0) goto fail;
    if (parent != ROOT && !indexed(&s, parent, -1)) {
        PyErr_Format(PyExc_IndexError, "store_chain: parent handle %ld is not a page of the index", parent);
        goto fail;
    }
    if (native && (s.reuse = &reuse, reuse_load(&s, &reuse) < 0)) goto fail;
    if (generic && !native && (s.s3fifo = is_s3fifo(policy)) < 0) goto fail;
    ran = 1;
    stored = s.present[admit] ? store_pages(&s, keys, write, parent, start, stop, admit) : 0;
fail:
    release_columns(&s);
    if (s.reuse) { /* reuse's scalars, also after an error */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int rc = reuse_unload(&s, &reuse);
        if (type != NULL) { /* the first error wins */
            if (rc < 0) PyErr_Clear();
            PyErr_Restore(type, value, tb);
        }
    }
    if (ran) { /* the scalars the run changed, also after an error: the state above is the Python path's */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *c = PyLong_FromLongLong(s.clock), *b = PyFloat_FromDouble(s.background);
        int rc = flush_links(&s) < 0 || c == NULL || b == NULL || PyObject_SetAttrString(s.index, "clock", c) < 0 ||
                 PyObject_SetAttrString(node, "background_ms", b) < 0 || add_long(metrics, "stored_pages", s.stored) < 0 ||
                 add_long(metrics, "evicted_pages", s.evicted) < 0;
        Py_XDECREF(c); Py_XDECREF(b);
        if (type != NULL) PyErr_Restore(type, value, tb);
        else if (!rc && stored != ERR) result = PyLong_FromLong(stored);
    }
    for (int t = 0; t < NTIERS; t++) Py_XDECREF(s.free_list[t]);
    Py_XDECREF(s.index); Py_XDECREF(policy); Py_XDECREF(slots); Py_XDECREF(metrics); Py_XDECREF(s.slot_freed);
    Py_XDECREF(s.page_placed); Py_XDECREF(s.page_dropped); Py_XDECREF(s.handles); Py_XDECREF(s.keys);
    Py_XDECREF(s.free_handles); Py_XDECREF(s.cols); Py_XDECREF(clock); Py_XDECREF(order); Py_XDECREF(s.tier_of);
    Py_XDECREF(below); Py_XDECREF(ptiers); Py_XDECREF(s.moved_pages); Py_XDECREF(s.stored_by_tier);
    Py_XDECREF(s.moves); Py_XDECREF(s.stores); Py_XDECREF(s.clock_obj); Py_XDECREF(s.nbytes_obj); Py_XDECREF(bg);
    Py_DECREF(keys);
    return result;
}

static PyMethodDef methods[] = {
    {"store_chain", store_chain, METH_VARARGS,
     "store_chain(manager, node, keys, write, parent, start, stop, tenant='', generic=False, native=False) -> pages stored "
     "(see kvray/sim/node.py; generic: the policy's own hooks, in Python, instead of LRU's; native: a ReusePolicy's, in C)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

static PyObject *import(const char *module, const char *name) {
    PyObject *m = PyImport_ImportModule(module), *attr = m ? PyObject_GetAttrString(m, name) : NULL;
    Py_XDECREF(m);
    return attr;
}

PyMODINIT_FUNC PyInit__chain(void) {
    PyObject *tiers = import("kvray.core.tiers", "Tier"), *labels = import("kvray.core.tiers", "TIER_LABELS");
    int ok = tiers != NULL && labels != NULL && PyTuple_Check(labels) && PyTuple_GET_SIZE(labels) == NTIERS;
    for (int t = 0; ok && t < NTIERS; t++) {
        ok = (TIER[t] = PyObject_CallFunction(tiers, "i", t)) != NULL;
        LABEL[t] = PyTuple_GET_ITEM(labels, t);
        Py_INCREF(LABEL[t]);
    }
    if (ok) { /* DISK (_chain_state.h) is Tier.DISK's value */
        PyObject *disk = PyObject_GetAttrString(tiers, "DISK");
        long value = disk == NULL ? -1 : PyLong_AsLong(disk);
        Py_XDECREF(disk);
        if (value != DISK && !PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "kvray.sim._chain: Tier.DISK is not DISK");
        ok = value == DISK;
    }
    for (int t = 0; ok && t < NTIERS; t++)
        for (int d = 0; ok && d < NTIERS; d++) ok = (MOVE_NAME[t][d] = PyUnicode_FromFormat("%U->%U", LABEL[t], LABEL[d])) != NULL;
    Py_XDECREF(tiers);
    Py_XDECREF(labels);
    if (!ok || (heappush = import("heapq", "heappush")) == NULL ||
        (store_kind = PyUnicode_InternFromString("store")) == NULL ||
        (A_queued = PyUnicode_InternFromString("queued")) == NULL ||
        (M_on_insert = PyUnicode_InternFromString("on_insert")) == NULL ||
        (M_on_remove = PyUnicode_InternFromString("on_remove")) == NULL ||
        (M_victim = PyUnicode_InternFromString("victim")) == NULL ||
        (M_demote_target = PyUnicode_InternFromString("demote_target")) == NULL ||
        (M_admit = PyUnicode_InternFromString("admit")) == NULL ||
        (M_on_admitted = PyUnicode_InternFromString("on_admitted")) == NULL ||
        (M_move_to_end = PyUnicode_InternFromString("move_to_end")) == NULL ||
        (empty_tenant = PyUnicode_InternFromString("")) == NULL ||
        (PageContextType = import("kvray.core.placement", "PageContext")) == NULL ||
        (A_bytes_by_kind = PyUnicode_InternFromString("bytes_by_kind")) == NULL ||
        (A_busy_ms = PyUnicode_InternFromString("busy_ms")) == NULL ||
        (A_last_end_ms = PyUnicode_InternFromString("last_end_ms")) == NULL ||
        (A_pending = PyUnicode_InternFromString("_pending")) == NULL ||
        (A_starts = PyUnicode_InternFromString("_starts")) == NULL || (A_ends = PyUnicode_InternFromString("_ends")) == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ImportError, "kvray.core.tiers: four tiers expected");
        return NULL;
    }
    return PyModule_Create(&module);
}
