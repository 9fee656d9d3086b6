"""The numpy path of the codec's kernels (routelog.format.kernels_numpy) against the compiled kernels
(routelog.format._ckernels): the same IDs, statuses and details for chunks the reference writes, for forged ones,
for its own simpler chunks, and for every chunk of the golden stores."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import routelog
from routelog.format import context, context_python, kernels, kernels_numpy, ranked
from routelog.format.documents import (
    CONTEXT_ESCAPES_FEATURE,
    CONTEXT_FEATURE,
    CONTEXT_LIST_REFERENCES_FEATURE,
    CONTEXT_REFERENCES_FEATURE,
)


def _compiled_reference() -> Any:
    """The compiled kernels the numpy ones must equal, under the signatures both share (the word arguments say
    whether rows of eight uint8 IDs take the 64-bit word path: on damaged chunks the two paths differ, and the numpy
    kernels reproduce each); None where they are not built."""
    try:
        from routelog.format import _ckernels  # type: ignore[attr-defined]
    except ImportError:
        return None

    def encode_chunk(ids: Any, words: Any, experts: int, policy: int) -> tuple[Any, ...]:
        gaps, rest, placed, matched = _ckernels.encode_chunk(ids, experts, policy, words is not None)
        return np.frombuffer(gaps, np.uint8), np.frombuffer(rest, np.uint8), placed, matched

    def decode_chunk(
        gaps: Any, rest: Any, experts: int, layers: int, rows: int, out: Any, words: Any, *tail: Any
    ) -> Any:
        return tuple(_ckernels.decode_chunk(gaps, rest, experts, layers, rows, out, *tail, words is not None))

    return SimpleNamespace(
        encode_chunk=encode_chunk,
        decode_chunk=decode_chunk,
        first_invalid_row=lambda ids, words, experts, ascending: _ckernels.first_invalid_row(ids, experts, ascending),
        sort_rows_of_eight=lambda ids, out, tokens, layers, top: _ckernels.sort_rows_of_eight(
            ids, out, tokens, layers, int(top)
        ),
        **{name: getattr(kernels, name) for name in dir(kernels) if name.isupper()},
    )


reference: Any = _compiled_reference()
NEEDS_REFERENCE = pytest.mark.skipif(reference is None, reason="the compiled kernels are not built here")

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = sorted(FIXTURES.glob("golden-v*"))
ACCEPT_RULES = (kernels_numpy.ANY_ROWS, kernels_numpy.SETS, kernels_numpy.SETS_OR_FILL)
POLICIES = (kernels_numpy.AUTO, kernels_numpy.NEVER, kernels_numpy.ALWAYS)
GUARD = 7  # what the block around a decoded window holds: neither decoder may write it
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _chunk(
    rng: np.random.Generator,
    shape: tuple[int, int, int],
    experts: int,
    dtype: type[np.unsignedinteger[Any]],
    skew: float,
    repeat: float,
    pool: int,
    n_bad: int,
) -> npt.NDArray[Any]:
    """Sorted top-k sets ``[layers, rows, k]``: per-layer popularity (Dirichlet, more skewed as ``skew`` grows; 0:
    uniform), drawn from ``pool`` sets per layer recurring out of order (0: every row drawn afresh; recurring sets
    make dictionaries pay), runs of rows that keep the previous row's set with probability ``repeat``, then
    ``n_bad`` rows that are no set (zeros, a repeated ID or random values of the dtype: exceptions)."""
    layers, rows, k = shape
    drawn = min(experts, 256) if dtype == np.uint8 else experts  # uint8 IDs of a larger universe stay below 256
    ids = np.empty(shape, dtype)
    for j in range(layers):
        weights = rng.dirichlet(np.full(drawn, 1.0 / skew)) if skew else np.full(drawn, 1.0 / drawn)
        with np.errstate(divide="ignore"):  # experts of weight 0 draw last
            keys = np.log(weights) + rng.gumbel(size=(rows, drawn))  # Gumbel top-k: k draws without replacement
        layer = np.sort(np.argpartition(-keys, k - 1, axis=1)[:, :k], axis=1)
        if pool and rows:
            layer = layer[rng.integers(0, min(pool, rows), rows)]
        keep = rng.random(rows) < repeat
        keep[:1] = False
        ids[j] = layer[np.maximum.accumulate(np.where(keep, 0, np.arange(rows)))]
    for _ in range(n_bad if rows else 0):
        j, r, kind = int(rng.integers(layers)), int(rng.integers(rows)), int(rng.integers(3))
        if kind == 0:
            ids[j, r] = 0  # zarr's fill value
        elif kind == 1:
            ids[j, r] = ids[j, r, 0]
        else:
            ids[j, r] = rng.integers(0, np.iinfo(dtype).max + 1, k)
    return ids


def _words(ids: npt.NDArray[Any]) -> npt.NDArray[np.uint64] | None:
    """Rows of eight uint8 IDs as one word each, flat (what ranked.py hands the encoder), else None."""
    return ids.reshape(-1).view(np.uint64) if ids.dtype == np.uint8 and ids.shape[2] == 8 else None


def _readonly(section: npt.NDArray[np.uint8] | bytes | bytearray) -> npt.NDArray[np.uint8]:
    """A section as the frames decompress it: a read-only uint8 array (the compiled kernels' cached signature)."""
    return np.frombuffer(bytes(section), np.uint8)


Window = tuple[tuple[int, int], tuple[int, int]]


def _window(rng: np.random.Generator, layers: int, rows: int) -> Window:
    """Often the whole chunk, else random layers and rows inside it (empty ones included)."""
    if rng.random() < 0.3:
        return (0, layers), (0, rows)
    l0, l1 = sorted(int(v) for v in rng.integers(0, layers + 1, 2))
    r0, r1 = sorted(int(v) for v in rng.integers(0, rows + 1, 2))
    return (l0, l1), (r0, r1)


def _decode(
    decoder: Callable[..., tuple[int, int]],
    sections: tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]],
    experts: int,
    shape: tuple[int, int, int],
    dtype: np.dtype[Any],
    window: Window,
    accept: int,
    fill_value: int,
    as_words: bool,
) -> tuple[tuple[int, int], npt.NDArray[Any]]:
    """(status, detail) and the window ``decoder`` wrote into a reader's block (the layers apart, guard rows around
    them, as ranked.decode passes a window), after checking that the guard rows are untouched."""
    (l0, l1), (r0, r1) = window
    layers, rows, k = shape
    block = np.full((l1 - l0, r1 - r0 + 3, k), GUARD, dtype)
    out = block[:, 1 : 1 + r1 - r0]
    words = out.view(np.uint64)[:, :, 0] if as_words else None
    gaps, rest = sections
    status, detail = decoder(gaps, rest, experts, layers, rows, out, words, l0, r0, accept, fill_value)
    assert (block[:, 0] == GUARD).all() and (block[:, 1 + r1 - r0 :] == GUARD).all()
    return (int(status), int(detail)), out.copy()


