/* The presence index's table (kvsvc.client.presence): which keys of one
 * namespace the server holds, in 16 bytes a slot.
 *
 * Open addressing with linear probing and backward-shift deletion (no
 * tombstones, so a table that churns never degrades). A slot holds the key's
 * 64-bit fingerprint (0 = empty) and a bitmask of the (layout, tier) pairs the
 * key is present in; the Python side numbers those pairs. Setting and clearing
 * bits is idempotent, so a repeated stored event never double-counts and
 * removing one layout keeps a key that another layout still holds. Load stays
 * <= 3/4, so at 1 M keys the table is 2^21 slots: 32 MiB, ~34 B a key.
 *
 * A CPython extension (not ctypes) because the hot call takes a list of bytes
 * objects: reading them in C with the GIL held costs ~20 ns a key, where a ctypes
 * call would first need the keys joined in Python. Every call holds the GIL from
 * start to end, so one call is atomic for other threads.
 *
 * Built by the package build (setup.py; `make native` in place) into
 * _presence.<suffix>.so next to this file; without it kvsvc.client.presence
 * uses its pure-Python table (same answers, slower).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    uint64_t *fp;   /* fingerprints, 0 = empty */
    uint64_t *mask; /* (layout, tier) bits per slot */
    size_t cap;     /* a power of two */
    size_t count;
} Table;

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static inline uint64_t fingerprint(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = mix(h ^ w);
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    h = mix(h ^ w ^ ((uint64_t)n << 56));
    return h ? h : 1;
}

/* The slot holding fp, or the empty slot where it would go. */
static inline size_t find(const Table *t, uint64_t fp) {
    size_t m = t->cap - 1, i = (size_t)fp & m;
    while (t->fp[i] != 0 && t->fp[i] != fp)
        i = (i + 1) & m;
    return i;
}

static int alloc(Table *t, size_t cap) {
    uint64_t *fp = PyMem_Calloc(cap, sizeof(uint64_t));
    uint64_t *mask = PyMem_Calloc(cap, sizeof(uint64_t));
    if (fp == NULL || mask == NULL) {
        PyMem_Free(fp);
        PyMem_Free(mask);
        PyErr_NoMemory();
        return -1;
    }
    t->fp = fp;
    t->mask = mask;
    t->cap = cap;
    t->count = 0;
    return 0;
}

static int grow(Table *t) {
    uint64_t *fp = t->fp, *mask = t->mask;
    size_t cap = t->cap, count = t->count;
    if (alloc(t, cap * 2) < 0) {
        t->fp = fp, t->mask = mask, t->cap = cap, t->count = count;
        return -1;
    }
    for (size_t i = 0; i < cap; i++) {
        if (fp[i] != 0) {
            size_t j = find(t, fp[i]);
            t->fp[j] = fp[i];
            t->mask[j] = mask[i];
        }
    }
    t->count = count;
    PyMem_Free(fp);
    PyMem_Free(mask);
    return 0;
}

/* Backward-shift deletion: later slots of the run move up so no probe breaks. */
static void erase(Table *t, size_t i) {
    size_t m = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (t->fp[j] == 0)
            break;
        size_t home = (size_t)t->fp[j] & m;
        /* may the entry at j move to the hole at i? (home not in (i, j]) */
        if (((j - home) & m) >= ((j - i) & m)) {
            t->fp[i] = t->fp[j];
            t->mask[i] = t->mask[j];
            i = j;
        }
    }
    t->fp[i] = 0;
    t->mask[i] = 0;
    t->count--;
}

static int key_bytes(PyObject *key, const unsigned char **p, Py_ssize_t *n) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys must be bytes, not %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    *p = (const unsigned char *)PyBytes_AS_STRING(key);
    *n = PyBytes_GET_SIZE(key);
    return 0;
}

