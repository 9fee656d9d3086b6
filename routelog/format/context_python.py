"""The set-context codec's passes in Python: what ``routelog/format/_ccontext.c`` does, bit for bit, where it was not
built (no compiler at install, or ``ROUTELOG_KERNELS=numpy``).

Slow (a microsecond or two per coded decision) and exact: ``tests/test_context.py`` proves both write the same
bytes and read the same rows, forged streams included. See the C file for the model; :mod:`routelog.format.context`
states it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

PROB_BITS = 11
PROB_ONE = 1 << PROB_BITS
ADAPT = 4
TOP = 1 << 24
MAX_POSITION = 4
MAX_LENGTH = 4
MAX_BUCKET = 31
TREE_BITS = 6
OK = 0
INDEX_RANGE = 1
BUCKET_RANGE = 2
_MASK32 = 0xFFFFFFFF
ESCAPE_PROB_BITS = 15
ESCAPE_PROB_ONE = 1 << ESCAPE_PROB_BITS
ESCAPE_MAX_SHIFT = 8
ESCAPE_FOUND = 8
"""Escape contexts tell apart 0..7 experts found so far in the row (8 and more share the last)."""
REF_CANDIDATES = 12
"""Candidates an escaped row of a version-3 chunk may take its reference from (4 below and 8 of its token)."""
REF_PLACES = 16
"""Places in the reference its contexts tell apart (16 and more share the last)."""
LIST_BUCKETS = 32
"""A listed set's reference is at most 2^31 - 1 sets back."""
MAX_TOKEN_CANDIDATES = 8
"""A token's candidates."""
MAX_BELOW_CANDIDATES = 4
"""A set below's candidates."""
MAX_TOKEN = 2**31 - 1
"""Token ids are int32."""
LIST_WINDOW = 512
"""The earlier sets a writer compares a listed set with."""
LIST_SEARCH = 1024
"""The list's first sets a writer compares an escaped row with (version 4)."""
LIST_PREFERENCE = 2
"""A writer takes a listed reference over a candidate (version 4) where the listed set shares this many more experts
with the row."""
LIST_MARGIN = 256
"""A writer takes a listed reference (version 4) where its bits cost this much (1/256 bits: one bit) less than the
row's alone."""
LIST_TRIAL = 128
"""A writer searches the list (version 4) for each escaped row of a chunk layer's first this many, then while one in
this many of the rows searched took a listed set."""
COST_SLOTS = 1024
"""A dry run prices a bit by its probability's 10 leading bits."""
TABLE_BUCKETS = 33
"""A token key's gap (model version 4) is at most 2^31."""
TABLE_RANGE = 1
TABLE_KEYS_BELOW = 2


class _Probabilities:
    """The adaptive probabilities of one chunk layer, each starting at one half (the C struct, as flat lists)."""

    def __init__(self) -> None:
        half = PROB_ONE // 2
        self.candidate = [half] * (2 * MAX_POSITION * MAX_LENGTH * 2)
        self.listed = [half] * 4
        self.bucket = [half] * (MAX_BUCKET + 1)
        self.tree = [half] * ((MAX_BUCKET + 1) << TREE_BITS)
        self.low = [half] * ((MAX_BUCKET + 1) * 32)


def _candidate_slot(source: int, position: int, length: int, other: bool) -> int:
    return (
        (source * MAX_POSITION + min(position, MAX_POSITION - 1)) * MAX_LENGTH + min(length, MAX_LENGTH) - 1
    ) * 2 + (1 if other else 0)