def _compare(
    sections: tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]],
    experts: int,
    shape: tuple[int, int, int],
    dtype: np.dtype[Any],
    window: Window,
    accept: int,
    fill_value: int,
    as_words: bool,
) -> tuple[tuple[int, int], npt.NDArray[Any]]:
    """Decode with both kernels and check they agree: the same (status, detail), and where the window was written
    whole (OK, or a row refused after writing it), the same IDs. Returns the reference's."""
    arguments = (sections, experts, shape, dtype, window, accept, fill_value, as_words)
    expected, expected_out = _decode(reference.decode_chunk, *arguments)
    got, got_out = _decode(kernels_numpy.decode_chunk, *arguments)
    context = f"window {window}, accept {accept}, fill {fill_value}, words {as_words}"
    assert got == expected, context
    if expected[0] in (kernels_numpy.OK, kernels_numpy.INVALID_ROW):
        np.testing.assert_array_equal(got_out, expected_out, err_msg=context)
    return expected, expected_out


def _as_words_choices(dtype: np.dtype[Any], k: int) -> tuple[bool, ...]:
    return (False, True) if dtype == np.uint8 and k == 8 else (False,)


chunks = st.fixed_dictionaries(
    {
        "layers": st.integers(1, 4),
        "rows": st.integers(0, 300),
        "k": st.sampled_from([1, 2, 6, 8]),
        "extra_experts": st.sampled_from([0, 1, 5, 30, 56, 120, 248, 292]),  # E = K + this, up to 300
        "wide": st.booleans(),  # uint16 IDs (uint8 IDs also where E > 256: a larger universe)
        "skew": st.sampled_from([0.0, 0.3, 3.0, 30.0]),
        "repeat": st.sampled_from([0.0, 0.1, 0.5, 0.95]),
        "pool": st.sampled_from([0, 3, 40, 150]),
        "n_bad": st.sampled_from([0, 0, 1, 5]),
        "seed": st.integers(0, 2**32 - 1),
    }
)


