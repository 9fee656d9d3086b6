"""Every count read from storage is checked against the bytes that hold it (or the document that vouches for it)
before anything is allocated or looped over for it (FORMAT.md section 9).

Each case copies a small valid store, forges one count (a commit's, an annotation's or a seal's, a
``ranked_context`` model's section head, a zstd frame header) to the most its field holds or to just past what its
bytes allow, with every SHA-256, size and checksum that vouches for it recomputed (so that only the count check can
stop it), then reads the step and verifies the store in a child process limited to 2 GiB of address space and a
minute. The read must end with a :class:`~routelog.errors.CorruptDataError` naming the object, the field, its value
and its bound, and verify must report it: never a ``MemoryError``, a timeout or a crash (before these checks, a part
claiming 2**31 rows had a reader allocate 16 GiB for its rows' tokens, and a model claiming 2**30 sets 4 GiB for its
list).

Forging a model's counts past 2**30 needs an array of that many rows; the commit refuses rows its records' tokens do
not cover, so those cases also add records of 2**22 missing tokens each to the part's index (what the format allows,
in a few KB) and lay the shard out again for the rows claimed (:func:`claim_rows`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import routelog
from routelog import ModelSpec, Record
from routelog.format import context, keys
from routelog.format.documents import MAX_CHUNK_BYTES, RoutingArrayInfo
from routelog.format.index_rows import part_row_tokens
from routelog.format.limits import MAX_RECORD_TOKENS, MAX_ZSTD_EXPANSION, MIN_RECORD_BITS, most_decisions
from routelog.format.part import PartOptions, index_table_to_parquet, shard_layout
from routelog.format.values import LOGPROB_INFER, LOGPROB_TRAIN
from routelog.store.storage import Storage
from routelog.synth import synthetic_spec
from tests.attacks.kit import commit_keys, entry_keys, read_commit, write_commit

ADDRESS_SPACE = 2 << 30
"""The child's address-space limit: an unforged read takes about 150 MB of it (passes under 1 GiB too:
``test_an_unforged_store_reads_within_the_limits``)."""
TIMEOUT = 60
FORGED_ROWS = 1 << 30
"""The rows the model cases claim: enough for 2**30 sets or token keys (a set is listed for two rows at least)."""
SPEC = synthetic_spec(layers=6, experts=32, topk=4)
WIDE_SPEC = synthetic_spec(layers=6, experts=2048, topk=4)
"""More experts than range-coded models take: its model is of version 1 (zstd-coded lists and tables)."""

CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2)  # before routelog and its packages load
url, sample_ids = sys.argv[2], json.loads(sys.argv[3])
found = {}
try:
    import routelog

    snapshot = routelog.open_store(url).step(0)
    snapshot.read(sample_ids[0])
    snapshot.read_many(sample_ids)
    snapshot.token_values(sample_ids, snapshot.value_columns())
    found["read"] = {"class": None, "message": ""}
except BaseException as exc:
    found["read"] = {"class": type(exc).__name__, "message": str(exc)}
try:
    report = routelog.open_store(url).verify() if sys.argv[4] == "verify" else None
    found["verify"] = {"class": None, "problems": None if report is None else report.problems}
except BaseException as exc:
    found["verify"] = {"class": type(exc).__name__, "problems": [str(exc)]}
found["torch"] = "torch" in sys.modules
print(json.dumps(found))
"""


def read_in_child(url: str, sample_ids: list[str], *, verify: bool = True) -> dict[str, Any]:
    """What reading ``sample_ids`` (routing, and every per-token column) of step 0, then verifying the store (where
    ``verify``), end with in a bounded child."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(ADDRESS_SPACE), url, json.dumps(sample_ids), "verify" * verify],
            check=False,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            cwd=Path(__file__).parent.parent,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the read of {url} ran past {TIMEOUT} s")
    assert done.returncode == 0, f"the child crashed ({done.returncode}): {done.stderr[-2000:]}"
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert not found["torch"], "reading a store imported torch"
    return found


# -- the stores forged ------------------------------------------------------------------------------------------------
def recurring_records(spec: ModelSpec, n: int, seed: int) -> list[Record]:
    """Records whose routing follows their tokens (a vocabulary of 24, a set per token and layer), so that a
    context-coded part's model lists sets and gives tokens candidates: every count of its sections is non-zero."""
    rng = np.random.default_rng(seed)
    table = np.sort(np.argsort(rng.random((24, spec.num_moe_layers, spec.num_experts)), axis=-1)[..., : spec.topk])
    out = []
    for i in range(n):
        length = int(rng.integers(40, 80))
        tokens = rng.integers(0, 24, length)
        valid = np.ones(length, bool)
        valid[-1] = False
        out.append(
            Record(
                sample_id=f"s{i}",
                expert_ids=table[tokens],
                prompt_len=2,
                response_len=length - 2,
                valid=valid,
                token_ids=tokens,
                token_values={LOGPROB_INFER: -rng.random(length).astype(np.float32)},
            )
        )
    return out


