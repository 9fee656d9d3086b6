/* The compiled per-chunk passes of the format-2 codec (routelog/format/kernels.py states their contract; FORMAT.md
 * section 5 the bytes). Built by pip from source with the machine's compiler; where it is not built,
 * routelog/format/kernels_numpy.py does the same work (tests/test_kernels_numpy.py proves them equal).
 *
 * Why compiled: the codec's work is per row (compare a row with the one before it, check it, take its gaps, find
 * whether it occurred earlier in its layer, relabel and sort its IDs), which numpy can only do as a dozen
 * whole-array passes with a temporary each.
 *
 * Rows of eight uint8 IDs (top-8 of at most 256 experts, the common case) are handled as one 64-bit word: equality
 * is one compare, the gaps are one subtraction (x - (x << 8) - 0x0101..00: no lane borrows when the row ascends,
 * and a borrow shows in the gaps' byte sum), the inverse prefix sum is one multiplication by 0x0101..01 (lane j of
 * the product is the sum of lanes 0..j). Other rows take the same steps one ID at a time. Both write the same bytes.
 *
 * The encoder's choices (ranking a layer's experts by popularity, a dictionary of its distinct rows) compare
 * floating-point estimates: they are evaluated in the order the format's reference writes them, without fused
 * multiply-adds (setup.py builds with -ffp-contract=off), so every build writes the same bytes.
 *
 * Decoding checks every index read from a payload before using it: a forged chunk makes decode_chunk return a
 * status code, never read or write out of bounds, and never return a row that is no top-k set when asked for sets.
 * Every function releases the GIL while it works: readers and writers run chunks on several threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the word paths assume little-endian lanes; this platform uses the numpy kernels"
#endif

/* Kept equal to routelog/format/kernels.py (tests/test_kernels.py compares them through CONSTANTS). */
#define RANK_BELOW 0.99
#define LOAD_SAMPLE 512
#define MIN_GAIN 0.05
#define RUN_BYTES 3.0
#define MAX_MASK_EXPERTS 1024
#define DICTIONARY 4
#define MAX_ENTRIES (1 << 16)
#define MATCH_BYTES 1.4
#define INDEX_WEIGHT 0.7
#define LONG_RUN_BYTES 4.4
enum { AUTO = 0, NEVER = 1, ALWAYS = 2 };
enum {
    OK = 0,
    UNKNOWN_MODE = 1,
    SECTION_SIZES = 2,
    FIRST_ROW_REPEATS = 3,
    UNIQUE_COUNT = 4,
    EXCEPTION_RANGE = 5,
    RANK_RANGE = 6,
    DICTIONARY_SIZE = 7,
    DICTIONARY_INDEX = 8,
    INVALID_ROW = 9
};
enum { ANY_ROWS = 0, SETS = 1, SETS_OR_FILL = 2 };

static const uint64_t FIRST_ONES = 0x0101010101010100ULL; /* +1 in every lane but lane 0 */
static const uint64_t EVEN_LANES = 0x00FF00FF00FF00FFULL;
static const uint64_t SUM_16 = 0x0001000100010001ULL;
static const uint64_t HASH = 0x9E3779B97F4A7C15ULL;

/* -- small helpers --------------------------------------------------------------------------------------------- */
static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* An ID of a uint8 or uint16 array (native order). */
static inline int64_t load_id(const uint8_t *p, int itemsize) {
    if (itemsize == 1) return p[0];
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline void store_id(uint8_t *p, int itemsize, int64_t v) {
    if (itemsize == 1) {
        p[0] = (uint8_t)v;
    } else {
        uint16_t w = (uint16_t)v;
        memcpy(p, &w, 2);
    }
}

/* The little-endian unsigned integer of nbytes at buffer[at]; writing one returns the next position. */
static inline int64_t get_le(const uint8_t *buffer, int64_t at, int nbytes) {
    int64_t v = 0;
    for (int b = 0; b < nbytes; b++) v |= (int64_t)buffer[at + b] << (8 * b);
    return v;
}
static inline int64_t put_le(uint8_t *buffer, int64_t at, int64_t value, int nbytes) {
    for (int b = 0; b < nbytes; b++) buffer[at + b] = (uint8_t)((value >> (8 * b)) & 255);
    return at + nbytes;
}

/* Set bits of a byte (a table: baseline x86-64 has no popcount instruction, and libgcc's call costs more). */
static const uint8_t BITS[256] = {
#define B2(n) n, n + 1, n + 1, n + 2
#define B4(n) B2(n), B2(n + 1), B2(n + 1), B2(n + 2)
#define B6(n) B4(n), B4(n + 1), B4(n + 1), B4(n + 2)
    B6(0), B6(1), B6(1), B6(2)};
static inline int popcount8(uint64_t x) { return BITS[x & 255]; }

/* -- rows as words (eight uint8 IDs) -------------------------------------------------------------------------- */
static inline uint64_t word_gaps(uint64_t word) { return word - ((word << 8) + FIRST_ONES); }

/* Whether word holds eight strictly ascending IDs below num_experts, given its word_gaps: without lane borrows
 * the gaps' bytes sum to the last ID minus 7; a borrow adds 255 or 256 to that sum. */
static inline int word_valid(uint64_t word, uint64_t gaps, int64_t num_experts) {
    uint64_t pairs = (gaps & EVEN_LANES) + ((gaps >> 8) & EVEN_LANES);
    uint64_t total = ((pairs * SUM_16) >> 48) + 7;
    uint64_t last = word >> 56;
    return (total == last) & ((int64_t)last < num_experts);
}

/* Inverse of word_gaps: lane j of the product is lane 0 plus (lane i + 1) for i = 1..j (with carries between
 * lanes where a damaged row's sums pass 255: the reference decoder's bytes, kept by every path). */
static inline uint64_t word_ids(uint64_t gaps) {
    /* times ONES = (1 + 2^8)(1 + 2^16)(1 + 2^32): three shift-adds, which vectorize where a 64-bit multiply does not */
    uint64_t x = gaps + FIRST_ONES;
    x += x << 8;
    x += x << 16;
    return x + (x << 32);
}

/* The loops every chunk runs, compiled twice where the toolchain can (AVX2 and baseline x86-64, chosen when the
 * module loads): over 64-bit lanes the baseline's vectorizer gives up, and these are most of a chunk's work. Word
 * arrays are 8-byte aligned (the callers copy a misaligned buffer first). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define HOT __attribute__((target_clones("avx2", "default"), noinline))
#elif defined(__GNUC__)
#define HOT __attribute__((noinline))
#else
#define HOT
#endif

/* ids[r] = the IDs whose gaps are gaps[r]. */
HOT static void ids_from_gaps(const uint64_t *restrict gaps, uint64_t *restrict ids, int64_t n) {
    for (int64_t r = 0; r < n; r++) ids[r] = word_ids(gaps[r]);
}

/* Whether some row whose gaps are one of the n words is no set below num_experts: its last ID, the gaps' byte sum
 * + 7, is at least min(E, 256). */
HOT static int gaps_past(const uint64_t *restrict rows, int64_t n, int64_t num_experts) {
    uint64_t over = 0;
    uint64_t bias = (uint64_t)(2048 + 7 - (num_experts < 256 ? num_experts : 256));
    for (int64_t r = 0; r < n; r++) {
        uint64_t w = rows[r];
        uint64_t pairs = (w & EVEN_LANES) + ((w >> 8) & EVEN_LANES);
        uint64_t quads = pairs + (pairs >> 16);
        over |= (((quads + (quads >> 32)) & 0xFFFF) + bias) & 2048;
    }
    return over != 0;
}

/* gaps[r] = the gaps of ids[r]; returns how many rows are no strictly ascending set below num_experts. */
HOT static int64_t gaps_of_ids(const uint64_t *restrict ids, uint64_t *restrict gaps, int64_t n, int64_t num_experts) {
    int64_t invalid = 0;
    for (int64_t r = 0; r < n; r++) {
        uint64_t g = word_gaps(ids[r]);
        gaps[r] = g;
        invalid += !word_valid(ids[r], g, num_experts);
    }
    return invalid;
}

/* How many of the n rows (words of eight uint8 IDs) are no strictly ascending set below num_experts. */
HOT static int64_t invalid_words(const uint64_t *restrict ids, int64_t n, int64_t num_experts) {
    int64_t invalid = 0;
    for (int64_t r = 0; r < n; r++) invalid += !word_valid(ids[r], word_gaps(ids[r]), num_experts);
    return invalid;
}

/* flags[r] = whether row r equals row r - 1 (flags[0] = 0); returns how many do. */
HOT static int64_t repeat_flags(const uint64_t *restrict ids, uint8_t *restrict flags, int64_t n) {
    int64_t repeats = 0;
    if (n > 0) flags[0] = 0;
    for (int64_t r = 1; r < n; r++) {
        flags[r] = ids[r] == ids[r - 1];
        repeats += flags[r];
    }
    return repeats;
}

/* Compare-exchange of two values of type T: the smaller into a, the larger into b (no branch on the data). */
#define MIN_MAX(T, a, b)              \
    do {                              \
        T lo_ = a < b ? a : b;        \
        T hi_ = a < b ? b : a;        \
        a = lo_;                      \
        b = hi_;                      \
    } while (0)
/* Batcher's network for eight values a0..a7, each compare-exchange made by CX(a, b) (19 of them;
 * codec.sorting_network); NETWORK(T) for values of type T. */
#define NETWORK_BY(CX)                                                                                        \
    CX(a0, a1); CX(a2, a3); CX(a4, a5); CX(a6, a7); CX(a0, a2); CX(a1, a3); CX(a4, a6); CX(a5, a7); CX(a1, a2); \
    CX(a5, a6); CX(a0, a4); CX(a1, a5); CX(a2, a6); CX(a3, a7); CX(a2, a4); CX(a3, a5); CX(a1, a2); CX(a3, a4); \
    CX(a5, a6)
#define MIN_MAX_OF_int64_t(a, b) MIN_MAX(int64_t, a, b)
#define MIN_MAX_OF_uint8_t(a, b) MIN_MAX(uint8_t, a, b)
#define MIN_MAX_OF_uint16_t(a, b) MIN_MAX(uint16_t, a, b)
#define NETWORK(T) NETWORK_BY(MIN_MAX_OF_##T)

/* Rows of eight values of type T sorted in place (the loop vectorizes across rows); nonzero when some row holds a
 * value above largest or a repeated one. */
#define SORT_ROWS(NAME, T)                                                                                      \
    HOT static int NAME(T *rows, int64_t n, T largest) {                                                        \
        T bad = 0;                                                                                              \
        for (int64_t r = 0; r < n; r++) {                                                                       \
            T *s = rows + 8 * r;                                                                                \
            T a0 = s[0], a1 = s[1], a2 = s[2], a3 = s[3], a4 = s[4], a5 = s[5], a6 = s[6], a7 = s[7];           \
            NETWORK(T);                                                                                         \
            bad |= (a0 == a1) | (a1 == a2) | (a2 == a3) | (a3 == a4) | (a4 == a5) | (a5 == a6) | (a6 == a7) |   \
                   (a7 > largest);                                                                              \
            s[0] = a0; s[1] = a1; s[2] = a2; s[3] = a3; s[4] = a4; s[5] = a5; s[6] = a6; s[7] = a7;             \
        }                                                                                                       \
        return bad;                                                                                             \
    }
SORT_ROWS(sort_rows_u8_scalar, uint8_t)
SORT_ROWS(sort_rows_u16, uint16_t)

#if defined(__SSE2__)
#include <emmintrin.h>
/* The same network on sixteen rows of eight uint8 at a time: the rows are transposed into eight registers (one per
 * position, a byte per row, rows in the order 0, 2, .., 14, 1, 3, .., 15), each compare-exchange is a min and a max
 * of two registers, and the transpose is undone: about 8 instructions a row. Sorting 2 M rows of 48 layers into layer
 * order took 8.7 ms with the loop above (vectorized by the compiler) after a copy into a block, and 3.0 ms so, from
 * the token rows straight into their places (2-core AMD EPYC). */
#define MIN_MAX_U8X16(a, b)                  \
    do {                                     \
        __m128i lo_ = _mm_min_epu8(a, b);    \
        b = _mm_max_epu8(a, b);              \
        a = lo_;                             \
    } while (0)

/* Rows i and i + 1 of eight uint8 (the j-th at src + j * stride) in one register. */
static inline __m128i two_rows(const uint8_t *src, int64_t i, int64_t stride) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(src + i * stride)),
                              _mm_loadl_epi64((const __m128i *)(src + (i + 1) * stride)));
}