class _Encoder:
    def __init__(self) -> None:
        self.low = 0
        self.range = _MASK32
        self.cache = 0
        self.pending = 1
        self.out = bytearray()
        self.bits = 0

    def _shift_low(self) -> None:
        if (self.low & _MASK32) < 0xFF000000 or (self.low >> 32) != 0:
            carry = self.low >> 32
            held = self.cache
            while True:
                self.out.append((held + carry) & 0xFF)
                held = 0xFF
                self.pending -= 1
                if self.pending == 0:
                    break
            self.cache = (self.low >> 24) & 0xFF
        self.pending += 1
        self.low = (self.low & 0x00FFFFFF) << 8

    def bit(self, probs: list[int], slot: int, bit: int) -> None:
        p = probs[slot]
        self._split((self.range >> PROB_BITS) * p, bit)
        probs[slot] = _adapted(p, bit, PROB_ONE, ADAPT)

    def counted_bit(self, probs: list[int], counts: list[int], slot: int, bit: int) -> None:
        """A bit with a 15-bit probability that adapts fast while its context is new and slower as it sees more
        (:func:`_escape_shift`): the escapes' coder."""
        p = probs[slot]
        self._split((self.range >> ESCAPE_PROB_BITS) * p, bit)
        probs[slot] = _adapted(p, bit, ESCAPE_PROB_ONE, _escape_shift(counts[slot]))
        counts[slot] = min(counts[slot] + 1, 255)

    def _split(self, bound: int, bit: int) -> None:
        """One decision: a 0 keeps the range below ``bound``, a 1 the rest; then the range is renormalized."""
        self.bits += 1
        if not bit:
            self.range = bound
        else:
            self.low += bound
            self.range -= bound
        while self.range < TOP:
            self.range = (self.range << 8) & _MASK32
            self._shift_low()

    def finish(self) -> bytes:
        """The stream (empty where no decision was coded), ending with the value of ``[low, low + range)`` with the
        most trailing zero bits, its zero bytes at the end left out: a decoder reads zeros past a stream's end."""
        if not self.bits:
            return b""
        last = self.low + self.range - 1
        for bits in range(32, 0, -1):
            mask = (1 << bits) - 1
            value = (self.low + mask) & ~mask
            if value <= last:
                self.low = value
                break
        for _ in range(5):
            self._shift_low()
        return bytes(self.out).rstrip(b"\0")


class _Decoder:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0
        self.code = 0
        self.range = _MASK32
        for _ in range(5):
            self.code = ((self.code << 8) | self._next()) & _MASK32

    def _next(self) -> int:
        at = self.at
        self.at += 1
        return self.data[at] if at < len(self.data) else 0

    def bit(self, probs: list[int], slot: int) -> int:
        p = probs[slot]
        found = self._split((self.range >> PROB_BITS) * p)
        probs[slot] = _adapted(p, found, PROB_ONE, ADAPT)
        return found

    def counted_bit(self, probs: list[int], counts: list[int], slot: int) -> int:
        p = probs[slot]
        found = self._split((self.range >> ESCAPE_PROB_BITS) * p)
        probs[slot] = _adapted(p, found, ESCAPE_PROB_ONE, _escape_shift(counts[slot]))
        counts[slot] = min(counts[slot] + 1, 255)
        return found

    def _split(self, bound: int) -> int:
        """The decision the encoder's ``_split`` coded with ``bound``, the range renormalized."""
        if self.code < bound:
            self.range = bound
            found = 0
        else:
            self.code -= bound
            self.range -= bound
            found = 1
        while self.range < TOP:
            self.range = (self.range << 8) & _MASK32
            self.code = ((self.code << 8) | self._next()) & _MASK32
        return found


def _adapted(p: int, bit: int, one: int, shift: int) -> int:
    """A probability of a 0 moved 1 / 2^shift of the way towards the bit coded (out of ``one``)."""
    return p - (p >> shift) if bit else p + ((one - p) >> shift)


def _escape_shift(seen: int) -> int:
    """The adaptation shift of an escape context that has coded ``seen`` bits (saturating at 255): 1, 2, 2, 3, 3,
    3, 3, 4, ... up to :data:`ESCAPE_MAX_SHIFT` (about 1 / (seen + 1), as counting would, until 1 / 256)."""
    return min((seen + 1).bit_length(), ESCAPE_MAX_SHIFT)