def build(url: str, spec: ModelSpec, options: PartOptions, *, sealed: bool) -> list[str]:
    """One part of four records, an annotation of them, and (``sealed``) the seal; returns the sample ids."""
    store = routelog.create_store(url, spec)
    written = recurring_records(spec, 4, seed=7)
    with store.writer(0, "w", options=options) as writer:
        for record in written:
            writer.append(record)
    with store.annotate(0, "trainer") as annotator:
        for record in written:
            annotator.add(record.sample_id, {LOGPROB_TRAIN: np.zeros(record.n_tokens, np.float32)})
    if sealed:
        store.seal(0)
    return [r.sample_id for r in written]


@dataclass(frozen=True)
class Base:
    root: Path
    sample_ids: list[str]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    """The valid stores the cases copy: context-coded (model of version 4), context-coded over 2048 experts (model
    of version 1), ``ranked_gaps``, and the first sealed."""
    root = tmp_path_factory.mktemp("bases")
    context_coded = PartOptions(transform="ranked_context")
    kinds = {
        "context": (SPEC, context_coded, False),
        "wide": (WIDE_SPEC, context_coded, False),
        "gaps": (SPEC, PartOptions(transform="ranked_gaps"), False),
        "sealed": (SPEC, context_coded, True),
    }
    return {
        name: Base(root / name, build(str(root / name), spec, options, sealed=sealed))
        for name, (spec, options, sealed) in kinds.items()
    }


@dataclass
class Forged:
    """A copy of a base store and the first commit of its first log entry, to edit (:meth:`save` writes it)."""

    url: str
    storage: Storage
    key: str
    commit: dict[str, Any]
    missing_records: int = 0
    """Records of :data:`MAX_RECORD_TOKENS` missing tokens added to the part's index (:func:`add_missing_records`)."""

    @property
    def part_dir(self) -> str:
        return keys.part_dir(0, self.commit["part"])

    def read(self, name: str) -> bytes:
        return self.storage.read(f"{self.part_dir}/{name}")

    def replace(self, name: str, data: bytes) -> None:
        """Overwrite one object of the part, listed again in the commit (size, SHA-256) as a writer would."""
        self.storage.write(f"{self.part_dir}/{name}", data)
        (listed,) = [o for o in self.commit["objects"] if o["key"] == name]
        listed.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def save(self) -> None:
        write_commit(self.storage, self.key, self.commit)


def copy(base: Base, into: Path) -> Forged:
    shutil.copytree(base.root, into)
    storage = routelog.open_store(str(into)).storage
    key = commit_keys(storage)[0]
    return Forged(str(into), storage, key, read_commit(storage, key))


# -- forging --------------------------------------------------------------------------------------------------------
def claim_rows(forged: Forged, rows: int) -> None:
    """Make the part's routing array claim ``rows`` rows consistently: records of missing tokens added to its index
    until their tokens cover them (:func:`add_missing_records`), and the shard laid out for them
    (:func:`lay_out_rows`)."""
    add_missing_records(forged, math.ceil(rows / MAX_RECORD_TOKENS))
    lay_out_rows(forged, rows)


def add_missing_records(forged: Forged, count: int) -> None:
    """``count`` records of :data:`MAX_RECORD_TOKENS` missing tokens (no spans, no token ids) added to the part's
    index and counted in its commit."""
    index = pq.read_table(io.BytesIO(forged.read(keys.INDEX)))
    missing = {"step": 0, "prompt_len": MAX_RECORD_TOKENS, "response_len": 0, "n_tokens": MAX_RECORD_TOKENS}
    added = [{**missing, "sample_id": f"missing{i}", "spans": [], "segments": []} for i in range(count)]
    forged.replace(
        keys.INDEX, index_table_to_parquet(pa.concat_tables([index, pa.Table.from_pylist(added, index.schema)]))
    )
    forged.commit["n_records"] += count
    forged.commit["n_tokens"] += count * MAX_RECORD_TOKENS
    forged.missing_records += count