def _draw(params: dict[str, Any]) -> tuple[npt.NDArray[Any], int, np.random.Generator]:
    """A chunk of ``params`` (:data:`chunks`), its E, and a generator for the rest of the example."""
    rng = np.random.default_rng(params["seed"])
    k = params["k"]
    experts = min(k + params["extra_experts"], 300)
    dtype = np.uint16 if params["wide"] else np.uint8
    shape = (params["layers"], params["rows"], k)
    ids = _chunk(rng, shape, experts, dtype, params["skew"], params["repeat"], params["pool"], params["n_bad"])
    return ids, experts, rng


@NEEDS_REFERENCE
def test_the_numpy_kernels_speak_the_reference_s_codes() -> None:
    """Statuses, accept rules, policies and mode bits: the numbers the compiled reference uses."""
    for name in kernels_numpy.__all__:
        value = getattr(kernels_numpy, name)
        if not callable(value):
            assert value == getattr(reference, name), name


# -- (a) the reference's chunks ---------------------------------------------------------------------------------
@NEEDS_REFERENCE
@settings(SETTINGS, max_examples=400)
@given(params=chunks, policy=st.sampled_from(POLICIES))
def test_chunks_the_reference_encodes_decode_alike(params: dict[str, Any], policy: int) -> None:
    ids, experts, rng = _draw(params)
    gaps, rest, _, _ = reference.encode_chunk(ids, _words(ids), experts, policy)
    sections = (_readonly(gaps), _readonly(rest))
    note(f"modes {list(rest[-9 - ids.shape[0] : -9])}")
    for as_words in _as_words_choices(ids.dtype, ids.shape[2]):
        for accept in ACCEPT_RULES:
            window = _window(rng, *ids.shape[:2])
            status, out = _compare(sections, experts, ids.shape, ids.dtype, window, accept, 0, as_words)
            if accept == kernels_numpy.ANY_ROWS:
                assert status == (kernels_numpy.OK, 0)
                (l0, l1), (r0, r1) = window
                np.testing.assert_array_equal(out, ids[l0:l1, r0:r1])