/* Eight registers out0..out7 from x0..x7 by LO and HI (an unpack's low and high halves) of the pairs of registers
 * one apart (0, 1), (2, 3), (4, 5), (6, 7); two apart (0, 2), (1, 3), (4, 6), (5, 7); or four apart (0, 4) .. (3, 7):
 * the stages of the 16 x 8 byte transpose. */
#define UNPACK_NEIGHBOURS(out, x, LO, HI)                                                                    \
    __m128i out##0 = LO(x##0, x##1), out##1 = HI(x##0, x##1), out##2 = LO(x##2, x##3), out##3 = HI(x##2, x##3), \
            out##4 = LO(x##4, x##5), out##5 = HI(x##4, x##5), out##6 = LO(x##6, x##7), out##7 = HI(x##6, x##7)
#define UNPACK_TWO_APART(out, x, LO, HI)                                                                     \
    __m128i out##0 = LO(x##0, x##2), out##1 = HI(x##0, x##2), out##2 = LO(x##1, x##3), out##3 = HI(x##1, x##3), \
            out##4 = LO(x##4, x##6), out##5 = HI(x##4, x##6), out##6 = LO(x##5, x##7), out##7 = HI(x##5, x##7)
#define UNPACK_FOUR_APART(out, x, LO, HI)                                                                    \
    __m128i out##0 = LO(x##0, x##4), out##1 = HI(x##0, x##4), out##2 = LO(x##1, x##5), out##3 = HI(x##1, x##5), \
            out##4 = LO(x##2, x##6), out##5 = HI(x##2, x##6), out##6 = LO(x##3, x##7), out##7 = HI(x##3, x##7)

/* Sixteen rows of eight uint8, the i-th at src + i * stride, sorted into dst (128 contiguous bytes; dst may be src
 * when stride is 8); repeated IDs and the largest ID seen accumulate in duplicate and top. */
static inline void sort_sixteen_u8(const uint8_t *src, int64_t stride, uint8_t *dst, __m128i *duplicate,
                                   __m128i *top) {
    __m128i r0 = two_rows(src, 0, stride), r1 = two_rows(src, 2, stride), r2 = two_rows(src, 4, stride),
            r3 = two_rows(src, 6, stride), r4 = two_rows(src, 8, stride), r5 = two_rows(src, 10, stride),
            r6 = two_rows(src, 12, stride), r7 = two_rows(src, 14, stride);
    /* rows (2i, 2i + 1) in r_i -> bytes of rows (0, 2), (1, 3), (4, 6), .. interleaved per position */
    UNPACK_NEIGHBOURS(b, r, _mm_unpacklo_epi8, _mm_unpackhi_epi8);
    /* -> positions 0-3 and 4-7 of rows (0, 2, 4, 6), (1, 3, 5, 7), (8, .., 14), (9, .., 15) */
    UNPACK_TWO_APART(c, b, _mm_unpacklo_epi16, _mm_unpackhi_epi16);
    /* -> positions (0, 1), (2, 3), (4, 5), (6, 7) of the even rows, then of the odd rows */
    UNPACK_FOUR_APART(d, c, _mm_unpacklo_epi32, _mm_unpackhi_epi32);
    /* -> one register per position: its byte of the even rows, then of the odd rows */
    UNPACK_FOUR_APART(a, d, _mm_unpacklo_epi64, _mm_unpackhi_epi64);
    NETWORK_BY(MIN_MAX_U8X16);
    *duplicate = _mm_or_si128(*duplicate, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(a0, a1), _mm_cmpeq_epi8(a1, a2)),
                                                     _mm_or_si128(_mm_cmpeq_epi8(a2, a3), _mm_cmpeq_epi8(a3, a4))));
    *duplicate = _mm_or_si128(*duplicate, _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(a4, a5), _mm_cmpeq_epi8(a5, a6)),
                                                     _mm_cmpeq_epi8(a6, a7)));
    *top = _mm_max_epu8(*top, a7);
    /* back: positions (0, 1), (2, 3), .. interleaved per row, then 4 positions, then whole rows of eight */
    UNPACK_NEIGHBOURS(e, a, _mm_unpacklo_epi8, _mm_unpackhi_epi8);
    UNPACK_TWO_APART(f, e, _mm_unpacklo_epi16, _mm_unpackhi_epi16);
    /* f0: rows 0, 2, 4, 6 (positions 0-3), f4: the same rows' positions 4-7; f1: rows 8-14, f2: rows 1-7, f3: 9-15 */
    UNPACK_FOUR_APART(g, f, _mm_unpacklo_epi32, _mm_unpackhi_epi32);
    /* g0: rows 0, 2; g1: 4, 6; g2: 8, 10; g3: 12, 14; g4: 1, 3; g5: 5, 7; g6: 9, 11; g7: 13, 15 */
    UNPACK_FOUR_APART(h, g, _mm_unpacklo_epi64, _mm_unpackhi_epi64);
    __m128i *out = (__m128i *)dst;
    _mm_storeu_si128(out, h0);
    _mm_storeu_si128(out + 1, h1);
    _mm_storeu_si128(out + 2, h2);
    _mm_storeu_si128(out + 3, h3);
    _mm_storeu_si128(out + 4, h4);
    _mm_storeu_si128(out + 5, h5);
    _mm_storeu_si128(out + 6, h6);
    _mm_storeu_si128(out + 7, h7);
}

/* Whether duplicate or top (sort_sixteen_u8's) saw a repeated ID or one above largest. */
static inline int sixteen_bad(__m128i duplicate, __m128i top, uint8_t largest) {
    uint8_t lanes[16];
    _mm_storeu_si128((__m128i *)lanes, top);
    int bad = _mm_movemask_epi8(duplicate) != 0;
    for (int i = 0; i < 16; i++) bad |= lanes[i] > largest;
    return bad;
}

/* Rows of eight uint8 sorted in place. */
HOT static int sort_rows_u8(uint8_t *rows, int64_t n, uint8_t largest) {
    int64_t whole = n - n % 16;
    __m128i duplicate = _mm_setzero_si128(), top = _mm_setzero_si128();
    for (int64_t r = 0; r < whole; r += 16) sort_sixteen_u8(rows + 8 * r, 8, rows + 8 * r, &duplicate, &top);
    return sixteen_bad(duplicate, top, largest) | sort_rows_u8_scalar(rows + 8 * whole, n - whole, largest);
}

/* Rows of eight uint8 IDs in token order [tokens, layers, 8] sorted into layer order [layers, tokens, 8] (out),
 * a block of tokens at a time: its rows (SORT_BLOCK_BYTES, in the second-level cache) are read once from memory
 * while each layer's are gathered (32 KiB blocks took 1.5 times as long, 256 KiB as long). */
#define SORT_BLOCK_BYTES 131072
HOT static int sort_rows_u8_by_layer(const uint8_t *ids, uint8_t *out, int64_t tokens, int64_t layers,
                                     uint8_t largest) {
    int64_t block = SORT_BLOCK_BYTES / (8 * layers) / 16 * 16;
    block = block < 16 ? 16 : block;
    __m128i duplicate = _mm_setzero_si128(), top = _mm_setzero_si128();
    int bad = 0;
    int64_t stride = 8 * layers;
    for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        int64_t n = tokens - t0 < block ? tokens - t0 : block, whole = n - n % 16;
        for (int64_t j = 0; j < layers; j++) {
            const uint8_t *from = ids + (t0 * layers + j) * 8;
            uint8_t *to = out + (j * tokens + t0) * 8;
            for (int64_t t = 0; t < whole; t += 16)
                sort_sixteen_u8(from + t * stride, stride, to + 8 * t, &duplicate, &top);
            for (int64_t t = whole; t < n; t++) memcpy(to + 8 * t, from + t * stride, 8);
            bad |= sort_rows_u8_scalar(to + 8 * whole, n - whole, largest);
        }
    }
    return bad | sixteen_bad(duplicate, top, largest);
}
#else
#define sort_rows_u8 sort_rows_u8_scalar
#endif

/* Rows of eight uint8 IDs given as gaps, each mapped through lookup (256 bytes) and sorted, into out (n words);
 * returns whether every row's IDs were a strictly ascending set below num_experts. */
static int map_and_sort_rows(const uint64_t *gaps, uint64_t *out, int64_t n, const uint8_t *lookup,
                             int64_t num_experts) {
    int valid = 1;
    uint8_t *bytes = (uint8_t *)out;
    for (int64_t i = 0; i < n; i++) {
        uint64_t g = gaps[i]; /* read before the row is written: out may be gaps */
        uint64_t ids = word_ids(g);
        valid &= word_valid(ids, g, num_experts);
        for (int c = 0; c < 8; c++) bytes[8 * i + c] = lookup[(ids >> (8 * c)) & 255];
    }
    sort_rows_u8(bytes, n, 255);
    return valid;
}

