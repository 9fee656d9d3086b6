"""The format-2 chunk codec (routelog.format.ranked) and its zarr-python registration."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numcodecs import Zstd

from routelog.errors import CorruptDataError
from routelog.format import kernels, ranked
from routelog.format.codec import gaps_from_sorted, storage_dtype
from routelog.format.zarr_codec import RankedGapsCodec
from routelog.synth import random_topk


def _routing(
    rng: np.random.Generator,
    layers: int,
    rows: int,
    experts: int,
    k: int,
    skew: float,
    repeat: float,
    pool: int = 0,
):
    """Sorted top-k sets ``[layers, rows, k]``: per-layer popularity (Dirichlet, ``skew`` > 0), drawn from ``pool``
    sets per layer recurring out of order (as token-determined routing does; 0: every row drawn afresh), and runs of
    rows that keep the previous row's set with probability ``repeat``."""
    out = np.empty((layers, rows, k), storage_dtype(experts))
    for j in range(layers):
        popularity = rng.dirichlet(np.full(experts, 1.0 / skew)) if skew > 0 else None
        out[j] = random_topk(rng, rows, experts, k, popularity)
        if pool and rows:
            out[j] = out[j][rng.integers(0, min(pool, rows), rows)]
        keep = rng.random(rows) < repeat
        keep[:1] = False
        source = np.maximum.accumulate(np.where(keep, 0, np.arange(rows)))
        out[j] = out[j][source]
    return np.sort(out, axis=-1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 4),
    rows=st.integers(0, 300),
    experts=st.sampled_from([1, 2, 8, 64, 128, 256, 257, 384, 1024]),
    k_frac=st.floats(0.0, 1.0),
    skew=st.sampled_from([0.0, 0.3, 3.0]),
    repeat=st.sampled_from([0.0, 0.1, 0.5, 0.95]),  # 0.1: most bitmap bytes hold no repeat
    pool=st.sampled_from([0, 3, 40]),
    n_bad=st.integers(0, 5),
    dictionaries=st.sampled_from(["auto", "never", "always"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_exact(
    layers: int,
    rows: int,
    experts: int,
    k_frac: float,
    skew: float,
    repeat: float,
    pool: int,
    n_bad: int,
    dictionaries: ranked.Dictionaries,
    seed: int,
) -> None:
    """Valid sets of any universe and K, skewed or not, with repeats and recurring sets, and rows that are no top-k
    set at all (the codec keeps those verbatim; only a decode told to accept any row returns them) all decode to
    exactly what was encoded, with or without dictionaries."""
    rng = np.random.default_rng(seed)
    k = max(1, round(k_frac * experts))
    ids = _routing(rng, layers, rows, experts, k, skew, repeat, pool)
    if rows and n_bad:
        where = rng.integers(0, rows, size=(n_bad, 2))
        for j, r in where:
            ids[j % layers, r] = rng.integers(0, np.iinfo(ids.dtype).max + 1, size=k, dtype=np.int64)
    payload = ranked.encode(ids, experts, dictionaries=dictionaries)
    back = ranked.decode(payload, ids.shape, ids.dtype, experts, accept="any")
    assert back.dtype == ids.dtype
    np.testing.assert_array_equal(back, ids)
    if _all_sets(ids, experts):
        np.testing.assert_array_equal(ranked.decode(payload, ids.shape, ids.dtype, experts, accept="sets"), ids)
    else:
        with pytest.raises(ranked.RankedFormatError, match="no set of distinct ascending IDs"):
            ranked.decode(payload, ids.shape, ids.dtype, experts, accept="sets")


def test_skewed_repeating_routing_is_smaller_than_format_1() -> None:
    """What the codec is for: with skewed expert load and repeats it beats format 1's ID gaps; on uniform routing it
    falls back to the same gaps (within the size of its repeat bitmap)."""
    zstd = Zstd(level=3)
    rng = np.random.default_rng(3)

    def sizes(ids: np.ndarray) -> tuple[int, int]:
        v2 = len(ranked.encode(ids, 128))
        v1 = len(zstd.encode(gaps_from_sorted(ids.copy())))
        return v2, v1

    v2, v1 = sizes(_routing(rng, 4, 4096, 128, 8, skew=3.0, repeat=0.3))
    assert v2 < 0.85 * v1
    v2, v1 = sizes(_routing(rng, 4, 4096, 128, 8, skew=0.0, repeat=0.0))
    assert v2 <= v1 + 4 * 4096 // 8 + 64


def test_uniform_layers_keep_plain_gaps_and_skewed_ones_are_ranked() -> None:
    rng = np.random.default_rng(5)
    uniform = _routing(rng, 1, 4096, 128, 8, skew=0.0, repeat=0.0)
    skewed = _routing(rng, 1, 4096, 128, 8, skew=3.0, repeat=0.0)
    _gaps, rest, _matching = ranked._sections(np.concatenate([uniform, skewed]), 128)
    assert list(rest[-11:-9]) == [ranked.MODE_GAPS, ranked.MODE_RANKED]  # the trailer's layer modes


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p[:-1],  # truncated
        lambda p: p + b"\0",  # trailing bytes
        lambda p: (10**6).to_bytes(4, "little") + p[4:],  # the gaps frame claims more than there is
        lambda p: p[:4] + p[5:],  # a damaged frame
    ],
)
def test_malformed_chunks_raise_a_typed_error(damage) -> None:
    ids = _routing(np.random.default_rng(1), 2, 100, 64, 4, skew=3.0, repeat=0.5)
    payload = ranked.encode(ids, 64)
    with pytest.raises(ranked.RankedFormatError):
        ranked.decode(damage(payload), ids.shape, ids.dtype, 64)