class Tables:
    """A layer's lookups as Python containers: token -> its candidates, row below's index -> its candidates."""

    def __init__(
        self,
        sets: int,
        token_keys: npt.NDArray[np.int64],
        token_offsets: npt.NDArray[np.uint32],
        token_candidates: npt.NDArray[np.uint32],
        below_offsets: npt.NDArray[np.uint32],
        below_candidates: npt.NDArray[np.uint32],
    ) -> None:
        self.sets = sets
        offsets = token_offsets.tolist()
        candidates = token_candidates.tolist()
        self.tokens = {key: candidates[offsets[i] : offsets[i + 1]] for i, key in enumerate(token_keys.tolist())}
        offsets = below_offsets.tolist()
        candidates = below_candidates.tolist()
        self.below = [candidates[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]

    def candidates(self, token: int, below: int) -> tuple[Sequence[int], Sequence[int]]:
        found_below = self.below[below] if 0 <= below < len(self.below) else ()
        found_token = self.tokens.get(token, ()) if token >= 0 else ()
        return found_below, found_token


def _contexts(tokens: npt.NDArray[np.int64], below: npt.NDArray[np.int32]) -> list[tuple[int, int]]:
    """Each row's token and its row below's index in the layer below's list (-1 for every row when ``below`` is
    empty: no layer below in the chunk)."""
    return list(zip(tokens.tolist(), below.tolist() if below.size else [-1] * tokens.size, strict=True))


def encode_layer(
    index: npt.NDArray[np.int32], tables: Tables, tokens: npt.NDArray[np.int64], below: npt.NDArray[np.int32]
) -> bytes:
    """The stream of one chunk layer's rows (``index``: each row's set in the list, -1 to escape)."""
    coder = _Encoder()
    probs = _Probabilities()
    for found, (token, under) in zip(index.tolist(), _contexts(tokens, below), strict=True):
        _encode_row(coder, probs, tables, token, under, found)
    return coder.finish()


def _encode_row(coder: _Encoder, probs: _Probabilities, tables: Tables, token: int, below: int, index: int) -> None:
    bc, tc = tables.candidates(token, below)
    for i, candidate in enumerate(bc):
        hit = candidate == index
        coder.bit(probs.candidate, _candidate_slot(0, i, len(bc), bool(tc)), 0 if hit else 1)
        if hit:
            return
    position = 0
    for candidate in tc:
        if candidate in bc:
            continue
        hit = candidate == index
        coder.bit(probs.candidate, _candidate_slot(1, position, len(tc), bool(bc)), 0 if hit else 1)
        position += 1
        if hit:
            return
    if tables.sets == 0:
        return
    coder.bit(probs.listed, 2 * bool(tc) + bool(bc), 1 if index < 0 else 0)
    if index < 0:
        return
    value = index + 1
    bucket = value.bit_length() - 1
    for i in range(bucket):
        coder.bit(probs.bucket, i, 1)
    coder.bit(probs.bucket, bucket, 0)
    node = 1
    for i in range(bucket - 1, -1, -1):
        bit = (value >> i) & 1
        if bucket - 1 - i < TREE_BITS:
            coder.bit(probs.tree, (bucket << TREE_BITS) + node, bit)
            node = 2 * node + bit
        else:
            coder.bit(probs.low, bucket * 32 + i, bit)


def decode_layer(
    stream: bytes,
    tables: Tables,
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32],
    index: npt.NDArray[np.int32],
) -> tuple[int, int]:
    """Each row's set in the list (-1: an escape) into ``index``; (status, the row it stopped at or -1)."""
    coder = _Decoder(bytes(stream))
    probs = _Probabilities()
    found: list[int] = []
    for r, (token, under) in enumerate(_contexts(tokens, below)):
        status, value = _decode_row(coder, probs, tables, token, under)
        if status != OK:
            index[: len(found)] = found
            return status, r
        found.append(value)
    index[:] = found
    return OK, -1


def _decode_row(coder: _Decoder, probs: _Probabilities, tables: Tables, token: int, below: int) -> tuple[int, int]:
    bc, tc = tables.candidates(token, below)
    for i, candidate in enumerate(bc):
        if not coder.bit(probs.candidate, _candidate_slot(0, i, len(bc), bool(tc))):
            return OK, candidate
    position = 0
    for candidate in tc:
        if candidate in bc:
            continue
        miss = coder.bit(probs.candidate, _candidate_slot(1, position, len(tc), bool(bc)))
        position += 1
        if not miss:
            return OK, candidate
    if tables.sets == 0 or coder.bit(probs.listed, 2 * bool(tc) + bool(bc)):
        return OK, -1
    bucket = 0
    while coder.bit(probs.bucket, bucket):
        bucket += 1
        if bucket == MAX_BUCKET:
            return BUCKET_RANGE, -1
    value = 1
    node = 1
    for i in range(bucket - 1, -1, -1):
        if bucket - 1 - i < TREE_BITS:
            bit = coder.bit(probs.tree, (bucket << TREE_BITS) + node)
            node = 2 * node + bit
        else:
            bit = coder.bit(probs.low, bucket * 32 + i)
        value = 2 * value + bit
    if value - 1 >= tables.sets:
        return INDEX_RANGE, -1
    return OK, value - 1