@NEEDS_REFERENCE
@pytest.mark.parametrize(
    ("experts", "k", "dtype"),
    [(64, 8, np.uint8), (64, 6, np.uint8), (300, 8, np.uint16), (300, 8, np.uint8), (120, 6, np.uint16)],
)
@pytest.mark.parametrize("policy", [kernels_numpy.AUTO, kernels_numpy.ALWAYS])
def test_ranked_layers_and_dictionaries_decode_alike(experts: int, k: int, dtype: Any, policy: int) -> None:
    """Skewed layers of recurring sets: the reference ranks them and gives them dictionaries (more than 256 entries
    in one layer: two-byte indices), the case the random chunks above reach less often."""
    rng = np.random.default_rng(experts * k)
    shape = (3, 2000, k)
    ids = np.concatenate(
        [
            _chunk(rng, (2, 2000, k), experts, dtype, 3.0, 0.3, 600, 3),
            _chunk(rng, (1, 2000, k), experts, dtype, 30.0, 0.5, 40, 0),
        ]
    )
    gaps, rest, _, _ = reference.encode_chunk(ids, _words(ids), experts, policy)
    modes = list(rest[-9 - shape[0] : -9])
    assert any(mode & 1 for mode in modes) and any(mode & kernels_numpy.DICTIONARY for mode in modes), modes
    sections = (_readonly(gaps), _readonly(rest))
    for as_words in _as_words_choices(ids.dtype, k):
        for window in [((0, 3), (0, 2000)), ((1, 3), (17, 1999)), ((0, 1), (1999, 2000)), ((2, 3), (5, 6))]:
            for accept in ACCEPT_RULES:
                _compare(sections, experts, shape, ids.dtype, window, accept, 0, as_words)


# -- (b) the numpy encoder's chunks -----------------------------------------------------------------------------
@NEEDS_REFERENCE
@settings(SETTINGS, max_examples=250)
@given(params=chunks, policy=st.sampled_from(POLICIES))
def test_chunks_the_numpy_encoder_writes_decode_exactly_through_both(params: dict[str, Any], policy: int) -> None:
    ids, experts, rng = _draw(params)
    layers, rows, k = ids.shape
    gaps, rest, placed, matched = kernels_numpy.encode_chunk(ids, _words(ids), experts, policy)
    assert gaps.dtype == rest.dtype == np.uint8 and gaps.size == placed * k * ids.itemsize
    modes = list(rest[-9 - layers : -9])
    assert rest[-1] == 1 and not any(mode & (1 | kernels_numpy.DICTIONARY) for mode in modes)
    assert int.from_bytes(rest[-9:-5].tobytes(), "little") == placed and 0 <= matched <= placed
    reference_sections = reference.encode_chunk(ids, _words(ids), experts, kernels_numpy.NEVER)
    if not any(mode & 1 for mode in reference_sections[1][-9 - layers : -9]):  # then the same bytes
        np.testing.assert_array_equal(gaps, reference_sections[0])
        np.testing.assert_array_equal(rest, reference_sections[1])
        assert placed == reference_sections[2]
    sections = (_readonly(gaps), _readonly(rest))
    for as_words in _as_words_choices(ids.dtype, k):
        whole = ((0, layers), (0, rows))
        for decoder in (reference.decode_chunk, kernels_numpy.decode_chunk):
            status, out = _decode(decoder, sections, experts, ids.shape, ids.dtype, whole, 0, 0, as_words)
            assert status == (kernels_numpy.OK, 0)
            np.testing.assert_array_equal(out, ids)
        for accept in ACCEPT_RULES:
            _compare(sections, experts, ids.shape, ids.dtype, _window(rng, layers, rows), accept, 0, as_words)


