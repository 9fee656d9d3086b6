/* The compiled coder of the lightning indexer's selected key positions (routelog/format/positions.py, whose module
 * docstring is the bit layout's specification; routelog/format/positions_python.py is the same coder in Python and
 * writes the same bytes).
 *
 * encode(rows, n, k, first_position, keyframe_every) -> bytes, or the index of the first row that is not in
 *     canonical form (an int): rows is a C-contiguous int32 buffer of n * k values.
 * decode(data, offsets, n, k, first_position, keyframe_every, start, stop, out) -> (status, row): rows start..stop-1
 *     of a block whose header routelog/format/positions.py parsed; offsets (int64, one more than the groups) are the
 *     byte offsets of the groups in data. Status 0 is success; otherwise the row at which the problem was found.
 * first_invalid_row(rows, n, k, first_position) -> the first row not in canonical form, or -1.
 *
 * Every read is bounds-checked: the groups a decode needs are copied into a buffer with zero padding past their
 * end, every field checks that it ends inside its group, and every value is checked against its range before it
 * is used as an index or written as a position. A forged block returns a status, never reads or writes out of
 * bounds, and the output buffer is written only inside its n * k values.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAGIC 0xA1
#define MAX_K 65536
#define ESCAPE_ZEROS 24 /* a d code's quotient of this many zeros escapes to an Exp-Golomb code of d */
#define MAX_GAMMA_ZEROS 32
#define PADDING_BYTES 32

enum {
    OK = 0,
    TRUNCATED = 1,
    CHANGES_RANGE = 2,
    REMOVED_RANGE = 3,
    ADDED_RANGE = 4,
    KEYFRAME_RANGE = 5,
    GROUP_LENGTH = 6,
    BAD_ARGUMENTS = 7,
    NO_MEMORY = 8,
};

/* -- shared ---------------------------------------------------------------------------------------------------- */

/* The Rice parameter of a block of m gaps summing to at most s (Kiely's rule for a geometric source of mean s / m:
 * r = 1 + floor(log2(0.48125 * (mean + 1/2))), at least 0), in integers so that every build agrees. */
static inline unsigned rice_parameter(uint64_t s, uint64_t m) {
    if (m == 0) return 0;
    unsigned r = 0;
    uint64_t lhs = 77u * (2 * s + m);
    while (r < 31 && lhs >= 320u * m * ((uint64_t)1 << r)) r++;
    return r;
}

/* The d code's adaptive state: a running mean of d (times 16) and the mean absolute prediction error (JPEG-LS). */
typedef struct {
    int known;
    int64_t mean16, error_sum, count;
} Changes;

static inline unsigned changes_parameter(const Changes *c) {
    unsigned r = 0;
    while (r < 31 && (c->count << r) < c->error_sum) r++;
    return r;
}

static inline int64_t isqrt64(int64_t v) {
    int64_t x = 0;
    while ((x + 1) * (x + 1) <= v) x++;
    return x;
}

static inline void changes_start(Changes *c, int64_t d) {
    c->known = 1;
    c->mean16 = d << 4;
    c->error_sum = isqrt64(d) + 1;
    c->count = 1;
}

