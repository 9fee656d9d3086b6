/* The Thrift compact-protocol walks of routelog.format.parquet_limits, compiled: a Parquet footer and a page header,
 * read exactly as that module's Python reader reads them (which reads them as Apache Thrift's C++ reader in pyarrow
 * does), with the same checks and the same messages. The Python reader stays, for builds without a compiler;
 * tests/test_parquet_walk.py and tools/fuzz_kernels.py hold the two to the same results and errors on forged bytes.
 *
 * Every read is bounded by the bytes given: a declared size or count is checked against the bytes left before
 * anything is read or allocated for it, nesting stops at MAX_DEPTH, and a failure raises ValueError with the
 * problem (the caller names the object).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { T_STOP, T_TRUE, T_FALSE, T_BYTE, T_I16, T_I32, T_I64, T_DOUBLE, T_BINARY, T_LIST, T_SET, T_MAP, T_STRUCT };
enum { RLE = 3, BIT_PACKED = 4 };
#define MAX_DEPTH 32

typedef struct {
    const uint8_t *data;
    Py_ssize_t pos, end;
    long long max_path; /* names in a column chunk's path_in_schema */
} Reader;

/* Raises ValueError(problem) and returns -1 (the value every failing step below returns). */
static int fail(const char *format, ...) {
    va_list args;
    va_start(args, format);
    PyObject *message = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (message) {
        PyErr_SetObject(PyExc_ValueError, message);
        Py_DECREF(message);
    }
    return -1;
}

static const char RUNS_PAST[] = "a Thrift structure runs past its bytes";

static int read_byte(Reader *r, int *out) {
    if (r->pos >= r->end) return fail(RUNS_PAST);
    *out = r->data[r->pos++];
    return 0;
}

static int varint(Reader *r, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->pos >= r->end) return fail(RUNS_PAST);
        uint8_t b = r->data[r->pos++];
        value |= (uint64_t)(b & 0x7F) << shift; /* shift <= 63: bits past 64 are dropped, as Python masks them */
        if (!(b & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return fail("a Thrift integer is longer than 10 bytes");
}

/* readVarint32: the varint truncated to a signed 32-bit integer */
static int32_t int32_of(uint64_t raw) { return (int32_t)(uint32_t)raw; }
/* readI32: zigzag decoding of the varint truncated to 32 bits */
static int32_t zigzag32(uint64_t raw) {
    uint32_t u = (uint32_t)raw;
    return (int32_t)(u >> 1) ^ -(int32_t)(u & 1);
}
static int64_t zigzag64(uint64_t raw) { return (int64_t)(raw >> 1) ^ -(int64_t)(raw & 1); }

static int read_i32(Reader *r, int32_t *out) {
    uint64_t raw = 0;
    if (varint(r, &raw) < 0) return -1;
    *out = zigzag32(raw);
    return 0;
}

static int read_i64(Reader *r, int64_t *out) {
    uint64_t raw = 0;
    if (varint(r, &raw) < 0) return -1;
    *out = zigzag64(raw);
    return 0;
}

/* A length or element count, never negative nor more than the bytes left. */
static int read_size(Reader *r, const char *what, Py_ssize_t *out) {
    uint64_t raw = 0;
    if (varint(r, &raw) < 0) return -1;
    int32_t n = int32_of(raw);
    if (n < 0 || n > r->end - r->pos) return fail("%s declares %d entries or bytes, %zd bytes are left", what, (int)n, r->end - r->pos);
    *out = n;
    return 0;
}

/* A Parquet name: a new str, or NULL with ValueError set. */
static PyObject *read_text(Reader *r) {
    Py_ssize_t n;
    if (read_size(r, "a Thrift string", &n) < 0) return NULL;
    PyObject *text = PyUnicode_DecodeUTF8((const char *)r->data + r->pos, n, "strict");
    r->pos += n;
    if (!text) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) return NULL;
        PyErr_Clear();
        fail("a Parquet name is not UTF-8");
    }
    return text;
}

