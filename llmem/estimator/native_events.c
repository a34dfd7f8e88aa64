/* The step schedule's event log, compiled: a line-for-line twin of llmem.estimator.events.EventLog (the Python
 * reference, used where this is not built; tests/estimator/test_native_events.py runs random operations through
 * both). A schedule's builder calls alloc and free once per tensor, a 70B plan about 2.7 million times: here each
 * costs a fraction of a Python method call (benchmarks/cli_timing.md, session 15).
 *
 * An event is (sign, key, size, stream, component), as llmem.memory.phase_replay reads it. Sizes and keys are
 * Python ints within a C long long; anything else is refused with TypeError (the Python reference would accept a
 * float size: no builder passes one, and the replay needs whole bytes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyObject *live_bytes_over = NULL;   /* llmem.estimator.events.LiveBytesOver, set once by its module */
static PyObject *plus_one = NULL, *minus_one = NULL, *default_stream = NULL;

typedef struct {
    PyObject_HEAD
    PyObject *events;        /* list of event tuples */
    PyObject *live;          /* dict: key -> its alloc event */
    long long next;          /* the next key handed out */
    long long min_bytes;     /* smaller tensors are left out (alloc returns -1) */
    long long live_bytes;
    long long peak_live_bytes;
    PyObject *stop_above;    /* None, or the live bytes past which alloc raises LiveBytesOver */
    long long stop_above_ll;
} EventLog;

/* a new log, empty (a subclass's __init__ may set its fields again: a dataclass's does) */
static PyObject *EventLog_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    EventLog *self = (EventLog *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->events = PyList_New(0);
    self->live = PyDict_New();
    Py_INCREF(Py_None);
    self->stop_above = Py_None;
    self->min_bytes = 1;
    if (self->events == NULL || self->live == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int EventLog_traverse(EventLog *self, visitproc visit, void *arg) {
    Py_VISIT(self->events);
    Py_VISIT(self->live);
    Py_VISIT(self->stop_above);
    return 0;
}

static int EventLog_clear(EventLog *self) {
    Py_CLEAR(self->events);
    Py_CLEAR(self->live);
    Py_CLEAR(self->stop_above);
    return 0;
}

static void EventLog_dealloc(EventLog *self) {
    PyObject_GC_UnTrack(self);
    EventLog_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* a Python int within a C long long, else -1 with TypeError / OverflowError set */
static int as_whole(PyObject *v, const char *what, long long *out) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "a schedule's %s must be an int, not %.100s", what, Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* events.py EventLog.alloc, for one tensor: its key (a new reference), or NULL with an exception set */
static PyObject *alloc_one(EventLog *self, PyObject *size_obj, PyObject *component, PyObject *stream) {
    long long size;
    if (as_whole(size_obj, "size", &size) < 0)
        return NULL;
    long long key = self->next;
    self->next = key + 1;
    if (size < self->min_bytes)
        return PyLong_FromLong(-1);
    PyObject *key_obj = PyLong_FromLongLong(key);
    if (key_obj == NULL)
        return NULL;
    PyObject *event = PyTuple_Pack(5, plus_one, key_obj, size_obj, stream, component);
    if (event != NULL)
        PyObject_GC_UnTrack(event);     /* ints and a str: no cycle through it (CPython untracks such tuples too) */
    if (event == NULL || PyList_Append(self->events, event) < 0 || PyDict_SetItem(self->live, key_obj, event) < 0) {
        Py_XDECREF(event);
        Py_DECREF(key_obj);
        return NULL;
    }
    Py_DECREF(event);
    long long live = self->live_bytes += size;
    if (live > self->peak_live_bytes) {
        self->peak_live_bytes = live;
        if (self->stop_above != Py_None && live > self->stop_above_ll) {
            Py_DECREF(key_obj);
            PyObject *n = PyLong_FromLongLong(live);
            if (n == NULL)
                return NULL;
            PyObject *exc = PyObject_CallOneArg(live_bytes_over, n);
            Py_DECREF(n);
            if (exc != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
            }
            return NULL;
        }
    }
    return key_obj;
}

static PyObject *EventLog_alloc(EventLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "alloc(size, component, stream=DEFAULT)");
        return NULL;
    }
    return alloc_one(self, args[0], args[1], nargs == 3 ? args[2] : default_stream);
}

/* events.py EventLog.alloc_many: each size allocated in order, their keys in a list */
static PyObject *EventLog_alloc_many(EventLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "alloc_many(sizes, component)");
        return NULL;
    }
    PyObject *sizes = PySequence_Fast(args[0], "alloc_many takes a sequence of sizes");
    if (sizes == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sizes);
    PyObject *keys = PyList_New(n);
    for (Py_ssize_t i = 0; keys != NULL && i < n; i++) {
        PyObject *key = alloc_one(self, PySequence_Fast_GET_ITEM(sizes, i), args[1], default_stream);
        if (key == NULL)
            Py_CLEAR(keys);
        else
            PyList_SET_ITEM(keys, i, key);
    }
    Py_DECREF(sizes);
    return keys;
}