def test_a_section_that_declares_more_than_a_chunk_holds_is_refused_before_decoding() -> None:
    """A forged frame header cannot make the reader allocate what it claims."""
    ids = _routing(np.random.default_rng(2), 2, 100, 64, 4, skew=0.0, repeat=0.0)
    huge = Zstd(level=3).encode(np.zeros(10_000, np.uint8))  # declares 10 000 bytes; the chunk's gaps are 800
    stored = ranked.encode(ids, 64)
    rest = stored[4 + int.from_bytes(stored[:4], "little") :]
    forged = len(huge).to_bytes(4, "little") + bytes(huge) + rest
    with pytest.raises(ranked.RankedFormatError, match="declares 10000 bytes; a chunk holds exactly 800"):
        ranked.decode(forged, ids.shape, ids.dtype, 64)


@pytest.mark.parametrize(("experts", "k"), [(300, 4), (64, 8)])  # IDs one at a time, and rows as words
@settings(max_examples=200, deadline=None)
@given(
    position=st.integers(0, 10_000),
    value=st.integers(0, 255),
    seed=st.integers(0, 3),
    accept=st.sampled_from(["any", "sets", "sets_or_fill"]),
)
def test_any_flipped_byte_decodes_or_raises_the_typed_error(
    experts: int, k: int, position: int, value: int, seed: int, accept: ranked.Accept
) -> None:
    """A damaged payload (crc32c catches it first in a store) never escapes as another exception type, and what it
    decodes to holds only rows ``accept`` allows."""
    n_bad = 1 if accept == "any" else 0
    ids = _with_bad_rows(
        np.random.default_rng(seed), _routing(np.random.default_rng(seed), 2, 64, experts, k, 3.0, 0.5), n_bad
    )
    payload = bytearray(ranked.encode(ids, experts))
    payload[position % len(payload)] = value
    try:
        out = ranked.decode(bytes(payload), ids.shape, ids.dtype, experts, accept=accept)
    except ranked.RankedFormatError:
        return
    assert out.shape == ids.shape
    if accept != "any":
        assert _all_sets(out, experts, fill=0 if accept == "sets_or_fill" else None)