/* Element count and declared type of a list or set: at most limit, and never more than the bytes left. */
static int container(Reader *r, long long limit, const char *what, Py_ssize_t *size, int *kind) {
    int header = 0;
    if (read_byte(r, &header) < 0) return -1;
    Py_ssize_t n = header >> 4;
    *kind = header & 0x0F;
    if (n == 15 && read_size(r, what, &n) < 0) return -1;
    long long left = r->end - r->pos, most = limit < left ? limit : left;
    if (n > most) return fail("%s declares %zd entries (at most %lld)", what, n, most);
    if (*kind > T_STRUCT) return fail("%s holds elements of unknown Thrift type %d", what, *kind);
    *size = n;
    return 0;
}

static int check_depth(int depth) {
    return depth > MAX_DEPTH ? fail("Thrift structures nested deeper than %d", MAX_DEPTH) : 0;
}

/* The next field of a struct: 1 with its id and type, 0 at the struct's end, -1 on failure. A struct's reading
 * starts with check_depth. */
static int next_field(Reader *r, int16_t *field_id, int *kind) {
    if (r->pos >= r->end) return fail(RUNS_PAST);
    int header = r->data[r->pos++];
    int delta = header >> 4;
    *kind = header & 0x0F;
    if (*kind == T_STOP) return 0;
    if (*kind > T_STRUCT) return fail("a Thrift field of unknown type %d", *kind);
    if (delta) {
        *field_id = (int16_t)(uint16_t)(*field_id + delta);
    } else {
        uint64_t raw = 0;
        if (varint(r, &raw) < 0) return -1;
        *field_id = (int16_t)(uint16_t)zigzag32(raw);
    }
    return 1;
}

/* Skip a value of the declared type (element: a container's, where a boolean takes a byte). */
static int skip(Reader *r, int kind, int depth, int element) {
    if (check_depth(depth) < 0) return -1;
    int byte;
    uint64_t raw = 0;
    Py_ssize_t size = 0;
    switch (kind) {
        case T_TRUE:
        case T_FALSE:
            return element ? read_byte(r, &byte) : 0;
        case T_BYTE:
            return read_byte(r, &byte);
        case T_I16:
        case T_I32:
        case T_I64:
            return varint(r, &raw);
        case T_DOUBLE:
            if (r->end - r->pos < 8) return fail("a Thrift double runs past its bytes");
            r->pos += 8;
            return 0;
        case T_BINARY:
            if (read_size(r, "a Thrift string", &size) < 0) return -1;
            r->pos += size;
            return 0;
        case T_LIST:
        case T_SET: {
            int inner = 0;
            if (container(r, r->end - r->pos, "a Thrift list", &size, &inner) < 0) return -1;
            for (Py_ssize_t i = 0; i < size; i++)
                if (skip(r, inner, depth + 1, 1) < 0) return -1;
            return 0;
        }
        case T_MAP: {
            int types = 0;
            if (read_size(r, "a Thrift map", &size) < 0) return -1;
            if (size && read_byte(r, &types) < 0) return -1;
            if ((types >> 4) > T_STRUCT || (types & 0x0F) > T_STRUCT)
                return fail("a Thrift map holds entries of unknown type");
            for (Py_ssize_t i = 0; i < size; i++)
                if (skip(r, types >> 4, depth + 1, 1) < 0 || skip(r, types & 0x0F, depth + 1, 1) < 0) return -1;
            return 0;
        }
        case T_STRUCT: {
            int16_t field_id = 0;
            int field_kind = 0, more;
            if (check_depth(depth + 1) < 0) return -1;
            while ((more = next_field(r, &field_id, &field_kind)) == 1)
                if (skip(r, field_kind, depth + 1, 0) < 0) return -1;
            return more;
        }
        default:
            return fail("a Thrift value of type %d where none may be", kind);
    }
}

/* Optional integers become None where absent. */
static PyObject *optional(int present, long long value) {
    if (present) return PyLong_FromLongLong(value);
    Py_RETURN_NONE;
}

