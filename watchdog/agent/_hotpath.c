/* The hot path of watch() in C: the two calls a server makes on every request, `model(x)` and
 * `model(a=, b=)` with tensors, timed and checked against the shape memory without a Python
 * frame. calls.py holds the same path in Python (used where this module is not built, and for
 * every other form of call, which this object hands to it) and owns every decision: a shape
 * not in the hot set and a stall go back to Python (`miss`, `slow`), as does a failed call
 * (`failed`).
 *
 * Why: what is left of the Python path's cost is the interpreter's own: a frame, the
 * `**kwargs` dict CPython builds for every call of a function that takes one, the bytecode
 * around two clock reads. Here a call costs the `.shape` read, two clock_gettime calls, a
 * comparison and the call itself; two keyword arguments are passed on as they came (the
 * vectorcall's kwnames), no dict at all.
 *
 * The contract is the Python path's (wrapper.Watched): a watched call returns what the model
 * returned and raises only what the model raised, the same object; nothing of the bookkeeping
 * reaches the caller (an Exception from a Python callback is cleared, as the Python path's
 * `except Exception` does; a BaseException such as KeyboardInterrupt propagates there and here).
 *
 * Calls in progress, for inflight.current_shape() (hooks.py tags a CUDA-graph recording with
 * the shape of the call in progress on its thread) and inflight.calls_in_flight() (drain.py): a
 * per-thread stack of the signatures of the calls this object runs, where a call handed to
 * the Python path pushes a marker ("the Python path's own stack holds it", calls.py), so the
 * innermost call is known whichever path ran it; and a process-wide count of calls in
 * progress with the signature of the last one to start. The stack holds references of its own: greenlets that switch inside
 * a model call pop each other's entries (a wrong shape at worst, never a freed one).
 *
 * Linux only (clock_gettime(CLOCK_MONOTONIC) is perf_counter's clock there); not built for
 * free-threaded CPython (the counters assume the GIL). Where it is not built or fails to
 * import, calls.py's path serves every call: nothing else changes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <time.h>

#ifndef __linux__
#error "Linux only: CLOCK_MONOTONIC is time.perf_counter()'s clock there (calls.py serves elsewhere)"
#endif
#ifdef Py_GIL_DISABLED
#error "the hot path assumes the GIL (calls.py's Python path serves free-threaded builds)"
#endif

#define DEPTH 32

/* copies of settings.current.stall_s and .route_eager (every call reads them), kept by
 * configure(), which settings.configure() calls through settings.COPIES and calls.py calls
 * once at import: no default of its own here (settings.STALL_S is the one) */
static double stall_s = 0.0;
static int route_eager = 0;    /* every call takes the Python path */
static PyObject *str_shape;    /* "shape", interned */

/* this thread's watched calls in progress: a[i] (and b[i] for two keyword arguments) the
 * signature of each, a[i] == NULL a call on the Python path; past DEPTH only counted */
static _Thread_local PyObject *stack_a[DEPTH];
static _Thread_local PyObject *stack_b[DEPTH];
static _Thread_local Py_ssize_t depth;
/* every thread's: how many, and the signature of the last to start (strong references) */
static Py_ssize_t in_flight;
static PyObject *last_a, *last_b;

static inline double
now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void
push(PyObject *a, PyObject *b)
{
    if (depth < DEPTH) {
        stack_a[depth] = Py_XNewRef(a);
        stack_b[depth] = Py_XNewRef(b);
    }
    depth++;
    in_flight++;
    if (a != NULL) {
        Py_INCREF(a);
        Py_XINCREF(b);
        Py_XSETREF(last_a, a);
        Py_XSETREF(last_b, b);
    }
}

