"""Wrong data is never returned silently: damaged bytes raise a typed error naming the object, and verify agrees.

The byte-flip fuzzing at the end visits every object kind of a store (documents, indexes, shards, values,
annotations, consolidated seal objects): after each flip, either reading everything returns exactly what was
written, or it raises a typed routelog error and verify reports a problem; a store verify calls sound always reads.
"""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zarr
import zstandard

import routelog
from routelog.errors import CorruptDataError, RoutelogError
from routelog.format import keys, ranked
from routelog.format.codec import RowProblem, decode_rows, invalid_row
from routelog.format.documents import RoutingArrayInfo
from routelog.format.part import PartOptions, shard_layout
from routelog.format.record import Record
from routelog.format.shard import EMPTY, _crc, decode_chunk
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.store.storage import Storage
from routelog.store.verify import verify_store
from routelog.synth import random_topk, synthetic_spec
from tests.attacks.kit import (
    Expected,
    assert_same,
    build_store,
    commit_keys,
    entry_keys,
    read_commit,
    read_everything,
    write_commit,
)


def _commits(storage: Storage) -> list[tuple[str, dict]]:  # type: ignore[type-arg]
    return [(key, read_commit(storage, key)) for key in commit_keys(storage)]


def test_a_chunk_marked_never_written_is_corruption_not_expert_zero(memory_url: str) -> None:
    """An index entry saying "never written" (crc and SHA recomputed, as a buggy writer would leave them) used to
    decode as experts 0..K-1 with verify clean."""
    build_store(memory_url, sealed=False)
    store = routelog.open_store(memory_url)
    key, commit = _commits(store.storage)[0]
    info = routelog.format.documents.RoutingArrayInfo.model_validate(commit["routing"])
    shard_key = f"{keys.part_dir(0, commit['part'])}/{info.path}/{shard_layout(info).shard_key()}"
    shard = bytearray(store.storage.read(shard_key))
    n = shard_layout(info).index_nbytes
    index = np.frombuffer(bytes(shard[: n - 4]), dtype="<u8").copy()
    index[:2] = EMPTY
    shard[: n - 4] = index.tobytes()
    shard[n - 4 : n] = _crc(bytes(shard[: n - 4]))
    store.storage.write(shard_key, bytes(shard))
    for obj in commit["objects"]:
        if obj["key"].startswith(f"{info.path}/c/"):
            obj.update(size=len(shard), sha256=hashlib.sha256(shard).hexdigest())
    write_commit(store.storage, key, commit)
    with pytest.raises(CorruptDataError, match="never written"):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok


@pytest.mark.parametrize("which", ["part values", "annotation values"])
def test_flipped_bytes_in_values_never_return_wrong_logprobs(memory_url: str, which: str) -> None:
    expected = build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    if which == "part values":
        key = f"{keys.part_dir(0, _commits(storage)[0][1]['part'])}/values.parquet"
    else:
        part = json.loads(storage.read(entry_keys(storage, "routelog.annotation")[0]))["part"]
        key = f"{keys.annotations_dir(0)}/{part}/values.parquet"
    original = storage.read(key)
    rng = random.Random(which)
    for _ in range(25):
        damaged = bytearray(original)
        damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        storage.write(key, bytes(damaged))
        with pytest.raises(CorruptDataError, match="SHA-256"):
            read_everything(memory_url)
        assert not verify_store(routelog.open_store(memory_url)).ok
    storage.write(key, original)
    assert_same(read_everything(memory_url), expected)