class _Counted:
    """Counted probabilities (the escapes' contexts), each starting at one half."""

    def __init__(self, size: int) -> None:
        self.probs = [ESCAPE_PROB_ONE // 2] * size
        self.counts = [0] * size


def _log2_fixed(m: int) -> int:
    """floor(256 * log2(m)) for m >= 1, by squaring (the C file's integer steps)."""
    whole = m.bit_length() - 1
    y = (m << 30) >> whole
    result = whole << 8
    for b in range(7, -1, -1):
        y = (y * y) >> 30
        if y >= 2 << 30:
            y >>= 1
            result |= 1 << b
    return result


_COSTS = [(11 << 8) - _log2_fixed(2 * i + 1) for i in range(COST_SLOTS)]
"""What a bit costs, in 1/256 bits, by its probability's 10 leading bits: 256 * -log2((2i + 1) / 2048)."""


class _DryRun:
    """A coder that codes nothing: it adds what each bit given would cost now to ``cost``, adapting nothing."""

    def __init__(self) -> None:
        self.cost = 0


def _code(coder: _Encoder | _Decoder | _DryRun, counted: _Counted, slot: int, bit: int) -> int:
    """One counted bit: the encoder codes ``bit``, the decoder returns the bit it reads, a dry run prices ``bit``
    (the escape passes are written once for all three)."""
    if isinstance(coder, _Encoder):
        coder.counted_bit(counted.probs, counted.counts, slot, bit)
        return bit
    if isinstance(coder, _Decoder):
        return coder.counted_bit(counted.probs, counted.counts, slot)
    at = counted.probs[slot] >> (ESCAPE_PROB_BITS - 10)
    coder.cost += _COSTS[COST_SLOTS - 1 - at if bit else at]
    return bit


def _found_context(found: int) -> int:
    return min(found, ESCAPE_FOUND - 1)


def _code_members(
    coder: _Encoder | _Decoder | _DryRun,
    counted: _Counted,
    order: Sequence[int],
    skip: frozenset[int] | set[int],
    want: int,
    members: frozenset[int] | set[int],
    by_remaining: bool,
) -> list[int]:
    """A row's members among the experts of ``order`` not in ``skip``, a bit each, until ``want`` are found or the
    rest must all be in it; context (place among the experts coded, found so far), or with ``by_remaining`` (place,
    still to find). The members found, in the order's order."""
    got: list[int] = []
    place = 0
    left = len(order) - len(skip)
    for i, expert in enumerate(order):
        if len(got) >= want:
            break
        if expert in skip:
            continue
        if left - place == want - len(got):  # the rest of the order is the rest of the set
            got += [e for e in order[i:] if e not in skip]
            break
        context = _found_context(want - len(got) - 1 if by_remaining else len(got))
        if _code(coder, counted, place * ESCAPE_FOUND + context, 1 if expert in members else 0):
            got.append(expert)
        place += 1
    return got


_NONE: frozenset[int] = frozenset()


def encode_escapes(rows: npt.NDArray[Any], order: Sequence[int], num_experts: int) -> bytes:
    """The escape stream of one chunk layer (version 2): its escaped rows ``[n, K]`` (ascending distinct IDs), each
    coded as one bit per expert in the layer's ``order`` (1: in the set) with a context per (place in the order,
    experts found so far up to 7), stopping once the row's K are found or the rest of the order must all be in it."""
    coder = _Encoder()
    counted = _Counted(num_experts * ESCAPE_FOUND)
    k = rows.shape[1] if rows.ndim == 2 else 0
    for row in rows.tolist():
        _code_members(coder, counted, order, _NONE, k, set(row), False)
    return coder.finish()


def decode_escapes(stream: bytes, out: npt.NDArray[Any], order: Sequence[int], num_experts: int) -> None:
    """The escaped rows of :func:`encode_escapes`' stream into ``out`` ``[n, K]`` (each ascending). Every stream
    decodes to valid rows: each names K distinct experts of the order."""
    coder = _Decoder(bytes(stream))
    counted = _Counted(num_experts * ESCAPE_FOUND)
    n, k = out.shape
    rows = [sorted(_code_members(coder, counted, order, _NONE, k, _NONE, False)) for _ in range(n)]
    if n:
        out[:] = rows


def _code_gamma(coder: _Encoder | _Decoder | _DryRun, bucket: _Counted, low: _Counted, buckets: int, value: int) -> int:
    """A positive integer (the encoder's ``value``), Elias-gamma: its bit length - 1 in unary, each bit with its
    context, then its bits below the leading one by (bucket, bit). Returns it, or -1 where its bucket reaches
    ``buckets`` - 1."""
    wanted = 0 if isinstance(coder, _Decoder) else value.bit_length() - 1
    b = 0
    while _code(coder, bucket, b, 1 if b < wanted else 0):
        b += 1
        if b == buckets - 1:
            return -1
    decoded = 1
    for bit in range(b - 1, -1, -1):
        decoded = 2 * decoded + _code(coder, low, b * 32 + bit, (value >> bit) & 1)
    return decoded


_ALONE, _BY_CANDIDATE, _BY_LIST = 0, 1, 2
"""The ways an escaped row is coded."""


class _Referenced:
    """A chunk layer's escape coder of versions 3 and 4, or a list's: its list, order and counted contexts (the C
    struct)."""

    def __init__(self, sets: npt.NDArray[Any], order: Sequence[int], num_experts: int) -> None:
        self.sets = sets
        self.order = list(order)
        self.rank = {expert: place for place, expert in enumerate(self.order)}
        self.experts = num_experts
        self.plain = _Counted(num_experts * ESCAPE_FOUND)
        self.rest = _Counted(num_experts * ESCAPE_FOUND)
        self.choose = _Counted(REF_CANDIDATES)
        self.kept = _Counted(REF_PLACES * ESCAPE_FOUND)
        self.referenced = _Counted(1)
        self.gap_bucket = _Counted(LIST_BUCKETS)
        self.gap_low = _Counted(LIST_BUCKETS * 32)
        self.list_referenced = _Counted(2)
        self._flags: npt.NDArray[np.int32] | None = None
        self.looked = self.taken = 0  # the encoder's rows searched, and taking a listed set

    def _set(self, at: int, distinct: bool) -> list[int]:
        """Listed set ``at``, checked where it is read, as the compiled pass checks it: its IDs below the experts, and
        ``distinct`` (as a reference)."""
        found = [int(v) for v in self.sets[at].tolist()]
        if any(v >= self.experts for v in found) or (distinct and len(set(found)) != len(found)):
            raise ValueError("referenced escapes: a listed set names an ID past the experts or twice")
        return found

    def row(
        self,
        coder: _Encoder | _Decoder,
        tables: Tables,
        token: int,
        below: int,
        k: int,
        members: set[int],
        lists: bool = False,
    ) -> list[int]:
        """One escaped row (``members``: its IDs when encoding, none when decoding), in the order found; ``lists``
        (version 4): a row its candidates do not reference may take any listed set as its reference."""
        found_below, found_token = tables.candidates(token, below)
        candidates = [*found_below, *(c for c in found_token if c not in found_below)][:REF_CANDIDATES]
        if any(c >= len(self.sets) for c in candidates):
            raise ValueError("referenced escapes: a reference outside the list")
        searched = lists and len(self.sets) > 0
        way, pick, near = _ALONE, 0, 0
        if isinstance(coder, _Encoder) and (candidates or searched):
            way, pick, near = self._way(candidates, searched, k, members)
        if candidates and _code(coder, self.referenced, 0, 1 if way == _BY_CANDIDATE else 0):
            chosen = len(candidates) - 1
            for i in range(len(candidates) - 1):
                if _code(coder, self.choose, i, 1 if i == pick else 0):
                    chosen = i
                    break
            return self.against(coder, candidates[chosen], k, members)
        if searched and _code(coder, self.list_referenced, 1 if candidates else 0, 1 if way == _BY_LIST else 0):
            value = self._gamma(coder, near + 1)
            if not 0 < value <= len(self.sets):
                raise ValueError("referenced escapes: a reference outside the list")
            return self.against(coder, value - 1, k, members)
        return _code_members(coder, self.plain, self.order, _NONE, k, members, True)

    def _way(self, candidates: list[int], searched: bool, k: int, members: set[int]) -> tuple[int, int, int]:
        """The encoder's way for an escaped row, with the candidate and the listed set it would take: the first
        candidate sharing most experts with the row, where it shares at least half and no searched listed set shares
        :data:`LIST_PREFERENCE` more; else, where searched, the first searched listed set sharing most, where it
        shares at least half and its bits cost :data:`LIST_MARGIN` less now (a dry run) than the row's alone; else
        that candidate where it shares at least half; else alone. The list is searched while
        :data:`LIST_TRIAL` says (see the C file)."""
        pick, best, near, near_shared = 0, -1, 0, -1
        if candidates:
            shared = [len(members.intersection(self._set(c, False))) for c in candidates]
            best = max(shared)
            pick = shared.index(best)
        if searched and (self.looked < LIST_TRIAL or self.taken * LIST_TRIAL >= self.looked):
            near, near_shared = self._nearest(members)
            self.looked += 1
        candidate = bool(candidates) and 2 * best >= k
        if candidate and near_shared < best + LIST_PREFERENCE:
            return _BY_CANDIDATE, pick, near
        if 2 * near_shared >= k:  # -1 where not searched
            has = 1 if candidates else 0
            alone, listed = _DryRun(), _DryRun()
            _code(alone, self.list_referenced, has, 0)
            _code_members(alone, self.plain, self.order, _NONE, k, members, True)
            _code(listed, self.list_referenced, has, 1)
            self._gamma(listed, near + 1)
            self.against(listed, near, k, members)
            if listed.cost + LIST_MARGIN < alone.cost:
                self.taken += 1
                return _BY_LIST, pick, near
        return (_BY_CANDIDATE if candidate else _ALONE), pick, near

    def _nearest(self, members: set[int]) -> tuple[int, int]:
        """The first of the list's :data:`LIST_SEARCH` first sets sharing most experts with a row where one shares
        at least half of them, and how many it shares; else 0 and -1."""
        if self._flags is None:  # the searched sets checked first, as the compiled pass checks them
            head = np.asarray(self.sets[:LIST_SEARCH], np.int64)
            if head.size and (head.max() >= self.experts or (np.diff(np.sort(head, axis=1), axis=1) == 0).any()):
                raise ValueError("referenced escapes: a row names an ID past the experts or twice")
            self._flags = np.zeros((head.shape[0], self.experts), np.int32)
            self._flags[np.repeat(np.arange(head.shape[0]), head.shape[1]), head.reshape(-1)] = 1
        shared = self._flags[:, sorted(members)].sum(axis=1)
        place = int(np.argmax(shared)) if shared.size else 0
        most = int(shared[place]) if shared.size else -1
        return (place, most) if 2 * most >= len(members) else (0, -1)

    def _gamma(self, coder: _Encoder | _Decoder | _DryRun, value: int) -> int:
        """A listed set's distance back, or a listed reference's place + 1 (:func:`_code_gamma`)."""
        return _code_gamma(coder, self.gap_bucket, self.gap_low, LIST_BUCKETS, value)

    def against(self, coder: _Encoder | _Decoder | _DryRun, at: int, k: int, members: set[int]) -> list[int]:
        """A row against listed set ``at``: the reference's experts it keeps, in the order's order, then the ones
        it adds."""
        reference = sorted(self._set(at, True), key=self.rank.__getitem__)
        got: list[int] = []
        for j, expert in enumerate(reference):
            keep = 1
            if j - len(got) < self.experts - k:  # else as many dropped as there are experts outside: kept
                slot = min(j, REF_PLACES - 1) * ESCAPE_FOUND + _found_context(len(got))
                keep = _code(coder, self.kept, slot, 1 if expert in members else 0)
            if keep:
                got.append(expert)
        return got + _code_members(coder, self.rest, self.order, set(reference), k - len(got), members, True)

    def listed(self, coder: _Encoder | _Decoder, i: int, back: int, k: int, members: set[int]) -> tuple[int, list[int]]:
        """Listed set ``i`` (of ``self.sets``, the list so far), against the set ``back`` places before it or
        alone (``back`` 0; the encoder's): the distance decoded (0: none; -1: past the list's start) and the set."""
        if not _code(coder, self.referenced, 0, 1 if back > 0 else 0):
            return 0, _code_members(coder, self.plain, self.order, _NONE, k, members, True)
        distance = self._gamma(coder, back)
        if not 0 < distance <= i:
            return -1, []
        try:
            return distance, self.against(coder, i - distance, k, members)
        except ValueError:
            return -1, []


def encode_referenced(
    rows: npt.NDArray[Any],
    order: Sequence[int],
    num_experts: int,
    sets: npt.NDArray[Any],
    tables: Tables,
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32],
    lists: bool = False,
) -> bytes:
    """The escape stream of one chunk layer (version 3, or 4 with ``lists``): its escaped rows ``[n, K]`` (ascending
    distinct IDs), each against its reference among its candidates (``tokens`` and ``below``: the escaped rows' own)
    or, in version 4, any set of the list ``sets``; see the C file."""
    coder = _Encoder()
    state = _Referenced(sets, order, num_experts)
    k = rows.shape[1] if rows.ndim == 2 else 0
    for row, (token, under) in zip(rows.tolist(), _contexts(tokens, below), strict=True):
        state.row(coder, tables, token, under, k, set(row), lists)
    return coder.finish()