/* SchemaElement -> (name, physical | None, type_length, repetition, children | None) */
static PyObject *schema_element(Reader *r, int depth) {
    PyObject *name = NULL;
    int32_t physical = 0, type_length = 0, repetition = 0, children = 0, value;
    int has_physical = 0, has_children = 0, kind = 0, more;
    int16_t field_id = 0;
    if (check_depth(depth) < 0) return NULL;
    while ((more = next_field(r, &field_id, &kind)) == 1) {
        if (field_id == 4 && kind == T_BINARY) {
            PyObject *text = read_text(r);
            if (!text) goto error;
            Py_XSETREF(name, text);
        } else if (field_id >= 1 && field_id <= 5 && field_id != 4 && kind == T_I32) {
            if (read_i32(r, &value) < 0) goto error;
            if (field_id == 1) physical = value, has_physical = 1;
            else if (field_id == 2) type_length = value;
            else if (field_id == 3) repetition = value;
            else children = value, has_children = 1;
        } else if (skip(r, kind, depth, 0) < 0) {
            goto error;
        }
    }
    if (more < 0) goto error;
    if (!name) {
        fail("a schema element has no name");
        return NULL;
    }
    return Py_BuildValue("(NNiiN)", name, optional(has_physical, physical), (int)type_length, (int)repetition,
                         optional(has_children, children));
error:
    Py_XDECREF(name);
    return NULL;
}

/* ColumnMetaData -> (physical | None, path, codec (-1 if absent), num_values, compressed, data_page_offset,
 * dictionary_page_offset | None) */
static PyObject *column_meta(Reader *r, int depth) {
    PyObject *path = PyTuple_New(0);
    int64_t values[4] = {0}; /* fields 5, 7, 9, 11: num_values, compressed, data offset, dictionary offset */
    int has[4] = {0}, has_physical = 0, has_codec = 0, kind = 0, more;
    int32_t physical = 0, codec = 0, value;
    int16_t field_id = 0;
    if (!path) return NULL;
    if (check_depth(depth) < 0) goto error;
    while ((more = next_field(r, &field_id, &kind)) == 1) {
        if (field_id == 3 && kind == T_LIST) {
            Py_ssize_t size = 0;
            int element = 0;
            if (container(r, r->max_path, "a column chunk's path_in_schema", &size, &element) < 0) goto error;
            if (element != T_BINARY) {
                fail("a column chunk's path_in_schema is not a list of names");
                goto error;
            }
            PyObject *names = PyTuple_New(size);
            if (!names) goto error;
            for (Py_ssize_t i = 0; i < size; i++) {
                PyObject *text = read_text(r);
                if (!text) {
                    Py_DECREF(names);
                    goto error;
                }
                PyTuple_SET_ITEM(names, i, text);
            }
            Py_SETREF(path, names);
        } else if ((field_id == 1 || field_id == 4) && kind == T_I32) {
            if (read_i32(r, &value) < 0) goto error;
            if (field_id == 1) physical = value, has_physical = 1;
            else codec = value, has_codec = 1;
        } else if ((field_id == 5 || field_id == 7 || field_id == 9 || field_id == 11) && kind == T_I64) {
            int slot = (field_id - 5) / 2;
            if (read_i64(r, &values[slot]) < 0) goto error;
            has[slot] = 1;
        } else if (skip(r, kind, depth, 0) < 0) {
            goto error;
        }
    }
    if (more < 0) goto error;
    if (!has[0] || !has[1] || !has[2]) {
        fail("a column chunk lacks its value count, size or offset");
        goto error;
    }
    return Py_BuildValue("(NNiLLLN)", optional(has_physical, physical), path, has_codec ? (int)codec : -1,
                         (long long)values[0], (long long)values[1], (long long)values[2],
                         optional(has[3], values[3]));
error:
    Py_DECREF(path);
    return NULL;
}

/* ColumnChunk -> its metadata's tuple */
static PyObject *column_chunk(Reader *r, int depth, long long unused) {
    (void)unused;
    PyObject *meta = NULL;
    int16_t field_id = 0;
    int kind = 0, more;
    if (check_depth(depth) < 0) return NULL;
    while ((more = next_field(r, &field_id, &kind)) == 1) {
        if (field_id == 1) {
            fail("a column chunk lives in another file (file_path)");
            goto error;
        }
        if (field_id == 8 || field_id == 9) {
            fail("a column chunk is encrypted");
            goto error;
        }
        if (field_id == 3 && kind == T_STRUCT) {
            PyObject *read = column_meta(r, depth + 1);
            if (!read) goto error;
            Py_XSETREF(meta, read);
        } else if (skip(r, kind, depth, 0) < 0) {
            goto error;
        }
    }
    if (more < 0) goto error;
    if (!meta) fail("a column chunk has no metadata");
    return meta;
error:
    Py_XDECREF(meta);
    return NULL;
}

