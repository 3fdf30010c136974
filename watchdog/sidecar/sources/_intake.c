/* The receiver's fast path in C: a datagram of the agent's events, one per line, parsed and
 * checked straight into event objects (no JSON dict, no generated builder in between).
 *
 * Why: at 1,000 events/s (benchmarks/sidecar_cost.py) the daemon spent a third of its CPU
 * decoding; in a daemon that wakes 10 times a second with cold caches the orjson line, the
 * builder and the loop around them cost ~1.8 us an event (1.25 us in a hot loop); here ~1.2
 * us (0.4 in a hot loop; benchmarks/sidecar_cost.py's docstring has the runs).
 *
 * It answers only what it is sure of, and hands everything else back: `parse()` returns the
 * events of a datagram whose every line is a compact-enough event of a kind `configure()`
 * named (fields of int, bool, str, float, lists of these or of lists, each optional or not),
 * with every field present, valid and once; None for anything else, and the receiver's Python
 * paths (receiver._decode_packed, then events.decode line by line, which count and say what
 * is wrong) take the datagram. So this parser declines, and the Python path decides:
 * - a string with an escape or a control character (json.dumps writes non-ASCII text as
 *   escapes: such an event goes to the Python path), an int of more than 18 digits, a number
 *   of more than 64 characters, a float that is not finite (json would give inf, the builder
 *   refuses it), a leading zero, an object or a nesting past MAX_DEPTH in a value;
 * - a duplicate, unknown or missing key (a field added later and left out: its default is
 *   the Python path's), `v` that is not the int 1, a pid that is not positive;
 * - a blank line, a line over `max_line` bytes, anything but JSON's blanks around a token.
 * What it accepts it reads as json does (tests/unit/test_intake.py compares the two on every
 * event of the recorded fixtures and on mutated ones): UTF-8 strings decoded strictly, ints
 * exact, floats correctly rounded as float() rounds them, which json calls (see number()).
 *
 * Where this module is not built (no compiler; optional in pyproject.toml) or
 * TORCH_WATCHDOG_PURE_PYTHON is set, the receiver's Python paths take every datagram. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#define MAX_KINDS 32
#define MAX_FIELDS 24
#define MAX_PAIRS (MAX_FIELDS + 2)
#define MAX_DEPTH 4
#define MAX_CODE 8
#define MAX_NUMBER 64

typedef struct {
    const char *name;                 /* the kind, as bytes (owned by `kind_names`) */
    Py_ssize_t name_len;
    PyObject *cls;                    /* the event's class */
    Py_ssize_t n;                     /* its fields */
    PyObject *names[MAX_FIELDS];      /* each field's name (str) */
    const char *utf8[MAX_FIELDS];     /* the same, as bytes (owned by names[i]) */
    Py_ssize_t len[MAX_FIELDS];
    char codes[MAX_FIELDS][MAX_CODE]; /* "i" "b" "s" "f", "[" a list of, "?" or None */
    Py_ssize_t pid;                   /* the index of `pid` */
} Kind;

static Kind kinds[MAX_KINDS];
static Py_ssize_t n_kinds;
static PyObject *kind_names;  /* the kinds' names (a list: they own kinds[i].name) */
static long schema_version = 1;
static PyObject *empty_tuple;

typedef struct {
    const char *p, *end;
} Cursor;

static inline void
blanks(Cursor *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\r'))
        c->p++;
}

