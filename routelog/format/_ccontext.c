/* The compiled passes of the set-context codec (routelog/format/context.py; FORMAT.md section 5): counting a
 * part's distinct rows and keys, hashing a layer's token keys, finding which rows a plan's candidates reach, coding
 * one chunk layer's rows as binary decisions behind an adaptive binary range coder, and placing its decoded rows.
 *
 * A layer's rows are coded one after the other. Each row is a set of the part's model: one of the candidates its
 * row in the layer below points at, one of its token's candidates, another set of the layer's list (its index,
 * Elias-gamma style), or an escape (a set the model does not list, stored by the format-2 codec beside the
 * decisions). Every decision is a bit coded with an adaptive probability chosen by a small context; the
 * probabilities start at one half in every chunk layer, so each chunk layer decodes alone given the model.
 *
 * The range coder is the classic binary one with 11-bit probabilities, a 32-bit range and carry propagation
 * through a cached byte: the encoder's first byte is always 0, and it flushes five bytes at the end; a stream that
 * codes no decision (every row an escape, with nothing listed) is stored empty. The decoder
 * reads zeros past the end of its bytes, so no stream, forged or not, reads outside its buffer; everything decoded
 * is checked against the model before it is used (indices below the list's size).
 *
 * Chunk version 2 codes the escaped rows behind the same range coder too (encode_escapes, decode_escapes): a bit
 * per expert in the layer's order, 1 when the expert is in the row's set, with 15-bit probabilities that adapt as
 * counts would (fast while a context is new, then down to 1/256). Any stream decodes to valid sets.
 *
 * Chunk version 3 codes each escaped row against a reference (encode_referenced, decode_referenced): the listed set
 * among the row's candidates (those its decisions passed over) that shares most experts with it. The row names
 * which candidate, then which of the reference's experts it keeps, then the experts it adds in the layer's order.
 * An escape is a set used once in the part, but most are a listed set with an expert or two changed.
 *
 * Model version 3 codes a layer's list the same way (encode_list, decode_list): each set against the earlier set of
 * the list sharing most experts with it, named by its distance back, or alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROB_BITS 11
#define PROB_ONE (1u << PROB_BITS)
#define ADAPT 4
#define TOP (1u << 24)
#define MAX_POSITION 4 /* candidate positions told apart by the context: 0, 1, 2, 3 and more */
#define MAX_LENGTH 4   /* candidate list lengths told apart: 1, 2, 3, 4 and more */
#define MAX_BUCKET 31  /* the largest Elias-gamma bucket: list indices below 2^31 - 1 */
#define TREE_BITS 6    /* the leading mantissa bits coded in a tree of contexts */

enum { OK = 0, INDEX_RANGE = 1, BUCKET_RANGE = 2 };

/* The coder's per-bit steps, inlined into every pass (a few percent of a corpus chunk's coding, measured). */
#if defined(__GNUC__)
#define HOT inline __attribute__((always_inline))
#else
#define HOT inline
#endif

/* -- adaptive probabilities ----------------------------------------------------------------------------------- */
typedef struct {
    uint16_t candidate[2][MAX_POSITION][MAX_LENGTH][2]; /* [below or token][position][length][other source has some] */
    uint16_t listed[2][2];                              /* [token has candidates][row below has candidates] */
    uint16_t bucket[MAX_BUCKET + 1];
    uint16_t tree[MAX_BUCKET + 1][1 << TREE_BITS];
    uint16_t low[MAX_BUCKET + 1][32];
} Model;

static void model_reset(Model *m) {
    uint16_t *p = (uint16_t *)m;
    for (size_t i = 0; i < sizeof(Model) / sizeof(uint16_t); i++) p[i] = PROB_ONE / 2;
}

/* -- the range coder ------------------------------------------------------------------------------------------ */
typedef struct {
    uint64_t low;
    uint32_t range;
    uint8_t cache;
    uint64_t pending; /* bytes held back: the cache and the 0xFF bytes after it a carry may still change */
    uint8_t *out;
    size_t size, capacity;
    int overflow;
    int64_t bits; /* decisions coded: a stream of none is stored empty */
} Encoder;

static void put(Encoder *e, uint8_t byte) {
    if (e->size < e->capacity)
        e->out[e->size++] = byte;
    else
        e->overflow = 1;
}

static void shift_low(Encoder *e) {
    if ((uint32_t)e->low < 0xFF000000u || (e->low >> 32) != 0) {
        uint8_t carry = (uint8_t)(e->low >> 32);
        uint8_t held = e->cache;
        do {
            put(e, (uint8_t)(held + carry));
            held = 0xFF;
        } while (--e->pending != 0);
        e->cache = (uint8_t)(e->low >> 24);
    }
    e->pending++;
    e->low = (e->low & 0x00FFFFFFu) << 8;
}

/* A probability of a 0 moved 1 / 2^shift of the way towards the bit coded (out of one). */
static inline uint16_t adapted(uint32_t p, int bit, uint32_t one, int shift) {
    if (bit) return (uint16_t)(p - (p >> shift));
    return (uint16_t)(p + ((one - p) >> shift));
}

/* One decision: a 0 keeps the range below ``bound``, a 1 the rest; then the range is renormalized. */
static HOT void encode_split(Encoder *e, uint32_t bound, int bit) {
    e->bits++;
    if (!bit) {
        e->range = bound;
    } else {
        e->low += bound;
        e->range -= bound;
    }
    while (e->range < TOP) {
        e->range <<= 8;
        shift_low(e);
    }
}

static HOT void encode_bit(Encoder *e, uint16_t *p, int bit) {
    encode_split(e, (e->range >> PROB_BITS) * *p, bit);
    *p = adapted(*p, bit, PROB_ONE, ADAPT);
}

/* The stream's end. Any value in [low, low + range) decodes alike: the one with the most trailing zero bits is
 * written, and the zero bytes the stream then ends with are left out (a decoder reads zeros past a stream's end). */
static void encoder_flush(Encoder *e) {
    uint64_t last = e->low + e->range - 1;
    for (int bits = 32; bits > 0; bits--) {
        uint64_t mask = (1ull << bits) - 1, value = (e->low + mask) & ~mask;
        if (value <= last) {
            e->low = value;
            break;
        }
    }
    for (int i = 0; i < 5; i++) shift_low(e);
    while (e->size > 0 && e->out[e->size - 1] == 0) e->size--;
}

typedef struct {
    uint32_t code, range;
    const uint8_t *in;
    size_t size, at;
} Decoder;

static HOT uint8_t next_byte(Decoder *d) { return d->at < d->size ? d->in[d->at++] : (d->at++, 0); }

static void decoder_start(Decoder *d, const uint8_t *in, size_t size) {
    d->in = in;
    d->size = size;
    d->at = 0;
    d->code = 0;
    d->range = 0xFFFFFFFFu;
    for (int i = 0; i < 5; i++) d->code = (d->code << 8) | next_byte(d);
}

/* The decision encode_split coded with ``bound``, the range renormalized. */
static HOT int decode_split(Decoder *d, uint32_t bound) {
    int bit;
    if (d->code < bound) {
        d->range = bound;
        bit = 0;
    } else {
        d->code -= bound;
        d->range -= bound;
        bit = 1;
    }
    while (d->range < TOP) {
        d->range <<= 8;
        d->code = (d->code << 8) | next_byte(d);
    }
    return bit;
}

static HOT int decode_bit(Decoder *d, uint16_t *p) {
    int bit = decode_split(d, (d->range >> PROB_BITS) * *p);
    *p = adapted(*p, bit, PROB_ONE, ADAPT);
    return bit;
}

/* -- the escapes' counted probabilities ----------------------------------------------------------------------- */
#define ESCAPE_PROB_BITS 15
#define ESCAPE_PROB_ONE (1u << ESCAPE_PROB_BITS)
#define ESCAPE_MAX_SHIFT 8
#define ESCAPE_FOUND 8 /* contexts tell apart 0..7 experts found in the row so far (8 and more share the last) */
#define ESCAPE_MAX_EXPERTS 1024

typedef struct {
    uint16_t p; /* the probability of a 0 (not in the set), out of ESCAPE_PROB_ONE */
    uint8_t seen;
} Counter;

/* 1 / 2^shift of the way to the bit: shift = bit length of (seen + 1), at most ESCAPE_MAX_SHIFT. */
static inline int escape_shift(uint8_t seen) {
    int shift = 32 - __builtin_clz((unsigned)seen + 1u);
    return shift < ESCAPE_MAX_SHIFT ? shift : ESCAPE_MAX_SHIFT;
}

static HOT void counter_update(Counter *c, int bit) {
    c->p = adapted(c->p, bit, ESCAPE_PROB_ONE, escape_shift(c->seen));
    if (c->seen < 255) c->seen++;
}

static HOT void encode_counted(Encoder *e, Counter *c, int bit) {
    encode_split(e, (e->range >> ESCAPE_PROB_BITS) * c->p, bit);
    counter_update(c, bit);
}

static HOT int decode_counted(Decoder *d, Counter *c) {
    int bit = decode_split(d, (d->range >> ESCAPE_PROB_BITS) * c->p);
    counter_update(c, bit);
    return bit;
}

static Counter *counters_new(int64_t experts) {
    Counter *c = malloc((size_t)experts * ESCAPE_FOUND * sizeof(Counter));
    if (c)
        for (int64_t i = 0; i < experts * ESCAPE_FOUND; i++) c[i] = (Counter){(uint16_t)(ESCAPE_PROB_ONE / 2), 0};
    return c;
}

static inline int found_context(int64_t found) { return found < ESCAPE_FOUND - 1 ? (int)found : ESCAPE_FOUND - 1; }

/* One direction of the escape coders: the encoder codes the bits it is given, the decoder returns the bits it reads
 * (and ignores the ones given), and a dry run (neither) adds what the bits given would cost now to *cost, adapting
 * nothing. The escape passes are written once for all three. */
typedef struct {
    Encoder *e;
    Decoder *d;
    uint64_t *cost;
} Coder;

static inline int knows_bits(const Coder *c) { return c->d == NULL; }

/* What a bit costs, in 1/256 bits, by its probability's 10 leading bits: 256 * -log2((2i + 1) / 2048), from an
 * integer log2 (the same in the Python passes, bit for bit). */
#define COST_SLOTS 1024
static uint32_t cost_table[COST_SLOTS];

static uint32_t log2_fixed(uint64_t m) { /* floor(256 * log2(m)) for m >= 1, by squaring */
    int whole = 63 - __builtin_clzll(m);
    uint64_t y = (m << 30) >> whole; /* m / 2^whole in [1, 2), 30 fraction bits */
    uint32_t result = (uint32_t)whole << 8;
    for (int b = 7; b >= 0; b--) {
        y = (y * y) >> 30;
        if (y >= (2ull << 30)) {
            y >>= 1;
            result |= 1u << b;
        }
    }
    return result;
}

static void costs_start(void) {
    for (uint64_t i = 0; i < COST_SLOTS; i++) cost_table[i] = (11u << 8) - log2_fixed(2 * i + 1);
}

static inline uint32_t bit_cost(const Counter *k, int bit) {
    unsigned slot = (unsigned)(k->p >> (ESCAPE_PROB_BITS - 10));
    return cost_table[bit ? COST_SLOTS - 1 - slot : slot];
}

static HOT int code_counted(Coder *c, Counter *k, int bit) {
    if (c->e) {
        encode_counted(c->e, k, bit);
        return bit;
    }
    if (c->d) return decode_counted(c->d, k);
    *c->cost += bit_cost(k, bit);
    return bit;
}

/* A row's members among the experts of the order not flagged in skip (skipped of them are), a bit each, until want
 * are found or the rest must all be in it (they then follow uncoded). The context is (place among the experts coded,
 * found so far), or with by_remaining (place, still to find); both up to ESCAPE_FOUND - 1. The members found are
 * appended to got in the order's order; returns how many (want, when want <= experts - skipped). */