/* counts[b] += how many of the n words' bytes are b. Four histograms take turns: a skewed layer's bytes are mostly
 * one value, and one histogram's increments of it would wait on each other. */
static void count_bytes(const uint64_t *words, int64_t n, int64_t *counts) {
    uint32_t sub[4][256];
    memset(sub, 0, sizeof(sub));
    for (int64_t i = 0; i < n; i++) {
        uint64_t w = words[i];
        for (int c = 0; c < 8; c += 4) {
            sub[0][(w >> (8 * c)) & 255]++;
            sub[1][(w >> (8 * c + 8)) & 255]++;
            sub[2][(w >> (8 * c + 16)) & 255]++;
            sub[3][(w >> (8 * c + 24)) & 255]++;
        }
    }
    for (int b = 0; b < 256; b++) counts[b] += (int64_t)sub[0][b] + sub[1][b] + sub[2][b] + sub[3][b];
}

/* Eight values sorted ascending in place (the network above, on wide values). */
static inline void network_of_eight(int64_t *v) {
    int64_t a0 = v[0], a1 = v[1], a2 = v[2], a3 = v[3], a4 = v[4], a5 = v[5], a6 = v[6], a7 = v[7];
    NETWORK(int64_t);
    v[0] = a0; v[1] = a1; v[2] = a2; v[3] = a3; v[4] = a4; v[5] = a5; v[6] = a6; v[7] = a7;
}

/* The eight lanes of word mapped through mapped[] (256 entries; 256 past any ID) and sorted, packed; whether they
 * are eight distinct values below 256 (below 64 when small: the reference sorts those as a 64-bit set). */
static inline int sorted_lanes(uint64_t word, const int64_t *mapped, int small, uint64_t *packed) {
    int64_t v[8];
    for (int c = 0; c < 8; c++) v[c] = mapped[(word >> (8 * c)) & 255];
    network_of_eight(v);
    int distinct = v[7] < (small ? 64 : 256);
    for (int c = 1; c < 8; c++) distinct &= v[c - 1] < v[c];
    uint64_t p = 0;
    for (int c = 0; c < 8; c++) p |= (uint64_t)(v[c] & 255) << (8 * c);
    *packed = p;
    return distinct;
}

/* Sort values (k of them) ascending in place. */
static inline void sort_values(int64_t *values, int64_t k) {
    if (k == 8) {
        network_of_eight(values);
        return;
    }
    for (int64_t c = 1; c < k; c++) {
        int64_t v = values[c];
        int64_t i = c;
        while (i > 0 && values[i - 1] > v) {
            values[i] = values[i - 1];
            i--;
        }
        values[i] = v;
    }
}

/* Shannon entropy (bits per draw) of counts[start:stop], times its total: the reference's order of operations. */
static double entropy_bits(const int64_t *counts, int64_t start, int64_t stop) {
    int64_t total = 0;
    for (int64_t b = start; b < stop; b++) total += counts[b];
    double bits = 0.0;
    for (int64_t b = start; b < stop; b++)
        if (counts[b]) bits -= (double)counts[b] * log2((double)counts[b] / (double)total);
    return bits;
}

/* Experts (or entries) by descending count, ties by index (a counting sort): order rank -> index, rank_of its
 * inverse. Returns -1 when out of memory. */
static int popularity(const int64_t *counts, int64_t n, int64_t *rank_of, int64_t *order) {
    int64_t most = 0;
    for (int64_t e = 0; e < n; e++) most = counts[e] > most ? counts[e] : most;
    int64_t *starts = calloc((size_t)most + 2, sizeof(int64_t));
    if (!starts) return -1;
    for (int64_t e = 0; e < n; e++) starts[most - counts[e] + 1]++;
    for (int64_t i = 1; i < most + 2; i++) starts[i] += starts[i - 1];
    for (int64_t e = 0; e < n; e++) {
        int64_t rank = starts[most - counts[e]]++;
        if (order) order[rank] = e;
        rank_of[e] = rank;
    }
    free(starts);
    return 0;
}

/* -- encoding ------------------------------------------------------------------------------------------------- */
typedef struct {
    /* input */
    const uint8_t *ids; /* [L, R, K]: each layer's rows contiguous, layers layer_stride bytes apart */
    int64_t layer_stride;
    int64_t layers, rows, k, num_experts;
    int itemsize, words, dictionaries;
    /* output of the transform */
    uint16_t *gaps;      /* [L * R, K] one ID at a time (rows of the gaps section) */
    uint64_t *gap_words; /* [L * R] rows of eight uint8 IDs as words */
    uint8_t *bitmaps;    /* [L, ceil(R / 8)] repeat bits, most significant first */
    uint8_t *modes;      /* [L] 1 ranked, 2 has repeats, 4 dictionary */
    int64_t *tables;     /* [L, E] rank -> ID of ranked layers */
    int64_t *exceptions; /* [L * R, 2] (unique row, flat row) of rows that are no valid set */
    int64_t *layer_unique, *entries, *indices;
    uint8_t *flags; /* [R] scratch: rows equal to the row before */
    int64_t placed, n_exceptions, matched;
} Encoding;

static inline int rows_equal(const Encoding *x, int64_t a, int64_t b) {
    if (x->words) return x->gap_words[a] == x->gap_words[b];
    return memcmp(x->gaps + a * x->k, x->gaps + b * x->k, (size_t)x->k * sizeof(uint16_t)) == 0;
}

/* Top bits of a multiplicative hash of gaps row i, its IDs packed little-endian in 64-bit words (for eight uint8
 * IDs exactly the hash of the row's word). */
static inline int64_t row_hash(const Encoding *x, int64_t i, int bits) {
    if (x->words) return (int64_t)((x->gap_words[i] * HASH) >> (64 - bits));
    int width = 8 * x->itemsize;
    uint64_t h = 0, word = 0;
    int filled = 0;
    for (int64_t c = 0; c < x->k; c++) {
        word |= (uint64_t)x->gaps[i * x->k + c] << filled;
        filled += width;
        if (filled == 64) {
            h = (h ^ word) * HASH;
            word = 0;
            filled = 0;
        }
    }
    if (filled) h = (h ^ word) * HASH;
    return (int64_t)(h >> (64 - bits));
}

/* The IDs whose gaps are row i, into values. */
static inline void row_ids(const Encoding *x, int64_t i, int64_t *values) {
    if (x->words) {
        uint64_t w = word_ids(x->gap_words[i]);
        for (int c = 0; c < 8; c++) values[c] = (int64_t)((w >> (8 * c)) & 255);
        return;
    }
    int64_t v = -1;
    for (int64_t c = 0; c < x->k; c++) {
        v += (int64_t)x->gaps[i * x->k + c] + 1;
        values[c] = v;
    }
}

/* The gaps of the sorted ranks of row i's IDs, into values. */
static inline void ranked_row(const Encoding *x, int64_t i, const int64_t *rank_of, int64_t *values) {
    row_ids(x, i, values);
    for (int64_t c = 0; c < x->k; c++) values[c] = rank_of[values[c]];
    sort_values(values, x->k);
    for (int64_t c = x->k - 1; c > 0; c--) values[c] -= values[c - 1] + 1;
}

static inline void set_row(Encoding *x, int64_t i, const int64_t *values) {
    if (x->words) {
        uint64_t w = 0;
        for (int c = 0; c < 8; c++) w |= (uint64_t)(values[c] & 255) << (8 * c);
        x->gap_words[i] = w;
        return;
    }
    for (int64_t c = 0; c < x->k; c++) x->gaps[i * x->k + c] = (uint16_t)values[c];
}

/* Step 1: a layer's repeats flagged, the gaps of its other rows from position unique, its rows that are no valid
 * set listed as exceptions (their gaps zero: IDs 0..K-1, a valid placeholder the exception overwrites). Returns the
 * next free position. */
static inline int64_t layer_gaps(Encoding *x, int64_t j, int64_t unique, int64_t numbered) {
    int64_t rows = x->rows, k = x->k, per_bitmap = (rows + 7) / 8;
    const uint8_t *layer = x->ids + j * x->layer_stride;
    int64_t first = unique; /* a row's number is numbered + its position - first */
    if (x->words) { /* whole-layer passes that vectorize, then only where needed the repeats and the invalid rows */
        const uint64_t *ids = (const uint64_t *)layer;
        uint64_t *out = x->gap_words + unique;
        int64_t invalid = gaps_of_ids(ids, out, rows, x->num_experts);
        int64_t repeats = repeat_flags(ids, x->flags, rows);
        if (!repeats && !invalid) return unique + rows;
        int64_t u = 0;
        for (int64_t r = 0; r < rows; r++) {
            if (x->flags[r]) {
                x->bitmaps[j * per_bitmap + (r >> 3)] |= (uint8_t)(0x80 >> (r & 7));
                continue;
            }
            out[u] = out[r];
            if (invalid && !word_valid(ids[r], out[r], x->num_experts)) {
                out[u] = 0;
                x->exceptions[2 * x->n_exceptions] = numbered + u;
                x->exceptions[2 * x->n_exceptions + 1] = j * rows + r;
                x->n_exceptions++;
            }
            u++;
        }
        return unique + u;
    }
    for (int64_t r = 0; r < rows; r++) {
        int valid;
        {
            int64_t size = k * x->itemsize;
            if (r > 0 && memcmp(layer + r * size, layer + (r - 1) * size, (size_t)size) == 0) {
                x->bitmaps[j * per_bitmap + (r >> 3)] |= (uint8_t)(0x80 >> (r & 7));
                continue;
            }
            const uint8_t *row = layer + r * size;
            valid = load_id(row + (k - 1) * x->itemsize, x->itemsize) < x->num_experts;
            uint16_t *out = x->gaps + unique * k;
            out[0] = (uint16_t)load_id(row, x->itemsize);
            for (int64_t c = 1; c < k; c++) {
                int64_t step = load_id(row + c * x->itemsize, x->itemsize) -
                               load_id(row + (c - 1) * x->itemsize, x->itemsize) - 1;
                valid &= step >= 0;
                out[c] = (uint16_t)step;
            }
            if (!valid) memset(out, 0, (size_t)k * sizeof(uint16_t));
        }
        if (!valid) {
            x->exceptions[2 * x->n_exceptions] = numbered + unique - first;
            x->exceptions[2 * x->n_exceptions + 1] = j * rows + r;
            x->n_exceptions++;
        }
        unique++;
    }
    return unique;
}