static inline void
pop(void)
{
    if (--depth < DEPTH && depth >= 0) {
        Py_CLEAR(stack_a[depth]);
        Py_CLEAR(stack_b[depth]);
    }
    if (--in_flight <= 0) {
        in_flight = 0;
        Py_CLEAR(last_a);
        Py_CLEAR(last_b);
    }
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn;      /* the watched callable */
    PyTypeObject *tensor;  /* torch.Tensor: only exact instances take this path */
    PyObject *seen;    /* the hot set of the shape memory (shapes._Hot.seen) */
    PyObject *other;   /* the Python path: every call this object does not take */
    PyObject *miss;    /* miss(sig, dt, t0) -> True if it reported a new shape */
    PyObject *slow;    /* slow(sig, dt, t0, new): a stall */
    PyObject *failed;  /* failed(exc, sig, t0, args, kwargs) */
    PyObject *last;    /* the last one-tensor signature found in `seen` */
    PyObject *la, *lb; /* the last two-keyword shapes found in `seen` */
    long long calls;
    double total;      /* seconds */
} Hot;

/* An Exception raised by a callback is the bookkeeping's: cleared. Returns -1 if what is
 * pending must propagate (KeyboardInterrupt, SystemExit...). */
static int
clear_bookkeeping_error(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

/* A failed call: report it (wrapper.Watched._failed) and raise the model's exception again.
 * `sa`, `sb`: the signature (sb NULL: one tensor, else the pair). */
static void
report_failure(Hot *self, PyObject *sa, PyObject *sb, double t0, PyObject *const *args,
               Py_ssize_t nargs, PyObject *kwnames)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL && exc != NULL)
        PyException_SetTraceback(exc, tb);
#endif
    if (exc == NULL)
        goto done;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *sig = sb == NULL ? Py_NewRef(sa) : PyTuple_Pack(2, sa, sb);
    PyObject *a = PyTuple_New(nargs), *kw = PyDict_New(), *t = PyFloat_FromDouble(t0);
    PyObject *r = NULL;
    if (sig == NULL || a == NULL || kw == NULL || t == NULL)
        goto cleanup;
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(a, i, Py_NewRef(args[i]));
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
            goto cleanup;
    r = PyObject_CallFunctionObjArgs(self->failed, exc, sig, t, a, kw, NULL);
cleanup:
    Py_XDECREF(r);
    Py_XDECREF(sig);
    Py_XDECREF(a);
    Py_XDECREF(kw);
    Py_XDECREF(t);
    PyErr_Clear();  /* the report's own failure: the model's exception is what is raised */
done:
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(type, exc, tb);
#endif
}

/* After a successful call: a signature not seen before goes to `miss`, a stall to `slow`.
 * Returns 0, or -1 with a BaseException to propagate. */
static int
after(Hot *self, PyObject *sig, double dt, double t0, int known)
{
    if (!known) {
        PyObject *argv[3];
        argv[0] = sig;
        argv[1] = PyFloat_FromDouble(dt);
        argv[2] = PyFloat_FromDouble(t0);
        PyObject *r = NULL;
        if (argv[1] != NULL && argv[2] != NULL)
            r = PyObject_Vectorcall(self->miss, argv, 3, NULL);
        Py_XDECREF(argv[1]);
        Py_XDECREF(argv[2]);
        if (r == NULL)
            return clear_bookkeeping_error();
        int reported = r == Py_True;
        Py_DECREF(r);
        if (reported)
            return 0;  /* its event says whether it was a stall */
    }
    if (dt >= stall_s) {
        PyObject *r = PyObject_CallFunction(self->slow, "OddO", sig, dt, t0, Py_False);
        if (r == NULL)
            return clear_bookkeeping_error();
        Py_DECREF(r);
    }
    return 0;
}

/* `x.shape`, or None where reading it raised an Exception (a torch function mode that
 * hijacks it); NULL with a BaseException to propagate */
static inline PyObject *
shape_of(PyObject *x)
{
    PyObject *shape = PyObject_GetAttr(x, str_shape);
    if (shape == NULL && clear_bookkeeping_error() == 0)
        shape = Py_NewRef(Py_None);
    return shape;
}

/* The model's call between two clock reads (`t0` its start, `dt` its wall time), counted and
 * on this thread's stack of calls in progress while it runs. */
static inline PyObject *
timed(Hot *self, PyObject *sa, PyObject *sb, PyObject *const *args, size_t nargsf,
      PyObject *kwnames, double *t0, double *dt)
{
    push(sa, sb);
    *t0 = now();
    PyObject *out = PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
    *dt = now() - *t0;
    pop();
    self->calls++;
    return out;
}

