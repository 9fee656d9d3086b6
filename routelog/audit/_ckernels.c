/* The compiled passes of the routing audits (routelog/audit/kernels.py states their contract). Built by pip from
 * source with the machine's compiler, beside the codec's kernels; where it is not built, the numpy functions in
 * routelog/audit/kernels.py do the same work (tests/test_audit_kernels.py proves them equal).
 *
 * Why compiled: an audit touches every ID of a step once. numpy needs a widened copy of the IDs for a histogram
 * (bincount takes intp) and a K x K broadcast for set differences; one pass in C reads each ID once, and an audit
 * then costs little more than reading the step.
 *
 * Inputs are routing as the reader hands it out, [layers, tokens, K] uint8 or uint16 with any strides: nothing here
 * trusts an ID. An ID at or above the universe is reported (its position) instead of counted, and a row's
 * difference never indexes past its histogram. Both functions release the GIL while they work.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline int64_t load_id(const uint8_t *p, int itemsize) {
    if (itemsize == 1) return p[0];
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* A buffer of `ndim` dimensions whose items are `itemsize` bytes (0: 1 or 2, an ID array). */
static int get_array(PyObject *obj, Py_buffer *view, int flags, int ndim, int itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    int ok = view->ndim == ndim && (itemsize ? view->itemsize == itemsize : view->itemsize == 1 || view->itemsize == 2);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: expected a %d-D array of %d-byte items", name, ndim, itemsize ? itemsize : 1);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* count_experts(ids [L, T, K], valid [T] bool, counts [L, E] int64) -> first bad ID's position, or -1.
 * Adds to counts[l, e] how often expert e is chosen in layer l over the valid tokens. An ID >= E stops the pass
 * before anything of its layer is added: returns (l * T + t) * K + k of it, and counts holds the layers before. */
static PyObject *count_experts(PyObject *self, PyObject *args) {
    PyObject *ids_obj, *valid_obj, *counts_obj;
    if (!PyArg_ParseTuple(args, "OOO", &ids_obj, &valid_obj, &counts_obj)) return NULL;
    Py_buffer ids, valid, counts;
    if (get_array(ids_obj, &ids, PyBUF_STRIDES | PyBUF_FORMAT, 3, 0, "ids") < 0) return NULL;
    if (get_array(valid_obj, &valid, PyBUF_C_CONTIGUOUS, 1, 1, "valid") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (get_array(counts_obj, &counts, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 2, 8, "counts") < 0) {
        PyBuffer_Release(&ids);
        PyBuffer_Release(&valid);
        return NULL;
    }
    PyObject *answer = NULL;
    int64_t layers = ids.shape[0], tokens = ids.shape[1], k = ids.shape[2], experts = counts.shape[1];
    if (valid.shape[0] != tokens || counts.shape[0] != layers) {
        PyErr_SetString(PyExc_ValueError, "count_experts: valid must be [T] and counts [L, E] for ids [L, T, K]");
        goto release;
    }
    /* Per layer, into 32-bit counters of the layer alone (a [E] table stays in the first-level cache; a token's
     * K IDs are distinct, so increments rarely wait on each other), added to the int64 totals once checked. */
    uint32_t *local = calloc((size_t)(experts > 0 ? experts : 1), sizeof(uint32_t));
    if (!local) {
        PyErr_NoMemory();
        goto release;
    }
    int64_t bad = -1;
    int itemsize = (int)ids.itemsize;
    Py_BEGIN_ALLOW_THREADS const uint8_t *base = ids.buf;
    const uint8_t *keep = valid.buf;
    int64_t *total = counts.buf;
    for (int64_t l = 0; l < layers && bad < 0; l++) {
        memset(local, 0, (size_t)experts * sizeof(uint32_t));
        int64_t t = 0;
        while (t < tokens && bad < 0) {
            /* at most 2**31 / K tokens between flushes: no 32-bit counter can wrap */
            int64_t stop = tokens - t < ((int64_t)1 << 31) / (k > 0 ? k : 1) ? tokens : t + ((int64_t)1 << 31) / k;
            if (itemsize == 1 && ids.strides[2] == 1 && experts >= 256) { /* every uint8 ID is in range */
                for (; t < stop; t++) {
                    if (!keep[t]) continue;
                    const uint8_t *row = base + l * ids.strides[0] + t * ids.strides[1];
                    for (int64_t c = 0; c < k; c++) local[row[c]]++;
                }
            } else {
                for (; t < stop && bad < 0; t++) {
                    if (!keep[t]) continue;
                    const uint8_t *row = base + l * ids.strides[0] + t * ids.strides[1];
                    for (int64_t c = 0; c < k; c++) {
                        int64_t id = load_id(row + c * ids.strides[2], itemsize);
                        if (id >= experts) {
                            bad = (l * tokens + t) * k + c;
                            break;
                        }
                        local[id]++;
                    }
                }
            }
            if (bad < 0)
                for (int64_t e = 0; e < experts; e++) {
                    total[l * experts + e] += local[e];
                    local[e] = 0;
                }
        }
    }
    Py_END_ALLOW_THREADS free(local);
    answer = PyLong_FromLongLong(bad);
release:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&valid);
    PyBuffer_Release(&counts);
    return answer;
}

/* How many of row a's K IDs row b lacks (rows of any order; K x K compares unless the rows are equal). */
static inline int64_t lacking(const uint8_t *a, const uint8_t *b, Py_ssize_t stride_a, Py_ssize_t stride_b, int64_t k,
                              int itemsize) {
    int64_t found = 0;
    for (int64_t i = 0; i < k; i++) {
        int64_t id = load_id(a + i * stride_a, itemsize);
        for (int64_t j = 0; j < k; j++)
            if (load_id(b + j * stride_b, itemsize) == id) {
                found++;
                break;
            }
    }
    return k - found;
}

/* compare_rows(a [L, T, K], b [L, T, K], both [T] bool, router_hist [K+1], token_hist [L*K+1], layer_diff [L])
 * -> (rows compared, differing experts summed over them). Per valid token and layer, d = how many of a's experts b
 * lacks: router_hist[d] += 1, layer_diff[l] += d > 0; per token, token_hist[sum over layers of d] += 1. The
 * histograms are int64 and added to. */
static PyObject *compare_rows(PyObject *self, PyObject *args) {
    PyObject *a_obj, *b_obj, *both_obj, *router_obj, *token_obj, *layer_obj;
    if (!PyArg_ParseTuple(args, "OOOOOO", &a_obj, &b_obj, &both_obj, &router_obj, &token_obj, &layer_obj))
        return NULL;
    Py_buffer a, b, both, router, token, layer;
    Py_buffer *views[] = {&a, &b, &both, &router, &token, &layer};
    PyObject *answer = NULL;
    int got = 0;
    if (get_array(a_obj, &a, PyBUF_STRIDES | PyBUF_FORMAT, 3, 0, "a") < 0) goto release;
    got++;
    if (get_array(b_obj, &b, PyBUF_STRIDES | PyBUF_FORMAT, 3, 0, "b") < 0) goto release;
    got++;
    if (get_array(both_obj, &both, PyBUF_C_CONTIGUOUS, 1, 1, "both") < 0) goto release;
    got++;
    if (get_array(router_obj, &router, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 1, 8, "router_hist") < 0) goto release;
    got++;
    if (get_array(token_obj, &token, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 1, 8, "token_hist") < 0) goto release;
    got++;
    if (get_array(layer_obj, &layer, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, 1, 8, "layer_diff") < 0) goto release;
    got++;
    int64_t layers = a.shape[0], tokens = a.shape[1], k = a.shape[2];
    if (b.shape[0] != layers || b.shape[1] != tokens || b.shape[2] != k || a.itemsize != b.itemsize ||
        both.shape[0] != tokens || router.shape[0] != k + 1 || token.shape[0] != layers * k + 1 ||
        layer.shape[0] != layers) {
        PyErr_SetString(PyExc_ValueError,
                        "compare_rows: a and b [L, T, K] alike, both [T], router_hist [K+1], token_hist [L*K+1], "
                        "layer_diff [L]");
        goto release;
    }
    int32_t *per_token = calloc((size_t)(tokens > 0 ? tokens : 1), sizeof(int32_t));
    if (!per_token) {
        PyErr_NoMemory();
        goto release;
    }
    int itemsize = (int)a.itemsize;
    int64_t rows = 0, differing = 0;
    /* Rows of eight uint8 IDs compare as one word when equal, as most rows of two routings of the same tokens are. */
    int words = itemsize == 1 && k == 8 && a.strides[2] == 1 && b.strides[2] == 1;
    Py_BEGIN_ALLOW_THREADS const uint8_t *keep = both.buf;
    int64_t *router_hist = router.buf, *token_hist = token.buf, *layer_diff = layer.buf;
    for (int64_t l = 0; l < layers; l++) { /* layer by layer: each layer's rows are contiguous in the reader's arrays */
        const uint8_t *row_a = (const uint8_t *)a.buf + l * a.strides[0];
        const uint8_t *row_b = (const uint8_t *)b.buf + l * b.strides[0];
        int64_t changed = 0;
        for (int64_t t = 0; t < tokens; t++, row_a += a.strides[1], row_b += b.strides[1]) {
            if (!keep[t]) continue;
            int64_t d;
            if (words) {
                uint64_t x, y;
                memcpy(&x, row_a, 8);
                memcpy(&y, row_b, 8);
                d = x == y ? 0 : lacking(row_a, row_b, 1, 1, 8, 1);
            } else {
                d = lacking(row_a, row_b, a.strides[2], b.strides[2], k, itemsize);
            }
            router_hist[d]++;
            changed += d > 0;
            per_token[t] += (int32_t)d;
        }
        layer_diff[l] += changed;
    }
    for (int64_t t = 0; t < tokens; t++)
        if (keep[t]) {
            token_hist[per_token[t]]++;
            differing += per_token[t];
            rows++;
        }
    Py_END_ALLOW_THREADS free(per_token);
    answer = Py_BuildValue("LL", (long long)rows, (long long)differing);
release:
    for (int i = 0; i < got; i++) PyBuffer_Release(views[i]);
    return answer;
}

static PyMethodDef methods[] = {
    {"count_experts", count_experts, METH_VARARGS,
     "count_experts(ids, valid, counts) -> position of the first ID >= E, or -1 (counts added to)"},
    {"compare_rows", compare_rows, METH_VARARGS,
     "compare_rows(a, b, both, router_hist, token_hist, layer_diff) -> (rows, differing experts)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ckernels",
                                    "The compiled passes of the routing audits (see kernels.py).", -1, methods};

PyMODINIT_FUNC PyInit__ckernels(void) { return PyModule_Create(&module); }