def decode_referenced(
    stream: bytes,
    out: npt.NDArray[Any],
    order: Sequence[int],
    num_experts: int,
    sets: npt.NDArray[Any],
    tables: Tables,
    tokens: npt.NDArray[np.int64],
    below: npt.NDArray[np.int32],
    lists: bool = False,
) -> None:
    """The escaped rows of :func:`encode_referenced`' stream into ``out`` ``[n, K]`` (each ascending). Every stream
    decodes to valid rows; a reference outside the list is a ValueError."""
    coder = _Decoder(bytes(stream))
    state = _Referenced(sets, order, num_experts)
    n, k = out.shape
    contexts = _contexts(tokens, below)
    rows = [sorted(state.row(coder, tables, token, under, k, set(), lists)) for token, under in contexts]
    if n:
        out[:] = rows


def encode_list(sets: npt.NDArray[Any], order: Sequence[int], num_experts: int) -> bytes:
    """A layer's list of version 3 (``order``: the experts' ID order), each set against the earlier set sharing most
    experts with it among the :data:`LIST_WINDOW` before it (the nearest of those) where it shares more than two
    thirds of them;
    see the C file."""
    coder = _Encoder()
    state = _Referenced(sets, order, num_experts)
    n, k = sets.shape
    if n and (int(sets.max()) >= num_experts or (np.diff(np.sort(sets.astype(np.int64), axis=1), axis=1) == 0).any()):
        raise ValueError("encode_list: a row names an ID past the experts or twice")
    flags = np.zeros((n, num_experts), np.int32)  # each set's experts flagged: a window's overlaps in one product
    flags[np.repeat(np.arange(n), k), sets.reshape(-1).astype(np.int64)] = 1
    for i, row in enumerate(sets.tolist()):
        back = 0
        if i:
            start = max(i - LIST_WINDOW, 0)
            shared = flags[start:i] @ flags[i]
            best = int(shared.max())
            if 3 * best > 2 * k:  # the nearest of those sharing most
                back = i - (start + int(np.flatnonzero(shared == best)[-1]))
        state.listed(coder, i, back, k, set(row))
    return coder.finish()