static int64_t code_members(Coder *c, Counter *counters, const uint16_t *order, int64_t experts, const uint8_t *skip,
                            int64_t skipped, int64_t want, const uint8_t *member, int by_remaining, uint16_t *got) {
    int64_t found = 0, place = 0, left = experts - skipped;
    for (int64_t i = 0; i < experts && found < want; i++) {
        uint16_t expert = order[i];
        if (skip && skip[expert]) continue;
        if (left - place == want - found) { /* the rest of the order is the rest of the set */
            for (; i < experts; i++)
                if (!(skip && skip[order[i]])) got[found++] = order[i];
            break;
        }
        int context = found_context(by_remaining ? want - found - 1 : found);
        if (code_counted(c, &counters[place * ESCAPE_FOUND + context], member[expert])) got[found++] = expert;
        place++;
    }
    return found;
}

/* A row's IDs in ascending order: an insertion sort of a few, else marking them and walking every ID. */
static void sort_ids(uint16_t *got, int64_t topk, int64_t experts, uint8_t *scratch) {
    if (experts <= ESCAPE_MAX_EXPERTS) { /* distinct IDs as bits, read back in order: no compare to mispredict */
        uint64_t bits[ESCAPE_MAX_EXPERTS / 64];
        int64_t words = (experts + 63) / 64, distinct = 0;
        memset(bits, 0, (size_t)words * sizeof(uint64_t));
        for (int64_t i = 0; i < topk && distinct >= 0; i++) {
            uint64_t bit = 1ull << (got[i] & 63);
            distinct = got[i] >= experts ? -1 : distinct + !(bits[got[i] >> 6] & bit);
            if (distinct >= 0) bits[got[i] >> 6] |= bit;
        }
        if (distinct == topk) { /* else (IDs past the experts or repeated) sorted as below */
            int64_t at = 0;
            for (int64_t w = 0; w < words; w++)
                for (uint64_t m = bits[w]; m; m &= m - 1) got[at++] = (uint16_t)(w * 64 + __builtin_ctzll(m));
            return;
        }
    }
    if (topk <= 32) {
        for (int64_t i = 1; i < topk; i++) {
            uint16_t v = got[i];
            int64_t j = i;
            for (; j > 0 && got[j - 1] > v; j--) got[j] = got[j - 1];
            got[j] = v;
        }
        return;
    }
    for (int64_t i = 0; i < topk; i++) scratch[got[i]] = 1;
    for (int64_t v = 0, at = 0; v < experts && at < topk; v++)
        if (scratch[v]) {
            scratch[v] = 0;
            got[at++] = (uint16_t)v;
        }
}

/* -- the layer's tables --------------------------------------------------------------------------------------- */
typedef struct {
    const int64_t *token_keys;
    const uint32_t *token_table; /* open addressing: a token's slot holds its key's position + 1 (0: empty) */
    uint64_t table_mask;
    int table_shift;
    const uint32_t *token_offsets, *token_candidates;
    const uint32_t *below_offsets, *below_candidates;
    int64_t below_keys; /* the layer below's list size: its rows' indices below this have candidates here */
    int64_t sets;
} Tables;

static inline uint64_t mix(uint64_t key) { return key * 0x9E3779B97F4A7C15ull; }

/* The token's candidates (count, and where they start), none for a token the layer does not key. */
static inline uint32_t token_candidates(const Tables *t, int64_t token, const uint32_t **at) {
    if (token < 0 || !t->token_table) return 0;
    uint64_t slot = mix((uint64_t)token) >> t->table_shift;
    for (;;) {
        uint32_t found = t->token_table[slot];
        if (!found) return 0;
        if (t->token_keys[found - 1] == token) {
            *at = t->token_candidates + t->token_offsets[found - 1];
            return t->token_offsets[found] - t->token_offsets[found - 1];
        }
        slot = (slot + 1) & t->table_mask;
    }
}

static inline uint32_t below_candidates(const Tables *t, int64_t below, const uint32_t **at) {
    if (below < 0 || below >= t->below_keys) return 0;
    *at = t->below_candidates + t->below_offsets[below];
    return t->below_offsets[below + 1] - t->below_offsets[below];
}

static inline int clamp(uint32_t n, int most) { return n < (uint32_t)most ? (int)n : most; }

static inline int listed_in(const uint32_t *list, uint32_t n, uint32_t value) {
    for (uint32_t i = 0; i < n; i++)
        if (list[i] == value) return 1;
    return 0;
}

/* One row's decisions. The encoder knows the row's index in the list (-1: escape) and codes it; the decoder passes
 * a Decoder and gets it back. Both walk the same candidates in the same order with the same contexts. */
static void encode_row(Encoder *e, Model *m, const Tables *t, int64_t token, int64_t below, int64_t index) {
    const uint32_t *bc = NULL, *tc = NULL;
    uint32_t nb = below_candidates(t, below, &bc), nt = token_candidates(t, token, &tc);
    int has_b = nb > 0, has_t = nt > 0;
    for (uint32_t i = 0; i < nb; i++) {
        int hit = (int64_t)bc[i] == index;
        encode_bit(e, &m->candidate[0][clamp(i, MAX_POSITION - 1)][clamp(nb, MAX_LENGTH) - 1][has_t], !hit);
        if (hit) return;
    }
    uint32_t position = 0;
    for (uint32_t i = 0; i < nt; i++) {
        if (listed_in(bc, nb, tc[i])) continue;
        int hit = (int64_t)tc[i] == index;
        encode_bit(e, &m->candidate[1][clamp(position, MAX_POSITION - 1)][clamp(nt, MAX_LENGTH) - 1][has_b], !hit);
        position++;
        if (hit) return;
    }
    if (t->sets == 0) return; /* an escape, the only thing a row of a layer without a list can be */
    encode_bit(e, &m->listed[has_t][has_b], index < 0);
    if (index < 0) return;
    uint64_t v = (uint64_t)index + 1;
    int bucket = 63 - __builtin_clzll(v);
    for (int i = 0; i < bucket; i++) encode_bit(e, &m->bucket[i], 1);
    encode_bit(e, &m->bucket[bucket], 0);
    unsigned node = 1;
    for (int i = bucket - 1; i >= 0; i--) {
        int bit = (int)((v >> i) & 1);
        if (bucket - 1 - i < TREE_BITS) {
            encode_bit(e, &m->tree[bucket][node], bit);
            node = 2 * node + (unsigned)bit;
        } else {
            encode_bit(e, &m->low[bucket][i], bit);
        }
    }
}

static int decode_row(Decoder *d, Model *m, const Tables *t, int64_t token, int64_t below, int64_t *index) {
    const uint32_t *bc = NULL, *tc = NULL;
    uint32_t nb = below_candidates(t, below, &bc), nt = token_candidates(t, token, &tc);
    int has_b = nb > 0, has_t = nt > 0;
    for (uint32_t i = 0; i < nb; i++) {
        if (!decode_bit(d, &m->candidate[0][clamp(i, MAX_POSITION - 1)][clamp(nb, MAX_LENGTH) - 1][has_t])) {
            *index = bc[i];
            return OK;
        }
    }
    uint32_t position = 0;
    for (uint32_t i = 0; i < nt; i++) {
        if (listed_in(bc, nb, tc[i])) continue;
        int miss = decode_bit(d, &m->candidate[1][clamp(position, MAX_POSITION - 1)][clamp(nt, MAX_LENGTH) - 1][has_b]);
        position++;
        if (!miss) {
            *index = tc[i];
            return OK;
        }
    }
    *index = -1;
    if (t->sets == 0 || decode_bit(d, &m->listed[has_t][has_b])) return OK;
    int bucket = 0;
    while (decode_bit(d, &m->bucket[bucket]))
        if (++bucket == MAX_BUCKET) return BUCKET_RANGE;
    uint64_t v = 1;
    unsigned node = 1;
    for (int i = bucket - 1; i >= 0; i--) {
        int bit;
        if (bucket - 1 - i < TREE_BITS) {
            bit = decode_bit(d, &m->tree[bucket][node]);
            node = 2 * node + (unsigned)bit;
        } else {
            bit = decode_bit(d, &m->low[bucket][i]);
        }
        v = 2 * v + (uint64_t)bit;
    }
    if ((int64_t)(v - 1) >= t->sets) return INDEX_RANGE;
    *index = (int64_t)(v - 1);
    return OK;
}

/* -- argument handling ---------------------------------------------------------------------------------------- */
typedef struct {
    Py_buffer view;
    int held;
} Arg;