@pytest.mark.parametrize("experts", [128, 384])
def test_zarr_python_writes_and_reads_through_the_registered_codec(tmp_path: Path, experts: int) -> None:
    """With routelog installed, plain zarr finds the codec by its name (entry point), including sharded arrays with
    padded edge chunks (the fill value 0 is no top-k set: the codec keeps it verbatim)."""
    ids = _routing(np.random.default_rng(7), 5, 1000, experts, 6, skew=3.0, repeat=0.4)
    array = zarr.create_array(
        str(tmp_path / "routing"),
        shape=ids.shape,
        dtype=ids.dtype,
        shards=(6, 1024, 6),
        chunks=(3, 256, 6),
        serializer=RankedGapsCodec(num_experts=experts),
        compressors=None,  # the codec compresses its own output
        fill_value=0,
    )
    array[...] = ids
    reopened = zarr.open_array(str(tmp_path / "routing"), mode="r")
    assert reopened.metadata.to_dict()["codecs"][0]["configuration"]["codecs"][0] == {
        "name": ranked.RANKED_CODEC,
        "configuration": {"num_experts": experts, "level": 3},
    }
    np.testing.assert_array_equal(reopened[...], ids)
    np.testing.assert_array_equal(reopened[1:4, 300:700], ids[1:4, 300:700])


def _all_sets(ids: np.ndarray, experts: int, fill: int | None = None) -> bool:
    """Every row of ``ids`` ``[..., K]`` is K strictly ascending IDs below ``experts`` (or holds ``fill`` alone)."""
    rows = ids.reshape(-1, ids.shape[-1]).astype(np.int64)
    valid = (rows[:, -1] < experts) & (np.diff(rows, axis=1) > 0).all(axis=1)
    if fill is not None:
        valid |= (rows == fill).all(axis=1)
    return bool(valid.all())


def _with_bad_rows(rng: np.random.Generator, ids: np.ndarray, n_bad: int) -> np.ndarray:
    """``ids`` with ``n_bad`` rows replaced by random values (no valid set, mostly: the codec lists them)."""
    ids = ids.copy()
    layers, rows, k = ids.shape
    for _ in range(n_bad if rows else 0):
        ids[rng.integers(layers), rng.integers(rows)] = rng.integers(0, np.iinfo(ids.dtype).max + 1, size=k)
    return ids