/* Whether a layer's unique rows cost less as a dictionary of its distinct rows and an index per unique row than
 * as zstd's matches of the repeated ones (the model fitted by tools/fit_dictionary_model.py). */
static inline int dictionary_pays(const int64_t *ranks, const int64_t *entry_uses, int64_t n_entries, int64_t runs,
                           int64_t long_runs) {
    int64_t planes[512] = {0};
    for (int64_t e = 0; e < n_entries; e++) {
        planes[ranks[e] & 255] += entry_uses[e];
        planes[256 + (ranks[e] >> 8)] += entry_uses[e];
    }
    double index_bits = entropy_bits(planes, 0, 256) + (n_entries > 256 ? entropy_bits(planes, 256, 512) : 0.0);
    return INDEX_WEIGHT * index_bits / 8 + LONG_RUN_BYTES * (double)long_runs < MATCH_BYTES * (double)runs;
}

/* The whole transform (steps 1-5 per layer); returns -1 when out of memory. */
static int transform(Encoding *result) {
    /* A local copy: the arrays' stores cannot change its fields, so loops keep them in registers. */
    Encoding local = *result;
    Encoding *x = &local;
    int64_t layers = x->layers, rows = x->rows, k = x->k, E = x->num_experts;
    int hash_bits = 10;
    while ((1LL << hash_bits) < 2 * rows && hash_bits < 16) hash_bits++;
    int status = -1;
    int64_t *seen = NULL; /* row hash -> its latest unique row (direct mapped), filled when first needed */
    int64_t *counts = calloc((size_t)E, sizeof(int64_t));
    int64_t *rank_of = malloc((size_t)E * sizeof(int64_t));
    int64_t *order = malloc((size_t)E * sizeof(int64_t));
    int64_t *values = malloc((size_t)k * sizeof(int64_t));
    int64_t *entry_of = malloc((size_t)(rows + 1) * sizeof(int64_t));   /* unique row -> entry, as first seen */
    int64_t *entry_row = malloc((size_t)(rows + 1) * sizeof(int64_t));  /* entry -> its first unique row */
    int64_t *entry_uses = calloc((size_t)rows + 1, sizeof(int64_t));     /* entry -> uses no run covers */
    int64_t *ranks = malloc((size_t)(rows + 1) * sizeof(int64_t));
    uint16_t *entry_gaps = malloc((size_t)(rows + 1) * (size_t)k * sizeof(uint16_t));
    uint64_t *entry_words = malloc((size_t)(rows + 1) * sizeof(uint64_t));
    uint64_t *sampled = malloc((size_t)(rows + 1) * sizeof(uint64_t)); /* words: the sampled first-seen rows */
    uint8_t lookup[256] = {0};                                          /* words: ID -> popularity rank */
    int64_t literals[1024]; /* byte histograms of first-seen rows' gaps: plain [0, 512), ranked after */
    if (!counts || !rank_of || !order || !values || !entry_of || !entry_row || !entry_uses || !ranks || !entry_gaps ||
        !entry_words || !sampled)
        goto done;
    int64_t placed = 0, numbered = 0;
    for (int64_t j = 0; j < layers; j++) {
        int64_t base = placed;
        /* 1. Repeats, the other rows' gaps, and rows that are no valid set. */
        int64_t unique = layer_gaps(x, j, base, numbered);
        int64_t n_unique = unique - base;
        x->layer_unique[j] = n_unique;
        placed = unique;
        numbered += n_unique;
        if (n_unique < rows) x->modes[j] |= 2;
        if (k > E) continue; /* no valid set exists: every row is an exception */
        /* 2. The expert load on a sample of the rows: is it skewed, and which experts are most popular? */
        memset(counts, 0, (size_t)E * sizeof(int64_t));
        int64_t sample = n_unique / LOAD_SAMPLE > 1 ? n_unique / LOAD_SAMPLE : 1;
        for (int64_t i = base; i < unique; i += sample) {
            row_ids(x, i, values);
            for (int64_t c = 0; c < k; c++) counts[values[c]]++;
        }
        int64_t total = 0;
        for (int64_t e = 0; e < E; e++) total += counts[e];
        int skewed = total > 0 && entropy_bits(counts, 0, E) < RANK_BELOW * log2((double)E) * (double)total;
        if (!skewed && n_unique == rows) continue; /* near-uniform sets, no repeats: plain gaps, nothing to match */
        if (skewed) {
            if (popularity(counts, E, rank_of, order) < 0) goto done;
            memset(literals, 0, sizeof(literals));
            if (x->words)
                for (int64_t e = 0; e < E && e < 256; e++) lookup[e] = (uint8_t)rank_of[e];
        }
        /* 3. Rows seen earlier in the layer (zstd matches them, or a dictionary names them), and for a skewed layer
         * both transforms' literals (the gaps of the rows seen first, on a sample of them). */
        if (!seen) {
            seen = malloc(((size_t)1 << hash_bits) * sizeof(int64_t));
            if (!seen) goto done;
            for (int64_t h = 0; h < (1LL << hash_bits); h++) seen[h] = -1;
        }
        int64_t runs = 0, long_runs = 0, run_length = 0, novel = 0, previous_match = -2, n_sampled = 0;
        int64_t to_sample = sample; /* first-seen rows until the next sampled one: every sample-th (no division) */
        int64_t first = numbered - n_unique;
        for (int64_t i = 0; i < n_unique; i++) {
            int64_t at = base + i;
            int64_t h = row_hash(x, at, hash_bits);
            int64_t earlier = seen[h];
            int repeated = earlier >= first && rows_equal(x, base + earlier - first, at);
            seen[h] = first + i; /* unique rows are numbered across layers: an earlier layer's are below first */
            if (repeated) {
                x->matched++;
                entry_of[i] = entry_of[earlier - first];
                if (earlier == previous_match + 1) {
                    run_length++;
                    long_runs += run_length == 2;
                } else {
                    runs++;
                    run_length = 1;
                    entry_uses[entry_of[i]]++;
                }
                previous_match = earlier;
                continue;
            }
            entry_of[i] = novel;
            entry_row[novel] = at;
            entry_uses[novel] = 1;
            previous_match = -2;
            run_length = 0;
            novel++;
            if (--to_sample) continue;
            to_sample = sample;
            if (!skewed) continue;
            if (x->words) { /* counted below, all at once */
                sampled[n_sampled++] = x->gap_words[at];
                continue;
            }
            row_ids(x, at, values); /* the plain gaps' bytes, then the ranked ones' */
            for (int64_t c = 0; c < k; c++) {
                int64_t g = c == 0 ? values[0] : values[c] - values[c - 1] - 1;
                literals[g & 255]++;
                if (!x->words) literals[256 + ((g >> 8) & 255)]++;
            }
            ranked_row(x, at, rank_of, values);
            for (int64_t c = 0; c < k; c++) {
                literals[512 + (values[c] & 255)]++;
                if (!x->words) literals[768 + ((values[c] >> 8) & 255)]++;
            }
        }
        if (n_sampled) { /* the words' plain gaps are their bytes; their ranked gaps come as step 5 makes them */
            count_bytes(sampled, n_sampled, literals);
            map_and_sort_rows(sampled, sampled, n_sampled, lookup, E);
            for (int64_t i = 0; i < n_sampled; i++) sampled[i] = word_gaps(sampled[i]);
            count_bytes(sampled, n_sampled, literals + 512);
        }
        /* 4. A dictionary of the layer's distinct rows when naming them costs less than zstd's matches would. */
        if (novel < n_unique && novel <= MAX_ENTRIES && x->dictionaries != NEVER) {
            if (popularity(entry_uses, novel, ranks, NULL) < 0) goto done;
            if (x->dictionaries == ALWAYS || dictionary_pays(ranks, entry_uses, novel, runs, long_runs)) {
                x->modes[j] |= DICTIONARY;
                x->matched -= n_unique - novel; /* the gaps section keeps no repeats of this layer */
                for (int64_t e = 0; e < novel; e++) {
                    if (x->words)
                        entry_words[ranks[e]] = x->gap_words[entry_row[e]];
                    else
                        memcpy(entry_gaps + ranks[e] * k, x->gaps + entry_row[e] * k, (size_t)k * sizeof(uint16_t));
                }
                if (x->words)
                    memcpy(x->gap_words + base, entry_words, (size_t)novel * sizeof(uint64_t));
                else
                    memcpy(x->gaps + base * k, entry_gaps, (size_t)(novel * k) * sizeof(uint16_t));
                for (int64_t i = 0; i < n_unique; i++) x->indices[first + i] = ranks[entry_of[i]];
                x->entries[j] = novel;
                placed = unique = base + novel;
            }
        }
        for (int64_t e = 0; e < novel; e++) entry_uses[e] = 0;
        if (!skewed) continue;
        double plain = (entropy_bits(literals, 0, 256) + entropy_bits(literals, 256, 512)) * (double)sample / 8 +
                       RUN_BYTES * (double)runs;
        double ranked = (entropy_bits(literals, 512, 768) + entropy_bits(literals, 768, 1024)) * (double)sample / 8 +
                        RUN_BYTES * (double)runs;
        if (ranked >= (1 - MIN_GAIN) * plain) continue;
        /* 5. Relabel by popularity rank: the ranked gaps replace the plain ones, in place. */
        x->modes[j] |= 1;
        for (int64_t e = 0; e < E; e++) x->tables[j * E + e] = order[e];
        if (x->words) { /* every row is a set (exceptions hold a placeholder): lanes mapped to ranks, sorted, gaps */
            uint64_t *rows = x->gap_words + base;
            map_and_sort_rows(rows, rows, unique - base, lookup, E);
            for (int64_t i = 0; i < unique - base; i++) rows[i] = word_gaps(rows[i]);
            continue;
        }
        for (int64_t i = base; i < unique; i++) {
            ranked_row(x, i, rank_of, values);
            set_row(x, i, values);
        }
    }
    x->placed = placed;
    *result = local;
    status = 0;
done:
    free(seen);
    free(counts);
    free(rank_of);
    free(order);
    free(values);
    free(entry_of);
    free(entry_row);
    free(entry_uses);
    free(ranks);
    free(entry_gaps);
    free(entry_words);
    free(sampled);
    return status;
}

/* The rest section's size, then its bytes (FORMAT.md section 5): bitmaps, tables, dictionaries, exceptions, the
 * layers' modes, the gaps section's rows, the exceptions' count, the payload version. */