def _use_numpy_kernels(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Route routelog.format.kernels (what ranked.py and codec.py call) to the numpy kernels, with the arguments
    it takes; returns the calls each gets."""
    calls: Counter[str] = Counter()

    def decode_chunk(*args: Any) -> tuple[int, int]:
        calls["decode_chunk"] += 1
        gaps, rest, experts, layers, rows, out, first_layer, first_row, accept, fill_value = args
        return kernels_numpy.decode_chunk(
            gaps, rest, experts, layers, rows, out, None, first_layer, first_row, accept, fill_value
        )

    def encode_chunk(ids: npt.NDArray[Any], experts: int, dictionaries: int) -> tuple[Any, ...]:
        calls["encode_chunk"] += 1
        return kernels_numpy.encode_chunk(ids, None, experts, dictionaries)

    def first_invalid_row(ids: npt.NDArray[Any], experts: int, ascending: bool) -> int:
        calls["first_invalid_row"] += 1
        return kernels_numpy.first_invalid_row(ids, None, experts, ascending)

    def sort_rows_of_eight(ids: npt.NDArray[Any], out: npt.NDArray[Any], tokens: int, layers: int, largest: int) -> int:
        calls["sort_rows_of_eight"] += 1
        return kernels_numpy.sort_rows_of_eight(ids, out, tokens, layers, ids.dtype.type(largest))

    for function in (decode_chunk, encode_chunk, first_invalid_row, sort_rows_of_eight):
        monkeypatch.setattr(kernels, function.__name__, function)
    monkeypatch.setattr(kernels, "IMPLEMENTATION", "numpy")
    # The set-context codec's Python passes in place of its compiled ones (context.py calls them where not built).
    monkeypatch.setattr(context, "_COMPILED", None)
    for name in ("decode_layer", "decode_escapes", "decode_referenced", "decode_list", "decode_tables"):
        python = getattr(context_python, name)

        def counted(*args: Any, _name: str = name, _python: Any = python) -> Any:
            calls[f"context.{_name}"] += 1
            return _python(*args)

        monkeypatch.setattr(context_python, name, counted)
    return calls


def test_the_codec_writes_through_the_numpy_encoder_and_reads_back_through_the_normal_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ranked.encode through the numpy kernels (zstd frames, the level chosen by the repeats it counts), then
    ranked.decode through the kernels this process normally runs: the same IDs, whole and as a window."""
    rng = np.random.default_rng(5)
    ids = _chunk(rng, (4, 1000, 8), 64, np.uint8, 3.0, 0.5, 40, 3)
    with monkeypatch.context() as patched:
        calls = _use_numpy_kernels(patched)
        payload = ranked.encode(ids, 64)
        assert calls["encode_chunk"] == 1
    np.testing.assert_array_equal(ranked.decode(payload, ids.shape, ids.dtype, 64, accept="any"), ids)
    window = ranked.decode(payload, ids.shape, ids.dtype, 64, window=((1, 3), (100, 900)), accept="any")
    np.testing.assert_array_equal(window, ids[1:3, 100:900])


# -- (c) forged payloads ----------------------------------------------------------------------------------------
def _caller_checks(
    gaps: bytearray, rest: bytearray, shape: tuple[int, int, int], itemsize: int, rng: np.random.Generator
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]] | None:
    """What ranked.decode checks before it calls the kernel: a trailer of a known payload version, at most a chunk's
    rows of gaps, and a gaps section of exactly that many rows (here cut or padded with random bytes to fit, as a
    frame declaring that size would decompress). None where ranked.decode raises instead."""
    layers, rows, k = shape
    if len(rest) < layers + 9 or not 1 <= rest[-1] <= ranked.VERSION:
        return None
    total = int.from_bytes(rest[-9:-5], "little")
    if total > layers * rows:
        return None
    size = total * k * itemsize
    fitted = bytes(gaps[:size]) + rng.integers(0, 256, max(0, size - len(gaps)), np.uint8).tobytes()
    return _readonly(fitted), _readonly(rest)


def _forge(section: bytearray, rng: np.random.Generator, near_end: bool) -> None:
    """One random change: a byte replaced by a random one or with one bit flipped, a run of up to 8 bytes cut out,
    or up to 8 random bytes inserted; ``near_end``: half the time in the last 20 bytes (the trailer's modes and
    counts, the exceptions)."""
    if not section:
        return
    size = len(section)
    at = int(rng.integers(max(0, size - 20), size)) if near_end and rng.random() < 0.5 else int(rng.integers(size))
    kind = rng.random()
    if kind < 0.7:
        section[at] = int(rng.integers(0, 256)) if rng.random() < 0.5 else section[at] ^ (1 << int(rng.integers(8)))
    elif kind < 0.85:
        del section[at : at + int(rng.integers(1, 9))]
    else:
        section[at:at] = rng.integers(0, 256, int(rng.integers(1, 9)), np.uint8).tobytes()