/* model(x) */
static PyObject *
call_one(Hot *self, PyObject *const *args, size_t nargsf)
{
    PyObject *sig = shape_of(args[0]);
    if (sig == NULL)
        return NULL;
    double t0, dt;
    PyObject *out = timed(self, sig, NULL, args, nargsf, NULL, &t0, &dt);
    if (out == NULL) {
        report_failure(self, sig, NULL, t0, args, 1, NULL);
        Py_DECREF(sig);
        return NULL;
    }
    self->total += dt;
    int known = 1;
    int ne = self->last == NULL ? 1 : PyObject_RichCompareBool(sig, self->last, Py_NE);
    if (ne > 0) {
        ne = PySet_Contains(self->seen, sig);
        if (ne > 0)
            Py_XSETREF(self->last, Py_NewRef(sig));
        else if (ne == 0)
            known = 0;
    }
    if ((ne < 0 && clear_bookkeeping_error() < 0)
            || ((!known || dt >= stall_s) && after(self, sig, dt, t0, known) < 0)) {
        Py_DECREF(sig);
        Py_DECREF(out);
        return NULL;
    }
    Py_DECREF(sig);
    return out;
}

/* model(a=, b=) with two tensors: the signature is the pair of shapes in call order; the
 * keyword arguments go on to the model as they came */
static PyObject *
call_two(Hot *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *sa = shape_of(args[0]);
    if (sa == NULL)
        return NULL;
    PyObject *sb = shape_of(args[1]);
    if (sb == NULL) {
        Py_DECREF(sa);
        return NULL;
    }
    double t0, dt;
    PyObject *out = timed(self, sa, sb, args, nargsf, kwnames, &t0, &dt);
    if (out == NULL) {
        report_failure(self, sa, sb, t0, args, 0, kwnames);
        Py_DECREF(sa);
        Py_DECREF(sb);
        return NULL;
    }
    self->total += dt;
    PyObject *sig = NULL;
    int known = 1;
    int ne = self->la == NULL ? 1 : PyObject_RichCompareBool(sa, self->la, Py_NE);
    if (ne == 0)
        ne = PyObject_RichCompareBool(sb, self->lb, Py_NE);
    if (ne < 0) {
        if (clear_bookkeeping_error() < 0)
            goto propagate;
    }
    else if (ne > 0) {  /* not the last pair: the tuple is built only here */
        sig = PyTuple_Pack(2, sa, sb);
        int in = sig == NULL ? -1 : PySet_Contains(self->seen, sig);
        if (in > 0) {
            Py_XSETREF(self->la, Py_NewRef(sa));
            Py_XSETREF(self->lb, Py_NewRef(sb));
        }
        else if (in == 0)
            known = 0;
        else if (clear_bookkeeping_error() < 0)
            goto propagate;
    }
    if (!known || dt >= stall_s) {
        if (sig == NULL)
            sig = PyTuple_Pack(2, sa, sb);
        if (sig == NULL) {
            if (clear_bookkeeping_error() < 0)
                goto propagate;
        }
        else if (after(self, sig, dt, t0, known) < 0)
            goto propagate;
    }
    Py_XDECREF(sig);
    Py_DECREF(sa);
    Py_DECREF(sb);
    return out;
propagate:
    Py_XDECREF(sig);
    Py_DECREF(sa);
    Py_DECREF(sb);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
hot_vectorcall(Hot *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (!route_eager) {
        if (nargs == 1 && nkw == 0 && Py_IS_TYPE(args[0], self->tensor))
            return call_one(self, args, nargsf);
        if (nargs == 0 && nkw == 2 && Py_IS_TYPE(args[0], self->tensor)
                && Py_IS_TYPE(args[1], self->tensor))
            return call_two(self, args, nargsf, kwnames);
    }
    /* every other call: the Python path, marked here so that its stack is looked at */
    push(NULL, NULL);
    PyObject *out = PyObject_Vectorcall(self->other, args, nargsf, kwnames);
    pop();
    return out;
}

static PyObject *
hot_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"fn", "tensor", "seen", "other", "miss", "slow", "failed", NULL};
    PyObject *fn, *tensor, *seen, *other, *miss, *slow, *failed;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!OOOO:Hot", names, &fn, &PyType_Type,
                                     &tensor, &PySet_Type, &seen, &other, &miss, &slow,
                                     &failed))
        return NULL;
    Hot *self = (Hot *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = (vectorcallfunc)hot_vectorcall;
    self->fn = Py_NewRef(fn);
    self->tensor = (PyTypeObject *)Py_NewRef(tensor);
    self->seen = Py_NewRef(seen);
    self->other = Py_NewRef(other);
    self->miss = Py_NewRef(miss);
    self->slow = Py_NewRef(slow);
    self->failed = Py_NewRef(failed);
    return (PyObject *)self;
}