def test_a_renamed_or_dropped_values_declaration_is_damage(memory_url: str) -> None:
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    key, commit = next((k, c) for k, c in _commits(storage) if c.get("values"))
    original = storage.read(key)
    commit["values"]["columns"][0]["name"] = "logprob_inferred"
    write_commit(storage, key, commit)
    with pytest.raises(CorruptDataError, match="declares"):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok
    storage.write(key, original)
    dropped = read_commit(storage, key)
    dropped.pop("values")  # the object is still listed: an undeclared values object is refused at parse time
    write_commit(storage, key, dropped)
    with pytest.raises(CorruptDataError, match="no values columns are declared"):
        read_everything(memory_url)
    assert not verify_store(routelog.open_store(memory_url)).ok
    dropped["objects"] = [o for o in dropped["objects"] if o["key"] != "values.parquet"]
    write_commit(storage, key, dropped)
    # With both the declaration and the listing gone the commit no longer vouches for the object: readers (who
    # never list part directories) read the records without the column, and verify reports the unlisted object.
    report = verify_store(routelog.open_store(memory_url))
    assert any("does not list" in p for p in report.problems), report.problems


def _all_objects(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _flip_and_check(url: str, path: Path, position: int, bit: int, expected: Expected) -> str:
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[position] ^= 1 << bit
    path.write_bytes(bytes(damaged))
    try:
        try:
            got = read_everything(url)
            read_error: RoutelogError | None = None
        except RoutelogError as exc:
            got, read_error = None, exc
        try:
            sound = verify_store(routelog.open_store(url)).ok
        except RoutelogError:  # the run document itself is damaged: `routelog verify` exits with the error
            sound = False
    finally:
        path.write_bytes(original)
    where = f"{path.name} byte {position} bit {bit}"
    if read_error is None:
        assert got is not None
        try:
            assert_same(got, expected)  # never wrong data: the flip was harmless (e.g. a timestamp digit)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        return "harmless" if sound else "flagged by verify only"
    assert not sound, f"{where}: reading fails ({read_error}) but verify calls the store sound"
    return "refused"


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
def test_byte_flips_in_every_object_kind(tmp_path: Path, sealed: bool) -> None:
    """Seeded fuzzing: a few flips in every object of a store holding every object kind. Raw exceptions (anything
    but a routelog error) fail the test by propagating."""
    root = tmp_path / uuid.uuid4().hex
    url = f"file://{root}"
    expected = build_store(url, sealed=sealed)
    rng = random.Random(11 if sealed else 12)
    outcomes: dict[str, int] = {}
    kinds: set[str] = set()
    for path in _all_objects(root):
        kinds.add(path.name if path.parent.name != "0" else "shard")
        for _ in range(3):
            outcome = _flip_and_check(url, path, rng.randrange(path.stat().st_size), rng.randrange(8), expected)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert {"routelog.json", "index.parquet", "zarr.json", "values.parquet", "shard"} <= kinds
    assert outcomes.get("refused", 0) > len(_all_objects(root)), outcomes
    assert_same(read_everything(url), expected)


def test_reading_needs_no_values_object_unless_asked(memory_url: str) -> None:
    """The values objects are checked when read, and only when read: routing reads do not fetch them."""
    build_store(memory_url, sealed=False)
    storage = routelog.open_store(memory_url).storage
    for key in [k for k in storage.find("steps") if k.endswith("values.parquet")]:
        storage.write(key, b"garbage")
    snapshot = routelog.open_store(memory_url).step(0)
    assert len(snapshot.read_many(snapshot.sample_ids)) == len(snapshot)
    with pytest.raises(CorruptDataError):
        snapshot.token_values(snapshot.sample_ids, [LOGPROB_INFER, LOGPROB_TRAIN])


# -- rows that are no top-k set (FORMAT.md sections 4-5): forged chunks, refused by every decode path -----------------
_LAYERS, _TOKENS, _CHUNK_ROWS = 4, 1200, 512  # three row chunks per layer chunk, the last one padded
_SHAPES = [(64, 8), (32, 4), (300, 8)]  # rows of eight uint8 IDs as words, uint8 IDs one at a time, uint16 IDs


def _forgery_store(
    root: Path, experts: int, k: int, routing: str, *, transform: str = "ranked_gaps", topk_order: str = "sorted"
) -> np.ndarray:
    """A store at ``root`` holding one record ``s0`` of ``_TOKENS`` tokens (every row routed) in one part of
    ``[_LAYERS, _TOKENS, k]``: ``routing`` "uniform" (ranked_gaps keeps plain ID gaps), "skewed" (it ranks every
    layer) or "recurring" (a few sets recurring out of order: it keeps a dictionary per layer). Returns the sorted
    routing, layer-major, as stored."""
    rng = np.random.default_rng(experts * 100 + k)
    layers = []
    for _ in range(_LAYERS):
        popularity = rng.dirichlet(np.full(experts, 0.3)) if routing == "skewed" else None
        rows = random_topk(rng, _TOKENS, experts, k, popularity)
        layers.append(rows[rng.integers(0, 30, _TOKENS)] if routing == "recurring" else rows)
    ids = np.stack(layers, axis=1)  # [tokens, layers, K], engine (score) order
    store = routelog.create_store(f"file://{root}", synthetic_spec(layers=_LAYERS, experts=experts, topk=k))
    options = PartOptions(chunk_rows=_CHUNK_ROWS, transform=transform, topk_order=topk_order, dedup="off")  # type: ignore[arg-type]
    with store.writer(0, "w", options=options) as writer:
        writer.append(Record("s0", ids, prompt_len=2, response_len=_TOKENS - 2))
    stored = ids if topk_order == "score" else np.sort(ids, axis=-1)
    return np.ascontiguousarray(stored.transpose(1, 0, 2))


def _routing_array(root: Path) -> tuple[Storage, str, dict, RoutingArrayInfo]:  # type: ignore[type-arg]
    storage = routelog.open_store(f"file://{root}").storage
    key, commit = _commits(storage)[0]
    return storage, key, commit, RoutingArrayInfo.model_validate(commit["routing"])


def _replace_first_chunk(root: Path, patch: Callable[[bytes], bytes]) -> None:
    """Replace the payload of the part's first inner chunk (layers 0-3, rows 0-127) by ``patch(payload)``, with a
    valid crc32c, shard index and commit listing (size, SHA-256): only the payload is wrong."""
    storage, key, commit, info = _routing_array(root)
    layout = shard_layout(info)
    shard_key = f"{keys.part_dir(0, commit['part'])}/{info.path}/{layout.shard_key()}"
    shard = storage.read(shard_key)
    n = layout.index_nbytes
    index = np.frombuffer(shard[: n - 4], "<u8").reshape(-1, 2).copy()
    pieces = [bytes(shard[offset : offset + size]) for offset, size in index.tolist()]
    payload = patch(pieces[0][:-4])
    pieces[0] = payload + _crc(payload)
    index[:, 1] = [len(piece) for piece in pieces]
    index[:, 0] = n + np.concatenate([[0], np.cumsum(index[:-1, 1])])
    body = index.tobytes()
    rebuilt = body + _crc(body) + b"".join(pieces)
    storage.write(shard_key, rebuilt)
    for obj in commit["objects"]:
        if obj["key"] == f"{info.path}/{layout.shard_key()}":
            obj.update(size=len(rebuilt), sha256=hashlib.sha256(rebuilt).hexdigest())
    write_commit(storage, key, commit)


def _assert_refused(root: Path, match: str = "no set of distinct ascending IDs") -> None:
    """Neither routelog's reader nor zarr-python (through the registered codec) returns the forged rows."""
    with pytest.raises(CorruptDataError, match=match) as refused:
        routelog.open_store(f"file://{root}").step(0).read("s0")
    assert f"inner chunk rows [0, {_CHUNK_ROWS})" in str(refused.value)
    _, _, commit, info = _routing_array(root)
    array = zarr.open_array(str(root / keys.part_dir(0, commit["part"]) / info.path), mode="r")
    with pytest.raises(CorruptDataError, match=match):
        array[...]


def _sections(payload: bytes) -> tuple[bytearray, bytearray]:
    """A ranked_gaps chunk's two sections, decompressed (FORMAT.md section 5)."""
    first = int.from_bytes(payload[:4], "little")
    unframe = zstandard.ZstdDecompressor().decompress
    return bytearray(unframe(payload[4 : 4 + first])), bytearray(unframe(payload[4 + first :]))


def _framed(gaps: bytes | bytearray, rest: bytes | bytearray) -> bytes:
    frame = zstandard.ZstdCompressor(level=1).compress
    first = frame(bytes(gaps))
    return len(first).to_bytes(4, "little") + first + frame(bytes(rest))


def _put_id(section: bytearray, at: int, value: int, itemsize: int) -> None:
    section[at : at + itemsize] = value.to_bytes(itemsize, "little")


def _table_at(rest: bytearray, layer: int, experts: int, itemsize: int) -> int:
    """Where ranked layer ``layer``'s rank -> ID table starts in the rest section: after the repeat bitmaps and the
    tables of the ranked layers before it."""
    modes = rest[-9 - _LAYERS : -9]
    assert modes[layer] & 1, f"layer {layer} is not ranked (modes {list(modes)})"
    bitmaps = sum(1 for mode in modes if mode & 2) * ((_CHUNK_ROWS + 7) // 8)
    return bitmaps + sum(1 for mode in modes[:layer] if mode & 1) * experts * itemsize


def _past_universe(gaps: bytearray, experts: int, k: int, itemsize: int) -> None:
    """The first row of the gaps section (layer 0's first unique row, or its dictionary's first entry) made to end
    at ID ``experts``: its last gap grows (no wrap, every other ID unchanged)."""
    planes = len(gaps) // itemsize  # the high-byte plane starts here (uint16)
    values = [gaps[c] | (gaps[planes + c] << 8 if itemsize == 2 else 0) for c in range(k)]
    last = sum(values) + k - 1
    values[-1] += experts - last
    gaps[k - 1] = values[-1] & 255
    if itemsize == 2:
        gaps[planes + k - 1] = values[-1] >> 8


@pytest.mark.parametrize(("experts", "k"), _SHAPES)
def test_a_store_of_valid_sets_reads_back_whole_padding_and_all(tmp_path: Path, experts: int, k: int) -> None:
    """Real data passes: the edge chunk's padding (rows 1200-1535, content unspecified; routelog's ranked_gaps
    writer repeats the last row, format 1's pads with 0: no set) is never refused, by the reader (which decodes
    only stored rows) or by zarr-python (which decodes whole chunks)."""
    stores = [("ranked_gaps", "sorted", routing) for routing in ("uniform", "skewed", "recurring")]
    stores += [("sorted_gaps", "sorted", "uniform"), ("ranked_gaps", "score", "uniform")]  # format 1
    for transform, topk_order, routing in stores:
        root = tmp_path / f"{transform}-{topk_order}-{routing}"
        ids = _forgery_store(root, experts, k, routing, transform=transform, topk_order=topk_order)
        np.testing.assert_array_equal(routelog.open_store(f"file://{root}").step(0).read("s0").by_layer, ids)
        _, _, commit, info = _routing_array(root)
        array = zarr.open_array(str(root / keys.part_dir(0, commit["part"]) / info.path), mode="r")
        if info.transform == "ranked_gaps" or (info.transform == "none" and experts <= 256):  # zarr returns IDs
            np.testing.assert_array_equal(array[...], ids)


@pytest.mark.parametrize(("experts", "k"), _SHAPES)
@pytest.mark.parametrize("forgery", ["an ID past E", "a repeated ID"])
def test_a_forged_rank_table_is_refused(tmp_path: Path, experts: int, k: int, forgery: str) -> None:
    """A ranked layer's rank -> ID table naming an ID >= E (e.g. 200 for E = 64), or one ID for two ranks (rows of
    both ranks decode with a repeat), used to come back as routing; only verify noticed."""
    _forgery_store(tmp_path, experts, k, "skewed")
    itemsize = 1 if experts <= 256 else 2

    def patch(payload: bytes) -> bytes:
        gaps, rest = _sections(payload)
        table = _table_at(rest, 0, experts, itemsize)
        rank_0 = int.from_bytes(rest[table : table + itemsize], "little")  # the most used expert
        _put_id(rest, table + itemsize, rank_0 if forgery == "a repeated ID" else experts + 136, itemsize)
        return _framed(gaps, rest)

    _replace_first_chunk(tmp_path, patch)
    _assert_refused(tmp_path)


@pytest.mark.parametrize(
    ("experts", "k", "routing"),  # plain gaps of a unique row, or of a dictionary's entry (uint16: the encoder ranks
    [*((e, k, "uniform") for e, k in _SHAPES), (64, 8, "recurring"), (32, 4, "recurring")],  # a few recurring sets)
)
def test_gaps_that_overflow_past_the_universe_are_refused(tmp_path: Path, experts: int, k: int, routing: str) -> None:
    """Plain ID gaps (no rank table: every ID they give is taken as is) that add up past E, in a unique row or in a
    dictionary's entry."""
    _forgery_store(tmp_path, experts, k, routing)
    itemsize = 1 if experts <= 256 else 2

    def patch(payload: bytes) -> bytes:
        gaps, rest = _sections(payload)
        modes = list(rest[-9 - _LAYERS : -9])
        assert not modes[0] & 1 and bool(modes[0] & 4) == (routing == "recurring"), modes
        _past_universe(gaps, experts, k, itemsize)
        return _framed(gaps, rest)

    _replace_first_chunk(tmp_path, patch)
    _assert_refused(tmp_path)


@pytest.mark.parametrize(("experts", "k"), [(64, 8), (32, 4)])
def test_gaps_that_wrap_past_the_ids_width_are_refused(tmp_path: Path, experts: int, k: int) -> None:
    """A gap of 255 between uint8 IDs wraps back to the ID before it: a row with a repeated ID."""
    _forgery_store(tmp_path, experts, k, "uniform")

    def patch(payload: bytes) -> bytes:
        gaps, rest = _sections(payload)
        assert rest[-9 - _LAYERS] == 0, "layer 0 keeps plain gaps, no repeats"
        gaps[1] = 255  # row 0 of layer 0: its second ID is its first plus 256
        return _framed(gaps, rest)

    _replace_first_chunk(tmp_path, patch)
    _assert_refused(tmp_path)


@pytest.mark.parametrize(("experts", "k"), _SHAPES)
@pytest.mark.parametrize("bad", ["repeats", "past E"])
def test_exception_rows_that_are_no_set_are_refused(tmp_path: Path, experts: int, k: int, bad: str) -> None:
    """The codec stores rows that are no set verbatim, as exceptions (the project's own encoder, handed one such row
    in the middle of real data): a stored row of the array must still be a set."""
    ids = _forgery_store(tmp_path, experts, k, "skewed")
    chunk = ids[:, :_CHUNK_ROWS].astype(np.uint8 if experts <= 256 else np.uint16)
    chunk[1, 5] = 3 if bad == "repeats" else np.arange(experts + 136, experts + 136 + k)
    _replace_first_chunk(tmp_path, lambda payload: ranked.encode(chunk, experts))
    _assert_refused(tmp_path)


def test_an_exception_row_of_the_fill_value_is_refused_by_the_reader_and_read_as_fill_by_zarr(tmp_path: Path) -> None:
    """zarr decodes whole chunks, padding included, and the codec cannot tell padding from data: it accepts rows of
    zarr's fill value (0) alone that an exception stores, as zarr's own missing data reads. Routelog's reader, which
    decodes only stored rows, refuses such a row inside the array."""
    ids = _forgery_store(tmp_path, 64, 8, "skewed")
    chunk = ids[:, :_CHUNK_ROWS].astype(np.uint8)
    chunk[1, 5] = 0
    _replace_first_chunk(tmp_path, lambda payload: ranked.encode(chunk, 64))
    with pytest.raises(CorruptDataError, match=r"layer 1 row 5 (of the chunk )?decodes to \[0, 0, 0, 0, 0, 0, 0, 0\]"):
        routelog.open_store(f"file://{tmp_path}").step(0).read("s0")
    _, _, commit, info = _routing_array(tmp_path)
    array = zarr.open_array(str(tmp_path / keys.part_dir(0, commit["part"]) / info.path), mode="r")
    expected = ids.copy()
    expected[1, 5] = 0
    np.testing.assert_array_equal(array[...], expected)


@pytest.mark.parametrize(
    ("experts", "k", "transform", "topk_order"),
    [(64, 8, "sorted_gaps", "sorted"), (300, 8, "sorted_gaps", "sorted"), (64, 8, "ranked_gaps", "score")],
    ids=["sorted_gaps", "sorted_gaps uint16 byte planes", "none"],
)
@pytest.mark.parametrize("reader", [True, False], ids=["reader", "codec"])
def test_format_1_rows_that_are_no_set_are_found(
    tmp_path: Path, experts: int, k: int, transform: str, topk_order: str, reader: bool
) -> None:
    """Format 1 (``bytes -> zstd``: zarr-python reads it without routelog) stores gaps (``sorted_gaps``) or the IDs
    in score order (``none``): gaps that add up past E, or a row naming one expert twice, decode to rows that
    :func:`routelog.format.codec.invalid_row` finds where the reader places them."""
    ids = _forgery_store(tmp_path, experts, k, "uniform", transform=transform, topk_order=topk_order)
    dtype = np.dtype(np.uint8 if experts <= 256 else np.uint16)
    plane = 4 * _CHUNK_ROWS * k  # IDs per byte plane of an inner chunk

    def patch(payload: bytes) -> bytes:
        stored = bytearray(zstandard.ZstdDecompressor().decompress(payload))
        if topk_order == "score":
            stored[1] = stored[0]  # row 0 of layer 0 names its first expert twice
        else:
            _past_universe(stored, experts, k, dtype.itemsize)  # uint16: low-byte plane, then high-byte plane
        assert len(stored) == plane * dtype.itemsize
        return zstandard.ZstdCompressor(level=3).compress(bytes(stored))

    _replace_first_chunk(tmp_path, patch)
    if reader:
        try:
            routelog.open_store(f"file://{tmp_path}").step(0).read("s0")
        except CorruptDataError:
            return
        raise AssertionError("the reader returned row 0 of layer 0 as forged")
    storage, _, commit, info = _routing_array(tmp_path)
    layout = shard_layout(info)
    shard = storage.read(f"{keys.part_dir(0, commit['part'])}/{info.path}/{layout.shard_key()}")
    offset, size = np.frombuffer(shard[: layout.index_nbytes - 4], "<u8")[:2].tolist()
    decoded = decode_chunk(shard[offset : offset + size], layout)
    if transform == "sorted_gaps":
        decoded = decode_rows(decoded, "sorted_gaps")
    got = decoded[:, :_CHUNK_ROWS]
    kind = "duplicate" if topk_order == "score" else "out_of_range"
    problem = invalid_row(got, experts, topk_order)  # type: ignore[arg-type]
    assert problem == RowProblem(0, kind, tuple(int(v) for v in got[0, 0]))
    assert problem.values[-1] == experts or kind == "duplicate"
    np.testing.assert_array_equal(got[1:], ids[1:, :_CHUNK_ROWS].astype(dtype))  # only row 0 of layer 0 changed
    assert invalid_row(decoded[:, :_CHUNK_ROWS][:, 1:], experts, topk_order) is None  # type: ignore[arg-type]