/* A string after its opening quote: the str, NULL (no exception) to decline. */
static PyObject *
string(Cursor *c)
{
    const char *start = c->p;
    int ascii = 1;
    while (c->p < c->end) {
        unsigned char b = (unsigned char)*c->p;
        if (b == '"') {
            Py_ssize_t n = c->p - start;
            c->p++;
            if (ascii) {
                PyObject *s = PyUnicode_New(n, 127);
                if (s != NULL)
                    memcpy(PyUnicode_DATA(s), start, (size_t)n);
                return s;
            }
            PyObject *s = PyUnicode_DecodeUTF8(start, n, "strict");
            if (s == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                PyErr_Clear();  /* invalid UTF-8: the Python path rejects it */
            return s;
        }
        if (b == '\\' || b < 0x20)
            return NULL;  /* an escape, or a control character json refuses */
        if (b >= 0x80)
            ascii = 0;
        c->p++;
    }
    return NULL;
}

static inline int
is_digit(const char *p, const char *end)
{
    return p < end && *p >= '0' && *p <= '9';
}

/* 10^0 .. 10^22: every one exact in a double */
static const double exact_tens[] = {
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
    1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
};

/* A number (JSON's grammar): an int of at most 18 digits or a finite float; NULL to decline.
 * A float whose digits make an integer up to 2^53 with a power of ten up to 22 either way is
 * that integer times or over the power, each exact in a double, so the one rounding is the
 * correct one (Clinger's fast path: the agent's durations, most timestamps); any other goes
 * to PyOS_string_to_double, float()'s own conversion. */
static PyObject *
number(Cursor *c)
{
    const char *start = c->p, *p = c->p, *end = c->end;
    int negative = p < end && *p == '-';
    p += negative;
    if (!is_digit(p, end))
        return NULL;
    unsigned long long mantissa = 0;
    int digits = 0, fraction = 0, is_float = 0;
    if (*p == '0') {
        p++;
        if (is_digit(p, end))
            return NULL;  /* a leading zero */
    }
    else {
        for (; is_digit(p, end); p++, digits++)
            mantissa = mantissa * 10 + (unsigned)(*p - '0');  /* wraps past 19: unused then */
    }
    if (p < end && *p == '.') {
        p++;
        if (!is_digit(p, end))
            return NULL;
        for (; is_digit(p, end); p++, digits++, fraction++)
            mantissa = mantissa * 10 + (unsigned)(*p - '0');
        is_float = 1;
    }
    long exponent = 0;
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        int minus = p < end && *p == '-';
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (!is_digit(p, end))
            return NULL;
        for (; is_digit(p, end); p++)
            if (exponent < 100000)
                exponent = exponent * 10 + (*p - '0');
        exponent = minus ? -exponent : exponent;
        is_float = 1;
    }
    Py_ssize_t n = p - start;
    if (n > MAX_NUMBER)
        return NULL;
    c->p = p;
    if (!is_float) {
        if (digits > 18)
            return NULL;
        return PyLong_FromLongLong(negative ? -(long long)mantissa : (long long)mantissa);
    }
    long tens = exponent - fraction;
    if (digits <= 19 && mantissa <= (1ULL << 53) && tens >= -22 && tens <= 22) {
        double d = (double)mantissa;
        d = tens < 0 ? d / exact_tens[-tens] : d * exact_tens[tens];
        return PyFloat_FromDouble(negative ? -d : d);
    }
    char buf[MAX_NUMBER + 1];
    memcpy(buf, start, (size_t)n);
    buf[n] = '\0';
    char *stop;
    double d = PyOS_string_to_double(buf, &stop, NULL);
    if (d == -1.0 && PyErr_Occurred())
        return NULL;  /* the caller clears it: declined */
    if (stop != buf + n || !isfinite(d))
        return NULL;
    return PyFloat_FromDouble(d);
}

static PyObject *value(Cursor *c, int depth);

/* An array after its '[': a list, NULL to decline. */
static PyObject *
array(Cursor *c, int depth)
{
    PyObject *list = PyList_New(0);
    if (list == NULL)
        return NULL;
    blanks(c);
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return list;
    }
    for (;;) {
        PyObject *item = value(c, depth + 1);
        if (item == NULL || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
        blanks(c);
        if (c->p >= c->end)
            break;
        char b = *c->p++;
        if (b == ']')
            return list;
        if (b != ',')
            break;
    }
    Py_DECREF(list);
    return NULL;
}

static inline int
literal(Cursor *c, const char *word, size_t n)
{
    if ((size_t)(c->end - c->p) >= n && memcmp(c->p, word, n) == 0) {
        c->p += n;
        return 1;
    }
    return 0;
}

static PyObject *
value(Cursor *c, int depth)
{
    blanks(c);
    if (c->p >= c->end || depth > MAX_DEPTH)
        return NULL;
    char b = *c->p;
    if (b == '"') {
        c->p++;
        return string(c);
    }
    if (b == '[') {
        c->p++;
        return array(c, depth);
    }
    if (b == 't' && literal(c, "true", 4))
        Py_RETURN_TRUE;
    if (b == 'f' && literal(c, "false", 5))
        Py_RETURN_FALSE;
    if (b == 'n' && literal(c, "null", 4))
        Py_RETURN_NONE;
    if (b == '-' || (b >= '0' && b <= '9'))
        return number(c);
    return NULL;  /* an object, NaN, Infinity, garbage */
}

/* Whether `v` (built by this parser: exact types) matches `code`. */
static int
matches(PyObject *v, const char *code)
{
    if (*code == '?') {
        if (v == Py_None)
            return 1;
        code++;
    }
    switch (*code) {
    case 'i':
        return PyLong_CheckExact(v);
    case 'b':
        return PyBool_Check(v);
    case 's':
        return PyUnicode_CheckExact(v);
    case 'f':
        return PyFloat_CheckExact(v) || PyLong_CheckExact(v);
    case '[':
        if (!PyList_CheckExact(v))
            return 0;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(v); i++)
            if (!matches(PyList_GET_ITEM(v, i), code + 1))
                return 0;
        return 1;
    }
    return 0;
}