@NEEDS_REFERENCE
@settings(SETTINGS, max_examples=600)
@given(params=chunks, policy=st.sampled_from(POLICIES), changes=st.integers(1, 4))
def test_forged_payloads_give_the_same_status_and_detail(params: dict[str, Any], policy: int, changes: int) -> None:
    """Damaged sections (flipped or replaced bytes, cuts, insertions: counts, bitmaps, tables, dictionaries,
    exceptions, gaps) reach every check; both decoders return the same (status, detail) and, where they write the
    whole window, the same IDs; neither raises or writes outside its window."""
    ids, experts, rng = _draw({**params, "rows": min(params["rows"], 120)})
    gaps, rest, _, _ = reference.encode_chunk(ids, _words(ids), experts, policy)
    forged_gaps, forged_rest = bytearray(gaps.tobytes()), bytearray(rest.tobytes())
    for _ in range(changes):
        if rng.random() < 0.3:
            _forge(forged_gaps, rng, False)
        else:
            _forge(forged_rest, rng, True)
    sections = _caller_checks(forged_gaps, forged_rest, ids.shape, ids.itemsize, rng)
    if sections is None:
        return
    for as_words in _as_words_choices(ids.dtype, ids.shape[2]):
        for accept in ACCEPT_RULES:
            fill = int(rng.choice([0, 0, 3, 300, -1]))
            _compare(sections, experts, ids.shape, ids.dtype, _window(rng, *ids.shape[:2]), accept, fill, as_words)


def _trailer(modes: list[int], total: int, exceptions: int, version: int = 1) -> bytes:
    return bytes(modes) + total.to_bytes(4, "little") + exceptions.to_bytes(4, "little") + bytes([version])


_IDENTITY = bytes(range(64))  # a rank -> ID table that changes nothing: a rank past E shows as it is