def _one_id_at_a_time(patch: pytest.MonkeyPatch) -> None:
    """Decode rows of eight uint8 IDs as the compiled kernels decode other rows: one ID at a time, not as words."""
    if kernels.IMPLEMENTATION != "compiled":
        pytest.skip("the compiled kernels are not built here")
    from routelog.format import _ckernels  # type: ignore[attr-defined]

    original = _ckernels.decode_chunk
    patch.setattr(kernels, "decode_chunk", lambda *args: tuple(original(*args, False)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 600),
    experts=st.sampled_from([8, 9, 64, 65, 128, 256]),
    skew=st.sampled_from([0.0, 0.3, 3.0]),
    repeat=st.sampled_from([0.0, 0.1, 0.5, 0.95]),
    pool=st.sampled_from([0, 5, 60]),
    n_bad=st.integers(0, 4),
    policy=st.sampled_from([kernels.AUTO, kernels.NEVER, kernels.ALWAYS]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_as_words_store_what_rows_one_id_at_a_time_store(
    rows: int, experts: int, skew: float, repeat: float, pool: int, n_bad: int, policy: int, seed: int
) -> None:
    """Eight uint8 IDs per row take the compiled kernels' 64-bit word path; the per-ID path must write the same
    sections, and each path must decode the other's output."""
    if kernels.IMPLEMENTATION != "compiled":
        pytest.skip("the compiled kernels are not built here")
    from routelog.format import _ckernels  # type: ignore[attr-defined]

    rng = np.random.default_rng(seed)
    ids = _with_bad_rows(rng, _routing(rng, 3, rows, experts, 8, skew, repeat, pool), n_bad)
    words = _ckernels.encode_chunk(ids, experts, policy, True)
    one_at_a_time = _ckernels.encode_chunk(ids, experts, policy, False)
    assert words == one_at_a_time
    for as_words in (True, False):
        out = np.empty_like(ids)
        gaps, rest = np.frombuffer(words[0], np.uint8), np.frombuffer(words[1], np.uint8)
        status = _ckernels.decode_chunk(gaps, rest, experts, *ids.shape[:2], out, 0, 0, kernels.ANY_ROWS, 0, as_words)
        assert status == (kernels.OK, 0)
        np.testing.assert_array_equal(out, ids)


@pytest.mark.parametrize(("experts", "k"), [(64, 8), (300, 4)])  # rows as words, and IDs one at a time
def test_a_chunk_decodes_in_place_into_a_window_of_a_larger_block(experts: int, k: int) -> None:
    """A reader's block takes a whole chunk where it lies: each layer's rows are contiguous, the layers are not."""
    ids = _with_bad_rows(np.random.default_rng(3), _routing(np.random.default_rng(3), 3, 50, experts, k, 3.0, 0.4), 2)
    block = np.full((5, 80, k), 7, ids.dtype)
    window = block[1:4, 20:70]
    assert not window.flags.c_contiguous
    ranked.decode(ranked.encode(ids, experts), ids.shape, ids.dtype, experts, out=window, accept="any")
    np.testing.assert_array_equal(window, ids)
    untouched = np.ones(block.shape[:2], bool)
    untouched[1:4, 20:70] = False
    assert (block[untouched] == 7).all(), "nothing outside the window is written"
    with pytest.raises(ValueError, match="rows are contiguous"):
        ranked.decode(ranked.encode(ids, experts), ids.shape, ids.dtype, experts, out=block[1:4, 20:70:1, ::-1])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 4),
    rows=st.integers(1, 200),
    shape=st.sampled_from([(64, 8), (256, 8), (300, 4), (1024, 8)]),
    skew=st.sampled_from([0.0, 3.0]),
    repeat=st.sampled_from([0.0, 0.1, 0.6, 0.97]),
    n_bad=st.integers(0, 4),
    as_words=st.booleans(),
    data=st.data(),
)
def test_a_window_decodes_to_that_part_of_the_chunk(
    layers: int,
    rows: int,
    shape: tuple[int, int],
    skew: float,
    repeat: float,
    n_bad: int,
    as_words: bool,
    data: st.DataObject,
) -> None:
    """Any window of layers and rows (one starting or ending on a repeat, in a ranked or plain layer, over
    exceptions and the repeats that follow them) decodes to exactly that part of the chunk, on both kernel paths,
    and writes nothing outside ``out``."""
    experts, k = shape
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ids = _with_bad_rows(rng, _routing(rng, layers, rows, experts, k, skew, repeat), n_bad)
    for j, r in rng.integers(0, [layers, rows], size=(n_bad, 2)):  # repeats of exceptions
        ids[j, r:] = ids[j, r]
        ids[j, min(rows - 1, r + 3) :] = ids[j, -1]
    l0 = data.draw(st.integers(0, layers - 1))
    l1 = data.draw(st.integers(l0 + 1, layers))
    r0 = data.draw(st.integers(0, rows - 1))
    r1 = data.draw(st.integers(r0, rows))
    payload = ranked.encode(ids, experts)
    buffer = np.full((l1 - l0 + 1, r1 - r0 + 2, k), 7, ids.dtype)
    out = buffer[: l1 - l0, 1 : r1 - r0 + 1]
    with pytest.MonkeyPatch.context() as patch:
        if not as_words:
            _one_id_at_a_time(patch)
        ranked.decode(payload, ids.shape, ids.dtype, experts, out=out, window=((l0, l1), (r0, r1)), accept="any")
    np.testing.assert_array_equal(out, ids[l0:l1, r0:r1])
    untouched = np.ones(buffer.shape[:2], bool)
    untouched[: l1 - l0, 1 : r1 - r0 + 1] = False
    assert (buffer[untouched] == 7).all()


def test_a_window_outside_the_chunk_or_a_mismatched_out_is_refused() -> None:
    ids = _routing(np.random.default_rng(5), 2, 40, 64, 8, 3.0, 0.5)
    payload = ranked.encode(ids, 64)
    for window in [((0, 3), (0, 40)), ((1, 0), (0, 40)), ((0, 2), (10, 41)), ((0, 2), (-1, 5))]:
        with pytest.raises(ValueError, match="not inside a chunk"):
            ranked.decode(payload, ids.shape, ids.dtype, 64, window=window)
    with pytest.raises(ValueError, match="shape"):
        ranked.decode(payload, ids.shape, ids.dtype, 64, out=np.empty((2, 40, 8), ids.dtype), window=((0, 1), (0, 40)))


