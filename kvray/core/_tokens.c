/* Token ids from a Python list or tuple, packed as little-endian int32 in one C loop.
 *
 * Engines pass token ids as Python lists, and a lookup hashes eight 256-token pages in a
 * few microseconds: converting 2,048 ints with array('I') took twice that, most of the
 * lookup. pack(seq) walks the sequence once, reading each int's value directly.
 *
 * It returns a bytearray of len(seq) * 4 bytes, or None when any item is not an int in
 * [0, 2**31) (or the sequence is empty): kvray.core.keys then takes its general path,
 * which says what is wrong. It never raises for bad items.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static PyObject *pack(PyObject *module, PyObject *seq) {
    (void)module;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n == 0) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyByteArray_AS_STRING(out);
    /* A list may not change size under us: nothing below runs Python code (the items
     * are exact ints or subclasses read through PyLong_AsLongAndOverflow, which calls
     * no __index__ on an int). */
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_Check(item)) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        int overflow = 0;
        long value = PyLong_AsLongAndOverflow(item, &overflow);
        if (overflow || value < 0 || value > INT32_MAX) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        uint32_t v = (uint32_t)value;
        dst[4 * i] = (uint8_t)v;
        dst[4 * i + 1] = (uint8_t)(v >> 8);
        dst[4 * i + 2] = (uint8_t)(v >> 16);
        dst[4 * i + 3] = (uint8_t)(v >> 24);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_O, "Token ids of a list or tuple as little-endian int32 bytes, or None if any is not in [0, 2**31)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvray.core._tokens", "Token ids packed in C (see kvray.core.keys).", -1, methods,
};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&module_def); }