static int get_array(PyObject *obj, Arg *a, const char *format, Py_ssize_t itemsize, int writable, const char *name) {
    a->held = 0;
    if (PyObject_GetBuffer(obj, &a->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    a->held = 1;
    const char *f = a->view.format ? a->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int matches = a->view.itemsize == itemsize && a->view.ndim <= 1;
    if (matches && format) { /* the integer kinds of one width are told apart by signedness only */
        int signed_given = strchr("bhilq", *f) != NULL, signed_wanted = strchr("bhilq", *format) != NULL;
        matches = signed_given == signed_wanted;
    }
    if (!matches) {
        PyErr_Format(PyExc_TypeError, "%s must be a flat C-contiguous array of %zd-byte %s integers", name, itemsize,
                     format && strchr("bhilq", *format) ? "signed" : "unsigned");
        return -1;
    }
    return 0;
}

static void release(Arg *args, int n) {
    for (int i = 0; i < n; i++)
        if (args[i].held) PyBuffer_Release(&args[i].view);
}

#define LEN(a, size) ((int64_t)((a).view.len / (size)))

/* tokens, below, token_keys, token_table, token_offsets, token_candidates, below_offsets, below_candidates */
enum { TOKENS, BELOW, KEYS, TABLE, TOKEN_OFFSETS, TOKEN_CANDIDATES, BELOW_OFFSETS, BELOW_CANDIDATES, TABLE_ARGS };

static int get_tables(PyObject **objs, Arg *a, int64_t sets, int64_t rows, Tables *t) {
    static const char *names[] = {"tokens",        "below",           "token_keys",     "token_table",
                                  "token_offsets", "token_candidates", "below_offsets", "below_candidates"};
    static const char formats[] = {'q', 'i', 'q', 'I', 'I', 'I', 'I', 'I'};
    static const Py_ssize_t sizes[] = {8, 4, 8, 4, 4, 4, 4, 4};
    for (int i = 0; i < TABLE_ARGS; i++)
        if (get_array(objs[i], &a[i], &formats[i], sizes[i], 0, names[i]) < 0) return -1;
    int64_t keys = LEN(a[KEYS], 8), table = LEN(a[TABLE], 4), below_keys = LEN(a[BELOW_OFFSETS], 4) - 1;
    if (LEN(a[TOKENS], 8) != rows || (LEN(a[BELOW], 4) != rows && LEN(a[BELOW], 4) != 0) ||
        LEN(a[TOKEN_OFFSETS], 4) != keys + 1 || (table & (table - 1)) != 0 || (keys && table < 2 * keys) ||
        below_keys < 0 || sets < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "tables: tokens and below (or none) need a value per row, token_offsets one per key and one "
                        "more, token_table a power of two at least twice the keys, below_offsets at least one entry");
        return -1;
    }
    /* The offsets were checked when the model was read (ascending, inside the candidates): the last ones here. */
    const uint32_t *to = a[TOKEN_OFFSETS].view.buf, *bo = a[BELOW_OFFSETS].view.buf;
    if (to[keys] > (uint64_t)LEN(a[TOKEN_CANDIDATES], 4) || bo[below_keys] > (uint64_t)LEN(a[BELOW_CANDIDATES], 4)) {
        PyErr_SetString(PyExc_ValueError, "tables: the offsets pass the end of their candidates");
        return -1;
    }
    t->token_keys = a[KEYS].view.buf;
    t->token_table = keys ? a[TABLE].view.buf : NULL;
    t->table_mask = table ? (uint64_t)table - 1 : 0;
    t->table_shift = 64;
    for (int64_t size = table; size > 1; size >>= 1) t->table_shift--;
    t->token_offsets = to;
    t->token_candidates = a[TOKEN_CANDIDATES].view.buf;
    t->below_offsets = bo;
    t->below_candidates = a[BELOW_CANDIDATES].view.buf;
    t->below_keys = below_keys;
    t->sets = sets;
    return 0;
}

/* encode_layer(index, sets, tokens, below, token_keys, token_table, token_offsets, token_candidates, below_offsets,
 *              below_candidates, out) -> bytes written, or -1 when out is too small */
static PyObject *encode_layer(PyObject *self, PyObject *args) {
    PyObject *index_obj, *out_obj, *objs[TABLE_ARGS];
    long long sets;
    if (!PyArg_ParseTuple(args, "OLOOOOOOOOO", &index_obj, &sets, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &out_obj))
        return NULL;
    Arg a[TABLE_ARGS + 2] = {0};
    PyObject *answer = NULL;
    Tables t;
    if (get_array(index_obj, &a[TABLE_ARGS], "i", 4, 0, "index") < 0 ||
        get_array(out_obj, &a[TABLE_ARGS + 1], "B", 1, 1, "out") < 0)
        goto done;
    int64_t rows = LEN(a[TABLE_ARGS], 4);
    if (get_tables(objs, a, sets, rows, &t) < 0) goto done;
    const int32_t *index = a[TABLE_ARGS].view.buf;
    const int64_t *tokens = a[TOKENS].view.buf;
    const int32_t *below = LEN(a[BELOW], 4) ? a[BELOW].view.buf : NULL;
    for (int64_t r = 0; r < rows; r++)
        if (index[r] < -1 || index[r] >= sets) {
            PyErr_SetString(PyExc_ValueError, "encode_layer: an index outside the list");
            goto done;
        }
    Encoder e = {0, 0xFFFFFFFFu, 0, 1, a[TABLE_ARGS + 1].view.buf, 0, (size_t)a[TABLE_ARGS + 1].view.len, 0, 0};
    Py_BEGIN_ALLOW_THREADS Model m;
    model_reset(&m);
    for (int64_t r = 0; r < rows; r++) encode_row(&e, &m, &t, tokens[r], below ? below[r] : -1, index[r]);
    if (e.bits) encoder_flush(&e);
    Py_END_ALLOW_THREADS answer = PyLong_FromLongLong(e.overflow ? -1 : e.bits ? (long long)e.size : 0);
done:
    release(a, TABLE_ARGS + 2);
    return answer;
}

/* decode_layer(stream, sets, tokens, below, token_keys, token_table, token_offsets, token_candidates, below_offsets,
 *              below_candidates, index) -> (status, row): each row's index in the list, -1 for an escape */
static PyObject *decode_layer(PyObject *self, PyObject *args) {
    PyObject *stream_obj, *index_obj, *objs[TABLE_ARGS];
    long long sets;
    if (!PyArg_ParseTuple(args, "OLOOOOOOOOO", &stream_obj, &sets, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                          &objs[5], &objs[6], &objs[7], &index_obj))
        return NULL;
    Arg a[TABLE_ARGS + 2] = {0};
    PyObject *answer = NULL;
    Tables t;
    if (get_array(stream_obj, &a[TABLE_ARGS], "B", 1, 0, "stream") < 0 ||
        get_array(index_obj, &a[TABLE_ARGS + 1], "i", 4, 1, "index") < 0)
        goto done;
    int64_t rows = LEN(a[TABLE_ARGS + 1], 4);
    if (get_tables(objs, a, sets, rows, &t) < 0) goto done;
    const int64_t *tokens = a[TOKENS].view.buf;
    const int32_t *below = LEN(a[BELOW], 4) ? a[BELOW].view.buf : NULL;
    int32_t *index = a[TABLE_ARGS + 1].view.buf;
    int status = OK;
    int64_t r = 0;
    Py_BEGIN_ALLOW_THREADS Model m;
    model_reset(&m);
    Decoder d;
    decoder_start(&d, a[TABLE_ARGS].view.buf, (size_t)a[TABLE_ARGS].view.len);
    for (; r < rows; r++) {
        int64_t found;
        status = decode_row(&d, &m, &t, tokens[r], below ? below[r] : -1, &found);
        if (status != OK) break;
        index[r] = (int32_t)found;
    }
    Py_END_ALLOW_THREADS answer = Py_BuildValue("iL", status, (long long)(status == OK ? -1 : r));
done:
    release(a, TABLE_ARGS + 2);
    return answer;
}

static int check_escape_args(Arg *order, Arg *rows, int64_t experts, int64_t topk, const char *name);

/* The rows (u8 or u16, any format), the order and the byte stream of encode_escapes and decode_escapes, held in
 * a[0], a[1] and a[2], and checked (check_escape_args). */
static int get_escape_args(PyObject *rows_obj, int rows_writable, PyObject *order_obj, PyObject *bytes_obj,
                           int bytes_writable, const char *bytes_name, int64_t experts, int64_t topk, Arg a[3],
                           const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (rows_writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(rows_obj, &a[0].view, flags) < 0) return -1;
    a[0].held = 1;
    if (get_array(order_obj, &a[1], "H", 2, 0, "order") < 0 ||
        get_array(bytes_obj, &a[2], "B", 1, bytes_writable, bytes_name) < 0)
        return -1;
    return check_escape_args(&a[1], &a[0], experts, topk, name);
}

/* The order (a permutation of 0..experts-1, u16) checked, and the rows' itemsize (1 or 2). */
static int check_escape_args(Arg *order, Arg *rows, int64_t experts, int64_t topk, const char *name) {
    if (experts < 1 || experts > ESCAPE_MAX_EXPERTS || topk < 1 || topk > experts ||
        LEN(*order, 2) != experts || (rows->view.itemsize != 1 && rows->view.itemsize != 2) ||
        (rows->view.len / rows->view.itemsize) % topk != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: experts must be 1..%d, topk 1..experts, the order one u16 per expert and the rows "
                     "u8 or u16, topk per row",
                     name, ESCAPE_MAX_EXPERTS);
        return -1;
    }
    uint8_t seen[ESCAPE_MAX_EXPERTS] = {0};
    const uint16_t *o = order->view.buf;
    for (int64_t i = 0; i < experts; i++) {
        if (o[i] >= experts || seen[o[i]]) {
            PyErr_Format(PyExc_ValueError, "%s: the order is not a permutation of the experts", name);
            return -1;
        }
        seen[o[i]] = 1;
    }
    return 0;
}

static inline int64_t row_value(const void *rows, int itemsize, int64_t i) {
    return itemsize == 1 ? ((const uint8_t *)rows)[i] : ((const uint16_t *)rows)[i];
}

/* Rows of topk IDs each below experts and distinct (member: all clear, left clear); -1 with a ValueError naming
 * the caller otherwise. */
static int check_rows(const void *rows, int itemsize, int64_t n, int64_t topk, int64_t experts, uint8_t *member,
                      const char *name) {
    for (int64_t i = 0; i < n * topk; i++) {
        int64_t v = row_value(rows, itemsize, i);
        if (v >= experts || member[v]) {
            memset(member, 0, ESCAPE_MAX_EXPERTS);
            PyErr_Format(PyExc_ValueError, "%s: a row names an ID past the experts or twice", name);
            return -1;
        }
        member[v] = 1;
        if (i % topk == topk - 1)
            for (int64_t j = i - topk + 1; j <= i; j++) member[row_value(rows, itemsize, j)] = 0;
    }
    return 0;
}

/* Row r's IDs flagged (value 1) or cleared (0) in member: what an encoder codes the row's bits from. */
static void flag_row(uint8_t *member, const void *rows, int itemsize, int64_t r, int64_t topk, uint8_t value) {
    for (int64_t j = 0; j < topk; j++) member[row_value(rows, itemsize, r * topk + j)] = value;
}

static void put_row(void *rows, int itemsize, int64_t r, int64_t topk, const uint16_t *got) {
    if (itemsize == 1)
        for (int64_t i = 0; i < topk; i++) ((uint8_t *)rows)[r * topk + i] = (uint8_t)got[i];
    else
        memcpy((uint16_t *)rows + r * topk, got, (size_t)topk * sizeof(uint16_t));
}

/* encode_escapes(rows, topk, experts, order, out) -> bytes written, or -1 when out is too small: the escaped rows
 * (u8 or u16, topk distinct IDs each) as a bit per expert in the order until the row's IDs are all found or the
 * rest of the order must all be in it; the context is (place in the order, found so far up to 7). */