/* events.py EventLog.free, for one key: 0, or -1 with an exception set */
static int free_one(EventLog *self, PyObject *key_obj) {
    long long key;
    if (as_whole(key_obj, "key", &key) < 0)
        return -1;
    if (key < 0)
        return 0;
    PyObject *event = PyDict_GetItemWithError(self->live, key_obj);   /* borrowed */
    if (event == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key_obj);
        return -1;
    }
    Py_INCREF(event);
    if (PyDict_DelItem(self->live, key_obj) < 0) {
        Py_DECREF(event);
        return -1;
    }
    PyObject *size_obj = PyTuple_GET_ITEM(event, 2);
    long long size;
    if (as_whole(size_obj, "size", &size) < 0) {
        Py_DECREF(event);
        return -1;
    }
    PyObject *freed = PyTuple_Pack(5, minus_one, key_obj, size_obj, default_stream, PyTuple_GET_ITEM(event, 4));
    Py_DECREF(event);
    if (freed == NULL)
        return -1;
    PyObject_GC_UnTrack(freed);
    int failed = PyList_Append(self->events, freed);
    Py_DECREF(freed);
    if (failed < 0)
        return -1;
    self->live_bytes -= size;
    return 0;
}

static PyObject *EventLog_free(EventLog *self, PyObject *key) {
    if (free_one(self, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* events.py EventLog.free_all: each key freed in order, then the list emptied */
static PyObject *EventLog_free_all(EventLog *self, PyObject *keys) {
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "free_all takes a list of keys");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        if (free_one(self, PyList_GET_ITEM(keys, i)) < 0)
            return NULL;
    }
    if (PyList_SetSlice(keys, 0, PyList_GET_SIZE(keys), NULL) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* events.py EventLog.play_block: a block plan's operations in order, (0, size, _) a kept tensor, (1, size, tag) a
 * temporary, (2, _, tag) that temporary freed; the kept tensors' keys in a list */
static PyObject *EventLog_play_block(EventLog *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "play_block(plan, component)");
        return NULL;
    }
    PyObject *plan = PySequence_Fast(args[0], "play_block takes a sequence of operations");
    if (plan == NULL)
        return NULL;
    PyObject *keys = PyList_New(0), *temps = PyDict_New();
    int failed = keys == NULL || temps == NULL;
    for (Py_ssize_t i = 0; !failed && i < PySequence_Fast_GET_SIZE(plan); i++) {
        PyObject *op = PySequence_Fast_GET_ITEM(plan, i);
        long long kind;
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3 || as_whole(PyTuple_GET_ITEM(op, 0), "operation", &kind) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a block plan's operation is (kind, size, tag)");
            failed = 1;
            break;
        }
        PyObject *size = PyTuple_GET_ITEM(op, 1), *tag = PyTuple_GET_ITEM(op, 2);
        if (kind == 0 || kind == 1) {
            PyObject *key = alloc_one(self, size, args[1], default_stream);
            if (key == NULL)
                failed = 1;
            else {
                failed = (kind == 0 ? PyList_Append(keys, key) : PyDict_SetItem(temps, tag, key)) < 0;
                Py_DECREF(key);
            }
        } else {
            PyObject *key = PyDict_GetItemWithError(temps, tag);     /* borrowed */
            if (key == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, tag);
                failed = 1;
            } else {
                Py_INCREF(key);
                failed = PyDict_DelItem(temps, tag) < 0 || free_one(self, key) < 0;
                Py_DECREF(key);
            }
        }
    }
    Py_DECREF(plan);
    Py_XDECREF(temps);
    if (failed) {
        Py_XDECREF(keys);
        return NULL;
    }
    return keys;
}