/* A key, or the kind's name, after its opening quote: plain ASCII, no escape (ours are);
 * 0 to decline. */
static int
plain(Cursor *c, const char **text, Py_ssize_t *len)
{
    const char *start = c->p;
    for (; c->p < c->end && *c->p != '"'; c->p++) {
        unsigned char b = (unsigned char)*c->p;
        if (b == '\\' || b < 0x20 || b >= 0x80)
            return 0;
    }
    if (c->p >= c->end)
        return 0;
    *text = start;
    *len = c->p++ - start;
    return 1;
}

static inline int
same(const char *a, Py_ssize_t a_len, const char *b, Py_ssize_t b_len)
{
    return a_len == b_len && memcmp(a, b, (size_t)a_len) == 0;
}

/* One line: the event, or NULL (no exception: declined; an exception: a real error). */
static PyObject *
event(const char *p, const char *end)
{
    Cursor c = {p, end};
    const char *keys[MAX_PAIRS];
    Py_ssize_t key_len[MAX_PAIRS];
    PyObject *vals[MAX_PAIRS];  /* NULL for `kind` (read in place) */
    Py_ssize_t n = 0;
    const char *kind = NULL;
    Py_ssize_t kind_len = 0;
    PyObject *version = NULL, *result = NULL;
    Py_ssize_t at_version = -1;  /* its pair (a field's value may be the same small int) */

    blanks(&c);
    if (c.p >= c.end || *c.p++ != '{')
        return NULL;
    for (;;) {
        blanks(&c);
        if (c.p >= c.end || *c.p++ != '"' || n == MAX_PAIRS ||
                !plain(&c, &keys[n], &key_len[n]))
            goto done;
        blanks(&c);
        if (c.p >= c.end || *c.p++ != ':')
            goto done;
        if (same(keys[n], key_len[n], "kind", 4)) {
            blanks(&c);
            if (kind != NULL || c.p >= c.end || *c.p++ != '"' || !plain(&c, &kind, &kind_len))
                goto done;  /* a second kind, or not a plain string */
            vals[n] = NULL;
        }
        else {
            vals[n] = value(&c, 0);
            if (vals[n] == NULL)
                goto done;
            if (same(keys[n], key_len[n], "v", 1)) {
                if (version != NULL) {
                    n++;
                    goto done;
                }
                version = vals[n];
                at_version = n;
            }
        }
        n++;
        blanks(&c);
        if (c.p >= c.end)
            goto done;
        char b = *c.p++;
        if (b == '}')
            break;
        if (b != ',')
            goto done;
    }
    blanks(&c);
    if (c.p != c.end || kind == NULL || version == NULL || !PyLong_CheckExact(version))
        goto done;  /* trailing bytes, no kind, no int `v` */
    int overflow;
    if (PyLong_AsLongAndOverflow(version, &overflow) != schema_version || overflow)
        goto done;
    Kind *kd = NULL;
    for (Py_ssize_t k = 0; k < n_kinds && kd == NULL; k++)
        if (same(kinds[k].name, kinds[k].name_len, kind, kind_len))
            kd = &kinds[k];
    if (kd == NULL || n != kd->n + 2)
        goto done;  /* a kind left to the Python path (or unknown); a field missing or unknown */

    PyObject *fields[MAX_FIELDS] = {NULL};
    for (Py_ssize_t i = 0; i < n; i++) {
        if (vals[i] == NULL || i == at_version)
            continue;
        Py_ssize_t j = 0;
        while (j < kd->n && !same(kd->utf8[j], kd->len[j], keys[i], key_len[i]))
            j++;
        if (j == kd->n || fields[j] != NULL || !matches(vals[i], kd->codes[j]))
            goto done;  /* unknown, repeated or bad */
        fields[j] = vals[i];
    }
    /* n == fields + 2, `v` and `kind` once each, no field twice: every field is there */
    long long pid = PyLong_AsLongLongAndOverflow(fields[kd->pid], &overflow);
    if (pid <= 0 || overflow)
        goto done;
    /* object.__new__(cls) and each field set as object.__setattr__ would: what the Python
     * builders do through __dict__, skipping the frozen dataclass's __init__ (every field is
     * checked above); the attributes go to the instance's shared-key storage, no dict built */
    result = PyBaseObject_Type.tp_new((PyTypeObject *)kd->cls, empty_tuple, NULL);
    for (Py_ssize_t j = 0; j < kd->n && result != NULL; j++)
        if (PyObject_GenericSetAttr(result, kd->names[j], fields[j]) < 0)
            Py_CLEAR(result);
done:
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(vals[i]);
    return result;
}