static PyObject *encode_escapes(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *order_obj, *out_obj;
    long long topk, experts;
    if (!PyArg_ParseTuple(args, "OLLOO", &rows_obj, &topk, &experts, &order_obj, &out_obj)) return NULL;
    Arg a[3] = {0};
    PyObject *answer = NULL;
    if (get_escape_args(rows_obj, 0, order_obj, out_obj, 1, "out", experts, topk, a, "encode_escapes") < 0) goto done;
    int itemsize = (int)a[0].view.itemsize;
    int64_t n = a[0].view.len / itemsize / topk;
    const void *rows = a[0].view.buf;
    uint8_t member[ESCAPE_MAX_EXPERTS] = {0};
    if (check_rows(rows, itemsize, n, topk, experts, member, "encode_escapes") < 0) goto done;
    Counter *counters = counters_new(experts);
    if (!counters) {
        PyErr_NoMemory();
        goto done;
    }
    const uint16_t *order = a[1].view.buf;
    Encoder e = {0, 0xFFFFFFFFu, 0, 1, a[2].view.buf, 0, (size_t)a[2].view.len, 0, 0};
    uint16_t *got = malloc((size_t)topk * sizeof(uint16_t));
    if (!got) {
        free(counters);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS Coder c = {&e, NULL, NULL};
    for (int64_t r = 0; r < n; r++) {
        flag_row(member, rows, itemsize, r, topk, 1);
        code_members(&c, counters, order, experts, NULL, 0, topk, member, 0, got);
        flag_row(member, rows, itemsize, r, topk, 0);
    }
    if (e.bits) encoder_flush(&e);
    Py_END_ALLOW_THREADS free(counters);
    free(got);
    answer = PyLong_FromLongLong(e.overflow ? -1 : e.bits ? (long long)e.size : 0);
done:
    release(a, 3);
    return answer;
}

/* decode_escapes(stream, topk, experts, order, out): the rows of encode_escapes' stream into out (u8 or u16, topk
 * per row), each ascending. Every stream, forged or not, decodes to rows of topk distinct IDs of the order. */
static PyObject *decode_escapes(PyObject *self, PyObject *args) {
    PyObject *stream_obj, *order_obj, *out_obj;
    long long topk, experts;
    if (!PyArg_ParseTuple(args, "OLLOO", &stream_obj, &topk, &experts, &order_obj, &out_obj)) return NULL;
    Arg a[3] = {0};
    PyObject *answer = NULL;
    if (get_escape_args(out_obj, 1, order_obj, stream_obj, 0, "stream", experts, topk, a, "decode_escapes") < 0)
        goto done;
    Counter *counters = counters_new(experts);
    if (!counters) {
        PyErr_NoMemory();
        goto done;
    }
    int itemsize = (int)a[0].view.itemsize;
    int64_t n = a[0].view.len / itemsize / topk;
    const uint16_t *order = a[1].view.buf;
    uint16_t *got = malloc((size_t)topk * sizeof(uint16_t));
    if (!got) {
        free(counters);
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS uint8_t member[ESCAPE_MAX_EXPERTS] = {0};
    Decoder d;
    decoder_start(&d, a[2].view.buf, (size_t)a[2].view.len);
    Coder c = {NULL, &d, NULL};
    for (int64_t r = 0; r < n; r++) {
        code_members(&c, counters, order, experts, NULL, 0, topk, member, 0, got);
        sort_ids(got, topk, experts, member);
        put_row(a[0].view.buf, itemsize, r, topk, got);
    }
    Py_END_ALLOW_THREADS free(counters);
    free(got);
    answer = Py_NewRef(Py_None);
done:
    release(a, 3);
    return answer;
}

/* -- chunk version 3: escapes coded against a reference ----------------------------------------------------------- */
#define REF_CANDIDATES 12 /* candidates a row may choose its reference from (4 below and 8 of its token at most) */
#define REF_PLACES 16     /* places in the reference told apart by the context (16 and more share the last) */
#define LIST_BUCKETS 32   /* a listed set's reference at most 2^31 - 1 sets back */
#define LIST_WINDOW 512   /* the earlier sets a writer compares a listed set with */
#define LIST_SEARCH 1024  /* the list's first sets a writer compares an escaped row with (version 4) */
#define LIST_PREFERENCE 2 /* a writer takes a listed reference over a candidate sharing this many fewer experts */
#define LIST_MARGIN 256   /* ... and one whose bits cost this much (1/256 bits) less than the row's alone */
#define LIST_TRIAL 128    /* a writer searches the list for each escaped row of a chunk layer's first this many, */
                          /* then while one row in LIST_TRIAL of those searched takes a listed set */

/* The first (or last) of n masks (words a mask) sharing most experts with a row, and in *best how many. */
typedef int64_t (*SharedSearch)(const uint64_t *masks, int64_t n, int64_t words, const uint64_t *row, int64_t *best);

typedef struct {
    int64_t topk, experts, n_sets;
    int itemsize;
    const void *sets; /* the layer's list [n_sets, topk] in the rows' dtype, each set checked where it is read */
    const uint16_t *order;
    uint16_t rank[ESCAPE_MAX_EXPERTS]; /* each expert's place in the order */
    uint8_t in_ref[ESCAPE_MAX_EXPERTS];
    uint8_t scratch[ESCAPE_MAX_EXPERTS];
    uint16_t *ref, *got;
    Counter *plain;  /* [experts][ESCAPE_FOUND]: rows without candidates, by (place, still to find) */
    Counter *rest;   /* [experts][ESCAPE_FOUND]: the experts outside the reference, by (place among them, to find) */
    Counter *choose; /* [REF_CANDIDATES]: is it this candidate */
    Counter *kept;   /* [REF_PLACES][ESCAPE_FOUND]: is this expert of the reference kept, by (place, kept so far) */
    Counter *referenced; /* [1]: does a row with candidates (a listed set) take a reference */
    Counter *gap_bucket; /* [LIST_BUCKETS]: a listed set's distance back to its reference, Elias-gamma: its bucket */
    Counter *gap_low;    /* [LIST_BUCKETS][32]: and its bits below the leading one, by (bucket, bit) */
    Counter *list_referenced; /* [2]: does a row take a listed set as its reference, by (row has candidates) */
    Counter *all;
    /* The encoder's search of the list's first LIST_SEARCH sets (version 4): */
    int64_t searched, looked, taken; /* sets searched; rows the search was run for, and took a listed set */
    int64_t words;                   /* 64-bit words an expert mask takes */
    uint64_t *masks;                 /* [searched][words]: each searched set's experts as bits */
    SharedSearch most_shared; /* chosen once per search (shared_search) */
    uint64_t row[ESCAPE_MAX_EXPERTS / 64]; /* the row's experts as bits */
} Referenced;

static int referenced_start(Referenced *x, int64_t topk, int64_t experts, const uint16_t *order, Arg *sets);

static void referenced_delete(Referenced *x) {
    if (!x) return;
    free(x->all);
    free(x->masks);
    free(x->ref);
    free(x->got);
    free(x);
}

/* The coder's state for one chunk layer or list (its order and list, or the list being written or read, already
 * checked by the caller's argument parsing); NULL with a Python error set. The list's sets are checked where a row
 * reads them (code_against), not all of them for every chunk layer. */
static Referenced *referenced_open(int64_t topk, int64_t experts, const uint16_t *order, Arg *sets) {
    Referenced *x = calloc(1, sizeof(Referenced));
    if (!x) {
        PyErr_NoMemory();
        return NULL;
    }
    if (referenced_start(x, topk, experts, order, sets) < 0) {
        referenced_delete(x);
        return NULL;
    }
    return x;
}

static int referenced_start(Referenced *x, int64_t topk, int64_t experts, const uint16_t *order, Arg *sets) {
    x->topk = topk;
    x->experts = experts;
    x->order = order;
    x->itemsize = (int)sets->view.itemsize;
    x->sets = sets->view.buf;
    if ((sets->view.len / x->itemsize) % topk != 0) {
        PyErr_SetString(PyExc_ValueError, "referenced escapes: the list must be topk IDs a set, in the rows' dtype");
        return -1;
    }
    x->n_sets = sets->view.len / x->itemsize / topk;
    memset(x->scratch, 0, sizeof(x->scratch));
    memset(x->in_ref, 0, sizeof(x->in_ref));
    for (int64_t i = 0; i < experts; i++) x->rank[order[i]] = (uint16_t)i;
    int64_t size = 2 * experts * ESCAPE_FOUND + REF_CANDIDATES + REF_PLACES * ESCAPE_FOUND + 1 + LIST_BUCKETS * 33 + 2;
    x->all = malloc((size_t)size * sizeof(Counter));
    x->ref = malloc((size_t)topk * sizeof(uint16_t));
    x->got = malloc((size_t)topk * sizeof(uint16_t));
    if (!x->all || !x->ref || !x->got) { /* referenced_open frees what was allocated */
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t i = 0; i < size; i++) x->all[i] = (Counter){(uint16_t)(ESCAPE_PROB_ONE / 2), 0};
    x->plain = x->all;
    x->rest = x->plain + experts * ESCAPE_FOUND;
    x->choose = x->rest + experts * ESCAPE_FOUND;
    x->kept = x->choose + REF_CANDIDATES;
    x->referenced = x->kept + REF_PLACES * ESCAPE_FOUND;
    x->gap_bucket = x->referenced + 1;
    x->gap_low = x->gap_bucket + LIST_BUCKETS;
    x->list_referenced = x->gap_low + LIST_BUCKETS * 32;
    return 0;
}

/* Experts flagged as bits in masks, words a mask: n sets of topk from sets (checked: IDs below the experts). */
static void flag_sets(const void *sets, int itemsize, int64_t n, int64_t topk, int64_t words, uint64_t *masks) {
    for (int64_t i = 0; i < n * topk; i++) {
        int64_t v = row_value(sets, itemsize, i);
        masks[(i / topk) * words + v / 64] |= 1ull << (v % 64);
    }
}

/* The searches (SharedSearch): how many experts a mask shares with the row, in portable steps or with the machine's
 * popcount instruction (the same answer; shared_search chooses), counted and compared in one pass (*best is -1 where
 * n is 0). */
static inline int64_t shared_bits(uint64_t v) {
    v = v - ((v >> 1) & 0x5555555555555555ull);
    v = (v & 0x3333333333333333ull) + ((v >> 2) & 0x3333333333333333ull);
    v = (v + (v >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    return (int64_t)((v * 0x0101010101010101ull) >> 56);
}

/* better: > for the first of the masks sharing most, >= for the last of them. */
#define MOST_SHARED(count, better)                                                                                    \
    int64_t place = 0, most = -1;                                                                                      \
    if (words == 1) {                                                                                                  \
        uint64_t r = row[0];                                                                                           \
        for (int64_t i = 0; i < n; i++) {                                                                              \
            int64_t shared = count(masks[i] & r);                                                                      \
            if (shared better most) most = shared, place = i;                                                          \
        }                                                                                                              \
    } else {                                                                                                           \
        for (int64_t i = 0; i < n; i++) {                                                                              \
            int64_t shared = 0;                                                                                        \
            for (int64_t w = 0; w < words; w++) shared += count(masks[i * words + w] & row[w]);                        \
            if (shared better most) most = shared, place = i;                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    *best = most;                                                                                                      \
    return place;

static int64_t most_shared(const uint64_t *masks, int64_t n, int64_t words, const uint64_t *row, int64_t *best) {
    MOST_SHARED(shared_bits, >)
}

static int64_t last_most_shared(const uint64_t *masks, int64_t n, int64_t words, const uint64_t *row, int64_t *best) {
    MOST_SHARED(shared_bits, >=)
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define HAS_POPCNT_TARGET 1
__attribute__((target("popcnt"))) static int64_t most_shared_popcnt(const uint64_t *masks, int64_t n, int64_t words,
                                                                    const uint64_t *row, int64_t *best) {
    MOST_SHARED(__builtin_popcountll, >)
}

__attribute__((target("popcnt"))) static int64_t last_most_shared_popcnt(const uint64_t *masks, int64_t n,
                                                                         int64_t words, const uint64_t *row,
                                                                         int64_t *best) {
    MOST_SHARED(__builtin_popcountll, >=)
}
#endif

/* The search to run: the first (or the last) of the masks sharing most, with the popcount instruction where the
 * machine has one. */
static SharedSearch shared_search(int last) {
#ifdef HAS_POPCNT_TARGET
    if (__builtin_cpu_supports("popcnt")) return last ? last_most_shared_popcnt : most_shared_popcnt;
#endif
    return last ? last_most_shared : most_shared;
}

/* The encoder's search of the list's first LIST_SEARCH sets (their sets checked by the caller): their experts as
 * bits, and how to count them (the popcount instruction where the machine has one); -1 when out of memory. */
static int search_start(Referenced *x) {
    x->searched = x->n_sets < LIST_SEARCH ? x->n_sets : LIST_SEARCH;
    x->words = (x->experts + 63) / 64;
    x->masks = calloc((size_t)(x->searched * x->words + 1), sizeof(uint64_t));
    if (!x->masks) return -1;
    flag_sets(x->sets, x->itemsize, x->searched, x->topk, x->words, x->masks);
    x->most_shared = shared_search(0);
    return 0;
}

/* The first of the searched sets sharing most experts with the row (x->row) where one shares at least half of them,
 * and in *shared how many it shares; else 0 and -1. */
static int64_t nearest_set(Referenced *x, int64_t *shared) {
    int64_t best;
    int64_t place = x->most_shared(x->masks, x->searched, x->words, x->row, &best);
    if (2 * best < x->topk) best = -1, place = 0;
    *shared = best;
    return place;
}

/* A positive integer (the encoder's value), Elias-gamma: its bit length - 1 in unary, each bit with its context
 * (bucket[b]), then its bits below the leading one by (bucket, bit) (low[b * 32 + bit]). Returns it, or -1 where its
 * bucket reaches buckets - 1 (at most 33: low has 32 a bucket). */
static int64_t code_gamma_in(Coder *c, Counter *bucket, Counter *low, int buckets, int64_t value) {
    int wanted = knows_bits(c) ? 63 - __builtin_clzll((uint64_t)value) : 0, b = 0;
    while (code_counted(c, &bucket[b], b < wanted))
        if (++b == buckets - 1) return -1;
    int64_t decoded = 1;
    for (int k = b - 1; k >= 0; k--)
        decoded = 2 * decoded + code_counted(c, &low[b * 32 + k], (int)((value >> k) & 1));
    return decoded;
}

/* A listed set's distance back, or a listed reference's place + 1. */
static int64_t code_gamma(Coder *c, Referenced *x, int64_t value) {
    return code_gamma_in(c, x->gap_bucket, x->gap_low, LIST_BUCKETS, value);
}

enum { REF_OUTSIDE = -1, REF_BAD_SET = -2 }; /* referenced_row's refusals */

/* The row's candidates in the order its decisions passed them (the row below's, then its token's not among those),
 * at most REF_CANDIDATES; -1 when one is outside the list. */
static int gather_candidates(const Tables *t, int64_t token, int64_t below, int64_t sets, uint32_t *out) {
    const uint32_t *bc = NULL, *tc = NULL;
    uint32_t nb = below_candidates(t, below, &bc), nt = token_candidates(t, token, &tc);
    int n = 0;
    for (uint32_t i = 0; i < nb && n < REF_CANDIDATES; i++) out[n++] = bc[i];
    for (uint32_t i = 0; i < nt && n < REF_CANDIDATES; i++)
        if (!listed_in(bc, nb, tc[i])) out[n++] = tc[i];
    for (int i = 0; i < n; i++)
        if ((int64_t)out[i] >= sets) return -1;
    return n;
}

/* A row against the reference x->sets[at] (member: its IDs flagged when encoding, all clear when decoding), into
 * x->got: which of the reference's experts it keeps, in the order's order (kept for certain once as many are dropped
 * as there are experts outside it), then the experts it adds, coded alone over the reference's. REF_BAD_SET when
 * the reference names an ID past the experts or twice. */
static int code_against(Coder *c, Referenced *x, int64_t at, const uint8_t *member) {
    int64_t topk = x->topk, experts = x->experts, words = (experts + 63) / 64;
    uint64_t ranks[ESCAPE_MAX_EXPERTS / 64]; /* the reference's experts by their place in the order, as bits */
    memset(ranks, 0, (size_t)words * sizeof(uint64_t));
    for (int64_t j = 0; j < topk; j++) {
        int64_t id = row_value(x->sets, x->itemsize, at * topk + j);
        if (id >= experts || x->in_ref[id]) { /* no set: refused, the flags of those placed cleared */
            for (int64_t i = 0; i < j; i++) x->in_ref[row_value(x->sets, x->itemsize, at * topk + i)] = 0;
            return REF_BAD_SET;
        }
        x->in_ref[id] = 1;
        ranks[x->rank[id] >> 6] |= 1ull << (x->rank[id] & 63);
    }
    /* The reference's experts in the order's order: topk distinct places (the order is a permutation) read back. */
    int64_t placed = 0;
    for (int64_t w = 0; w < words; w++)
        for (uint64_t m = ranks[w]; m; m &= m - 1) x->ref[placed++] = x->order[w * 64 + __builtin_ctzll(m)];
    int64_t kept = 0;
    for (int64_t j = 0; j < topk; j++) {
        int keep = 1;
        if (j - kept < experts - topk) {
            int place = j < REF_PLACES - 1 ? (int)j : REF_PLACES - 1;
            keep = code_counted(c, &x->kept[place * ESCAPE_FOUND + found_context(kept)], member[x->ref[j]]);
        }
        if (keep) x->got[kept++] = x->ref[j];
    }
    code_members(c, x->rest, x->order, experts, x->in_ref, topk, topk - kept, member, 1, x->got + kept);
    for (int64_t j = 0; j < topk; j++) x->in_ref[x->ref[j]] = 0;
    return 0;
}

enum { ALONE, BY_CANDIDATE, BY_LIST }; /* the ways an escaped row is coded */

/* The encoder's way for an escaped row (member: its IDs flagged; x->row: the same), with the candidate (*pick)
 * and the listed set (*near) it would take: the first candidate sharing most experts with the row, where it shares at
 * least half and no searched listed set shares LIST_PREFERENCE more; else, where searched, the first searched listed
 * set sharing most, where it shares at least half and its bits cost LIST_MARGIN less now (a dry run: the counters as
 * they stand, none adapted) than the row's alone (measured: taken on their overlap alone, listed references made
 * token-dependent routing's escapes 2.8 % larger; priced, 0.06 %); else that candidate, where it shares at least
 * half; else alone. The list is searched for a chunk layer's first LIST_TRIAL rows, then while one in LIST_TRIAL of
 * the rows searched took a listed set (token-dependent routing's rows take one in a thousand: searching for each
 * made its writer five times slower). REF_BAD_SET when a set it reads names an ID past the experts or twice. */
static int choose_way(Referenced *x, const uint32_t *candidates, int n, int searched, const uint8_t *member, int *way,
                      int *pick, int64_t *near) {
    int64_t topk = x->topk, best = -1, near_shared = -1;
    for (int i = 0; i < n; i++) {
        int64_t shared = 0;
        for (int64_t j = 0; j < topk; j++) {
            int64_t v = row_value(x->sets, x->itemsize, candidates[i] * topk + j);
            if (v >= x->experts) return REF_BAD_SET;
            shared += member[v];
        }
        if (shared > best) best = shared, *pick = i;
    }
    searched = searched && (x->looked < LIST_TRIAL || x->taken * LIST_TRIAL >= x->looked);
    if (searched) {
        *near = nearest_set(x, &near_shared);
        x->looked++;
    }
    int candidate = n > 0 && 2 * best >= topk;
    if (candidate && near_shared < best + LIST_PREFERENCE) {
        *way = BY_CANDIDATE;
        return 0;
    }
    if (2 * near_shared >= topk) { /* -1 where not searched */
        uint64_t alone = 0, listed = 0;
        Coder dry = {NULL, NULL, &alone};
        code_counted(&dry, &x->list_referenced[n > 0], 0);
        code_members(&dry, x->plain, x->order, x->experts, NULL, 0, topk, member, 1, x->got);
        dry.cost = &listed;
        code_counted(&dry, &x->list_referenced[n > 0], 1);
        code_gamma(&dry, x, *near + 1);
        if (code_against(&dry, x, *near, member) < 0) return REF_BAD_SET;
        if (listed + LIST_MARGIN < alone) {
            *way = BY_LIST;
            x->taken++;
            return 0;
        }
    }
    if (candidate) *way = BY_CANDIDATE;
    return 0;
}

/* One escaped row (member: its IDs flagged when encoding, all clear when decoding; the encoder's of version 4 also
 * in x->row) into x->got, in the order found. Where the row has candidates, a bit says whether it takes
 * one as its reference; if so which (unary over them), then which of the reference's experts it keeps (in the
 * layer's order; kept for certain once as many are dropped as there are experts outside it), then the experts it
 * adds, in the layer's order. In version 4 (lists) a row no candidate references may then take a listed set as its
 * reference: a bit (context: has candidates), the set's place + 1 (Elias-gamma), then the row against it. Any other
 * row is coded alone, as version 2 codes a row (but with contexts by experts still to find). The encoder's way is
 * choose_way's. Returns REF_OUTSIDE when a candidate or listed reference is outside the list, REF_BAD_SET when a set
 * it reads names an ID past the experts or twice. */
static int referenced_row(Coder *c, Referenced *x, const Tables *t, int64_t token, int64_t below,
                          const uint8_t *member, int lists) {
    uint32_t candidates[REF_CANDIDATES];
    int n = gather_candidates(t, token, below, x->n_sets, candidates);
    if (n < 0) return REF_OUTSIDE;
    int searched = lists && x->n_sets > 0, way = ALONE, pick = 0;
    int64_t near = 0;
    if (c->e && (n > 0 || searched) && choose_way(x, candidates, n, searched, member, &way, &pick, &near) < 0)
        return REF_BAD_SET;
    if (n > 0 && code_counted(c, x->referenced, way == BY_CANDIDATE)) {
        int chosen = n - 1;
        for (int i = 0; i + 1 < n; i++)
            if (code_counted(c, &x->choose[i], i == pick)) {
                chosen = i;
                break;
            }
        return code_against(c, x, candidates[chosen], member);
    }
    if (searched && code_counted(c, &x->list_referenced[n > 0], way == BY_LIST)) {
        int64_t value = code_gamma(c, x, near + 1);
        if (value < 1 || value > x->n_sets) return REF_OUTSIDE;
        return code_against(c, x, value - 1, member);
    }
    code_members(c, x->plain, x->order, x->experts, NULL, 0, x->topk, member, 1, x->got);
    return 0;
}

static void referenced_error(const char *name, int status) {
    PyErr_Format(PyExc_ValueError, "%s: %s", name,
                 status == REF_OUTSIDE ? "a reference outside the list"
                                       : "a listed set names an ID past the experts or twice");
}

enum { REF_ROWS, REF_ORDER, REF_BYTES, REF_SETS, REF_ARGS }; /* the first three as get_escape_args holds them */

/* The arguments of encode_referenced and decode_referenced: rows (or out), order, sets, stream (or out), tables. */
static int get_referenced_args(PyObject **objs, int rows_writable, int bytes_writable, const char *bytes_name,
                               int64_t experts, int64_t topk, Arg *a, Tables *t, const char *name) {
    if (get_escape_args(objs[REF_ROWS], rows_writable, objs[REF_ORDER], objs[REF_BYTES], bytes_writable, bytes_name,
                        experts, topk, a, name) < 0)
        return -1;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (PyObject_GetBuffer(objs[REF_SETS], &a[3].view, flags) < 0) return -1;
    a[3].held = 1;
    if (a[3].view.itemsize != a[0].view.itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: the list must have the rows' dtype", name);
        return -1;
    }
    int64_t rows = a[0].view.len / a[0].view.itemsize / topk;
    return get_tables(objs + REF_ARGS, a + 4, 0, rows, t);
}

/* encode_referenced(rows, topk, experts, order, sets, tokens, below, token_keys, token_table, token_offsets,
 * token_candidates, below_offsets, below_candidates, out, lists) -> bytes written, or -1 when out is too small: a
 * chunk layer's escaped rows (u8 or u16, topk distinct IDs each) against their references in the list ``sets``
 * (version 3, or 4 with lists: any listed set may be one); tokens and below are the escaped rows' own. */
static PyObject *encode_referenced(PyObject *self, PyObject *args) {
    PyObject *objs[REF_ARGS + TABLE_ARGS];
    long long topk, experts;
    int lists;
    if (!PyArg_ParseTuple(args, "OLLOOOOOOOOOOOp", &objs[REF_ROWS], &topk, &experts, &objs[REF_ORDER],
                          &objs[REF_SETS], &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10],
                          &objs[11], &objs[REF_BYTES], &lists))
        return NULL;
    Arg a[REF_ARGS + TABLE_ARGS] = {0};
    Tables t;
    PyObject *answer = NULL;
    Referenced *x = NULL;
    if (get_referenced_args(objs, 0, 1, "out", experts, topk, a, &t, "encode_referenced") < 0 ||
        !(x = referenced_open(topk, experts, a[REF_ORDER].view.buf, &a[REF_SETS])))
        goto done;
    const void *rows = a[REF_ROWS].view.buf;
    int itemsize = (int)a[REF_ROWS].view.itemsize;
    int64_t n = a[REF_ROWS].view.len / itemsize / topk;
    uint8_t *member = x->scratch;
    if (check_rows(rows, itemsize, n, topk, experts, member, "encode_referenced") < 0) goto done;
    if (lists) { /* the searched sets are checked here: the encoder compares the row with each */
        int64_t searched = x->n_sets < LIST_SEARCH ? x->n_sets : LIST_SEARCH;
        if (check_rows(x->sets, x->itemsize, searched, topk, experts, member, "encode_referenced") < 0) goto done;
        if (search_start(x) < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    const int64_t *tokens = a[4 + TOKENS].view.buf;
    const int32_t *below = LEN(a[4 + BELOW], 4) ? a[4 + BELOW].view.buf : NULL;
    Encoder e = {0, 0xFFFFFFFFu, 0, 1, a[REF_BYTES].view.buf, 0, (size_t)a[REF_BYTES].view.len, 0, 0};
    Coder c = {&e, NULL, NULL};
    int status = 0;
    Py_BEGIN_ALLOW_THREADS for (int64_t r = 0; r < n && status == 0; r++) {
        flag_row(member, rows, itemsize, r, topk, 1);
        if (lists) {
            memset(x->row, 0, sizeof(x->row));
            flag_sets((const uint8_t *)rows + r * topk * itemsize, itemsize, 1, topk, x->words, x->row);
        }
        status = referenced_row(&c, x, &t, tokens[r], below ? below[r] : -1, member, lists);
        flag_row(member, rows, itemsize, r, topk, 0);
    }
    if (e.bits) encoder_flush(&e);
    Py_END_ALLOW_THREADS if (status < 0) referenced_error("encode_referenced", status);
    else answer = PyLong_FromLongLong(e.overflow ? -1 : e.bits ? (long long)e.size : 0);
done:
    referenced_delete(x);
    release(a, REF_ARGS + TABLE_ARGS);
    return answer;
}

/* decode_referenced(stream, topk, experts, order, sets, tokens, below, token_keys, token_table, token_offsets,
 * token_candidates, below_offsets, below_candidates, out, lists): the rows of encode_referenced's stream into out (u8
 * or u16, topk per row), each ascending. Every stream, forged or not, decodes to rows of topk distinct IDs; a
 * reference outside the list, or a listed set read that is no set, is a ValueError. */
static PyObject *decode_referenced(PyObject *self, PyObject *args) {
    PyObject *objs[REF_ARGS + TABLE_ARGS];
    long long topk, experts;
    int lists;
    if (!PyArg_ParseTuple(args, "OLLOOOOOOOOOOOp", &objs[REF_BYTES], &topk, &experts, &objs[REF_ORDER],
                          &objs[REF_SETS], &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10],
                          &objs[11], &objs[REF_ROWS], &lists))
        return NULL;
    Arg a[REF_ARGS + TABLE_ARGS] = {0};
    Tables t;
    PyObject *answer = NULL;
    Referenced *x = NULL;
    if (get_referenced_args(objs, 1, 0, "stream", experts, topk, a, &t, "decode_referenced") < 0 ||
        !(x = referenced_open(topk, experts, a[REF_ORDER].view.buf, &a[REF_SETS])))
        goto done;
    int itemsize = (int)a[REF_ROWS].view.itemsize;
    int64_t n = a[REF_ROWS].view.len / itemsize / topk;
    const int64_t *tokens = a[4 + TOKENS].view.buf;
    const int32_t *below = LEN(a[4 + BELOW], 4) ? a[4 + BELOW].view.buf : NULL;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS Decoder d;
    decoder_start(&d, a[REF_BYTES].view.buf, (size_t)a[REF_BYTES].view.len);
    Coder c = {NULL, &d, NULL};
    for (int64_t r = 0; r < n && status == 0; r++) {
        status = referenced_row(&c, x, &t, tokens[r], below ? below[r] : -1, x->scratch, lists);
        if (status == 0) {
            sort_ids(x->got, topk, experts, x->scratch);
            put_row(a[REF_ROWS].view.buf, itemsize, r, topk, x->got);
        }
    }
    Py_END_ALLOW_THREADS if (status < 0) referenced_error("decode_referenced", status);
    else answer = Py_NewRef(Py_None);
done:
    referenced_delete(x);
    release(a, REF_ARGS + TABLE_ARGS);
    return answer;
}


/* -- model version 3: a layer's list, each set against an earlier one ------------------------------------------- */
/* Listed set i (of the list x->sets, in ID order; member: its IDs flagged when encoding) into x->got: a bit whether
 * it takes an earlier set of the list as its reference; if so the distance back to it (the encoder's ``back``),
 * Elias-gamma (its bit length - 1 in unary, each with its context, then its bits below the leading one, each by
 * (bucket, bit)), then the set against it; else the set coded alone. Returns the distance (0: none), or -1 for a
 * distance past the list's start or a reference that is no set. */
static int64_t list_set(Coder *c, Referenced *x, int64_t i, int64_t back, const uint8_t *member) {
    if (!code_counted(c, x->referenced, back > 0)) {
        code_members(c, x->plain, x->order, x->experts, NULL, 0, x->topk, member, 1, x->got);
        return 0;
    }
    int64_t distance = code_gamma(c, x, back);
    if (distance < 1 || distance > i || code_against(c, x, i - distance, member) < 0) return -1;
    return distance;
}

/* encode_list(rows, topk, experts, order, out) -> bytes written, or -1 when out is too small: a layer's list (u8 or
 * u16, topk distinct IDs each; the order: the experts' ID order), each set against the earlier set of the list that
 * shares most experts with it among the LIST_WINDOW before it (the nearest of those), where it shares more than
 * two thirds of them (measured: at more than half, lists of sets drawn at random, as token-dependent routing's,
 * grew 11 % against version 2's; at two thirds 3 %, and the DeepSeek-V3-style corpus' lists 0.4 % larger). */
static PyObject *encode_list(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *order_obj, *out_obj;
    long long topk, experts;
    if (!PyArg_ParseTuple(args, "OLLOO", &rows_obj, &topk, &experts, &order_obj, &out_obj)) return NULL;
    Arg a[3] = {0};
    PyObject *answer = NULL;
    uint64_t *masks = NULL;
    Referenced *x = NULL;
    if (get_escape_args(rows_obj, 0, order_obj, out_obj, 1, "out", experts, topk, a, "encode_list") < 0 ||
        !(x = referenced_open(topk, experts, a[1].view.buf, &a[0])))
        goto done;
    int64_t n = x->n_sets, words = (experts + 63) / 64;
    if (check_rows(x->sets, x->itemsize, n, topk, experts, x->scratch, "encode_list") < 0) goto done;
    masks = calloc((size_t)(n * words + 1), sizeof(uint64_t));
    if (!masks) {
        PyErr_NoMemory();
        goto done;
    }
    flag_sets(x->sets, x->itemsize, n, topk, words, masks);
    Encoder e = {0, 0xFFFFFFFFu, 0, 1, a[2].view.buf, 0, (size_t)a[2].view.len, 0, 0};
    Coder c = {&e, NULL, NULL};
    int64_t status = 0;
    SharedSearch nearest = shared_search(1);
    Py_BEGIN_ALLOW_THREADS for (int64_t i = 0; i < n && status >= 0; i++) {
        /* The window's sets in memory order end at set i - 1: the last of them sharing most is the nearest. */
        int64_t first = i > LIST_WINDOW ? i - LIST_WINDOW : 0, best = -1, back = 0;
        if (i > first) back = i - (first + nearest(masks + first * words, i - first, words, masks + i * words, &best));
        if (3 * best <= 2 * topk) back = 0;
        flag_row(x->scratch, x->sets, x->itemsize, i, topk, 1);
        status = list_set(&c, x, i, back, x->scratch);
        flag_row(x->scratch, x->sets, x->itemsize, i, topk, 0);
    }
    if (e.bits) encoder_flush(&e);
    Py_END_ALLOW_THREADS if (status < 0) PyErr_SetString(PyExc_ValueError, "encode_list: a set's reference failed");
    else answer = PyLong_FromLongLong(e.overflow ? -1 : e.bits ? (long long)e.size : 0);
done:
    free(masks);
    referenced_delete(x);
    release(a, 3);
    return answer;
}

/* decode_list(stream, topk, experts, order, out) -> (status, row): encode_list's sets into out (u8 or u16, topk
 * per set), each ascending; status 1 at the first set whose reference lies before the list's start (0: all read).
 * Every other stream decodes to sets of topk distinct IDs. */
static PyObject *decode_list(PyObject *self, PyObject *args) {
    PyObject *stream_obj, *order_obj, *out_obj;
    long long topk, experts;
    if (!PyArg_ParseTuple(args, "OLLOO", &stream_obj, &topk, &experts, &order_obj, &out_obj)) return NULL;
    Arg a[3] = {0};
    PyObject *answer = NULL;
    Referenced *x = NULL;
    if (get_escape_args(out_obj, 1, order_obj, stream_obj, 0, "stream", experts, topk, a, "decode_list") < 0 ||
        !(x = referenced_open(topk, experts, a[1].view.buf, &a[0])))
        goto done;
    int64_t n = x->n_sets, i = 0;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS Decoder d;
    decoder_start(&d, a[2].view.buf, (size_t)a[2].view.len);
    Coder c = {NULL, &d, NULL};
    for (; i < n; i++) {
        if (list_set(&c, x, i, 0, x->scratch) < 0) {
            status = 1;
            break;
        }
        sort_ids(x->got, topk, experts, x->scratch);
        put_row(a[0].view.buf, x->itemsize, i, topk, x->got);
    }
    Py_END_ALLOW_THREADS answer = Py_BuildValue("iL", status, (long long)(status ? i : -1));
done:
    referenced_delete(x);
    release(a, 3);
    return answer;
}

/* -- model version 4: a layer's candidate tables range-coded ------------------------------------------------- */
#define MAX_TOKEN_CANDIDATES 8 /* a token's candidates */
#define MAX_BELOW_CANDIDATES 4 /* a set below's candidates */
#define MAX_TOKEN 2147483647   /* token ids are int32 */
#define TABLE_BUCKETS 33       /* a token key's gap at most 2^31 */

typedef struct {
    Counter key_bucket[TABLE_BUCKETS], key_low[TABLE_BUCKETS * 32];
    Counter token_more[MAX_TOKEN_CANDIDATES];
    Counter token_bucket[TABLE_BUCKETS], token_low[TABLE_BUCKETS * 32];
    Counter below_more[MAX_BELOW_CANDIDATES];
    Counter below_bucket[TABLE_BUCKETS], below_low[TABLE_BUCKETS * 32];
} TableCounters;

enum { TABLE_RANGE = 1, TABLE_KEYS_BELOW = 2 }; /* code_tables' refusals: a value past its limit, keys miscounted */

/* A count from least up to most (the encoder's count): a bit "more than n" for each n from least, context n. */
static int64_t code_count(Coder *c, Counter *more, int64_t count, int64_t least, int64_t most) {
    int64_t n = least;
    while (n < most && code_counted(c, &more[n], count > n)) n++;
    return n;
}

/* A candidate, as its place in the list + 1 (Elias-gamma); -1 when past the list of sets. */
static int64_t code_candidate(Coder *c, Counter *bucket, Counter *low, int64_t sets, uint32_t value) {
    int64_t got = code_gamma_in(c, bucket, low, TABLE_BUCKETS, (int64_t)value + 1);
    return got < 1 || got > sets ? -1 : got - 1;
}

/* A layer's candidate tables, read by the encoder and written by the decoder: its n_keys token keys (ascending) as
 * gaps from the one before (the first from -1), Elias-gamma; then each key's candidate count (1 to
 * MAX_TOKEN_CANDIDATES, unary) and its candidates (each as its place in the list + 1, Elias-gamma); then, where the
 * layer has a layer below (below_sets >= 0), each of that list's sets' candidate count (0 to MAX_BELOW_CANDIDATES,
 * unary) and candidates. Every bit is counted, with contexts by what it says (a bucket, a bit of it, a count so far).
 * Returns 0, TABLE_RANGE (a key past MAX_TOKEN, a candidate past the list, a bucket past its end), or
 * TABLE_KEYS_BELOW (n_below sets below with candidates, as the model's head says, not what the stream holds). */
static int code_tables(Coder *c, TableCounters *k, int64_t n_keys, int64_t sets, int64_t below_sets, int64_t n_below,
                       int64_t *keys, uint32_t *token_offsets, uint32_t *token_candidates, uint32_t *below_offsets,
                       uint32_t *below_candidates) {
    int known = knows_bits(c);
    int64_t previous = -1;
    for (int64_t i = 0; i < n_keys; i++) {
        int64_t gap = code_gamma_in(c, k->key_bucket, k->key_low, TABLE_BUCKETS, known ? keys[i] - previous : 0);
        if (gap < 1 || previous + gap > MAX_TOKEN) return TABLE_RANGE;
        previous += gap;
        if (!known) keys[i] = previous;
    }
    if (!known) token_offsets[0] = 0;
    for (int64_t i = 0; i < n_keys; i++) {
        int64_t count = known ? token_offsets[i + 1] - token_offsets[i] : 0;
        count = code_count(c, k->token_more, count, 1, MAX_TOKEN_CANDIDATES);
        if (!known) token_offsets[i + 1] = token_offsets[i] + (uint32_t)count;
        for (uint32_t j = token_offsets[i]; j < token_offsets[i + 1]; j++) {
            int64_t got = code_candidate(c, k->token_bucket, k->token_low, sets, known ? token_candidates[j] : 0);
            if (got < 0) return TABLE_RANGE;
            if (!known) token_candidates[j] = (uint32_t)got;
        }
    }
    if (below_sets < 0) return 0;
    int64_t keyed = 0;
    if (!known) below_offsets[0] = 0;
    for (int64_t s = 0; s < below_sets; s++) {
        int64_t count = known ? below_offsets[s + 1] - below_offsets[s] : 0;
        count = code_count(c, k->below_more, count, 0, MAX_BELOW_CANDIDATES);
        keyed += count > 0;
        if (!known) below_offsets[s + 1] = below_offsets[s] + (uint32_t)count;
        for (uint32_t j = below_offsets[s]; j < below_offsets[s + 1]; j++) {
            int64_t got = code_candidate(c, k->below_bucket, k->below_low, sets, known ? below_candidates[j] : 0);
            if (got < 0) return TABLE_RANGE;
            if (!known) below_candidates[j] = (uint32_t)got;
        }
    }
    return keyed == n_below ? 0 : TABLE_KEYS_BELOW;
}

static TableCounters *table_counters_new(void) {
    TableCounters *k = malloc(sizeof(TableCounters));
    if (!k) return NULL;
    Counter *all = (Counter *)k;
    for (size_t i = 0; i < sizeof(TableCounters) / sizeof(Counter); i++)
        all[i] = (Counter){(uint16_t)(ESCAPE_PROB_ONE / 2), 0};
    return k;
}

/* encode_tables(token_keys, token_offsets, token_candidates, below_offsets, below_candidates, sets, below_sets,
 * out) -> bytes written, or -1 when out is too small: a layer's candidate tables (code_tables; below_sets -1: no
 * layer below, below_offsets then [0]). The caller's tables are checked: keys ascending in 0..MAX_TOKEN, counts
 * within their limits, candidates in the list. */
static PyObject *encode_tables(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    long long sets, below_sets;
    if (!PyArg_ParseTuple(args, "OOOOOLLO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &sets, &below_sets,
                          &objs[5]))
        return NULL;
    Arg a[6] = {0};
    PyObject *answer = NULL;
    TableCounters *k = NULL;
    if (get_array(objs[0], &a[0], "q", 8, 0, "token_keys") < 0 ||
        get_array(objs[1], &a[1], "I", 4, 0, "token_offsets") < 0 ||
        get_array(objs[2], &a[2], "I", 4, 0, "token_candidates") < 0 ||
        get_array(objs[3], &a[3], "I", 4, 0, "below_offsets") < 0 ||
        get_array(objs[4], &a[4], "I", 4, 0, "below_candidates") < 0 || get_array(objs[5], &a[5], "B", 1, 1, "out") < 0)
        goto done;
    int64_t n_keys = LEN(a[0], 8), n_below = 0;
    int64_t *keys = a[0].view.buf;
    uint32_t *to = a[1].view.buf, *tc = a[2].view.buf, *bo = a[3].view.buf, *bc = a[4].view.buf;
    int bad = LEN(a[1], 4) != n_keys + 1 || to[0] != 0 || LEN(a[3], 4) != (below_sets < 0 ? 1 : below_sets + 1) ||
              bo[0] != 0 || to[n_keys] != LEN(a[2], 4) || bo[LEN(a[3], 4) - 1] != LEN(a[4], 4);
    for (int64_t i = 0; i < n_keys && !bad; i++)
        bad = keys[i] < (i ? keys[i - 1] + 1 : 0) || keys[i] > MAX_TOKEN || to[i + 1] <= to[i] ||
              to[i + 1] - to[i] > MAX_TOKEN_CANDIDATES;
    for (int64_t s = 0; s < below_sets && !bad; s++) {
        bad = bo[s + 1] < bo[s] || bo[s + 1] - bo[s] > MAX_BELOW_CANDIDATES;
        n_below += bo[s + 1] > bo[s];
    }
    for (int64_t j = 0; j < LEN(a[2], 4) && !bad; j++) bad = tc[j] >= sets;
    for (int64_t j = 0; j < LEN(a[4], 4) && !bad; j++) bad = bc[j] >= sets;
    if (bad) {
        PyErr_SetString(PyExc_ValueError,
                        "encode_tables: keys out of order, or counts or candidates past their limits");
        goto done;
    }
    if (!(k = table_counters_new())) {
        PyErr_NoMemory();
        goto done;
    }
    Encoder e = {0, 0xFFFFFFFFu, 0, 1, a[5].view.buf, 0, (size_t)a[5].view.len, 0, 0};
    Coder c = {&e, NULL, NULL};
    Py_BEGIN_ALLOW_THREADS code_tables(&c, k, n_keys, sets, below_sets, n_below, keys, to, tc, bo, bc);
    if (e.bits) encoder_flush(&e);
    Py_END_ALLOW_THREADS answer = PyLong_FromLongLong(e.overflow ? -1 : e.bits ? (long long)e.size : 0);
done:
    free(k);
    release(a, 6);
    return answer;
}

/* decode_tables(stream, sets, below_sets, n_below, token_keys, token_offsets, token_candidates, below_offsets,
 * below_candidates) -> status: encode_tables' stream into the arrays (token_keys sized to the model's keys,
 * token_offsets one more, token_candidates room for MAX_TOKEN_CANDIDATES a key, below_offsets below_sets + 1 (1 where
 * -1), below_candidates room for MAX_BELOW_CANDIDATES a set below); code_tables' status. */
static PyObject *decode_tables(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    long long sets, below_sets, n_below;
    if (!PyArg_ParseTuple(args, "OLLLOOOOO", &objs[0], &sets, &below_sets, &n_below, &objs[1], &objs[2], &objs[3],
                          &objs[4], &objs[5]))
        return NULL;
    Arg a[6] = {0};
    PyObject *answer = NULL;
    TableCounters *k = NULL;
    if (get_array(objs[0], &a[0], "B", 1, 0, "stream") < 0 || get_array(objs[1], &a[1], "q", 8, 1, "token_keys") < 0 ||
        get_array(objs[2], &a[2], "I", 4, 1, "token_offsets") < 0 ||
        get_array(objs[3], &a[3], "I", 4, 1, "token_candidates") < 0 ||
        get_array(objs[4], &a[4], "I", 4, 1, "below_offsets") < 0 ||
        get_array(objs[5], &a[5], "I", 4, 1, "below_candidates") < 0)
        goto done;
    int64_t n_keys = LEN(a[1], 8);
    if (LEN(a[2], 4) != n_keys + 1 || LEN(a[3], 4) < n_keys * MAX_TOKEN_CANDIDATES ||
        LEN(a[4], 4) != (below_sets < 0 ? 1 : below_sets + 1) ||
        LEN(a[5], 4) < (below_sets < 0 ? 0 : below_sets * MAX_BELOW_CANDIDATES)) {
        PyErr_SetString(PyExc_ValueError, "decode_tables: the arrays must have room for the most candidates");
        goto done;
    }
    if (!(k = table_counters_new())) {
        PyErr_NoMemory();
        goto done;
    }
    int status;
    uint32_t *bo = a[4].view.buf;
    bo[0] = 0;
    Py_BEGIN_ALLOW_THREADS Decoder d;
    decoder_start(&d, a[0].view.buf, (size_t)a[0].view.len);
    Coder c = {NULL, &d, NULL};
    status = code_tables(&c, k, n_keys, sets, below_sets, n_below, a[1].view.buf, a[2].view.buf, a[3].view.buf, bo,
                         a[5].view.buf);
    Py_END_ALLOW_THREADS answer = PyLong_FromLong(status);
done:
    free(k);
    release(a, 6);
    return answer;
}

/* -- counting distinct rows and keys -------------------------------------------------------------------------- */
static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 0x243F6A8885A308D3ull ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, p + i, n - i);
        h = (h ^ w) * 0x9E3779B97F4A7C15ull;
        h ^= h >> 29;
    }
    return h * 0xBF58476D1CE4E5B9ull;
}

static int64_t table_size(int64_t n) {
    int64_t size = 2;
    while (size < 2 * n) size *= 2;
    return size;
}

/* distinct(data, width, ids, first) -> D: the distinct items of ``data`` (rows of ``width`` bytes) numbered in the
 * order they first appear (``ids[i]``: item i's number), and where each first appears (``first[d]``, d < D). */
static PyObject *distinct(PyObject *self, PyObject *args) {
    PyObject *data_obj, *ids_obj, *first_obj;
    long long width;
    if (!PyArg_ParseTuple(args, "OLOO", &data_obj, &width, &ids_obj, &first_obj)) return NULL;
    Arg a[3] = {0};
    PyObject *answer = NULL;
    if (get_array(data_obj, &a[0], "B", 1, 0, "data") < 0 || get_array(ids_obj, &a[1], "i", 4, 1, "ids") < 0 ||
        get_array(first_obj, &a[2], "q", 8, 1, "first") < 0)
        goto done;
    int64_t n = LEN(a[1], 4);
    if (width < 1 || a[0].view.len != n * width || LEN(a[2], 8) != n || n >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "distinct: data must hold one item of width bytes per id and first");
        goto done;
    }
    int64_t size = table_size(n);
    uint32_t *table = calloc((size_t)size, sizeof(uint32_t));
    if (!table) {
        PyErr_NoMemory();
        goto done;
    }
    const uint8_t *data = a[0].view.buf;
    int32_t *ids = a[1].view.buf;
    int64_t *first = a[2].view.buf;
    int64_t count = 0;
    Py_BEGIN_ALLOW_THREADS uint64_t mask = (uint64_t)size - 1;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *item = data + i * width;
        uint64_t slot = hash_bytes(item, (size_t)width) & mask;
        for (;;) {
            uint32_t found = table[slot];
            if (!found) {
                table[slot] = (uint32_t)(count + 1);
                first[count] = i;
                ids[i] = (int32_t)count++;
                break;
            }
            if (!memcmp(data + first[found - 1] * width, item, (size_t)width)) {
                ids[i] = (int32_t)(found - 1);
                break;
            }
            slot = (slot + 1) & mask;
        }
    }
    Py_END_ALLOW_THREADS free(table);
    answer = PyLong_FromLongLong((long long)count);
done:
    release(a, 3);
    return answer;
}

/* hash_keys(keys, table): the open-addressing table decode_layer and encode_layer look tokens up in. */
static PyObject *hash_keys(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *table_obj;
    if (!PyArg_ParseTuple(args, "OO", &keys_obj, &table_obj)) return NULL;
    Arg a[2] = {0};
    PyObject *answer = NULL;
    if (get_array(keys_obj, &a[0], "q", 8, 0, "keys") < 0 || get_array(table_obj, &a[1], "I", 4, 1, "table") < 0)
        goto done;
    int64_t n = LEN(a[0], 8), size = LEN(a[1], 4);
    if ((size & (size - 1)) != 0 || (n && size < 2 * n) || n >= UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "hash_keys: the table must be a power of two at least twice the keys");
        goto done;
    }
    const int64_t *keys = a[0].view.buf;
    uint32_t *table = a[1].view.buf;
    memset(table, 0, (size_t)size * sizeof(uint32_t));
    int shift = 64;
    for (int64_t s = size; s > 1; s >>= 1) shift--;
    uint64_t mask = size ? (uint64_t)size - 1 : 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t slot = mix((uint64_t)keys[i]) >> shift;
        while (table[slot]) {
            if (keys[table[slot] - 1] == keys[i]) {
                PyErr_SetString(PyExc_ValueError, "hash_keys: a key repeats");
                goto done;
            }
            slot = (slot + 1) & mask;
        }
        table[slot] = (uint32_t)(i + 1);
    }
    answer = Py_NewRef(Py_None);
done:
    release(a, 2);
    return answer;
}