static int64_t rest_size(const Encoding *x) {
    int64_t per_bitmap = (x->rows + 7) / 8;
    int64_t size = x->layers + 9 + x->n_exceptions * (4 + x->k * x->itemsize);
    for (int64_t j = 0; j < x->layers; j++) {
        size += per_bitmap * ((x->modes[j] >> 1) & 1) + x->num_experts * x->itemsize * (x->modes[j] & 1);
        if (x->modes[j] & DICTIONARY) size += 4 + x->layer_unique[j] * (1 + (x->entries[j] > 256));
    }
    return size;
}

static void write_rest(const Encoding *x, uint8_t *rest) {
    int64_t per_bitmap = (x->rows + 7) / 8, at = 0, layers = x->layers, k = x->k, rows = x->rows;
    int itemsize = x->itemsize;
    for (int64_t j = 0; j < layers; j++)
        if (x->modes[j] & 2) {
            memcpy(rest + at, x->bitmaps + j * per_bitmap, (size_t)per_bitmap);
            at += per_bitmap;
        }
    for (int64_t j = 0; j < layers; j++)
        if (x->modes[j] & 1)
            for (int64_t e = 0; e < x->num_experts; e++) at = put_le(rest, at, x->tables[j * x->num_experts + e], itemsize);
    int64_t numbered = 0;
    int version = 1; /* a chunk without dictionaries stays readable by format-2 readers that predate them */
    for (int64_t j = 0; j < layers; j++) {
        if (x->modes[j] & DICTIONARY) {
            version = 2;
            at = put_le(rest, at, x->entries[j], 4);
            int64_t n = x->layer_unique[j];
            for (int64_t i = 0; i < n; i++) rest[at + i] = (uint8_t)(x->indices[numbered + i] & 255);
            at += n;
            if (x->entries[j] > 256) {
                for (int64_t i = 0; i < n; i++) rest[at + i] = (uint8_t)(x->indices[numbered + i] >> 8);
                at += n;
            }
        }
        numbered += x->layer_unique[j];
    }
    for (int64_t n = 0; n < x->n_exceptions; n++) {
        at = put_le(rest, at, x->exceptions[2 * n], 4);
        int64_t flat = x->exceptions[2 * n + 1]; /* layer * R + row */
        const uint8_t *row = x->ids + (flat / x->rows) * x->layer_stride + (flat % x->rows) * k * itemsize;
        for (int64_t c = 0; c < k; c++) at = put_le(rest, at, load_id(row + c * itemsize, itemsize), itemsize);
    }
    (void)rows;
    memcpy(rest + at, x->modes, (size_t)layers);
    at = put_le(rest, at + layers, x->placed, 4);
    at = put_le(rest, at, x->n_exceptions, 4);
    rest[at] = (uint8_t)version;
}

static int get_ids(PyObject *obj, Py_buffer *view, int flags, int ndim, const char *name) {
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->ndim != ndim || (view->itemsize != 1 && view->itemsize != 2)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a %d-D uint8 or uint16 array", name, ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *encode_chunk(PyObject *self, PyObject *args) {
    PyObject *ids_obj;
    long long num_experts;
    int dictionaries, allow_words = 1; /* allow_words 0: rows of eight uint8 IDs one ID at a time (tests) */
    if (!PyArg_ParseTuple(args, "OLi|p", &ids_obj, &num_experts, &dictionaries, &allow_words)) return NULL;
    Py_buffer view;
    if (get_ids(ids_obj, &view, PyBUF_STRIDES | PyBUF_FORMAT, 3, "ids") < 0) return NULL;
    Encoding x = {0};
    x.ids = view.buf;
    x.layers = view.shape[0];
    x.rows = view.shape[1];
    x.k = view.shape[2];
    x.itemsize = (int)view.itemsize;
    x.layer_stride = view.strides[0];
    x.num_experts = num_experts;
    x.dictionaries = dictionaries;
    x.words = allow_words && x.itemsize == 1 && x.k == 8;
    PyObject *result = NULL;
    uint8_t *aligned_ids = NULL;
    int64_t row_bytes = x.k * x.itemsize;
    /* A chunk is read in place from the writer's part (a block of its layers): each layer's rows contiguous, the
     * layers apart, never overlapping. */
    if (view.strides[2] != x.itemsize || view.strides[1] != row_bytes ||
        (x.layers > 1 && x.layer_stride < x.rows * row_bytes)) {
        PyErr_SetString(PyExc_ValueError, "encode_chunk: ids must hold each layer's rows contiguous");
        goto fail;
    }
    if (x.words && (((uintptr_t)x.ids % 8) || (x.layer_stride % 8))) { /* the word passes read aligned rows */
        aligned_ids = malloc((size_t)(x.layers * x.rows * 8 + 8));
        if (!aligned_ids) {
            PyErr_NoMemory();
            goto fail;
        }
        for (int64_t j = 0; j < x.layers; j++)
            memcpy(aligned_ids + j * x.rows * 8, x.ids + j * x.layer_stride, (size_t)(x.rows * 8));
        x.ids = aligned_ids;
        x.layer_stride = x.rows * 8;
    }
    int64_t n = x.layers * x.rows, per_bitmap = (x.rows + 7) / 8;
    if (num_experts < 1 || x.k < 1) {
        PyErr_SetString(PyExc_ValueError, "encode_chunk: num_experts and K must be positive");
        goto fail;
    }
    if (x.words)
        x.gap_words = malloc((size_t)(n + 1) * sizeof(uint64_t));
    else
        x.gaps = malloc((size_t)(n + 1) * (size_t)x.k * sizeof(uint16_t));
    x.bitmaps = calloc((size_t)(x.layers * per_bitmap + 1), 1);
    x.modes = calloc((size_t)x.layers + 1, 1);
    x.tables = malloc((size_t)(x.layers * num_experts + 1) * sizeof(int64_t));
    x.exceptions = malloc((size_t)(2 * n + 1) * sizeof(int64_t));
    x.layer_unique = calloc((size_t)x.layers + 1, sizeof(int64_t));
    x.entries = calloc((size_t)x.layers + 1, sizeof(int64_t));
    x.indices = malloc((size_t)(n + 1) * sizeof(int64_t));
    x.flags = malloc((size_t)x.rows + 1);
    if ((!x.gap_words && !x.gaps) || !x.bitmaps || !x.modes || !x.tables || !x.exceptions || !x.layer_unique ||
        !x.entries || !x.indices || !x.flags) {
        PyErr_NoMemory();
        goto fail;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS status = transform(&x);
    Py_END_ALLOW_THREADS if (status < 0) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t section_size = x.placed * x.k * x.itemsize;
    PyObject *section = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)section_size);
    PyObject *rest = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)rest_size(&x));
    if (!section || !rest) {
        Py_XDECREF(section);
        Py_XDECREF(rest);
        goto fail;
    }
    uint8_t *s = (uint8_t *)PyBytes_AS_STRING(section);
    if (x.words) {
        for (int64_t i = 0; i < x.placed; i++) store64(s + 8 * i, x.gap_words[i]);
    } else if (x.itemsize == 1) {
        for (int64_t i = 0; i < x.placed * x.k; i++) s[i] = (uint8_t)x.gaps[i];
    } else { /* byte planes: zstd fits one entropy table per plane */
        int64_t m = x.placed * x.k;
        for (int64_t i = 0; i < m; i++) {
            s[i] = (uint8_t)(x.gaps[i] & 255);
            s[m + i] = (uint8_t)(x.gaps[i] >> 8);
        }
    }
    write_rest(&x, (uint8_t *)PyBytes_AS_STRING(rest));
    result = Py_BuildValue("NNLL", section, rest, (long long)x.placed, (long long)x.matched);
fail:
    free(x.gaps);
    free(x.gap_words);
    free(x.bitmaps);
    free(x.modes);
    free(x.tables);
    free(x.exceptions);
    free(x.layer_unique);
    free(x.entries);
    free(x.indices);
    free(x.flags);
    free(aligned_ids);
    PyBuffer_Release(&view);
    return result;
}

/* -- decoding ------------------------------------------------------------------------------------------------- */
typedef struct {
    const uint8_t *gap_bytes, *rest;
    int64_t gap_size, rest_size, num_experts, layers, rows, k;
    uint8_t *out; /* [Lw, Rw, K]: each layer's rows contiguous, layers layer_stride bytes apart */
    int64_t window_layers, window_rows, layer_stride, first_layer, first_row;
    int itemsize, words, accept;
    int64_t fill_value;
} Decoding;

static inline uint8_t *out_row(const Decoding *d, int64_t jw, int64_t r) {
    return d->out + jw * d->layer_stride + r * d->k * d->itemsize;
}

static inline int repeat_bit(const uint8_t *bits, int64_t nbits, int64_t row) {
    if (nbits == 0 || row >> 3 >= nbits) return 0;
    return (bits[row >> 3] >> (7 - (row & 7))) & 1;
}

static inline int64_t repeats_before(const uint8_t *bits, int64_t nbits, int64_t row) {
    if (nbits == 0) return 0;
    int64_t count = 0;
    for (int64_t byte = 0; byte < (row >> 3); byte++) count += popcount8(bits[byte]);
    if ((row & 7) && (row >> 3) < nbits) count += popcount8(bits[row >> 3] & ((0xFF00 >> (row & 7)) & 0xFF));
    return count;
}

/* Unique row u's IDs into values, one at a time: the gaps' prefix sums (wrapping in the IDs' width; high: where
 * the high-byte plane starts, 0 for uint8), and in a ranked layer the table's IDs sorted. Returns -1 for a rank
 * past the table, 1 when the prefix sums ascend below E without wrapping, else 0. */
static inline int decode_row(const Decoding *d, int64_t u, int64_t high, int64_t wrap, const int64_t *table, int ranked,
                      int64_t *values) {
    int64_t k = d->k, x = 0, last = 0;
    for (int64_t c = 0; c < k; c++) {
        int64_t g = d->gap_bytes[u * k + c];
        if (high) g |= (int64_t)d->gap_bytes[high + u * k + c] << 8;
        last += g + (c > 0);
        x = (x + g + (c > 0)) & wrap;
        values[c] = x;
    }
    if (ranked) {
        for (int64_t c = 0; c < k; c++) {
            if (values[c] >= d->num_experts) return -1;
            values[c] = table[values[c]];
        }
        sort_values(values, k);
    }
    return last < d->num_experts && last <= wrap ? 1 : 0;
}

/* Rows first.. of the gaps section (eight uint8 IDs each) as ID words into out[0:n]: prefix sums, and in a ranked
 * layer the table's IDs sorted. Returns -1 for a rank past the table, 1 when every row's values (IDs, or ranks)
 * are strictly ascending and below E, else 0. */