/* parse(data, max_line) -> list of events, or None: see the top of this file. */
static PyObject *
parse(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t max_line;
    if (!PyArg_ParseTuple(args, "y*n", &buf, &max_line))
        return NULL;
    const char *p = buf.buf, *end = p + buf.len;
    PyObject *out = PyList_New(0);
    if (out == NULL || buf.len == 0)
        goto decline;
    for (;;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *stop = nl != NULL ? nl : end;
        if (stop - p > max_line)
            goto decline;
        PyObject *ev = event(p, stop);
        if (ev == NULL) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_ValueError) &&
                    !PyErr_ExceptionMatches(PyExc_OverflowError))
                goto fail;  /* MemoryError and the like: the caller sees it */
            goto decline;
        }
        int bad = PyList_Append(out, ev);
        Py_DECREF(ev);
        if (bad < 0)
            goto fail;
        if (nl == NULL)
            break;
        p = nl + 1;
    }
    PyBuffer_Release(&buf);
    return out;
decline:
    PyErr_Clear();
    Py_XDECREF(out);
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&buf);
    return NULL;
}

static void
forget(void)
{
    for (Py_ssize_t i = 0; i < n_kinds; i++) {
        Py_CLEAR(kinds[i].cls);
        for (Py_ssize_t j = 0; j < kinds[i].n; j++)
            Py_CLEAR(kinds[i].names[j]);
        kinds[i].n = 0;
    }
    n_kinds = 0;
    PyList_SetSlice(kind_names, 0, PyList_GET_SIZE(kind_names), NULL);
}

/* configure(version, {kind: (cls, ((name, code), ...))}) */
static PyObject *
configure(PyObject *Py_UNUSED(self), PyObject *args)
{
    long version;
    PyObject *specs;
    if (!PyArg_ParseTuple(args, "lO!", &version, &PyDict_Type, &specs))
        return NULL;
    forget();
    schema_version = version;
    PyObject *name, *spec;
    Py_ssize_t pos = 0;
    while (PyDict_Next(specs, &pos, &name, &spec)) {
        PyObject *cls, *fields;
        if (n_kinds == MAX_KINDS) {
            PyErr_SetString(PyExc_ValueError, "too many kinds");
            goto fail;
        }
        if (!PyUnicode_Check(name) || !PyTuple_Check(spec) ||
                !PyArg_ParseTuple(spec, "O!O!;(cls, fields)", &PyType_Type, &cls,
                                  &PyTuple_Type, &fields))
            goto fail_type;
        Kind *kd = &kinds[n_kinds];
        Py_ssize_t n = PyTuple_GET_SIZE(fields);
        if (n > MAX_FIELDS) {
            PyErr_SetString(PyExc_ValueError, "too many fields");
            goto fail;
        }
        kd->cls = Py_NewRef(cls);
        kd->pid = -1;
        n_kinds++;
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *field_name;
            const char *code;
            Py_ssize_t code_len;
            if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fields, j), "Us#;(name, code)",
                                  &field_name, &code, &code_len))
                goto fail;
            if (code_len == 0 || code_len >= MAX_CODE) {
                PyErr_SetString(PyExc_ValueError, "bad code");
                goto fail;
            }
            Py_INCREF(field_name);
            PyUnicode_InternInPlace(&field_name);
            kd->names[j] = field_name;
            kd->n = j + 1;
            kd->utf8[j] = PyUnicode_AsUTF8AndSize(field_name, &kd->len[j]);
            if (kd->utf8[j] == NULL)
                goto fail;
            memcpy(kd->codes[j], code, (size_t)code_len + 1);
            if (strcmp(kd->utf8[j], "pid") == 0)
                kd->pid = j;
        }
        if (kd->pid < 0) {
            PyErr_SetString(PyExc_ValueError, "a kind without pid");
            goto fail;
        }
        if (PyList_Append(kind_names, name) < 0)
            goto fail;
        kd->name = PyUnicode_AsUTF8AndSize(name, &kd->name_len);
        if (kd->name == NULL)
            goto fail;
    }
    Py_RETURN_NONE;
fail_type:
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "specs: {str: (type, tuple)}");
fail:
    forget();
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(data, max_line) -> the datagram's events, or None: the Python path decides."},
    {"configure", configure, METH_VARARGS,
     "configure(version, {kind: (cls, ((field, code), ...))}): the kinds parse() builds."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_intake", "The receiver's fast path in C (see receiver.py).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__intake(void)
{
    empty_tuple = PyTuple_New(0);
    kind_names = PyList_New(0);
    if (empty_tuple == NULL || kind_names == NULL)
        return NULL;
    return PyModule_Create(&module_def);
}