@NEEDS_REFERENCE
@pytest.mark.parametrize(
    ("gaps", "rest", "experts"),
    [
        (bytes(16), _trailer([8], 2, 0), 64),  # an unknown mode bit
        (bytes(16), _trailer([4], 2, 0), 64),  # a dictionary in a version-1 payload
        (bytes(16), b"\0" + _trailer([0], 2, 0), 64),  # a byte no section owns
        (bytes(8), bytes([0x80]) + _trailer([2], 1, 0), 64),  # the first row repeats
        (bytes(8), bytes([0x00]) + _trailer([2], 1, 0), 64),  # unique rows that do not add up
        (bytes(16), (3).to_bytes(4, "little") + bytes([0, 1]) + _trailer([4], 2, 0, 2), 64),  # too many entries
        (bytes(0), (0).to_bytes(4, "little") + bytes([0, 0]) + _trailer([4], 0, 0, 2), 64),  # no entries
        (bytes(8), (1).to_bytes(4, "little") + bytes([0, 1]) + _trailer([4], 1, 0, 2), 64),  # an index past the end
        (bytes(8), (1).to_bytes(4, "little") + bytes([0]) + _trailer([4], 1, 0, 2), 64),  # indices cut short
        (bytes(8), bytes(2) + _trailer([4], 1, 0, 2), 64),  # no room for the dictionary's size
        (bytes(16), (1).to_bytes(4, "little") + bytes([0, 0]) + _trailer([4], 2, 0, 2), 64),
        (bytes(16), (5).to_bytes(4, "little") + bytes(8) + _trailer([0], 2, 1), 64),  # an exception past the chunk
        (bytes(7) + bytes([60]) + bytes(8), _IDENTITY + _trailer([1], 2, 0), 64),  # a rank past E
        (bytes(8) + bytes([40] * 8), _IDENTITY + _trailer([1], 2, 0), 64),  # ranks past 255: as words they carry
        (bytes(8) + bytes([40] * 8), _trailer([0], 2, 0), 64),  # IDs past 255
        (bytes(8) + bytes([255] + [0] * 7), _IDENTITY + _trailer([1], 2, 0), 64),
        # ranks past 255 whose words (carries included) are eight distinct ranks below E: as words a set, one ID
        # at a time a rank past E
        (bytes(8) + bytes([150, 149, 210, 0, 0, 0, 0, 0]), bytes(range(200)) + _trailer([1], 2, 0), 200),
        # a ranked dictionary whose second entry holds ranks past E, named by an index past the end, or unused: as
        # words every entry is decoded first, one ID at a time only the ones named, after their index
        (
            bytes(8) + bytes([70] + [0] * 7),
            _IDENTITY + (2).to_bytes(4, "little") + bytes([0, 2]) + _trailer([5], 2, 0, 2),
            64,
        ),
        (
            bytes(8) + bytes([70] + [0] * 7),
            _IDENTITY + (2).to_bytes(4, "little") + bytes([0, 0]) + _trailer([5], 2, 0, 2),
            64,
        ),
        # a table that is no permutation: ranks of a row map to a repeated ID, or one past E
        (bytes(16), bytes([5] * 64) + _trailer([1], 2, 0), 64),
        (bytes(16), bytes([*range(7), 200, *range(8, 64)]) + _trailer([1], 2, 0), 64),
        (bytes(8) + bytes([40] * 8), bytes([*range(7), 200, *range(8, 64)]) + _trailer([1], 2, 0), 64),
    ],
)
def test_hand_forged_sections_give_the_same_status_and_detail(gaps: bytes, rest: bytes, experts: int) -> None:
    """test_ranked's forged sections, and ones where the compiled kernel's two arithmetics (rows as words, IDs one
    at a time) part ways; 1 layer, 2 rows, K = 8."""
    sections = (_readonly(gaps), _readonly(rest))
    for as_words in (False, True):
        for accept in ACCEPT_RULES:
            for window in [((0, 1), (0, 2)), ((0, 1), (1, 2)), ((0, 1), (0, 1))]:
                _compare(sections, experts, (1, 2, 8), np.dtype(np.uint8), window, accept, 0, as_words)


# -- (d) checking and sorting rows ------------------------------------------------------------------------------
@NEEDS_REFERENCE
@settings(SETTINGS, max_examples=150)
@given(
    params=chunks,
    ascending=st.booleans(),
    shuffled=st.booleans(),
    view=st.sampled_from(["whole", "window", "layer"]),
)
def test_first_invalid_row_is_the_reference_s(
    params: dict[str, Any], ascending: bool, shuffled: bool, view: str
) -> None:
    ids, experts, rng = _draw(params)
    if shuffled:  # score order: distinct IDs in any order
        ids = np.ascontiguousarray(rng.permuted(ids, axis=2))
    if view == "window":  # a reader's block: the layers' rows apart
        block = np.zeros((ids.shape[0], ids.shape[1] + 2, ids.shape[2]), ids.dtype)
        block[:, 1:-1] = ids
        ids = block[:, 1:-1]
    elif view == "layer":
        ids = ids[:1]
    words = ids.view(np.uint64)[:, :, 0] if ids.dtype == np.uint8 and ids.shape[2] == 8 else None
    for given_words in (None,) if words is None else (None, words):
        expected = reference.first_invalid_row(ids, given_words, experts, ascending)
        assert kernels_numpy.first_invalid_row(ids, given_words, experts, ascending) == expected