/* place_rows(index, sets, escapes, out, topk): a chunk layer's decoded rows into out (topk IDs a row, the list's
 * dtype): row r is listed set index[r], or where index[r] is -1 the next of the escapes in order; the escapes must
 * be used up exactly. In one pass: numpy's take, mask and masked assignment were a tenth of a chunk's decoding. */
static PyObject *place_rows(PyObject *self, PyObject *args) {
    PyObject *index_obj, *sets_obj, *escapes_obj, *out_obj;
    long long topk;
    if (!PyArg_ParseTuple(args, "OOOOL", &index_obj, &sets_obj, &escapes_obj, &out_obj, &topk)) return NULL;
    Arg a[4] = {0};
    PyObject *answer = NULL;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (get_array(index_obj, &a[0], "i", 4, 0, "index") < 0) goto done;
    if (PyObject_GetBuffer(sets_obj, &a[1].view, flags) < 0) goto done;
    a[1].held = 1;
    if (PyObject_GetBuffer(escapes_obj, &a[2].view, flags) < 0) goto done;
    a[2].held = 1;
    if (PyObject_GetBuffer(out_obj, &a[3].view, flags | PyBUF_WRITABLE) < 0) goto done;
    a[3].held = 1;
    Py_ssize_t itemsize = a[3].view.itemsize;
    int64_t n = LEN(a[0], 4);
    /* topk bounded first: a row's bytes, and every count below, then fit without overflow */
    if (topk < 1 || topk > (1 << 20) || (itemsize != 1 && itemsize != 2) || a[1].view.itemsize != itemsize ||
        a[2].view.itemsize != itemsize || a[1].view.len % (topk * itemsize) != 0 ||
        a[2].view.len % (topk * itemsize) != 0 || a[3].view.len % (topk * itemsize) != 0 ||
        a[3].view.len / (topk * itemsize) != n) {
        PyErr_SetString(PyExc_ValueError, "place_rows: out must hold topk IDs a row, the sets and escapes alike");
        goto done;
    }
    const size_t row_bytes = (size_t)(topk * itemsize);
    int64_t sets = (int64_t)((size_t)a[1].view.len / row_bytes), escapes = (int64_t)((size_t)a[2].view.len / row_bytes);
    int64_t used = 0;
    const int32_t *index = a[0].view.buf;
    const uint8_t *set_bytes = a[1].view.buf, *escape_bytes = a[2].view.buf;
    uint8_t *out = a[3].view.buf;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *from;
        if (index[r] >= 0 && index[r] < sets) {
            from = set_bytes + (size_t)index[r] * row_bytes;
        } else if (index[r] == -1 && used < escapes) {
            from = escape_bytes + (size_t)used++ * row_bytes;
        } else {
            PyErr_SetString(PyExc_ValueError, "place_rows: an index outside the list, or more escapes than given");
            goto done;
        }
        memcpy(out + (size_t)r * row_bytes, from, row_bytes);
    }
    if (used != escapes) {
        PyErr_SetString(PyExc_ValueError, "place_rows: fewer escaped rows than escapes given");
        goto done;
    }
    answer = Py_NewRef(Py_None);