static inline int decode_words(const Decoding *d, int64_t first, uint64_t *out, int64_t n, int ranked, const int64_t *table,
                        int64_t *values) {
    const uint64_t *words = (const uint64_t *)d->gap_bytes + first;
    int64_t E = d->num_experts;
    if (!ranked) {
        ids_from_gaps(words, out, n);
        return gaps_past(words, n, E) ? 0 : 1;
    }
    uint8_t lookup[256];
    for (int v = 0; v < 256; v++) lookup[v] = v < E ? (uint8_t)(table[v] & 255) : 0;
    if (map_and_sort_rows(words, out, n, lookup, E)) return 1;
    /* a row of ranks that is no set (damage): row by row, one ID at a time where needed */
    int64_t mapped[256];
    for (int v = 0; v < 256; v++) mapped[v] = v < E ? table[v] : 256;
    for (int64_t i = 0; i < n; i++) {
        uint64_t word;
        if (!sorted_lanes(word_ids(words[i]), mapped, E <= 64, &word)) {
            if (decode_row(d, first + i, 0, 255, table, 1, values) < 0) return -1;
            word = 0;
            for (int c = 0; c < 8; c++) word |= (uint64_t)(values[c] & 255) << (8 * c);
        }
        out[i] = word;
    }
    return 0;
}

/* out[i] = the entry of unique row lo + i, for i < n; 1 when an index is past the n_entries entries (those read as
 * the last entry). entries has room for 256 at least: with one-byte indices its tail repeats the last entry, so
 * the loop indexes without a clamp. */
static inline int gather_entries(const Decoding *d, int64_t at, int64_t n_unique, int64_t lo, uint64_t *restrict entries,
                                 int64_t n_entries, uint64_t *restrict out, int64_t n) {
    const uint8_t *restrict low = d->rest + at + lo;
    int64_t last = n_entries - 1, largest = 0;
    if (n_entries <= 256) {
        for (int64_t e = n_entries; e < 256; e++) entries[e] = entries[last];
        uint8_t top = 0;
        for (int64_t i = 0; i < n; i++) {
            uint8_t e = low[i];
            top = e > top ? e : top;
            out[i] = entries[e];
        }
        return top > last;
    }
    const uint8_t *restrict high = d->rest + at + n_unique + lo;
    for (int64_t i = 0; i < n; i++) {
        int64_t e = (int64_t)low[i] | (int64_t)high[i] << 8;
        largest = e > largest ? e : largest;
        out[i] = entries[e < last ? e : last];
    }
    return largest > last;
}

static inline int64_t entry_index(const Decoding *d, int64_t at, int64_t n_unique, int64_t n_entries, int64_t i) {
    int64_t e = d->rest[at + i];
    if (n_entries > 256) e |= (int64_t)d->rest[at + n_unique + i] << 8;
    return e;
}

/* TAKEN[b][p]: of the rows a bitmap byte b covers (its first row in the high bit; a set bit: the row repeats the
 * one before it), how many up to and including row p are not repeats, less one. Filled when the module loads. */
static int8_t TAKEN[256][8];

static void fill_taken(void) {
    for (int b = 0; b < 256; b++) {
        int count = 0;
        for (int p = 0; p < 8; p++) {
            count += !((b >> (7 - p)) & 1);
            TAKEN[b][p] = (int8_t)(count - 1);
        }
    }
}

/* Row r of expand_repeats alone (before the first whole bitmap byte, after the last): returns i after it. */
static inline int64_t expand_row(const uint8_t *bits, const uint64_t *restrict unique_rows, int64_t last,
                                 uint64_t *restrict out, int64_t r, int64_t first_row, int64_t i) {
    int64_t row = first_row + r;
    int64_t repeat = (bits[row >> 3] >> (7 - (row & 7))) & 1;
    int64_t at = i - repeat;
    out[r] = unique_rows[at < last ? at : last];
    return i + 1 - repeat;
}

/* Rows first_row.. of a layer into layer (words, n of them), from the unique rows they expand from (the first one
 * the row before first_row, when starts_repeat) and the repeat bitmap: a repeat keeps the row before it. */
static inline void expand_repeats(const uint8_t *bits, const uint64_t *restrict unique_rows, int64_t n_unique_rows,
                                  uint8_t *layer, int64_t n, int64_t first_row, int starts_repeat) {
    int64_t last = n_unique_rows - 1; /* the counts were checked: the clamp only keeps damage inside the array */
    if (last < 0) last = 0;
    int64_t i = starts_repeat; /* the unique rows taken so far */
    uint64_t *restrict out = (uint64_t *)layer;
    /* Branch-free, as an index rather than a select (which compilers turn into a branch): repeats fall anywhere,
     * and a branch on them mispredicts. Row r takes unique row i + (rows up to r that are no repeat) - 1: the
     * next one, or for a repeat the one taken last (at the first row, only when it starts on a repeat: i is 1).
     * Whole bitmap bytes take their eight counts from TAKEN, so no row waits for the one before it. */
    int64_t r = 0;
    for (; r < n && ((first_row + r) & 7); r++) i = expand_row(bits, unique_rows, last, out, r, first_row, i);
    for (; r + 8 <= n; r += 8) {
        uint8_t byte = bits[(first_row + r) >> 3];
        const int8_t *taken = TAKEN[byte];
        for (int p = 0; p < 8; p++) {
            int64_t at = i + taken[p];
            at = at < 0 ? 0 : at;
            out[r + p] = unique_rows[at < last ? at : last];
        }
        i += taken[7] + 1;
    }
    for (; r < n; r++) i = expand_row(bits, unique_rows, last, out, r, first_row, i);
}

static inline int row_valid(const Decoding *d, int64_t jw, int64_t r) {
    const uint8_t *row = out_row(d, jw, r);
    int itemsize = d->itemsize;
    int valid = load_id(row + (d->k - 1) * itemsize, itemsize) < d->num_experts;
    for (int64_t c = 1; c < d->k; c++) valid &= load_id(row + c * itemsize, itemsize) > load_id(row + (c - 1) * itemsize, itemsize);
    return valid;
}

/* Overwrite the exceptions' unique rows (the last listing of a row wins) and the repeats that follow them, where
 * they fall in the window; mark them in written [Lw, Rw]. Returns -1 when out of memory. */
static inline int apply_exceptions(const Decoding *d, int64_t trailer, int64_t per_bitmap, int64_t listed,
                            int64_t n_exceptions, uint8_t *written) {
    int64_t k = d->k, rows = d->rows, entry = 4 + k * d->itemsize;
    int64_t *exception_of = malloc((size_t)(rows * d->layers + 1) * sizeof(int64_t));
    if (!exception_of) return -1;
    for (int64_t i = 0; i < rows * d->layers; i++) exception_of[i] = -1;
    for (int64_t n = 0; n < n_exceptions; n++) exception_of[get_le(d->rest, listed + n * entry, 4)] = n;
    int64_t u = 0, bitmap = -per_bitmap;
    for (int64_t j = 0; j < d->layers; j++) {
        int repeats = d->rest[trailer + j] & 2;
        bitmap += repeats ? per_bitmap : 0;
        int64_t jw = j - d->first_layer;
        int inside = 0 <= jw && jw < d->window_layers;
        int64_t listed_row = -1;
        for (int64_t r = 0; r < rows; r++) {
            if (!(repeats && ((d->rest[bitmap + (r >> 3)] >> (7 - (r & 7))) & 1))) listed_row = exception_of[u++];
            if (listed_row >= 0 && inside && d->first_row <= r && r < d->first_row + d->window_rows) {
                written[jw * d->window_rows + r - d->first_row] = 1;
                uint8_t *row = out_row(d, jw, r - d->first_row);
                for (int64_t c = 0; c < k; c++)
                    store_id(row + c * d->itemsize, d->itemsize,
                             get_le(d->rest, listed + listed_row * entry + 4 + c * d->itemsize, d->itemsize));
            }
        }
    }
    free(exception_of);
    return 0;
}

/* The first row of the window (jw * Rw + r) that is no set of K ascending IDs below E, or -1; layers proven valid
 * while decoding are skipped unless an exception wrote some row; a row an exception wrote holding only fill is
 * accepted (fill -1: none is). */
static inline int64_t first_invalid_in_window(const Decoding *d, int64_t fill, const uint8_t *written, const uint8_t *proven) {
    for (int64_t jw = 0; jw < d->window_layers; jw++) {
        int any_written = 0;
        if (written)
            for (int64_t r = 0; r < d->window_rows; r++) any_written |= written[jw * d->window_rows + r];
        if (proven[jw] && !any_written) continue;
        for (int64_t r = 0; r < d->window_rows; r++) {
            if (row_valid(d, jw, r)) continue;
            if (fill < 0 || !written || !written[jw * d->window_rows + r]) return jw * d->window_rows + r;
            const uint8_t *row = out_row(d, jw, r);
            for (int64_t c = 0; c < d->k; c++)
                if (load_id(row + c * d->itemsize, d->itemsize) != fill) return jw * d->window_rows + r;
        }
    }
    return -1;
}

typedef struct {
    int64_t status, detail;
} Result;

#define FAIL(s, x)          \
    do {                    \
        result.status = (s); \
        result.detail = (x); \
        goto done;          \
    } while (0)