/* events.py EventLog.size_of */
static PyObject *EventLog_size_of(EventLog *self, PyObject *key_obj) {
    long long key;
    if (as_whole(key_obj, "key", &key) < 0)
        return NULL;
    if (key < 0)
        return PyLong_FromLong(0);
    PyObject *event = PyDict_GetItemWithError(self->live, key_obj);
    if (event == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key_obj);
        return NULL;
    }
    PyObject *size = PyTuple_GET_ITEM(event, 2);
    Py_INCREF(size);
    return size;
}

static PyObject *get_object(PyObject *v) {
    Py_INCREF(v);
    return v;
}

static PyObject *EventLog_get_events(EventLog *self, void *closure) { return get_object(self->events); }
static PyObject *EventLog_get_live(EventLog *self, void *closure) { return get_object(self->live); }
static PyObject *EventLog_get_stop(EventLog *self, void *closure) { return get_object(self->stop_above); }

static int EventLog_set_events(EventLog *self, PyObject *v, void *closure) {
    if (v == NULL || !PyList_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "events must be a list");
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(self->events, v);
    return 0;
}

static int EventLog_set_live(EventLog *self, PyObject *v, void *closure) {
    if (v == NULL || !PyDict_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "_live must be a dict");
        return -1;
    }
    Py_INCREF(v);
    Py_XSETREF(self->live, v);
    return 0;
}

static int EventLog_set_stop(EventLog *self, PyObject *v, void *closure) {
    if (v == NULL) {
        PyErr_SetString(PyExc_TypeError, "stop_above_bytes cannot be deleted");
        return -1;
    }
    if (v != Py_None && as_whole(v, "stop_above_bytes", &self->stop_above_ll) < 0)
        return -1;
    Py_INCREF(v);
    Py_XSETREF(self->stop_above, v);
    return 0;
}

static PyGetSetDef EventLog_getset[] = {
    {"events", (getter)EventLog_get_events, (setter)EventLog_set_events, NULL, NULL},
    {"_live", (getter)EventLog_get_live, (setter)EventLog_set_live, NULL, NULL},
    {"stop_above_bytes", (getter)EventLog_get_stop, (setter)EventLog_set_stop, NULL, NULL},
    {NULL},
};

static PyMemberDef EventLog_members[] = {
    {"_next", T_LONGLONG, offsetof(EventLog, next), 0, NULL},
    {"min_bytes", T_LONGLONG, offsetof(EventLog, min_bytes), 0, NULL},
    {"live_bytes", T_LONGLONG, offsetof(EventLog, live_bytes), 0, NULL},
    {"peak_live_bytes", T_LONGLONG, offsetof(EventLog, peak_live_bytes), 0, NULL},
    {NULL},
};

static PyMethodDef EventLog_methods[] = {
    {"alloc", (PyCFunction)(void (*)(void))EventLog_alloc, METH_FASTCALL, NULL},
    {"alloc_many", (PyCFunction)(void (*)(void))EventLog_alloc_many, METH_FASTCALL, NULL},
    {"play_block", (PyCFunction)(void (*)(void))EventLog_play_block, METH_FASTCALL, NULL},
    {"free", (PyCFunction)EventLog_free, METH_O, NULL},
    {"free_all", (PyCFunction)EventLog_free_all, METH_O, NULL},
    {"size_of", (PyCFunction)EventLog_size_of, METH_O, NULL},
    {NULL},
};

static PyTypeObject EventLogType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "llmem.estimator.native_events.EventLog",
    .tp_basicsize = sizeof(EventLog),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = EventLog_new,
    .tp_dealloc = (destructor)EventLog_dealloc,
    .tp_traverse = (traverseproc)EventLog_traverse,
    .tp_clear = (inquiry)EventLog_clear,
    .tp_methods = EventLog_methods,
    .tp_members = EventLog_members,
    .tp_getset = EventLog_getset,
};

static PyObject *set_live_bytes_over(PyObject *module, PyObject *cls) {
    Py_INCREF(cls);
    Py_XSETREF(live_bytes_over, cls);
    Py_RETURN_NONE;
}