static inline void changes_update(Changes *c, int64_t d, int64_t predicted) {
    int64_t e = d - predicted;
    c->mean16 += e;
    c->error_sum += e < 0 ? -e : e;
    if (++c->count == 32) {
        c->error_sum >>= 1;
        c->count >>= 1;
    }
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static inline unsigned ctz64(uint64_t w) {
#if defined(__GNUC__) || defined(__clang__)
    return (unsigned)__builtin_ctzll(w);
#else
    unsigned n = 0;
    while (!(w & 1)) {
        w >>= 1;
        n++;
    }
    return n;
#endif
}

static int64_t row_problem(const int32_t *row, int64_t k, int64_t p) {
    /* 0 when the row is canonical or missing (all -1), else 1 */
    if (row[0] == -1) {
        for (int64_t j = 1; j < k; j++)
            if (row[j] != -1) return 1;
        return 0;
    }
    int64_t c = p + 1 < k ? p + 1 : k;
    if (row[0] < 0) return 1;
    for (int64_t j = 1; j < c; j++)
        if (row[j] <= row[j - 1]) return 1;
    if (row[c - 1] > p) return 1;
    for (int64_t j = c; j < k; j++)
        if (row[j] != -1) return 1;
    return 0;
}

static int64_t scan_rows(const int32_t *rows, int64_t n, int64_t k, int64_t first, uint8_t *missing) {
    for (int64_t i = 0; i < n; i++) {
        const int32_t *row = rows + i * k;
        if (row_problem(row, k, first + i)) return i;
        if (missing) missing[i] = row[0] == -1;
    }
    return -1;
}

/* -- the bit writer -------------------------------------------------------------------------------------------- */
typedef struct {
    uint8_t *data;
    size_t size, capacity;
    uint64_t acc;
    unsigned used; /* bits in acc */
    int failed;
} Writer;

static int writer_reserve(Writer *w, size_t more) {
    if (w->size + more <= w->capacity) return 0;
    size_t capacity = w->capacity ? w->capacity : 4096;
    while (capacity < w->size + more) capacity *= 2;
    uint8_t *data = realloc(w->data, capacity);
    if (!data) {
        w->failed = 1;
        return -1;
    }
    w->data = data;
    w->capacity = capacity;
    return 0;
}

static inline void put_bits(Writer *w, uint64_t value, unsigned bits) { /* bits <= 32 */
    if (bits == 0 || w->failed) return;
    value &= ((uint64_t)1 << bits) - 1;
    w->acc |= value << w->used;
    w->used += bits;
    if (w->used >= 32) {
        if (writer_reserve(w, 4) < 0) return;
        uint32_t low = (uint32_t)w->acc;
        w->data[w->size++] = (uint8_t)low;
        w->data[w->size++] = (uint8_t)(low >> 8);
        w->data[w->size++] = (uint8_t)(low >> 16);
        w->data[w->size++] = (uint8_t)(low >> 24);
        w->acc >>= 32;
        w->used -= 32;
    }
}

static inline void put_unary(Writer *w, uint64_t q) { /* q zero bits, then a one */
    while (q >= 32) {
        put_bits(w, 0, 32);
        q -= 32;
    }
    put_bits(w, (uint64_t)1 << q, (unsigned)q + 1);
}

static void put_gamma(Writer *w, uint64_t v) { /* Exp-Golomb of order 0 */
    uint64_t x = v + 1;
    unsigned length = 0;
    while ((x >> length) > 1) length++;
    put_unary(w, length);
    put_bits(w, x, length);
}

static void flush_bytes(Writer *w) { /* pad to a byte with zero bits */
    while (w->used > 0 && !w->failed) {
        if (writer_reserve(w, 1) < 0) return;
        w->data[w->size++] = (uint8_t)w->acc;
        w->acc >>= 8;
        w->used = w->used >= 8 ? w->used - 8 : 0;
    }
    w->acc = 0;
}

static void put_varint(Writer *w, uint64_t v) { /* to a byte-aligned writer */
    do {
        if (writer_reserve(w, 1) < 0) return;
        uint8_t byte = v & 0x7F;
        v >>= 7;
        w->data[w->size++] = byte | (v ? 0x80 : 0);
    } while (v);
}

/* A Rice block: the m low parts of r bits, then the m quotients in unary. */
static void put_block(Writer *w, const uint32_t *values, int64_t m, unsigned r) {
    if (r)
        for (int64_t j = 0; j < m; j++) put_bits(w, values[j], r);
    for (int64_t j = 0; j < m; j++) put_unary(w, values[j] >> r);
}

static void put_changes(Writer *w, Changes *c, int64_t d) {
    if (!c->known) {
        put_gamma(w, (uint64_t)d);
        changes_start(c, d);
        return;
    }
    int64_t predicted = (c->mean16 + 8) >> 4;
    int64_t e = d - predicted;
    uint64_t v = e >= 0 ? (uint64_t)(2 * e) : (uint64_t)(-2 * e - 1);
    unsigned r = changes_parameter(c);
    uint64_t q = v >> r;
    if (q < ESCAPE_ZEROS) {
        put_unary(w, q);
        put_bits(w, v, r);
    } else {
        put_bits(w, 0, ESCAPE_ZEROS);
        put_gamma(w, (uint64_t)d);
    }
    changes_update(c, d, predicted);
}

/* -- encode ---------------------------------------------------------------------------------------------------- */

/* gaps of ascending values in place: v[j] - v[j-1] - 1, v[-1] = -1 */
static inline void to_gaps(uint32_t *v, int64_t m) {
    for (int64_t j = m - 1; j > 0; j--) v[j] = v[j] - v[j - 1] - 1;
}

static int encode_group(Writer *w, const int32_t *rows, const uint8_t *missing, int64_t lo, int64_t hi, int64_t k,
                        int64_t first, uint32_t *removed, uint32_t *added, uint32_t *scratch) {
    int has_missing = 0;
    for (int64_t i = lo; i < hi; i++) has_missing |= missing[i];
    put_bits(w, (uint64_t)has_missing, 1);
    Changes changes = {0};
    int previous_known = 0;
    for (int64_t i = lo; i < hi; i++) {
        int64_t p = first + i;
        if (has_missing) put_bits(w, missing[i], 1);
        if (missing[i]) {
            previous_known = 0;
            continue;
        }
        const int32_t *row = rows + i * k;
        if (p + 1 <= k) {
            previous_known = 1;
            continue;
        }
        if (!previous_known) { /* keyframe */
            int64_t m = k <= p + 1 - k ? k : p + 1 - k;
            if (m == k) {
                for (int64_t j = 0; j < k; j++) scratch[j] = (uint32_t)row[j];
            } else { /* the complement of the row in [0, p] */
                int64_t j = 0, out = 0;
                for (int64_t x = 0; x <= p; x++) {
                    if (j < k && row[j] == x)
                        j++;
                    else
                        scratch[out++] = (uint32_t)x;
                }
            }
            to_gaps(scratch, m);
            put_block(w, scratch, m, rice_parameter((uint64_t)(p + 1 - m), (uint64_t)m));
            changes.known = 0;
            previous_known = 1;
            continue;
        }
        /* delta against the row before: both hold k positions */
        const int32_t *prev = row - k;
        int64_t a = 0, b = 0, d_removed = 0, d_added = 0;
        while (a < k && b < k) {
            if (prev[a] == row[b]) {
                a++;
                b++;
            } else if (prev[a] < row[b]) {
                removed[d_removed++] = (uint32_t)a++;
            } else {
                added[d_added++] = (uint32_t)(row[b++] - a); /* its rank among the positions not in prev */
            }
        }
        while (a < k) removed[d_removed++] = (uint32_t)a++;
        while (b < k) added[d_added++] = (uint32_t)(row[b++] - k);
        int64_t d = d_removed; /* == d_added */
        put_changes(w, &changes, d);
        to_gaps(removed, d);
        put_block(w, removed, d, rice_parameter((uint64_t)(k - d), (uint64_t)d));
        to_gaps(added, d);
        put_block(w, added, d, rice_parameter((uint64_t)(p + 1 - k - d), (uint64_t)d));
    }
    flush_bytes(w);
    return w->failed ? -1 : 0;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    long long n, k, first, every;
    if (!PyArg_ParseTuple(args, "y*LLLL", &view, &n, &k, &first, &every)) return NULL;
    PyObject *result = NULL;
    uint8_t *missing = NULL;
    uint32_t *scratch = NULL;
    int64_t *lengths = NULL;
    Writer body = {0}, head = {0};
    if (n < 0 || k < 1 || k > MAX_K || first < 0 || first + n > ((int64_t)1 << 31) || every < 1 ||
        every > INT32_MAX || view.len != (Py_ssize_t)(n * k * 4)) {
        PyErr_SetString(PyExc_ValueError, "encode: arguments out of range");
        goto done;
    }
    const int32_t *rows = (const int32_t *)view.buf;
    missing = malloc(n ? (size_t)n : 1);
    scratch = malloc(sizeof(uint32_t) * (size_t)(3 * k));
    int64_t groups = (n + every - 1) / every;
    lengths = malloc(sizeof(int64_t) * (size_t)(groups ? groups : 1));
    if (!missing || !scratch || !lengths) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t bad = scan_rows(rows, n, k, first, missing);
    if (bad >= 0) {
        result = PyLong_FromLongLong(bad);
        goto done;
    }
    for (int64_t g = 0; g < groups; g++) {
        size_t before = body.size;
        int64_t lo = g * every, hi = lo + every < n ? lo + every : n;
        if (encode_group(&body, rows, missing, lo, hi, k, first, scratch, scratch + k, scratch + 2 * k) < 0) {
            PyErr_NoMemory();
            goto done;
        }
        lengths[g] = (int64_t)(body.size - before);
    }
    if (writer_reserve(&head, 1) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    head.data[head.size++] = MAGIC;
    put_varint(&head, (uint64_t)n);
    put_varint(&head, (uint64_t)k);
    put_varint(&head, (uint64_t)first);
    put_varint(&head, (uint64_t)every);
    for (int64_t g = 0; g + 1 < groups; g++) put_varint(&head, (uint64_t)lengths[g]);
    if (head.failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(head.size + body.size));
    if (result) {
        char *out = PyBytes_AS_STRING(result);
        memcpy(out, head.data, head.size);
        if (body.size) memcpy(out + head.size, body.data, body.size);
    }
done:
    free(missing);
    free(scratch);
    free(lengths);
    free(body.data);
    free(head.data);
    PyBuffer_Release(&view);
    return result;
}

/* -- the bit reader -------------------------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *buf; /* PADDING_BYTES readable zero bytes past the bytes copied */
    uint64_t pos, end;  /* bits; end: the group's */
} Reader;

static inline uint64_t peek(const Reader *r) { return load64(r->buf + (r->pos >> 3)) >> (r->pos & 7); }

/* One bit; -1 past the group's end. */
static inline int get_bit(Reader *r) {
    if (r->pos >= r->end) return -1;
    int bit = (r->buf[r->pos >> 3] >> (r->pos & 7)) & 1;
    r->pos++;
    return bit;
}

/* bits <= 32, the caller having checked that they end inside the group */
static inline uint64_t get_bits_unchecked(Reader *r, unsigned bits) {
    if (bits == 0) return 0;
    uint64_t v = peek(r) & (((uint64_t)1 << bits) - 1);
    r->pos += bits;
    return v;
}

static inline int get_bits(Reader *r, unsigned bits, uint64_t *v) {
    if (r->pos + bits > r->end) return -1;
    *v = get_bits_unchecked(r, bits);
    return 0;
}

/* A unary quotient (zeros, then a one inside the group), or -1. */
static inline int get_unary(Reader *r, uint64_t *q) {
    uint64_t count = 0;
    for (;;) {
        if (r->pos >= r->end) return -1;
        uint64_t w = peek(r);
        if (w) {
            unsigned z = ctz64(w);
            if (r->pos + z >= r->end) return -1;
            r->pos += z + 1;
            *q = count + z;
            return 0;
        }
        unsigned step = 64 - (unsigned)(r->pos & 7);
        r->pos += step;
        count += step;
    }
}

/* Zeros up to `limit`, then a one: how many zeros (limit when `limit` zeros came first); -1 past the end. */
static inline int get_zeros(Reader *r, unsigned limit, unsigned *zeros) {
    unsigned z = 0;
    for (;;) {
        if (z == limit) break;
        int bit = get_bit(r);
        if (bit < 0) return -1;
        if (bit) break;
        z++;
    }
    *zeros = z;
    return 0;
}

/* Exp-Golomb of order 0: status TRUNCATED, CHANGES_RANGE (more than MAX_GAMMA_ZEROS zeros) or OK */
static int get_gamma(Reader *r, uint64_t *v) {
    unsigned z;
    if (get_zeros(r, MAX_GAMMA_ZEROS, &z) < 0) return TRUNCATED;
    if (z == MAX_GAMMA_ZEROS) return CHANGES_RANGE;
    uint64_t low;
    if (get_bits(r, z, &low) < 0) return TRUNCATED;
    *v = (((uint64_t)1 << z) | low) - 1;
    return OK;
}

static int get_changes(Reader *r, Changes *c, int64_t limit, int64_t *d) {
    uint64_t v;
    int status;
    if (!c->known) {
        if ((status = get_gamma(r, &v)) != OK) return status;
        if (v > (uint64_t)limit) return CHANGES_RANGE;
        *d = (int64_t)v;
        changes_start(c, *d);
        return OK;
    }
    int64_t predicted = (c->mean16 + 8) >> 4;
    unsigned rp = changes_parameter(c), z;
    if (get_zeros(r, ESCAPE_ZEROS, &z) < 0) return TRUNCATED;
    int64_t value;
    if (z < ESCAPE_ZEROS) {
        uint64_t low;
        if (get_bits(r, rp, &low) < 0) return TRUNCATED;
        uint64_t zz = ((uint64_t)z << rp) | low;
        int64_t e = (zz & 1) ? -(int64_t)((zz + 1) >> 1) : (int64_t)(zz >> 1);
        value = predicted + e;
    } else {
        if ((status = get_gamma(r, &v)) != OK) return status;
        if (v > (uint64_t)limit) return CHANGES_RANGE;
        value = (int64_t)v;
    }
    if (value < 0 || value > limit) return CHANGES_RANGE;
    *d = value;
    changes_update(c, value, predicted);
    return OK;
}

/* A Rice block of m gaps into ascending values below `universe` (out[j]); TRUNCATED, `range` or OK. */
static int get_block(Reader *r, int64_t m, unsigned rp, int64_t universe, int range, int32_t *out) {
    if (m == 0) return OK;
    if (r->pos + (uint64_t)m * rp > r->end) return TRUNCATED;
    Reader low = *r;
    r->pos += (uint64_t)m * rp;
    uint64_t cap = (uint64_t)universe >> rp, total = 0;
    int too_big = 0;
    int64_t t = -1;
    for (int64_t j = 0; j < m; j++) {
        uint64_t q, bits = get_bits_unchecked(&low, rp);
        if (get_unary(r, &q) < 0) return TRUNCATED;
        if (q > cap) {
            too_big = 1;
            continue;
        }
        uint64_t v = (q << rp) | bits;
        total += v + 1;
        t += (int64_t)v + 1;
        out[j] = (int32_t)t; /* below 2^33 in all: checked before it is used */
    }
    if (too_big || total > (uint64_t)universe) return range;
    return OK;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view, offsets_view, out_view;
    long long n, k, first, every, start, stop;
    if (!PyArg_ParseTuple(args, "y*y*LLLLLLw*", &view, &offsets_view, &n, &k, &first, &every, &start, &stop,
                          &out_view))
        return NULL;
    int status = OK;
    int64_t at = -1;
    uint8_t *copy = NULL;
    int32_t *scratch = NULL;
    int64_t groups = every >= 1 && n >= 0 ? (n + every - 1) / every : -1;
    if (n < 0 || k < 1 || k > MAX_K || first < 0 || first + n > ((int64_t)1 << 31) || every < 1 || start < 0 ||
        start > stop || stop > n || offsets_view.len != (Py_ssize_t)(8 * (groups + 1)) ||
        out_view.len != (Py_ssize_t)((stop - start) * k * 4)) {
        status = BAD_ARGUMENTS;
        goto done;
    }
    if (start == stop) goto done;
    const int64_t *offsets = (const int64_t *)offsets_view.buf;
    for (int64_t g = 0; g <= groups; g++)
        if (offsets[g] < 0 || offsets[g] > view.len || (g && offsets[g] < offsets[g - 1])) {
            status = BAD_ARGUMENTS;
            goto done;
        }
    int64_t g0 = start / every, g1 = (stop - 1) / every;
    int64_t base = offsets[g0], size = offsets[g1 + 1] - base;
    copy = calloc((size_t)size + PADDING_BYTES, 1);
    scratch = malloc(sizeof(int32_t) * (size_t)(4 * k));
    if (!copy || !scratch) {
        status = NO_MEMORY;
        goto done;
    }
    memcpy(copy, (const uint8_t *)view.buf + base, (size_t)size);
    int32_t *out = (int32_t *)out_view.buf;
    int32_t *ring[2] = {scratch, scratch + k}, *removed = scratch + 2 * k, *added = scratch + 3 * k;
    for (int64_t g = g0; g <= g1 && status == OK; g++) {
        Reader r = {copy, (uint64_t)(offsets[g] - base) * 8, (uint64_t)(offsets[g + 1] - base) * 8};
        int64_t lo = g * every, hi = lo + every < n ? lo + every : n, last = hi < stop ? hi : stop;
        int has_missing = get_bit(&r);
        if (has_missing < 0) {
            status = TRUNCATED;
            at = lo;
            break;
        }
        Changes changes = {0};
        int previous_known = 0;
        const int32_t *prev = NULL;
        for (int64_t i = lo; i < last; i++) {
            int64_t p = first + i;
            int32_t *row = i >= start ? out + (i - start) * k : ring[i & 1];
            at = i;
            int is_missing = 0;
            if (has_missing && (is_missing = get_bit(&r)) < 0) {
                status = TRUNCATED;
                break;
            }
            if (is_missing) {
                if (i >= start)
                    for (int64_t j = 0; j < k; j++) row[j] = -1;
                previous_known = 0;
                continue;
            }
            if (p + 1 <= k) {
                for (int64_t j = 0; j <= p; j++) row[j] = (int32_t)j;
                for (int64_t j = p + 1; j < k; j++) row[j] = -1;
                previous_known = 1;
                prev = row;
                continue;
            }
            if (!previous_known) {
                int64_t m = k <= p + 1 - k ? k : p + 1 - k;
                unsigned rp = rice_parameter((uint64_t)(p + 1 - m), (uint64_t)m);
                if (m == k) {
                    if ((status = get_block(&r, m, rp, p + 1, KEYFRAME_RANGE, row)) != OK) break;
                } else {
                    if ((status = get_block(&r, m, rp, p + 1, KEYFRAME_RANGE, removed)) != OK) break;
                    int64_t j = 0, o = 0;
                    for (int64_t x = 0; x <= p; x++) {
                        if (j < m && removed[j] == x)
                            j++;
                        else
                            row[o++] = (int32_t)x;
                    }
                }
                changes.known = 0;
                previous_known = 1;
                prev = row;
                continue;
            }
            int64_t candidates = p + 1 - k, d;
            if ((status = get_changes(&r, &changes, k < candidates ? k : candidates, &d)) != OK) break;
            if ((status = get_block(&r, d, rice_parameter((uint64_t)(k - d), (uint64_t)d), k, REMOVED_RANGE,
                                    removed)) != OK)
                break;
            if ((status = get_block(&r, d, rice_parameter((uint64_t)(candidates - d), (uint64_t)d), candidates,
                                    ADDED_RANGE, added)) != OK)
                break;
            /* prev minus its removed ranks, plus the added ones: the rank a among the positions not in prev is
             * a + (the number of prev's positions below it), and prev[x] is below it when prev[x] - x <= a */
            int64_t jr = 0, ja = 0, o = 0;
            if (d == 0) {
                memcpy(row, prev, sizeof(int32_t) * (size_t)k);
            } else {
                for (int64_t x = 0; x < k; x++) {
                    int32_t v = prev[x];
                    while (ja < d && v - x > added[ja]) row[o++] = (int32_t)(added[ja++] + x);
                    if (jr < d && removed[jr] == x)
                        jr++;
                    else
                        row[o++] = v;
                }
                while (ja < d) row[o++] = (int32_t)(added[ja++] + k);
            }
            prev = row;
        }
        if (status != OK) break;
        if (last == hi) { /* the whole group was read: it ends in the byte its last bit is in, zero bits after */
            at = hi - 1;
            uint64_t used = r.pos - (uint64_t)(offsets[g] - base) * 8;
            uint64_t bytes = (uint64_t)(offsets[g + 1] - offsets[g]);
            if ((used + 7) / 8 != bytes || (r.pos < r.end && (peek(&r) & ((1u << (r.end - r.pos)) - 1)) != 0)) {
                status = GROUP_LENGTH;
                break;
            }
        }
    }
done:
    free(copy);
    free(scratch);
    PyBuffer_Release(&view);
    PyBuffer_Release(&offsets_view);
    PyBuffer_Release(&out_view);
    if (status == NO_MEMORY) return PyErr_NoMemory();
    return Py_BuildValue("(iL)", status, (long long)(status == OK ? -1 : at));
}

static PyObject *first_invalid_row(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    long long n, k, first;
    if (!PyArg_ParseTuple(args, "y*LLL", &view, &n, &k, &first)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || k < 1 || first < 0 || view.len != (Py_ssize_t)(n * k * 4))
        PyErr_SetString(PyExc_ValueError, "first_invalid_row: arguments out of range");
    else
        result = PyLong_FromLongLong(scan_rows((const int32_t *)view.buf, n, k, first, NULL));
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(rows, n, k, first_position, keyframe_every) -> bytes, or the first non-canonical row's index"},
    {"decode", decode, METH_VARARGS,
     "decode(data, offsets, n, k, first_position, keyframe_every, start, stop, out) -> (status, row)"},
    {"first_invalid_row", first_invalid_row, METH_VARARGS,
     "first_invalid_row(rows, n, k, first_position) -> the first row not in canonical form, or -1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpositions",
                                    "The indexer's key positions coded in C (see positions.py).", -1, methods};

PyMODINIT_FUNC PyInit__cpositions(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "MAX_K", MAX_K) < 0 || PyModule_AddIntConstant(m, "MAGIC", MAGIC) < 0))
        Py_CLEAR(m);
    return m;
}