done:
    release(a, 4);
    return answer;
}

/* candidate_hits(at, offsets, candidates, index, hit): hit[r] |= 1 where row r's set index[r] is among the candidates
 * of its key at[r] (-1: none), key i's being candidates[offsets[i]:offsets[i + 1]]. The writer's plan asks this of
 * every row of a layer twice or more (a loop over candidate ranks in numpy was a third of its planning). */
static PyObject *candidate_hits(PyObject *self, PyObject *args) {
    PyObject *at_obj, *offsets_obj, *candidates_obj, *index_obj, *hit_obj;
    if (!PyArg_ParseTuple(args, "OOOOO", &at_obj, &offsets_obj, &candidates_obj, &index_obj, &hit_obj)) return NULL;
    Arg a[5] = {0};
    PyObject *answer = NULL;
    if (get_array(at_obj, &a[0], "q", 8, 0, "at") < 0 || get_array(offsets_obj, &a[1], "I", 4, 0, "offsets") < 0 ||
        get_array(candidates_obj, &a[2], "I", 4, 0, "candidates") < 0 ||
        get_array(index_obj, &a[3], "i", 4, 0, "index") < 0 || get_array(hit_obj, &a[4], "B", 1, 1, "hit") < 0)
        goto done;
    int64_t n = LEN(a[0], 8), keys = LEN(a[1], 4) - 1, size = LEN(a[2], 4);
    if (LEN(a[3], 4) != n || LEN(a[4], 1) != n || keys < 0) {
        PyErr_SetString(PyExc_ValueError, "candidate_hits: at, index and hit need a value per row, offsets one or more");
        goto done;
    }
    const int64_t *at = a[0].view.buf;
    const uint32_t *offsets = a[1].view.buf, *candidates = a[2].view.buf;
    const int32_t *index = a[3].view.buf;
    uint8_t *hit = a[4].view.buf;
    for (int64_t i = 0; i < keys; i++)
        if (offsets[i] > offsets[i + 1] || offsets[i + 1] > (uint64_t)size) {
            PyErr_SetString(PyExc_ValueError, "candidate_hits: the offsets must ascend inside the candidates");
            goto done;
        }
    for (int64_t r = 0; r < n; r++)
        if (at[r] >= keys) {
            PyErr_SetString(PyExc_ValueError, "candidate_hits: a key past the offsets");
            goto done;
        }
    for (int64_t r = 0; r < n; r++) {
        if (at[r] < 0 || index[r] < 0) continue;
        for (uint32_t i = offsets[at[r]]; i < offsets[at[r] + 1]; i++)
            if (candidates[i] == (uint32_t)index[r]) {
                hit[r] = 1;
                break;
            }
    }
    answer = Py_NewRef(Py_None);
done:
    release(a, 5);
    return answer;
}