/* every object field of Hot, once, for traverse and clear */
#define HOT_OBJECTS(X) \
    X(fn) X(tensor) X(seen) X(other) X(miss) X(slow) X(failed) X(last) X(la) X(lb)

static int
hot_traverse(Hot *self, visitproc visit, void *arg)
{
#define VISIT(field) Py_VISIT(self->field);
    HOT_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
hot_clear(Hot *self)
{
#define CLEAR(field) Py_CLEAR(self->field);
    HOT_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void
hot_dealloc(Hot *self)
{
    PyObject_GC_UnTrack(self);
    hot_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
hot_totals(Hot *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("(Ld)", self->calls, self->total);
}

static PyMethodDef hot_methods[] = {
    {"totals", (PyCFunction)hot_totals, METH_NOARGS,
     "(calls, total seconds) of the calls this path ran."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torch_watchdog.agent._hotpath.Hot",
    .tp_doc = "Hot(fn, tensor, seen, other, miss, slow, failed): watch()'s hot path.",
    .tp_basicsize = sizeof(Hot),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = hot_new,
    .tp_traverse = (traverseproc)hot_traverse,
    .tp_clear = (inquiry)hot_clear,
    .tp_dealloc = (destructor)hot_dealloc,
    .tp_vectorcall_offset = offsetof(Hot, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_methods = hot_methods,
};

static PyObject *
configure(PyObject *Py_UNUSED(module), PyObject *args)
{
    double s;
    int eager;
    if (!PyArg_ParseTuple(args, "dp:configure", &s, &eager))
        return NULL;
    stall_s = s;
    route_eager = eager;
    Py_RETURN_NONE;
}

/* (where, shape) of this thread's innermost watched call: where 0 none, 1 this path's (shape
 * its signature), 2 one on the Python path (calls.py's stack for this thread holds it) */
static PyObject *
current(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    if (depth <= 0)
        return Py_BuildValue("(iO)", 0, Py_None);
    if (depth > DEPTH || stack_a[depth - 1] == NULL)
        return Py_BuildValue("(iO)", 2, Py_None);
    if (stack_b[depth - 1] == NULL)
        return Py_BuildValue("(iO)", 1, stack_a[depth - 1]);
    return Py_BuildValue("(i(OO))", 1, stack_a[depth - 1], stack_b[depth - 1]);
}

/* (calls in progress on any thread, on this one, the signature of the last this path began
 * or None) */
static PyObject *
everywhere(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    if (last_a == NULL)
        return Py_BuildValue("(nnO)", in_flight, depth, Py_None);
    if (last_b == NULL)
        return Py_BuildValue("(nnO)", in_flight, depth, last_a);
    return Py_BuildValue("(nn(OO))", in_flight, depth, last_a, last_b);
}

/* In a forked child only the forking thread exists: its calls are the only ones in progress
 * (the others' would keep a drain waiting forever). */
static PyObject *
after_fork(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    in_flight = depth;
    if (in_flight == 0) {
        Py_CLEAR(last_a);
        Py_CLEAR(last_b);
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS, "configure(stall_s, route_eager)"},
    {"current", current, METH_NOARGS, "(where, shape) of this thread's innermost call."},
    {"everywhere", everywhere, METH_NOARGS,
     "(in progress anywhere, on this thread, last signature begun)."},
    {"after_fork", after_fork, METH_NOARGS, "In a forked child: forget other threads' calls."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_hotpath", "watch()'s hot path in C (see calls.py).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    if (PyType_Ready(&HotType) < 0)
        return NULL;
    str_shape = PyUnicode_InternFromString("shape");
    if (str_shape == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Hot", (PyObject *)&HotType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