@pytest.mark.parametrize(("experts", "k"), [(64, 8), (300, 4), (4, 8)])
def test_chunks_of_fill_values_round_trip(experts: int, k: int) -> None:
    """Zarr's edge padding (all zeros: no valid set) and K above the universe are exceptions, not crashes."""
    ids = np.zeros((2, 37, k), storage_dtype(experts))
    np.testing.assert_array_equal(ranked.decode(ranked.encode(ids, experts), ids.shape, ids.dtype, experts), ids)


def test_the_gaps_frame_takes_the_configured_level_only_where_rows_repeat_earlier_ones() -> None:
    """Near-uniform chunks compress their gaps at level 1 (smaller and faster there); chunks whose rows repeat
    earlier ones at the configured level (its larger tables find the matches), unless a dictionary holds each of
    those sets once."""
    rng = np.random.default_rng(11)
    uniform = _routing(rng, 4, 4096, 64, 8, skew=0.0, repeat=0.0)
    motifs = _routing(rng, 4, 64, 64, 8, skew=3.0, repeat=0.0)
    recurring = motifs[:, rng.integers(0, 64, size=4096)]  # a few sets, recurring out of order
    assert not ranked._sections(uniform, 64)[2]
    assert ranked._sections(recurring, 64, "never")[2]
    assert not ranked._sections(recurring, 64)[2], "recurring sets take a dictionary: no repeats left to match"


def _forged(gaps: bytes, rest: bytes) -> bytes:
    """A chunk payload from raw sections (either may break the format)."""
    zstd = Zstd(level=1)
    first = bytes(zstd.encode(gaps))
    return len(first).to_bytes(4, "little") + first + bytes(zstd.encode(rest))


def _trailer(modes: list[int], unique: int, exceptions: int, version: int = 1) -> bytes:
    return bytes(modes) + unique.to_bytes(4, "little") + exceptions.to_bytes(4, "little") + bytes([version])