def decode_list(stream: bytes, out: npt.NDArray[Any], order: Sequence[int], num_experts: int) -> tuple[int, int]:
    """:func:`encode_list`'s sets into ``out`` ``[S, K]`` (each ascending): (status, the set it stopped at or -1),
    status 1 where a set's reference lies before the list's start."""
    coder = _Decoder(bytes(stream))
    state = _Referenced(out, order, num_experts)
    n, k = out.shape
    for i in range(n):
        distance, found = state.listed(coder, i, 0, k, set())
        if distance < 0:
            return 1, i
        out[i] = sorted(found)
    return OK, -1


class _TableCounters:
    """The counted contexts of a layer's candidate tables (model version 4; the C struct)."""

    def __init__(self) -> None:
        self.key_bucket, self.key_low = _Counted(TABLE_BUCKETS), _Counted(TABLE_BUCKETS * 32)
        self.token_more = _Counted(MAX_TOKEN_CANDIDATES)
        self.token_bucket, self.token_low = _Counted(TABLE_BUCKETS), _Counted(TABLE_BUCKETS * 32)
        self.below_more = _Counted(MAX_BELOW_CANDIDATES)
        self.below_bucket, self.below_low = _Counted(TABLE_BUCKETS), _Counted(TABLE_BUCKETS * 32)