static Result decode(const Decoding *given) {
    const Decoding local = *given; /* a local copy: stores to out cannot change its fields */
    const Decoding *d = &local;
    Result result = {OK, 0};
    const uint8_t *rest = d->rest;
    int64_t layers = d->layers, rows = d->rows, k = d->k, E = d->num_experts, itemsize = d->itemsize;
    int64_t trailer = d->rest_size - layers - 9;
    int known_modes = rest[d->rest_size - 1] >= 2 ? 7 : 3; /* dictionaries came with payload version 2 */
    int64_t *layer_unique = malloc((size_t)(layers + 1) * sizeof(int64_t));
    int64_t *layer_stored = malloc((size_t)(layers + 1) * sizeof(int64_t));
    int64_t *index_at = calloc((size_t)layers + 1, sizeof(int64_t));
    uint8_t *proven = calloc((size_t)d->window_layers + 1, 1);
    uint8_t *seen = malloc((size_t)E + 1);
    int64_t *table = malloc((size_t)(E + 1) * sizeof(int64_t));
    int64_t *values = malloc((size_t)(k + 8) * sizeof(int64_t));
    uint64_t *decoded = NULL, *entry_words = NULL;
    uint8_t *written = NULL;
    if (!layer_unique || !layer_stored || !index_at || !proven || !seen || !table || !values) FAIL(-1, 0);
    /* The rest section: its parts must add up to its size, and its indices stay inside the chunk. */
    int64_t n_bitmaps = 0, n_tables = 0;
    for (int64_t j = 0; j < layers; j++) {
        int mode = rest[trailer + j];
        if (mode & ~known_modes) FAIL(UNKNOWN_MODE, mode);
        n_bitmaps += (mode >> 1) & 1;
        n_tables += mode & 1;
    }
    int64_t total = get_le(rest, d->rest_size - 9, 4);
    int64_t n_exceptions = get_le(rest, d->rest_size - 5, 4);
    int64_t per_bitmap = (rows + 7) / 8;
    int64_t tables = n_bitmaps * per_bitmap;
    int64_t listed = tables + n_tables * E * itemsize;
    if (listed > trailer) FAIL(SECTION_SIZES, listed + layers + 9);
    int64_t bitmap = 0;
    for (int64_t j = 0; j < layers; j++) {
        layer_unique[j] = rows;
        if (rest[trailer + j] & 2) {
            if (rows && (rest[bitmap] & 0x80)) FAIL(FIRST_ROW_REPEATS, j);
            for (int64_t byte = 0; byte < per_bitmap; byte++) {
                uint64_t bits = rest[bitmap + byte];
                if (byte == rows >> 3) bits &= (0xFF00 >> (rows & 7)) & 0xFF;
                layer_unique[j] -= popcount8(bits);
            }
            bitmap += per_bitmap;
        }
    }
    int64_t largest_dictionary = 0;
    for (int64_t j = 0; j < layers; j++) {
        layer_stored[j] = layer_unique[j]; /* rows of the gaps section: unique rows, or a dictionary's entries */
        if (rest[trailer + j] & DICTIONARY) {
            if (listed + 4 > trailer) FAIL(SECTION_SIZES, listed + 4 + layers + 9);
            layer_stored[j] = get_le(rest, listed, 4);
            if (layer_stored[j] > layer_unique[j] || (layer_stored[j] == 0) != (layer_unique[j] == 0))
                FAIL(DICTIONARY_SIZE, j);
            index_at[j] = listed + 4;
            listed += 4 + layer_unique[j] * (1 + (layer_stored[j] > 256));
            largest_dictionary = layer_stored[j] > largest_dictionary ? layer_stored[j] : largest_dictionary;
        }
    }
    int64_t entry = 4 + k * itemsize;
    if (listed + n_exceptions * entry != trailer) FAIL(SECTION_SIZES, listed + n_exceptions * entry + layers + 9);
    int64_t stored = 0, unique = 0;
    for (int64_t j = 0; j < layers; j++) {
        stored += layer_stored[j];
        unique += layer_unique[j];
    }
    if (stored != total) FAIL(UNIQUE_COUNT, stored);
    if (d->gap_size != total * k * itemsize) FAIL(-2, 0);
    for (int64_t n = 0; n < n_exceptions; n++)
        if (get_le(rest, listed + n * entry, 4) >= unique) FAIL(EXCEPTION_RANGE, n);
    /* The window's rows, layer by layer. */
    if (d->words) {
        decoded = malloc((size_t)(d->window_rows + 1) * sizeof(uint64_t)); /* unique rows the window expands from */
        /* a dictionary's entries; at least 256 (gather_entries) */
        entry_words = malloc((size_t)((largest_dictionary > 256 ? largest_dictionary : 256) + 1) * sizeof(uint64_t));
        if (!decoded || !entry_words) FAIL(-1, 0);
    }
    int64_t high = itemsize == 2 ? total * k : 0; /* where the high-byte plane starts */
    int64_t wrap = (1LL << (8 * itemsize)) - 1;
    int64_t stop_row = d->first_row + d->window_rows;
    int64_t u = 0;
    bitmap = -per_bitmap;
    int64_t ranked_at = tables - E * itemsize;
    for (int64_t j = 0; j < layers; j++) {
        int mode = rest[trailer + j];
        bitmap += mode & 2 ? per_bitmap : 0;
        ranked_at += mode & 1 ? E * itemsize : 0;
        int64_t start = u;
        u += layer_stored[j];
        int64_t jw = j - d->first_layer;
        if (jw < 0 || jw >= d->window_layers || d->window_rows == 0) continue;
        const uint8_t *bits = rest + bitmap;
        int64_t nbits = mode & 2 ? per_bitmap : 0;
        int permutation = 1; /* the table maps ranks to distinct IDs in [0, E): valid ranks give valid rows */
        if (mode & 1) {
            memset(seen, 0, (size_t)E);
            for (int64_t e = 0; e < E; e++) {
                table[e] = get_le(rest, ranked_at + e * itemsize, (int)itemsize);
                int64_t at = table[e] < E - 1 ? table[e] : E - 1;
                permutation &= table[e] < E && !seen[at];
                seen[at] = 1;
            }
        }
        int64_t n_entries = mode & DICTIONARY ? layer_stored[j] : 0;
        /* The layer's unique rows [lo, hi) that the window's rows expand from: from the one the first row repeats
         * (when it is a repeat) to the last one at or before the last row. */
        int starts_repeat = repeat_bit(bits, nbits, d->first_row);
        int64_t lo = d->first_row - repeats_before(bits, nbits, d->first_row) - starts_repeat;
        int64_t hi = stop_row - repeats_before(bits, nbits, stop_row);
        if (d->words) {
            uint8_t *layer = out_row(d, jw, 0);
            if (mode == 0) { /* plain, no repeats: straight into the output */
                const uint64_t *source = (const uint64_t *)d->gap_bytes + start + lo;
                ids_from_gaps(source, (uint64_t *)layer, d->window_rows);
                proven[jw] = !gaps_past(source, hi - lo, E);
                continue;
            }
            uint64_t *rows_of_gaps = n_entries ? entry_words : decoded;
            int64_t n_rows = n_entries ? n_entries : hi - lo;
            int status = decode_words(d, n_entries ? start : start + lo, rows_of_gaps, n_rows, mode & 1, table, values);
            if (status < 0) FAIL(RANK_RANGE, j);
            proven[jw] = status == 1 && permutation;
            if (n_entries && gather_entries(d, index_at[j], layer_unique[j], lo, entry_words, n_entries, decoded, hi - lo))
                FAIL(DICTIONARY_INDEX, j);
            if (!(mode & 2)) {
                memcpy(layer, decoded, (size_t)d->window_rows * 8);
                continue;
            }
            expand_repeats(bits, decoded, hi - lo, layer, d->window_rows, d->first_row, starts_repeat);
            continue;
        }
        int64_t next_unique = lo; /* one ID at a time: values holds the row a repeat keeps */
        int ascending = 1;        /* every row decoded: prefix sums that ascend below E */
        for (int64_t r = -starts_repeat; r < d->window_rows; r++) {
            if (r < 0 || !repeat_bit(bits, nbits, d->first_row + r)) {
                int64_t row = start + next_unique;
                if (n_entries) {
                    int64_t e = entry_index(d, index_at[j], layer_unique[j], n_entries, next_unique);
                    if (e >= n_entries) FAIL(DICTIONARY_INDEX, j);
                    row = start + e;
                }
                int status = decode_row(d, row, high, wrap, table, mode & 1, values);
                if (status < 0) FAIL(RANK_RANGE, j);
                ascending &= status == 1;
                next_unique++;
            }
            if (r >= 0) {
                uint8_t *out = out_row(d, jw, r);
                for (int64_t c = 0; c < k; c++) store_id(out + c * itemsize, (int)itemsize, values[c]);
            }
        }
        proven[jw] = ascending && permutation;
    }
    if (n_exceptions) {
        written = calloc((size_t)(d->window_layers * d->window_rows + 1), 1);
        if (!written || apply_exceptions(d, trailer, per_bitmap, listed, n_exceptions, written) < 0) FAIL(-1, 0);
    }
    if (d->accept != ANY_ROWS) {
        int64_t fill = d->accept == SETS_OR_FILL ? d->fill_value : -1;
        int64_t bad = first_invalid_in_window(d, fill, written, proven);
        if (bad >= 0) FAIL(INVALID_ROW, bad);
    }
done:
    free(layer_unique);
    free(layer_stored);
    free(index_at);
    free(proven);
    free(seen);
    free(table);
    free(values);
    free(decoded);
    free(entry_words);
    free(written);
    return result;
}

