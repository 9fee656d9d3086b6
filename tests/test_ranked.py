"""The format-2 chunk codec (routelog.ranked) and its zarr-python registration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numcodecs import Zstd

from routelog import ranked
from routelog.codec import gaps_from_sorted, storage_dtype
from routelog.synth import random_topk
from routelog.zarr_codec import RankedGapsCodec


def _routing(rng: np.random.Generator, layers: int, rows: int, experts: int, k: int, skew: float, repeat: float):
    """Sorted top-k sets ``[layers, rows, k]``: per-layer popularity (Dirichlet, ``skew`` > 0) and runs of rows
    that keep the previous row's set with probability ``repeat``."""
    out = np.empty((layers, rows, k), storage_dtype(experts))
    for j in range(layers):
        popularity = rng.dirichlet(np.full(experts, 1.0 / skew)) if skew > 0 else None
        out[j] = random_topk(rng, rows, experts, k, popularity)
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
    repeat=st.sampled_from([0.0, 0.5, 0.95]),
    n_bad=st.integers(0, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_is_exact(
    layers: int, rows: int, experts: int, k_frac: float, skew: float, repeat: float, n_bad: int, seed: int
) -> None:
    """Valid sets of any universe and K, skewed or not, with repeats, and rows that are no top-k set at all (the
    codec keeps those verbatim) all decode to exactly what was encoded."""
    rng = np.random.default_rng(seed)
    k = max(1, round(k_frac * experts))
    ids = _routing(rng, layers, rows, experts, k, skew, repeat)
    if rows and n_bad:
        where = rng.integers(0, rows, size=(n_bad, 2))
        for j, r in where:
            ids[j % layers, r] = rng.integers(0, np.iinfo(ids.dtype).max + 1, size=k, dtype=np.int64)
    payload = ranked.encode(ids, experts)
    back = ranked.decode(payload, ids.shape, ids.dtype, experts)
    assert back.dtype == ids.dtype
    np.testing.assert_array_equal(back, ids)


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
    _gaps, tail = ranked._transform(np.concatenate([uniform, skewed]), 128, validate=True)
    assert list(tail[-11:-9]) == [ranked.MODE_GAPS, ranked.MODE_RANKED]  # the trailer's layer modes


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
    with pytest.raises(ranked.RankedFormatError, match="more than a chunk holds"):
        ranked.decode(forged, ids.shape, ids.dtype, 64)


@settings(max_examples=200, deadline=None)
@given(position=st.integers(0, 10_000), value=st.integers(0, 255), seed=st.integers(0, 3))
def test_any_flipped_byte_decodes_or_raises_the_typed_error(position: int, value: int, seed: int) -> None:
    """A damaged payload (crc32c catches it first in a store) never escapes as another exception type."""
    ids = _routing(np.random.default_rng(seed), 2, 64, 300, 4, skew=3.0, repeat=0.5)
    payload = bytearray(ranked.encode(ids, 300))
    payload[position % len(payload)] = value
    try:
        out = ranked.decode(bytes(payload), ids.shape, ids.dtype, 300)
    except ranked.RankedFormatError:
        return
    assert out.shape == ids.shape


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


@pytest.mark.parametrize("skew", [0.0, 3.0])
def test_the_writers_fast_path_stores_what_the_general_path_stores(skew: float) -> None:
    """Writers skip validation and take a one-pass path for plain chunks; it must give the same bytes."""
    ids = _routing(np.random.default_rng(9), 4, 4096, 128, 8, skew=skew, repeat=0.0)
    assert ranked.encode(ids, 128, validate=False) == ranked.encode(ids, 128, validate=True)