static PyMethodDef methods[] = {
    {"encode_layer", encode_layer, METH_VARARGS,
     "encode_layer(index, sets, tokens, below, token_keys, token_table, token_offsets, token_candidates, "
     "below_offsets, below_candidates, out) -> bytes written, or -1 when out is too small"},
    {"decode_layer", decode_layer, METH_VARARGS,
     "decode_layer(stream, sets, tokens, below, token_keys, token_table, token_offsets, token_candidates, "
     "below_offsets, below_candidates, index) -> (status, row)"},
    {"encode_escapes", encode_escapes, METH_VARARGS,
     "encode_escapes(rows, topk, experts, order, out) -> bytes written, or -1 when out is too small"},
    {"decode_escapes", decode_escapes, METH_VARARGS, "decode_escapes(stream, topk, experts, order, out) -> None"},
    {"encode_list", encode_list, METH_VARARGS,
     "encode_list(rows, topk, experts, order, out) -> bytes written, or -1 when out is too small"},
    {"decode_list", decode_list, METH_VARARGS, "decode_list(stream, topk, experts, order, out) -> (status, row)"},
    {"encode_referenced", encode_referenced, METH_VARARGS,
     "encode_referenced(rows, topk, experts, order, sets, tokens, below, token_keys, token_table, token_offsets, "
     "token_candidates, below_offsets, below_candidates, out, lists) -> bytes written, or -1 when out is too small"},
    {"decode_referenced", decode_referenced, METH_VARARGS,
     "decode_referenced(stream, topk, experts, order, sets, tokens, below, token_keys, token_table, token_offsets, "
     "token_candidates, below_offsets, below_candidates, out, lists) -> None"},
    {"encode_tables", encode_tables, METH_VARARGS,
     "encode_tables(token_keys, token_offsets, token_candidates, below_offsets, below_candidates, sets, below_sets, "
     "out) -> bytes written, or -1 when out is too small"},
    {"decode_tables", decode_tables, METH_VARARGS,
     "decode_tables(stream, sets, below_sets, n_below, token_keys, token_offsets, token_candidates, below_offsets, "
     "below_candidates) -> status"},
    {"distinct", distinct, METH_VARARGS, "distinct(data, width, ids, first) -> number of distinct items"},
    {"hash_keys", hash_keys, METH_VARARGS, "hash_keys(keys, table) -> None"},
    {"candidate_hits", candidate_hits, METH_VARARGS, "candidate_hits(at, offsets, candidates, index, hit) -> None"},
    {"place_rows", place_rows, METH_VARARGS, "place_rows(index, sets, escapes, out, topk) -> None"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ccontext",
                                    "The compiled passes of the set-context codec (see context.py).", -1, methods};

PyMODINIT_FUNC PyInit__ccontext(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "OK", OK) < 0 || PyModule_AddIntConstant(m, "INDEX_RANGE", INDEX_RANGE) < 0 ||
        PyModule_AddIntConstant(m, "BUCKET_RANGE", BUCKET_RANGE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_POSITION", MAX_POSITION) < 0 ||
        PyModule_AddIntConstant(m, "MAX_LENGTH", MAX_LENGTH) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BUCKET", MAX_BUCKET) < 0 ||
        PyModule_AddIntConstant(m, "TREE_BITS", TREE_BITS) < 0 || PyModule_AddIntConstant(m, "ADAPT", ADAPT) < 0 ||
        PyModule_AddIntConstant(m, "ESCAPE_PROB_BITS", ESCAPE_PROB_BITS) < 0 ||
        PyModule_AddIntConstant(m, "ESCAPE_MAX_SHIFT", ESCAPE_MAX_SHIFT) < 0 ||
        PyModule_AddIntConstant(m, "ESCAPE_FOUND", ESCAPE_FOUND) < 0 ||
        PyModule_AddIntConstant(m, "ESCAPE_MAX_EXPERTS", ESCAPE_MAX_EXPERTS) < 0 ||
        PyModule_AddIntConstant(m, "REF_CANDIDATES", REF_CANDIDATES) < 0 ||
        PyModule_AddIntConstant(m, "REF_PLACES", REF_PLACES) < 0 ||
        PyModule_AddIntConstant(m, "LIST_BUCKETS", LIST_BUCKETS) < 0 ||
        PyModule_AddIntConstant(m, "LIST_WINDOW", LIST_WINDOW) < 0 ||
        PyModule_AddIntConstant(m, "LIST_SEARCH", LIST_SEARCH) < 0 ||
        PyModule_AddIntConstant(m, "LIST_PREFERENCE", LIST_PREFERENCE) < 0 ||
        PyModule_AddIntConstant(m, "LIST_MARGIN", LIST_MARGIN) < 0 ||
        PyModule_AddIntConstant(m, "LIST_TRIAL", LIST_TRIAL) < 0 ||
        PyModule_AddIntConstant(m, "COST_SLOTS", COST_SLOTS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TOKEN_CANDIDATES", MAX_TOKEN_CANDIDATES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BELOW_CANDIDATES", MAX_BELOW_CANDIDATES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_TOKEN", MAX_TOKEN) < 0 ||
        PyModule_AddIntConstant(m, "TABLE_BUCKETS", TABLE_BUCKETS) < 0 ||
        PyModule_AddIntConstant(m, "TABLE_RANGE", TABLE_RANGE) < 0 ||
        PyModule_AddIntConstant(m, "TABLE_KEYS_BELOW", TABLE_KEYS_BELOW) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    costs_start();
    return m;
}