static int parse_bit(PyObject *args, PyObject **keys, uint64_t *bit) {
    int b;
    if (!PyArg_ParseTuple(args, "Oi", keys, &b))
        return -1;
    if (b < 0 || b > 63) {
        PyErr_SetString(PyExc_ValueError, "bit must be in 0..63");
        return -1;
    }
    *bit = 1ULL << b;
    return 0;
}

static PyObject *Table_add(Table *t, PyObject *args) {
    PyObject *keys;
    uint64_t bit;
    if (parse_bit(args, &keys, &bit) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *p;
        Py_ssize_t len;
        if (key_bytes(items[k], &p, &len) < 0)
            goto fail;
        if ((t->count + 1) * 4 > t->cap * 3 && grow(t) < 0)
            goto fail;
        uint64_t fp = fingerprint(p, len);
        size_t i = find(t, fp);
        if (t->fp[i] == 0) {
            t->fp[i] = fp;
            t->count++;
        }
        t->mask[i] |= bit;
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Table_remove(Table *t, PyObject *args) {
    PyObject *keys;
    uint64_t bit;
    if (parse_bit(args, &keys, &bit) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *p;
        Py_ssize_t len;
        if (key_bytes(items[k], &p, &len) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        size_t i = find(t, fingerprint(p, len));
        if (t->fp[i] != 0) {
            t->mask[i] &= ~bit;
            if (t->mask[i] == 0)
                erase(t, i);
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *Table_hits(Table *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *p;
        Py_ssize_t len;
        if (key_bytes(items[k], &p, &len) < 0) {
            Py_DECREF(seq);
            Py_DECREF(out);
            return NULL;
        }
        PyObject *b = t->fp[find(t, fingerprint(p, len))] != 0 ? Py_True : Py_False;
        Py_INCREF(b);
        PyList_SET_ITEM(out, k, b);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *Table_prefix(Table *t, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t k = 0;
    for (; k < n; k++) {
        const unsigned char *p;
        Py_ssize_t len;
        if (key_bytes(items[k], &p, &len) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (t->fp[find(t, fingerprint(p, len))] == 0)
            break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(k);
}

static PyObject *Table_clear(Table *t, PyObject *Py_UNUSED(ignored)) {
    uint64_t *fp = t->fp, *mask = t->mask;
    size_t cap = t->cap, count = t->count;
    if (alloc(t, 16) < 0) {
        t->fp = fp, t->mask = mask, t->cap = cap, t->count = count;
        return NULL;
    }
    PyMem_Free(fp);
    PyMem_Free(mask);
    Py_RETURN_NONE;
}

static PyObject *Table_nbytes(Table *t, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(t->cap * 2 * sizeof(uint64_t) + sizeof(Table));
}

static Py_ssize_t Table_len(Table *t) { return (Py_ssize_t)t->count; }

static int Table_init(Table *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist))
        return -1;
    PyMem_Free(t->fp);
    PyMem_Free(t->mask);
    t->fp = t->mask = NULL;
    return alloc(t, 16);
}

static void Table_dealloc(Table *t) {
    PyMem_Free(t->fp);
    PyMem_Free(t->mask);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Table_methods[] = {
    {"add", (PyCFunction)Table_add, METH_VARARGS, "add(keys, bit): set bit on each key."},
    {"remove", (PyCFunction)Table_remove, METH_VARARGS,
     "remove(keys, bit): clear bit; a key with no bit left leaves the table."},
    {"hits", (PyCFunction)Table_hits, METH_O, "hits(keys) -> list[bool]."},
    {"prefix", (PyCFunction)Table_prefix, METH_O, "prefix(keys) -> leading keys present."},
    {"clear", (PyCFunction)Table_clear, METH_NOARGS, "clear(): drop every key."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Table_getset[] = {
    {"nbytes", (getter)Table_nbytes, NULL, "bytes the table holds", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Table_as_sequence = {.sq_length = (lenfunc)Table_len};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvsvc.client.native._presence.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Keys present, each with a bitmask of (layout, tier) pairs.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_as_sequence = &Table_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_presence", "The presence index's native table.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__presence(void) {
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