@NEEDS_REFERENCE
@settings(SETTINGS, max_examples=150)
@given(
    tokens=st.integers(0, 800),  # at 48 layers, three of the compiled uint8 sort's blocks of tokens
    layers=st.integers(1, 48),
    wide=st.booleans(),
    largest=st.integers(7, 400),
    bad=st.sampled_from([0.0, 0.001, 0.1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sort_rows_of_eight_is_the_reference_s(
    tokens: int, layers: int, wide: bool, largest: int, bad: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    dtype: np.dtype[Any] = np.dtype(np.uint16 if wide else np.uint8)
    top = 65535 if wide else 255
    largest = min(largest, top)
    steps = rng.integers(1, (largest + 1) // 8 + 1, (tokens * layers, 8))
    ids = rng.permuted(np.cumsum(steps, axis=1) - 1, axis=1).astype(dtype)  # eight distinct IDs, unsorted
    broken = rng.random(tokens * layers) < bad
    ids[broken] = rng.integers(0, min(largest + 20, top + 1), (int(broken.sum()), 8))
    flat = ids.reshape(-1)
    outputs = []
    for kernel in (reference.sort_rows_of_eight, kernels_numpy.sort_rows_of_eight):
        out = np.zeros(flat.size, dtype)
        outputs.append((kernel(flat, out, tokens, layers, dtype.type(largest)), out))
    (expected, expected_out), (got, got_out) = outputs
    assert got == expected
    np.testing.assert_array_equal(got_out, expected_out)


# -- (e) the golden stores --------------------------------------------------------------------------------------
def _golden_stores() -> Iterator[Path]:
    for golden in GOLDEN:
        yield from sorted(p for p in golden.iterdir() if p.is_dir())


def _read_everything(path: Path) -> dict[str, npt.NDArray[Any]]:
    store = routelog.open_store(str(path))
    found = {}
    for step in store.steps():
        snapshot = store.step(step)
        for record in snapshot.read_many(snapshot.sample_ids):
            found[f"{step}/{record.sample_id}"] = record.expert_ids
    return found


@pytest.mark.parametrize("store", list(_golden_stores()), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_stores_read_the_same_through_the_numpy_kernels(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record of every golden store, read once through the kernels this process normally runs and once
    through the numpy ones in their place (ranked.py's chunk codec, codec.py's checks of format-1 rows, and the
    set-context codec's Python passes): the same IDs, which are the ones the fixture expects."""
    copy = tmp_path / store.name
    shutil.copytree(store, copy)  # read a copy: the fixture itself must never change
    normal = _read_everything(copy)
    calls = _use_numpy_kernels(monkeypatch)
    got = _read_everything(copy)
    assert got.keys() == normal.keys() and normal
    with np.load(store.parent / "expected.npz", allow_pickle=False) as expected:
        for key, ids in normal.items():
            np.testing.assert_array_equal(got[key], ids, err_msg=key)
            np.testing.assert_array_equal(ids, expected[f"{store.name}/{key.split('/', 1)[1]}/ids"], err_msg=key)
    if store.name == "archived":  # revision 4.2's entry; its two small parts reach few of the codec's paths
        return
    features = {f for log in copy.rglob("log/*.json") for f in json.loads(log.read_text()).get("features", [])}
    if CONTEXT_LIST_REFERENCES_FEATURE in features:  # revision 3.4: the candidate tables range-coded too
        assert calls["context.decode_tables"], "the coded tables were not read by the Python passes"
    if CONTEXT_REFERENCES_FEATURE in features:  # revision 3.3: escapes and lists against references
        assert calls["context.decode_referenced"], "the referenced escapes were not read by the Python passes"
        assert calls["context.decode_list"], "the referenced lists were not read by the Python passes"
    elif CONTEXT_ESCAPES_FEATURE in features:  # revision 3.2: every set range-coded, no format-2 chunk left
        assert calls["context.decode_escapes"], "the coded escapes and lists were not read by the Python passes"
    else:
        assert calls["decode_chunk"] or calls["first_invalid_row"], "the numpy kernels were not used"
    if CONTEXT_FEATURE in features:
        assert calls["context.decode_layer"], "the set-context codec's Python passes were not used"