typedef PyObject *(*ReadStruct)(Reader *, int, long long);

/* A Thrift list of at most limit structs (what: its name in errors; not_structs: the error when its elements are
 * another type), each read by read_one(r, depth, arg): a Python list, or NULL. */
static PyObject *struct_list(Reader *r, long long limit, const char *what, const char *not_structs, ReadStruct read_one,
                             int depth, long long arg) {
    Py_ssize_t count = 0;
    int element = 0;
    if (container(r, limit, what, &count, &element) < 0) return NULL;
    if (element != T_STRUCT) {
        fail("%s", not_structs);
        return NULL;
    }
    PyObject *list = PyList_New(count);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = read_one(r, depth, arg);
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *schema_element_entry(Reader *r, int depth, long long unused) {
    (void)unused;
    return schema_element(r, depth);
}

/* RowGroup -> (num_rows, [column chunk tuples]) */
static PyObject *row_group(Reader *r, int depth, long long max_columns) {
    PyObject *chunks = PyList_New(0);
    int64_t num_rows = 0;
    int has_rows = 0, kind = 0, more;
    int16_t field_id = 0;
    if (!chunks) return NULL;
    if (check_depth(depth) < 0) goto error;
    while ((more = next_field(r, &field_id, &kind)) == 1) {
        if (field_id == 1 && kind == T_LIST) {
            PyObject *read = struct_list(r, max_columns, "a row group's column list",
                                         "a row group's columns are not structs", column_chunk, depth + 1, 0);
            if (!read) goto error;
            Py_SETREF(chunks, read);
        } else if (field_id == 3 && kind == T_I64) {
            if (read_i64(r, &num_rows) < 0) goto error;
            has_rows = 1;
        } else if (skip(r, kind, depth, 0) < 0) {
            goto error;
        }
    }
    if (more < 0) goto error;
    if (!has_rows) {
        fail("a row group does not say how many rows it holds");
        goto error;
    }
    return Py_BuildValue("(LN)", (long long)num_rows, chunks);
error:
    Py_DECREF(chunks);
    return NULL;
}

static int reader_of(Py_buffer *view, Py_ssize_t start, Py_ssize_t end, Reader *r) {
    if (start < 0 || end < start || end > view->len) {
        PyErr_Format(PyExc_ValueError, "bytes [%zd, %zd) outside an object of %zd", start, end, view->len);
        return -1;
    }
    r->data = view->buf;
    r->pos = start;
    r->end = end;
    r->max_path = 0;
    return 0;
}

static PyObject *footer(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t start, end;
    long long max_elements, max_groups, max_path;
    if (!PyArg_ParseTuple(args, "y*nnLLL", &view, &start, &end, &max_elements, &max_groups, &max_path)) return NULL;
    Reader r;
    PyObject *elements = PyList_New(0), *groups = PyList_New(0), *result = NULL;
    int64_t num_rows = 0;
    int has_rows = 0, kind = 0, more;
    int16_t field_id = 0;
    if (!elements || !groups || reader_of(&view, start, end, &r) < 0) goto done;
    r.max_path = max_path;
    while ((more = next_field(&r, &field_id, &kind)) == 1) {
        if (field_id == 2 && kind == T_LIST) {
            PyObject *read = struct_list(&r, max_elements, "the schema", "the schema is not a list of structs",
                                         schema_element_entry, 1, 0);
            if (!read) goto done;
            Py_SETREF(elements, read);
        } else if (field_id == 3 && kind == T_I64) {
            if (read_i64(&r, &num_rows) < 0) goto done;
            has_rows = 1;
        } else if (field_id == 4 && kind == T_LIST) {
            Py_ssize_t columns = PyList_GET_SIZE(elements);
            PyObject *read = struct_list(&r, max_groups, "the row group list", "the row groups are not structs",
                                         row_group, 1, columns ? columns : max_elements);
            if (!read) goto done;
            Py_SETREF(groups, read);
        } else if (field_id == 8) {
            fail("the footer is encrypted");
            goto done;
        } else if (skip(&r, kind, 0, 0) < 0) {
            goto done;
        }
    }
    if (more == 0) result = Py_BuildValue("(NOO)", optional(has_rows, num_rows), elements, groups);
done:
    Py_XDECREF(elements);
    Py_XDECREF(groups);
    PyBuffer_Release(&view);
    return result;
}

/* DataPageHeader (5), DictionaryPageHeader (7) or DataPageHeaderV2 (8): (num_values, encoding) */
static int sub_header(Reader *r, int which, int32_t *num_values, int32_t *encoding) {
    int16_t field_id = 0;
    int kind = 0, more;
    int32_t value;
    *num_values = -1;
    *encoding = -1;
    if (check_depth(1) < 0) return -1;
    while ((more = next_field(r, &field_id, &kind)) == 1) {
        if (field_id == 1 && kind == T_I32) {
            if (read_i32(r, num_values) < 0) return -1;
        } else if (field_id == (which == 8 ? 4 : 2) && kind == T_I32) {
            if (read_i32(r, encoding) < 0) return -1;
        } else if (which == 5 && (field_id == 3 || field_id == 4) && kind == T_I32) {
            if (read_i32(r, &value) < 0) return -1;
            if (value != RLE && value != BIT_PACKED) return fail("a data page's levels use an encoding other than RLE");
        } else if (which == 8 && (field_id == 5 || field_id == 6) && kind == T_I32) {
            if (read_i32(r, &value) < 0) return -1;
            if (value < 0) return fail("a data page declares levels of negative length");
        } else if (skip(r, kind, 1, 0) < 0) {
            return -1;
        }
    }
    return more;
}

static PyObject *page_header(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &end)) return NULL;
    Reader r;
    PyObject *result = NULL;
    int32_t sizes[3] = {0}, counts[3] = {0}, encodings[3] = {0}; /* type, uncompressed, compressed; per sub-header */
    int has[3] = {0}, has_sub[3] = {0}, kind = 0, more;
    int16_t field_id = 0;
    if (reader_of(&view, start, end, &r) < 0) goto done;
    while ((more = next_field(&r, &field_id, &kind)) == 1) {
        if (field_id >= 1 && field_id <= 3 && kind == T_I32) {
            if (read_i32(&r, &sizes[field_id - 1]) < 0) goto done;
            has[field_id - 1] = 1;
        } else if ((field_id == 5 || field_id == 7 || field_id == 8) && kind == T_STRUCT) {
            int slot = field_id == 5 ? 0 : field_id - 6;
            if (sub_header(&r, field_id, &counts[slot], &encodings[slot]) < 0) goto done;
            has_sub[slot] = 1;
        } else if (skip(&r, kind, 0, 0) < 0) {
            goto done;
        }
    }
    if (more < 0) goto done;
    if (!has[0] || !has[1] || !has[2]) {
        fail("a page header lacks its type or sizes");
        goto done;
    }
    if (sizes[1] < 0 || sizes[2] < 0) {
        fail("a page header declares a negative size");
        goto done;
    }
    /* the sub-header the page type names: DATA_PAGE 0 -> 5, DICTIONARY_PAGE 2 -> 7, DATA_PAGE_V2 3 -> 8 */
    int slot = sizes[0] == 0 ? 0 : sizes[0] == 2 ? 1 : sizes[0] == 3 ? 2 : -1;
    int32_t num_values = slot >= 0 && has_sub[slot] ? counts[slot] : 0;
    int32_t encoding = slot >= 0 && has_sub[slot] ? encodings[slot] : 0;
    if (slot >= 0 && num_values < 0) {
        fail("a page header declares a negative value count");
        goto done;
    }
    result = Py_BuildValue("(iiiiin)", (int)sizes[0], (int)sizes[1], (int)sizes[2], (int)num_values, (int)encoding,
                           r.pos);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"footer", footer, METH_VARARGS,
     "footer(data, start, end, max_schema_elements, max_row_groups, max_path) -> (num_rows | None, schema elements, "
     "row groups); ValueError(problem) on bytes that break the rules"},
    {"page_header", page_header, METH_VARARGS,
     "page_header(data, start, end) -> (type, uncompressed, compressed, num_values, encoding, body offset)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cthrift",
                                    "Parquet footers and page headers read in C (see parquet_limits.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cthrift(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "MAX_DEPTH", MAX_DEPTH) < 0) Py_CLEAR(m);
    return m;
}