def lay_out_rows(forged: Forged, rows: int) -> None:
    """The routing array claims ``rows`` rows in the largest inner chunks the format allows, its shard laid out for
    the grid that makes (each new chunk a copy of its layer chunk's first, stored once: a few KB of index)."""
    routing = forged.commit["routing"]
    before = shard_layout(RoutingArrayInfo.model_validate(routing))
    shard_key = f"{routing['path']}/{before.shard_key()}"
    pieces = split_shard(forged.read(shard_key), before.grid)
    routing["n_rows"] = rows
    routing["chunk_rows"] = largest_chunk_rows(routing)
    after = shard_layout(RoutingArrayInfo.model_validate(routing))
    forged.replace(shard_key, join_shard([[row[0]] * after.grid[1] for row in pieces]))


def largest_chunk_rows(routing: dict[str, Any]) -> int:
    itemsize = 1 if routing["dtype"] == "uint8" else 2
    return int(MAX_CHUNK_BYTES // (routing["chunk_layers"] * routing["topk"] * itemsize))


def split_shard(shard: bytes, grid: tuple[int, int]) -> list[list[bytes]]:
    """A shard's stored inner chunks, ``[layer chunk][row chunk]``."""
    index = np.frombuffer(shard[: math.prod(grid) * 16], "<u8").reshape(*grid, 2)
    return [[shard[int(o) : int(o + n)] for o, n in row] for row in index]


def join_shard(pieces: list[list[bytes]]) -> bytes:
    """A shard of ``pieces`` (its index first); a piece repeated is stored once and pointed at again."""
    grid = (len(pieces), len(pieces[0]))
    at = math.prod(grid) * 16 + 4
    placed: dict[bytes, int] = {}
    body = bytearray()
    index = np.zeros((*grid, 2), "<u8")
    for (lc, rc), piece in np.ndenumerate(np.array(pieces, dtype=object)):
        if piece not in placed:
            placed[piece] = at + len(body)
            body += piece
        index[lc, rc] = (placed[piece], len(piece))
    head = index.tobytes()
    return head + crc(head) + bytes(body)


def crc(data: bytes) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


def forge_section(forged: Forged, layer: int, field: int, value: int | Callable[[bytes], int]) -> None:
    """Set u32 ``field`` (0: S sets, 1: T token keys, 2: B keys below) of layer ``layer``'s model section, its
    checksum sealed again; ``value`` may be computed from the section's bytes."""
    name = f"{forged.commit['routing']['path']}/{context.MODEL_KEY}"
    model = bytearray(forged.read(name))
    layers = forged.commit["routing"]["num_moe_layers"]
    head = context.model_header_nbytes(layers)
    ends = np.frombuffer(bytes(model[12 : 12 + 8 * layers]), "<u8")
    start, end = (head if layer == 0 else int(ends[layer - 1])), int(ends[layer])
    section = model[start:end]
    count = value(bytes(section)) if callable(value) else value
    section[4 * field : 4 * field + 4] = count.to_bytes(4, "little")
    section[-4:] = crc(bytes(section[:-4]))
    model[start:end] = section
    forged.replace(name, bytes(model))


def plausible_sets(section: bytes) -> int:
    """One past the sets a range-coded list of the section's list bytes codes at the most."""
    return 1 + most_decisions(int.from_bytes(section[12:16], "little")) + 1


def plausible_keys(section: bytes) -> int:
    """One past the token keys the section's range-coded tables code at the most."""
    tables_at = 16 + int.from_bytes(section[12:16], "little")
    return most_decisions(int.from_bytes(section[tables_at : tables_at + 4], "little")) + 1


def forge_rest_frame(forged: Forged, declared: Callable[[int], int]) -> None:
    """Make the first ``ranked_gaps`` chunk's second zstd frame declare ``declared(its bytes)`` bytes (its header's
    content size, 8 bytes wide), and let the commit's inner chunks be as large as the format allows, so that the
    frame's own bytes, not the chunk's bound, are what stops it."""
    routing = forged.commit["routing"]
    layout = shard_layout(RoutingArrayInfo.model_validate(routing))
    shard_key = f"{routing['path']}/{layout.shard_key()}"
    pieces = split_shard(forged.read(shard_key), layout.grid)
    payload = pieces[0][0][:-4]
    first = int.from_bytes(payload[:4], "little")
    rest = payload[4 + first :]
    descriptor = rest[4]
    assert descriptor & 0x20 and not descriptor & 0x03, "a single-segment frame without a dictionary"
    content = {0: 1, 1: 2, 2: 4, 3: 8}[descriptor >> 6]
    header = rest[:4] + bytes([descriptor | 0xC0]) + declared(len(rest) + 8 - content).to_bytes(8, "little")
    rest = header + rest[5 + content :]
    payload = payload[: 4 + first] + rest
    pieces[0][0] = payload + crc(payload)
    routing["chunk_rows"] = largest_chunk_rows(routing)
    forged.replace(shard_key, join_shard(pieces))


def forge_entry(forged: Forged, kind: str, field: str, value: int) -> str:
    """Set ``field`` of the step's first log entry of ``kind`` (and of ``_SEALED.json``, its copy, for the seal);
    returns the entry's key."""
    key = entry_keys(forged.storage, kind)[0]
    doc = json.loads(forged.storage.read(key))
    doc[field] = value
    data = json.dumps(doc).encode()
    forged.storage.write(key, data)
    if kind == "routelog.seal":
        forged.storage.write(keys.seal_key(0), data)
    return key


# -- the cases --------------------------------------------------------------------------------------------------------
Forge = Callable[[Forged], str]
"""Forges a copied store; returns what the refusal must name (a key or an object's name)."""


def in_commit(field: str, value: Callable[[Forged], int], *, bounding: str | None = None) -> Forge:
    """The commit's ``field`` (dotted) set to ``value``; the refusal names the commit's log entry, or the object of
    the part whose bytes bound the count (``bounding``)."""

    def forge(forged: Forged) -> str:
        *path, last = field.split(".")
        target = forged.commit
        for name in path:
            target = target[name]
        target[last] = value(forged)
        forged.save()
        return forged.key if bounding is None else f"{forged.part_dir}/{bounding}"

    return forge


def index_records(forged: Forged) -> int:
    """One more record than the part's index can hold, at a bit a record."""
    index = next(o for o in forged.commit["objects"] if o["key"] == keys.INDEX)
    return int(index["size"]) * 8 // MIN_RECORD_BITS + 1


def rows_laid_out(rows: int) -> Forge:
    """The commit claims ``rows`` rows, and its shard is laid out for them, but its records' tokens are not."""

    def forge(forged: Forged) -> str:
        lay_out_rows(forged, rows)
        forged.save()
        return forged.key

    return forge


def in_section(layer: int, field: int, value: int | Callable[[bytes], int], *, rows: int = FORGED_ROWS) -> Forge:
    def forge(forged: Forged) -> str:
        claim_rows(forged, rows)
        forge_section(forged, layer, field, value)
        forged.save()
        return f"{forged.commit['routing']['path']}/{context.MODEL_KEY}"

    return forge


def rest_frame(forged: Forged) -> str:
    layout = shard_layout(RoutingArrayInfo.model_validate(forged.commit["routing"]))
    forge_rest_frame(forged, lambda nbytes: nbytes * MAX_ZSTD_EXPANSION + 1)
    forged.save()
    return f"{forged.commit['routing']['path']}/{layout.shard_key()}"


def in_entry(kind: str, field: str, value: int) -> Forge:
    def forge(forged: Forged) -> str:
        forge_entry(forged, kind, field, value)
        return ".parquet"  # the refusal names the object the count bounds: the values, or the consolidated index

    return forge


CASES: dict[str, tuple[str, Forge, str]] = {
    # name: (base store, forgery, the field the refusal names)
    "commit n_records 2**63-1": (
        "context",
        in_commit("n_records", lambda _: 2**63 - 1, bounding=keys.INDEX),
        "n_records",
    ),
    "commit n_records past its index's bytes": (
        "context",
        in_commit("n_records", index_records, bounding=keys.INDEX),
        "n_records",
    ),
    "commit n_tokens 2**63-1": ("context", in_commit("n_tokens", lambda _: 2**63 - 1), "n_tokens"),
    "routing n_rows 2**31-1, shard laid out for them": ("context", rows_laid_out((1 << 31) - 1), "routing.n_rows"),
    "routing n_rows one past its records' tokens": (
        "context",
        in_commit("routing.n_rows", lambda f: f.commit["n_tokens"] + 1),
        "routing.n_rows",
    ),
    "model S 2**32-1": ("context", in_section(0, 0, 2**32 - 1), "S (sets listed)"),
    "model S 2**30": ("context", in_section(0, 0, 1 << 30), "S (sets listed)"),
    "model S past its list's bytes": ("context", in_section(0, 0, plausible_sets), "S (sets listed)"),
    "model T 2**30": ("context", in_section(0, 1, 1 << 30), "T (token keys)"),
    "model T past its tables' bytes": ("context", in_section(0, 1, plausible_keys), "T (token keys)"),
    "model B 2**32-1": ("context", in_section(1, 2, 2**32 - 1), "B (keys below)"),
    "zstd-coded model S 2**30": ("wide", in_section(0, 0, 1 << 30), "S (sets listed)"),
    "zstd-coded model T 2**30": ("wide", in_section(0, 1, 1 << 30), "T (token keys)"),
    "ranked_gaps chunk frame content size": ("gaps", rest_frame, "content size"),
    "annotation n_records 2**63-1": ("context", in_entry("routelog.annotation", "n_records", 2**63 - 1), "n_records"),
    "seal n_records 2**63-1": ("sealed", in_entry("routelog.seal", "n_records", 2**63 - 1), "n_records"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_forged_count_is_refused_naming_it_before_anything_is_allocated(
    case: str, bases: dict[str, Base], tmp_path: Path
) -> None:
    base_name, forge, field = CASES[case]
    base = bases[base_name]
    forged = copy(base, tmp_path / "store")
    named = forge(forged)
    # verify reads every record, those of missing tokens added too: 96 MiB each, as a reader reads such records
    verified = not forged.missing_records
    found = read_in_child(forged.url, base.sample_ids, verify=verified)
    read, verify = found["read"], found["verify"]
    assert read["class"] == "CorruptDataError", read
    assert f"{field} = " in read["message"] and "expected at most" in read["message"], read["message"]
    assert named in read["message"], read["message"]
    assert verify["class"] is None, verify  # it reports what it finds, without dying on it
    if verified:
        assert any(f"{field} = " in problem for problem in verify["problems"]), verify["problems"]


@pytest.mark.parametrize("base_name", ["context", "wide", "gaps", "sealed"])
def test_an_unforged_store_reads_within_the_limits(base_name: str, bases: dict[str, Base], tmp_path: Path) -> None:
    """The control: each base store, copied, reads whole and verifies sound in a child under the same limits."""
    base = bases[base_name]
    forged = copy(base, tmp_path / "store")
    found = read_in_child(forged.url, base.sample_ids)
    assert found["read"]["class"] is None, found
    assert found["verify"] == {"class": None, "problems": []}, found


def test_row_tokens_are_made_a_window_at_a_time_as_the_writer_makes_them(bases: dict[str, Base]) -> None:
    """A reader's rows' tokens (windows of :class:`~routelog.format.index_rows.RowTokens`, sized by the rows read,
    never by the array's claimed rows) equal the writer's table of the whole array, edges and past the end alike."""
    storage = routelog.open_store(str(bases["context"].root)).storage
    commit = read_commit(storage, commit_keys(storage)[0])
    table = pq.read_table(io.BytesIO(storage.read(f"{keys.part_dir(0, commit['part'])}/{keys.INDEX}")))
    n_rows = commit["routing"]["n_rows"]
    records = [
        (row["token_ids"], [(s["token_start"], s["n_rows"], s["row"], s["part"]) for s in row["spans"]])
        for row in table.to_pylist()
    ]
    whole = context.row_tokens(records, n_rows)
    assert (whole >= 0).any()
    tokens = part_row_tokens(table, n_rows)
    for start, stop in [(0, n_rows), (0, 1), (5, 77), (n_rows - 3, n_rows + 4096), (n_rows, n_rows + 10)]:
        np.testing.assert_array_equal(tokens.window(start, stop), whole[start:stop])