/* deepen.py's repeated(): for each shift in `shifts`, every event of `part` appended to `out` with its key k
 * replaced by moved[k] + shift where k is in `moved` (the others kept): the middle copies of a template layer's
 * run, whose keys all move by one layer's worth of keys from one copy to the next */
static PyObject *repeat_events(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[0]) || !PyDict_Check(args[1]) || !PyList_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "repeat_events(part: list, moved: dict, shifts, out: list)");
        return NULL;
    }
    PyObject *part = args[0], *moved = args[1], *out = args[3];
    PyObject *shifts = PySequence_Fast(args[2], "repeat_events takes a sequence of shifts");
    if (shifts == NULL)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(part);
    for (Py_ssize_t s = 0; s < PySequence_Fast_GET_SIZE(shifts); s++) {
        long long shift;
        if (as_whole(PySequence_Fast_GET_ITEM(shifts, s), "shift", &shift) < 0)
            goto fail;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *ev = PyList_GET_ITEM(part, i);
            if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 5) {
                PyErr_SetString(PyExc_TypeError, "an event is a 5-tuple");
                goto fail;
            }
            PyObject *base = PyDict_GetItemWithError(moved, PyTuple_GET_ITEM(ev, 1));    /* borrowed */
            if (base == NULL) {
                if (PyErr_Occurred() || PyList_Append(out, ev) < 0)
                    goto fail;
                continue;
            }
            long long key;
            if (as_whole(base, "key", &key) < 0)
                goto fail;
            PyObject *key_obj = PyLong_FromLongLong(key + shift);
            if (key_obj == NULL)
                goto fail;
            PyObject *copy = PyTuple_Pack(5, PyTuple_GET_ITEM(ev, 0), key_obj, PyTuple_GET_ITEM(ev, 2),
                                          PyTuple_GET_ITEM(ev, 3), PyTuple_GET_ITEM(ev, 4));
            Py_DECREF(key_obj);
            if (copy == NULL)
                goto fail;
            PyObject_GC_UnTrack(copy);
            int failed = PyList_Append(out, copy);
            Py_DECREF(copy);
            if (failed < 0)
                goto fail;
        }
    }
    Py_DECREF(shifts);
    Py_RETURN_NONE;
fail:
    Py_DECREF(shifts);
    return NULL;
}

/* deepen.py's live_bytes(): the live tensor bytes' peak and their sum after the last of `events` (an EventLog's
 * peak_live_bytes and live_bytes, for a schedule made without one) */
static PyObject *live_bytes(PyObject *module, PyObject *events) {
    if (!PyList_Check(events)) {
        PyErr_SetString(PyExc_TypeError, "live_bytes takes a list of events");
        return NULL;
    }
    long long live = 0, peak = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        long long sign, size;
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 5) {
            PyErr_SetString(PyExc_TypeError, "an event is a 5-tuple");
            return NULL;
        }
        if (as_whole(PyTuple_GET_ITEM(ev, 0), "sign", &sign) < 0 || as_whole(PyTuple_GET_ITEM(ev, 2), "size", &size) < 0)
            return NULL;
        live += sign > 0 ? size : -size;
        if (live > peak)
            peak = live;
    }
    return Py_BuildValue("(LL)", peak, live);
}

static PyMethodDef module_methods[] = {
    {"set_live_bytes_over", set_live_bytes_over, METH_O, NULL},
    {"repeat_events", (PyCFunction)(void (*)(void))repeat_events, METH_FASTCALL, NULL},
    {"live_bytes", live_bytes, METH_O, NULL},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_events", NULL, -1, module_methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_native_events(void) {
    if (PyType_Ready(&EventLogType) < 0)
        return NULL;
    plus_one = PyLong_FromLong(1);
    minus_one = PyLong_FromLong(-1);
    default_stream = PyLong_FromLong(0);       /* events.py DEFAULT */
    PyObject *m = PyModule_Create(&module);
    if (m == NULL || plus_one == NULL || minus_one == NULL || default_stream == NULL)
        return NULL;
    Py_INCREF(&EventLogType);
    if (PyModule_AddObject(m, "EventLog", (PyObject *)&EventLogType) < 0) {
        Py_DECREF(&EventLogType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