def _code_count(coder: _Encoder | _Decoder, more: _Counted, count: int, least: int, most: int) -> int:
    """A count from ``least`` up to ``most``: a bit "more than n" for each n from ``least``, context n."""
    n = least
    while n < most and _code(coder, more, n, 1 if count > n else 0):
        n += 1
    return n


def _code_candidates(
    coder: _Encoder | _Decoder, bucket: _Counted, low: _Counted, sets: int, values: list[int]
) -> list[int] | None:
    """Candidates, each as its place in the list + 1 (Elias-gamma); None at one past the list."""
    got = []
    for value in values:
        place = _code_gamma(coder, bucket, low, TABLE_BUCKETS, value + 1) - 1
        if not 0 <= place < sets:
            return None
        got.append(place)
    return got


def encode_tables(
    token_keys: Sequence[int],
    token_offsets: Sequence[int],
    token_candidates: Sequence[int],
    below_offsets: Sequence[int],
    below_candidates: Sequence[int],
    sets: int,
    below_sets: int,
) -> bytes:
    """A layer's candidate tables of model version 4 (checked by the caller; ``below_sets`` -1 where the layer has no
    layer below, ``below_offsets`` then ``[0]``); see the C file."""
    coder = _Encoder()
    counters = _TableCounters()
    previous = -1
    for key in token_keys:
        _code_gamma(coder, counters.key_bucket, counters.key_low, TABLE_BUCKETS, key - previous)
        previous = key
    for i in range(len(token_keys)):
        start, end = token_offsets[i], token_offsets[i + 1]
        _code_count(coder, counters.token_more, end - start, 1, MAX_TOKEN_CANDIDATES)
        _code_candidates(coder, counters.token_bucket, counters.token_low, sets, list(token_candidates[start:end]))
    for s in range(max(below_sets, 0)):
        start, end = below_offsets[s], below_offsets[s + 1]
        _code_count(coder, counters.below_more, end - start, 0, MAX_BELOW_CANDIDATES)
        _code_candidates(coder, counters.below_bucket, counters.below_low, sets, list(below_candidates[start:end]))
    return coder.finish()