@pytest.mark.parametrize(
    ("gaps", "rest", "message"),
    [
        (bytes(16), _trailer([4], 2, 0), "unknown layer mode"),
        (bytes(16), _trailer([0], 2, 0, version=3), "version"),
        (bytes(16), _trailer([8], 2, 0, version=2), "unknown layer mode"),
        (bytes(16), b"\0" + _trailer([0], 2, 0), "sections take"),  # a byte no section owns
        (bytes(24), _trailer([0], 3, 0), "unique rows in a chunk"),
        (bytes(8), bytes([0x80]) + _trailer([2], 1, 0), "first row"),
        (bytes(8), bytes([0x00]) + _trailer([2], 1, 0), "leave 2 rows of gaps"),
        # a dictionary (payload version 2): its size, then an entry index per unique row (one byte up to 256)
        (bytes(16), (3).to_bytes(4, "little") + bytes([0, 1]) + _trailer([4], 2, 0, 2), "more entries than unique"),
        (bytes(0), (0).to_bytes(4, "little") + bytes([0, 0]) + _trailer([4], 0, 0, 2), "more entries than unique"),
        (bytes(8), (1).to_bytes(4, "little") + bytes([0, 1]) + _trailer([4], 1, 0, 2), "past the end of its dict"),
        (bytes(8), (1).to_bytes(4, "little") + bytes([0]) + _trailer([4], 1, 0, 2), "sections take"),
        (bytes(8), bytes(2) + _trailer([4], 1, 0, 2), "sections take"),  # no room for the dictionary's size
        (bytes(16), (1).to_bytes(4, "little") + bytes([0, 0]) + _trailer([4], 2, 0, 2), "leave 1 rows of gaps"),
        (bytes(16), (5).to_bytes(4, "little") + bytes(8) + _trailer([0], 2, 1), "outside the chunk"),
        (bytes(7) + bytes([60]) + bytes(8), bytes(range(64)) + _trailer([1], 2, 0), "rank outside"),
        (bytes(8) + bytes([40] * 8), bytes(range(64)) + _trailer([1], 2, 0), "rank outside"),  # past 255
    ],
)
@pytest.mark.parametrize("as_words", [True, False])
def test_forged_sections_raise_the_typed_error(
    gaps: bytes, rest: bytes, message: str, as_words: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every count and index the sections give is checked before it is used, on both kernel paths (rows of eight
    uint8 IDs as 64-bit words, and one ID at a time). The chunk: 1 layer, 2 rows, K = 8, E = 64."""
    if not as_words:
        _one_id_at_a_time(monkeypatch)
    with pytest.raises(ranked.RankedFormatError, match=message):
        ranked.decode(_forged(gaps, rest), (1, 2, 8), np.dtype(np.uint8), 64)


@pytest.mark.parametrize(("experts", "k"), [(300, 4), (64, 8), (64, 5)])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), seed=st.integers(0, 3))
def test_damaged_sections_decode_or_raise_the_typed_error(experts: int, k: int, data: st.DataObject, seed: int) -> None:
    """The kernels see whatever the frames decompress to: sections with damaged bytes (counts, bitmaps, tables,
    exception indices, gaps) decode to something or raise the typed error, never crash or write outside ``out``,
    whether the whole chunk is decoded or a window of it."""
    ids = _with_bad_rows(
        np.random.default_rng(seed), _routing(np.random.default_rng(seed), 3, 50, experts, k, 3.0, 0.5, pool=8), 2
    )
    gaps, rest, _ = ranked._sections(ids, experts, data.draw(st.sampled_from(["never", "always"])))
    gaps, rest = bytearray(gaps.tobytes()), bytearray(rest.tobytes())
    for _ in range(data.draw(st.integers(1, 4))):
        section = data.draw(st.sampled_from([gaps, rest]))
        if section:
            section[data.draw(st.integers(0, len(section) - 1))] = data.draw(st.integers(0, 255))
    l0, l1 = sorted(data.draw(st.tuples(st.integers(0, ids.shape[0]), st.integers(0, ids.shape[0]))))
    r0, r1 = sorted(data.draw(st.tuples(st.integers(0, ids.shape[1]), st.integers(0, ids.shape[1]))))
    wanted = (l1 - l0, r1 - r0, k)
    size = math.prod(wanted)
    buffer = np.full(size + 64, 7, ids.dtype)  # guard values past the window
    with contextlib.suppress(ranked.RankedFormatError):
        ranked.decode(
            _forged(bytes(gaps), bytes(rest)),
            ids.shape,
            ids.dtype,
            experts,
            out=buffer[:size].reshape(wanted),
            window=((l0, l1), (r0, r1)),
        )
    assert (buffer[size:] == 7).all()


def test_uint8_ids_of_a_larger_universe_round_trip() -> None:
    """No store writes uint8 IDs for more than 256 experts, but zarr may hand the codec such an array: ranks still
    fit the IDs' width (experts no row names rank last, by ID)."""
    ids = _routing(np.random.default_rng(12), 2, 500, 256, 8, skew=3.0, repeat=0.3)
    np.testing.assert_array_equal(ranked.decode(ranked.encode(ids, 300), ids.shape, ids.dtype, 300), ids)


def _payload_version_and_modes(payload: bytes, layers: int) -> tuple[int, list[int]]:
    """The trailer's payload version and layer modes."""
    first = int.from_bytes(payload[:4], "little")
    rest = Zstd().decode(payload[4 + first :])
    return rest[-1], list(rest[-9 - layers : -9])


def test_recurring_sets_take_a_dictionary_and_other_chunks_keep_payload_version_1() -> None:
    """Sets that recur out of order (token-determined routing) are stored once per layer with an index per row:
    smaller than zstd's matches of them. A chunk with no dictionary writes the version-1 payload byte for byte, so
    readers that predate dictionaries still read it."""
    rng = np.random.default_rng(21)
    recurring = _routing(rng, 4, 4096, 64, 8, skew=1.0, repeat=0.2, pool=300)
    version, modes = _payload_version_and_modes(ranked.encode(recurring, 64), 4)
    assert version == 2 and all(mode & kernels.DICTIONARY for mode in modes)
    assert len(ranked.encode(recurring, 64)) < 0.8 * len(ranked.encode(recurring, 64, dictionaries="never"))
    uniform = _routing(rng, 4, 4096, 64, 8, skew=0.0, repeat=0.1)
    assert ranked.encode(uniform, 64) == ranked.encode(uniform, 64, dictionaries="never")
    assert _payload_version_and_modes(ranked.encode(uniform, 64), 4)[0] == 1


@pytest.mark.parametrize(("experts", "k"), [(64, 8), (64, 6), (300, 8)])  # words, one ID at a time, uint16
def test_a_dictionary_of_more_than_256_entries_takes_two_byte_indices(experts: int, k: int) -> None:
    rng = np.random.default_rng(experts + k)
    ids = _routing(rng, 2, 3000, experts, k, skew=0.5, repeat=0.3, pool=700)
    payload = ranked.encode(ids, experts, dictionaries="always")
    first = int.from_bytes(payload[:4], "little")
    rest = Zstd().decode(payload[4 + first :])
    modes = list(rest[-11:-9])
    assert all(mode & kernels.DICTIONARY for mode in modes)
    at = math.ceil(3000 / 8) * sum(1 for mode in modes if mode & 2) + experts * ids.itemsize * sum(m & 1 for m in modes)
    entries = int.from_bytes(rest[at : at + 4], "little")  # the first layer's, after bitmaps and tables
    assert entries > 256, "the first layer's dictionary needs a high byte"
    np.testing.assert_array_equal(ranked.decode(payload, ids.shape, ids.dtype, experts), ids)
    for l0, r0, r1 in [(0, 0, 1), (1, 1500, 3000), (0, 17, 2222), (1, 2999, 3000)]:
        window = ranked.decode(payload, ids.shape, ids.dtype, experts, window=((l0, l0 + 1), (r0, r1)))
        np.testing.assert_array_equal(window, ids[l0 : l0 + 1, r0:r1])


@pytest.mark.parametrize("as_words", [True, False])
def test_a_hand_written_dictionary_decodes_as_the_format_says(as_words: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """FORMAT.md section 5, written out: one layer of rows A, B, A, A (the last a repeat of the one before): three
    unique rows naming two entries, A (used twice) first."""
    if not as_words:
        _one_id_at_a_time(monkeypatch)
    a, b = np.arange(8), np.arange(1, 17, 2)
    gaps = bytes(gaps_from_sorted(np.stack([a, b]).astype(np.uint8)).tobytes())
    rest = bytes([0b0001_0000]) + (2).to_bytes(4, "little") + bytes([0, 1, 0]) + _trailer([6], 2, 0, version=2)
    out = ranked.decode(_forged(gaps, rest), (1, 4, 8), np.dtype(np.uint8), 64)
    np.testing.assert_array_equal(out[0], np.stack([a, b, a, a]))


@pytest.mark.parametrize(("experts", "k"), [(64, 8), (300, 4)])  # rows as words, and IDs one at a time
def test_decoded_rows_that_are_no_set_are_refused_except_fill_in_a_whole_chunk(experts: int, k: int) -> None:
    """FORMAT.md sections 4-5: every stored row is a set; edge padding is unspecified. A reader's window (which never
    covers padding) must hold sets only; a whole chunk (zarr decodes padding too) may also hold rows of the fill value
    alone where an exception stores them, as the zarr codec writes zarr's padding."""
    ids = _routing(np.random.default_rng(4), 2, 60, experts, k, 3.0, 0.3)
    ids[1, 40:] = 0  # zarr's padding of an edge chunk: exceptions (and repeats of them)
    payload = ranked.encode(ids, experts)
    np.testing.assert_array_equal(ranked.decode(payload, ids.shape, ids.dtype, experts), ids)
    np.testing.assert_array_equal(
        ranked.decode(payload, ids.shape, ids.dtype, experts, window=((0, 2), (0, 40))), ids[:, :40]
    )
    with pytest.raises(ranked.RankedFormatError, match=r"layer 1 row 40 of the chunk decodes to \[0, 0"):
        ranked.decode(payload, ids.shape, ids.dtype, experts, window=((1, 2), (30, 50)))
    with pytest.raises(ranked.RankedFormatError, match=r"layer 1 row 40 .* no set of distinct ascending IDs in"):
        ranked.decode(payload, ids.shape, ids.dtype, experts, accept="sets")
    with pytest.raises(ranked.RankedFormatError, match="layer 1 row 40"):  # another fill value: these are no padding
        ranked.decode(payload, ids.shape, ids.dtype, experts, fill_value=7)
    ids[1, 40:] = 7
    np.testing.assert_array_equal(
        ranked.decode(ranked.encode(ids, experts), ids.shape, ids.dtype, experts, fill_value=7), ids
    )


@pytest.mark.parametrize("as_words", [True, False])
def test_a_row_of_the_fill_value_that_no_exception_stores_is_refused(
    as_words: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gaps that wrap (0, then 255 + 1 more per ID) give a row of zeros: no exception stores it, so it is no padding
    zarr wrote, and even a whole-chunk decode refuses it. The chunk: 1 layer, 2 rows, K = 8, E = 64."""
    if not as_words:
        _one_id_at_a_time(monkeypatch)
    forged = _forged(bytes([0] + [255] * 7) + bytes(8), _trailer([0], 2, 0))
    out = ranked.decode(forged, (1, 2, 8), np.dtype(np.uint8), 64, accept="any")
    assert not _all_sets(out[0, :1], 64)
    np.testing.assert_array_equal(out[0, 1], np.arange(8))
    for accept in ("sets", "sets_or_fill"):
        with pytest.raises(ranked.RankedFormatError, match=r"layer 0 row 0 of the chunk decodes to \["):
            ranked.decode(forged, (1, 2, 8), np.dtype(np.uint8), 64, accept=accept)  # type: ignore[arg-type]


@pytest.mark.parametrize("fill_value", [0, 5])
def test_zarr_python_reads_its_own_edge_padding_and_refuses_forged_rows(tmp_path: Path, fill_value: int) -> None:
    """zarr pads edge chunks with its fill value (stored as exceptions) and decodes them whole: that reads back; a
    chunk whose rows are no sets raises CorruptDataError through zarr's own read."""
    ids = _routing(np.random.default_rng(8), 3, 300, 64, 8, skew=3.0, repeat=0.4)
    array = zarr.create_array(
        str(tmp_path / "routing"),
        shape=ids.shape,
        dtype=ids.dtype,
        chunks=(2, 128, 8),
        serializer=RankedGapsCodec(num_experts=64),
        compressors=None,
        fill_value=fill_value,
    )
    array[...] = ids
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "routing"), mode="r")[...], ids)
    forged = ids[:2, :128].copy()
    forged[0, 3] = [3, 3, 4, 5, 6, 7, 8, 9]  # the codec keeps it as an exception: no set
    (tmp_path / "routing" / "c" / "0" / "0" / "0").write_bytes(ranked.encode(forged, 64))
    with pytest.raises(CorruptDataError, match=r"layer 0 row 3 of the chunk decodes to \[3, 3, 4"):
        zarr.open_array(str(tmp_path / "routing"), mode="r")[...]


def test_a_view_encodes_to_the_bytes_of_its_contiguous_copy() -> None:
    """The encoder reads a block of a part's array in place (each layer's rows contiguous, the layers apart) and
    copies any other view first: either way the bytes are those of the contiguous array."""
    rng = np.random.default_rng(5)
    ids = np.sort(np.argsort(rng.random((8, 300, 40)), axis=-1)[..., :8], axis=-1).astype(np.uint8)
    ids[:, 1::3] = ids[:, ::3][:, : ids[:, 1::3].shape[1]]  # repeats, so the layers take every mode
    wide = ids.astype(np.uint16) * 7
    for array, experts in ((ids, 40), (wide, 280)):
        for view in (array[::2], array[::-1], array[2:5], array[:, 10:250], array[:1], array[:, ::2]):
            assert ranked.encode(view, experts) == ranked.encode(np.ascontiguousarray(view), experts)
            decoded = ranked.decode(ranked.encode(view, experts), view.shape, view.dtype, experts)
            assert np.array_equal(decoded, view)