static PyObject *decode_chunk(PyObject *self, PyObject *args) {
    PyObject *gap_obj, *rest_obj, *out_obj;
    long long num_experts, layers, rows, first_layer, first_row, fill_value;
    int accept, allow_words = 1; /* allow_words 0: rows of eight uint8 IDs one ID at a time (tests) */
    if (!PyArg_ParseTuple(args, "OOLLLOLLiL|p", &gap_obj, &rest_obj, &num_experts, &layers, &rows, &out_obj,
                          &first_layer, &first_row, &accept, &fill_value, &allow_words))
        return NULL;
    Py_buffer gaps, rest, out;
    if (PyObject_GetBuffer(gap_obj, &gaps, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(rest_obj, &rest, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&gaps);
        return NULL;
    }
    if (get_ids(out_obj, &out, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE, 3, "out") < 0) {
        PyBuffer_Release(&gaps);
        PyBuffer_Release(&rest);
        return NULL;
    }
    PyObject *answer = NULL;
    Decoding d = {0};
    d.gap_bytes = gaps.buf;
    d.gap_size = gaps.len;
    d.rest = rest.buf;
    d.rest_size = rest.len;
    d.num_experts = num_experts;
    d.layers = layers;
    d.rows = rows;
    d.out = out.buf;
    d.window_layers = out.shape[0];
    d.window_rows = out.shape[1];
    d.k = out.shape[2];
    d.itemsize = (int)out.itemsize;
    d.layer_stride = out.strides[0];
    d.first_layer = first_layer;
    d.first_row = first_row;
    d.accept = accept;
    d.fill_value = fill_value;
    d.words = allow_words && d.itemsize == 1 && d.k == 8;
    int rows_contiguous = out.strides[2] == out.itemsize && out.strides[1] == d.k * out.itemsize;
    if (num_experts < 1 || d.k < 1 || layers < 0 || rows < 0 || !rows_contiguous || d.rest_size < layers + 9 ||
        first_layer < 0 || first_row < 0 || first_layer + d.window_layers > layers || first_row + d.window_rows > rows ||
        (d.window_layers > 1 && d.layer_stride < d.window_rows * d.k * d.itemsize && d.window_rows)) {
        PyErr_SetString(PyExc_ValueError, "decode_chunk: a window outside the chunk, or a layout it does not take");
        goto release;
    }
    /* The word passes read and write 8-byte aligned rows: a misaligned section or window goes through a copy. */
    uint8_t *gap_copy = NULL, *out_copy = NULL, *out_given = d.out;
    int64_t stride_given = d.layer_stride;
    if (d.words && ((uintptr_t)d.gap_bytes % 8)) {
        gap_copy = malloc((size_t)d.gap_size + 8);
        if (!gap_copy) {
            PyErr_NoMemory();
            goto release;
        }
        memcpy(gap_copy, d.gap_bytes, (size_t)d.gap_size);
        d.gap_bytes = gap_copy;
    }
    if (d.words && (((uintptr_t)d.out % 8) || (d.layer_stride % 8))) {
        out_copy = malloc((size_t)(d.window_layers * d.window_rows * 8 + 8));
        if (!out_copy) {
            free(gap_copy);
            PyErr_NoMemory();
            goto release;
        }
        for (int64_t jw = 0; jw < d.window_layers; jw++)
            memcpy(out_copy + jw * d.window_rows * 8, out_given + jw * stride_given, (size_t)(d.window_rows * 8));
        d.out = out_copy;
        d.layer_stride = d.window_rows * 8;
    }
    Result result;
    Py_BEGIN_ALLOW_THREADS result = decode(&d);
    Py_END_ALLOW_THREADS if (out_copy) {
        for (int64_t jw = 0; jw < d.window_layers; jw++)
            memcpy(out_given + jw * stride_given, out_copy + jw * d.window_rows * 8, (size_t)(d.window_rows * 8));
    }
    free(gap_copy);
    free(out_copy);
    if (result.status == -1) {
        PyErr_NoMemory();
        goto release;
    }
    if (result.status == -2) {
        PyErr_SetString(PyExc_ValueError, "decode_chunk: the gaps section is not the trailer's rows of gaps");
        goto release;
    }
    answer = Py_BuildValue("LL", (long long)result.status, (long long)result.detail);
release:
    PyBuffer_Release(&gaps);
    PyBuffer_Release(&rest);
    PyBuffer_Release(&out);
    return answer;
}

/* -- sorting and checking rows -------------------------------------------------------------------------------- */
static PyObject *sort_rows_of_eight(PyObject *self, PyObject *args) {
    PyObject *ids_obj, *out_obj;
    long long tokens, layers, largest;
    if (!PyArg_ParseTuple(args, "OOLLL", &ids_obj, &out_obj, &tokens, &layers, &largest)) return NULL;
    Py_buffer ids, out;
    if (get_ids(ids_obj, &ids, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, 1, "ids") < 0) return NULL;
    if (get_ids(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE, 1, "out") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    PyObject *answer = NULL;
    int itemsize = (int)ids.itemsize;
    if (out.itemsize != itemsize || ids.shape[0] != tokens * layers * 8 || out.shape[0] != tokens * layers * 8 ||
        (uintptr_t)out.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "sort_rows_of_eight: ids and out (8-byte aligned) must hold tokens x layers rows of eight");
        goto release;
    }
    int64_t bad = -1;
    size_t row_bytes = (size_t)8 * itemsize;
    /* Rows of uint16 IDs (uint8 ones go straight to their places: sort_rows_u8_by_layer): a block of tokens (every
     * layer: contiguous in ids, small enough for the first-level cache) is sorted in a
     * scratch buffer by the vectorized network, then each layer's rows of the block move to their place in out. */
    int64_t block = layers > 0 ? 2048 / layers : 0;
    block = block < 16 ? 16 : block;
    uint8_t *scratch = malloc((size_t)(block * layers) * row_bytes + 16);
    if (!scratch) {
        PyErr_NoMemory();
        goto release;
    }
    Py_BEGIN_ALLOW_THREADS const uint8_t *src = ids.buf;
    uint8_t *dst = out.buf;
    int wrong = 0;
#if defined(__SSE2__)
    if (itemsize == 1) /* sorted straight from the token rows into their layer's place */
        wrong = sort_rows_u8_by_layer(src, dst, tokens, layers, (uint8_t)(largest > 255 ? 255 : largest));
    else
#endif
    for (int64_t t0 = 0; t0 < tokens; t0 += block) {
        int64_t n = tokens - t0 < block ? tokens - t0 : block;
        memcpy(scratch, src + t0 * layers * row_bytes, (size_t)(n * layers) * row_bytes);
        if (itemsize == 1)
            wrong |= sort_rows_u8(scratch, n * layers, (uint8_t)(largest > 255 ? 255 : largest));
        else
            wrong |= sort_rows_u16((uint16_t *)scratch, n * layers, (uint16_t)(largest > 65535 ? 65535 : largest));
        for (int64_t j = 0; j < layers; j++) { /* rows as whole words: one (uint8) or two (uint16) per row */
            uint64_t *to = (uint64_t *)(dst + (j * tokens + t0) * row_bytes);
            const uint64_t *from = (const uint64_t *)scratch + j * itemsize;
            if (itemsize == 1) {
                for (int64_t t = 0; t < n; t++) to[t] = from[t * layers];
            } else {
                for (int64_t t = 0; t < n; t++) {
                    to[2 * t] = from[2 * t * layers];
                    to[2 * t + 1] = from[2 * t * layers + 1];
                }
            }
        }
    }
    for (int64_t t = 0; wrong && t < tokens && bad < 0; t++) /* the rare case: the first bad row, token order */
        for (int64_t j = 0; j < layers && bad < 0; j++) {
            const uint8_t *row = dst + (j * tokens + t) * row_bytes;
            int w = load_id(row + 7 * itemsize, itemsize) > largest;
            for (int c = 1; c < 8; c++) w |= load_id(row + c * itemsize, itemsize) == load_id(row + (c - 1) * itemsize, itemsize);
            if (w) bad = t * layers + j;
        }
    Py_END_ALLOW_THREADS free(scratch);
    answer = PyLong_FromLongLong(bad);
release:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return answer;
}

static PyObject *first_invalid_row(PyObject *self, PyObject *args) {
    PyObject *ids_obj;
    long long num_experts;
    int ascending;
    if (!PyArg_ParseTuple(args, "OLp", &ids_obj, &num_experts, &ascending)) return NULL;
    Py_buffer ids;
    if (get_ids(ids_obj, &ids, PyBUF_STRIDES | PyBUF_FORMAT, 3, "ids") < 0) return NULL;
    int64_t layers = ids.shape[0], rows = ids.shape[1], k = ids.shape[2], bad = -1;
    int itemsize = (int)ids.itemsize;
    /* Sorted rows of eight uint8 IDs, each layer's rows contiguous and 8-byte aligned: a pass over words per layer
     * that vectorizes, and only a layer with a bad row looks for which. */
    int words = ascending && itemsize == 1 && k == 8 && ids.strides[2] == 1 && ids.strides[1] == 8 &&
                ids.strides[0] % 8 == 0 && (uintptr_t)ids.buf % 8 == 0;
    Py_BEGIN_ALLOW_THREADS const uint8_t *base = ids.buf;
    for (int64_t j = 0; j < layers && bad < 0; j++) {
        if (words && !invalid_words((const uint64_t *)(base + j * ids.strides[0]), rows, num_experts)) continue;
        for (int64_t r = 0; r < rows && bad < 0; r++) {
            const uint8_t *row = base + j * ids.strides[0] + r * ids.strides[1];
            int valid = 1;
            for (int64_t c = 0; c < k; c++) {
                int64_t value = load_id(row + c * ids.strides[2], itemsize);
                valid &= value < num_experts;
                if (ascending) {
                    if (c > 0) valid &= value > load_id(row + (c - 1) * ids.strides[2], itemsize);
                } else {
                    for (int64_t e = 0; e < c; e++) valid &= value != load_id(row + e * ids.strides[2], itemsize);
                }
            }
            if (!valid) bad = j * rows + r;
        }
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&ids);
    return PyLong_FromLongLong(bad);
}

static PyMethodDef methods[] = {
    {"encode_chunk", encode_chunk, METH_VARARGS,
     "encode_chunk(ids, num_experts, dictionaries, allow_words=True) -> (gaps section, rest section, rows of gaps, "
     "matched)"},
    {"decode_chunk", decode_chunk, METH_VARARGS,
     "decode_chunk(gaps, rest, num_experts, layers, rows, out, first_layer, first_row, accept, fill, allow_words=True) "
     "-> (status, detail)"},
    {"sort_rows_of_eight", sort_rows_of_eight, METH_VARARGS,
     "sort_rows_of_eight(ids, out, tokens, layers, largest) -> first bad row in token order, or -1"},
    {"first_invalid_row", first_invalid_row, METH_VARARGS,
     "first_invalid_row(ids, num_experts, ascending) -> first invalid row (layer * R + row), or -1"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ckernels",
                                    "The compiled per-chunk passes of the format-2 codec (see kernels.py).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__ckernels(void) {
    fill_taken();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *constants = Py_BuildValue(
        "{s:d,s:i,s:d,s:d,s:i,s:i,s:i,s:d,s:d,s:d,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
        "RANK_BELOW", RANK_BELOW, "LOAD_SAMPLE", LOAD_SAMPLE, "MIN_GAIN", MIN_GAIN, "RUN_BYTES", RUN_BYTES,
        "MAX_MASK_EXPERTS", MAX_MASK_EXPERTS, "DICTIONARY", DICTIONARY, "MAX_ENTRIES", MAX_ENTRIES, "MATCH_BYTES",
        MATCH_BYTES, "INDEX_WEIGHT", INDEX_WEIGHT, "LONG_RUN_BYTES", LONG_RUN_BYTES, "AUTO", AUTO, "NEVER", NEVER,
        "ALWAYS", ALWAYS, "OK", OK, "UNKNOWN_MODE", UNKNOWN_MODE, "SECTION_SIZES", SECTION_SIZES,
        "FIRST_ROW_REPEATS", FIRST_ROW_REPEATS, "UNIQUE_COUNT", UNIQUE_COUNT, "EXCEPTION_RANGE", EXCEPTION_RANGE,
        "RANK_RANGE", RANK_RANGE, "DICTIONARY_SIZE", DICTIONARY_SIZE, "DICTIONARY_INDEX", DICTIONARY_INDEX,
        "INVALID_ROW", INVALID_ROW, "ANY_ROWS", ANY_ROWS, "SETS", SETS, "SETS_OR_FILL", SETS_OR_FILL);
    if (!constants || PyModule_AddObject(m, "CONSTANTS", constants) < 0) {
        Py_XDECREF(constants);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