def decode_tables(
    stream: bytes, n_keys: int, sets: int, below_sets: int, n_below: int
) -> tuple[int, list[int], list[int], list[int], list[int], list[int]]:
    """:func:`encode_tables`' stream: (status, token keys, token offsets, token candidates, below offsets, below
    candidates); status :data:`TABLE_RANGE` (a key past the largest token id, a candidate past the list, a bucket
    past its end) or :data:`TABLE_KEYS_BELOW` (not ``n_below`` sets below with candidates), the lists then partial."""
    coder = _Decoder(bytes(stream))
    counters = _TableCounters()
    keys: list[int] = []
    token_offsets, below_offsets = [0], [0]
    token_candidates: list[int] = []
    below_candidates: list[int] = []
    tables = (keys, token_offsets, token_candidates, below_offsets, below_candidates)  # filled in place
    previous = -1
    for _ in range(n_keys):
        gap = _code_gamma(coder, counters.key_bucket, counters.key_low, TABLE_BUCKETS, 0)
        if gap < 1 or previous + gap > MAX_TOKEN:
            return TABLE_RANGE, *tables
        previous += gap
        keys.append(previous)
    for _ in range(n_keys):
        count = _code_count(coder, counters.token_more, 0, 1, MAX_TOKEN_CANDIDATES)
        got = _code_candidates(coder, counters.token_bucket, counters.token_low, sets, [0] * count)
        if got is None:
            return TABLE_RANGE, *tables
        token_candidates += got
        token_offsets.append(len(token_candidates))
    keyed = 0
    for _ in range(max(below_sets, 0)):
        count = _code_count(coder, counters.below_more, 0, 0, MAX_BELOW_CANDIDATES)
        got = _code_candidates(coder, counters.below_bucket, counters.below_low, sets, [0] * count)
        if got is None:
            return TABLE_RANGE, *tables
        keyed += count > 0
        below_candidates += got
        below_offsets.append(len(below_candidates))
    return (OK if below_sets < 0 or keyed == n_below else TABLE_KEYS_BELOW), *tables


def distinct(items: npt.NDArray[Any]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """Items (a flat array of any fixed-size dtype) numbered in the order they first appear, and where each first
    appears."""
    if not items.size:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    _, first, inverse = np.unique(items, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # sorted values -> their number by first appearance
    number = np.empty(order.size, np.int32)
    number[order] = np.arange(order.size, dtype=np.int32)
    return number[inverse.reshape(-1)], first[order].astype(np.int64)
