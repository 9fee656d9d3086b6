"""Fuzz the compiled kernels under AddressSanitizer and UndefinedBehaviorSanitizer.

Builds ``routelog/format/_ckernels.c`` (the codec's), ``routelog/format/_ccontext.c`` (the ``ranked_context``
codec's), ``routelog/format/_cthrift.c`` (the bounded Parquet reader's Thrift walks) and ``routelog/audit/_ckernels.c``
(the audits') with gcc's
``-fsanitize=address,undefined`` into a scratch directory, then runs them (libasan preloaded) for ``--seconds``: the
codec's on random chunks and on forged ones (every chunk encoded, by both the word and the one-ID-at-a-time path,
must decode to itself, and every forged payload, with bytes flipped in either section, the tail section cut short,
random windows, every accept rule, misaligned buffers, must return a status), the context codec's on random
tables (every layer it codes decodes to itself, every forged stream decodes to indices inside the list or returns
a status, coded escapes decode to themselves and forged escape streams to sorted distinct sets, escapes coded
against references likewise, forged lists and candidates past the list refused, lists of model version 3
likewise, distinct items are numbered as a
dict numbers them, the plan's candidate hits found as a plain loop finds them and forged keys or offsets refused),
the audits' on random routing
(views with any strides, IDs past E, tokens left out) against plain numpy, the Thrift walks on forged Parquet footers
and page headers against the Python walks (same values or same problem). A sanitizer report aborts the run with its
stack.

    python tools/fuzz_kernels.py [--seconds 120] [--seed 1]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import build_sanitized, rerun_sanitized

PACKAGE = Path(__file__).resolve().parent.parent / "routelog"
SOURCES = {
    "format": PACKAGE / "format" / "_ckernels.c",
    "context": PACKAGE / "format" / "_ccontext.c",
    "audit": PACKAGE / "audit" / "_ckernels.c",
    "thrift": PACKAGE / "format" / "_cthrift.c",
}
"""Each extension is built into its own subdirectory of the scratch one (two modules are named ``_ckernels``)."""


def build(directory: Path) -> None:
    for name, source in SOURCES.items():
        (directory / name).mkdir()
        _build(source, directory / name)


def _build(source: Path, directory: Path) -> None:
    build_sanitized(source, directory / f"{source.stem}{sysconfig.get_config_var('EXT_SUFFIX')}")


def _chunk(rng: Any, np: Any) -> tuple[Any, int]:
    dtype = np.uint8 if rng.random() < 0.6 else np.uint16
    k = int(rng.choice([1, 2, 6, 8, 8]))
    experts = int(rng.integers(k, 256 if dtype == np.uint8 else 2000))
    layers, rows = int(rng.integers(1, 5)), int(rng.integers(1, 600))
    load = rng.dirichlet(np.full(experts, 0.2 if rng.random() < 0.5 else 5.0))
    pool = [np.sort(rng.choice(experts, k, replace=False, p=load)) for _ in range(int(rng.integers(1, 30)))]
    ids = np.empty((layers, rows, k), dtype)
    for j in range(layers):
        for r in range(rows):
            recur = rng.random() < 0.6
            ids[j, r] = (
                pool[rng.integers(len(pool))] if recur else np.sort(rng.choice(experts, k, replace=False, p=load))
            )
    if rng.random() < 0.3:  # a row that is no set: an exception
        ids[rng.integers(layers), rng.integers(rows)] = rng.integers(0, 255, k)
    return ids, experts


def _load(directory: Path) -> Any:
    """The sanitized build of one extension in ``directory``."""
    path = next(directory.glob("_c*"))
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fuzz(scratch: Path, seconds: float, seed: int) -> None:
    import numpy as np

    kernels, audit, thrift = _load(scratch / "format"), _load(scratch / "audit"), _load(scratch / "thrift")
    coder = _load(scratch / "context")
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + seconds
    chunks = forged = routings = walks = sorts = layers_coded = 0
    parquet = _parquet_objects()
    while time.monotonic() < deadline:
        _fuzz_context(coder, rng, np, seed)
        layers_coded += 1
        _fuzz_audit(audit, rng, np, seed)
        routings += 1
        for _ in range(20):
            _fuzz_thrift(thrift, parquet, rng, seed)
            walks += 1
        _fuzz_sort(kernels, rng, np, seed)
        sorts += 1
        ids, experts = _chunk(rng, np)
        layers, rows, k = ids.shape
        words = bool(rng.random() < 0.8)
        gaps, rest, _, _ = kernels.encode_chunk(ids, experts, int(rng.integers(0, 3)), words)
        gaps, rest = np.frombuffer(gaps, np.uint8), np.frombuffer(rest, np.uint8)
        shifted = np.zeros(gaps.size + 3, np.uint8)[3:]  # a misaligned copy: the word path copies it first
        shifted[...] = gaps
        out = np.empty_like(ids)
        if kernels.decode_chunk(shifted, rest, experts, layers, rows, out, 0, 0, 0, 0, words) != (0, 0):
            raise SystemExit(f"seed {seed}: a chunk the kernels wrote does not decode")
        if not np.array_equal(out, ids):
            raise SystemExit(f"seed {seed}: a chunk decodes to other IDs")
        chunks += 1
        for _ in range(20):
            section, tail = gaps.copy(), rest.copy()
            for _ in range(int(rng.integers(1, 6))):
                u = rng.random()
                if u < 0.5:
                    tail[rng.integers(tail.size)] = rng.integers(256)
                elif u < 0.8 and section.size:
                    section[rng.integers(section.size)] = rng.integers(256)
                elif tail.size > layers + 9:  # the tail's parts cut short, its trailer kept
                    tail = np.concatenate([tail[: rng.integers(0, tail.size - layers - 9)], tail[-(layers + 9) :]])
            total = int.from_bytes(bytes(tail[-9:-5]), "little")
            if total > layers * rows:  # ranked.decode refuses these before the kernel
                continue
            section = np.resize(section, total * k * ids.itemsize).astype(np.uint8)
            l0, r0 = int(rng.integers(0, layers)), int(rng.integers(0, rows))
            window = np.zeros(
                (int(rng.integers(0, layers - l0 + 1)), int(rng.integers(0, rows - r0 + 1)), k), ids.dtype
            )
            accept = int(rng.integers(0, 3))
            kernels.decode_chunk(section, tail, experts, layers, rows, window, l0, r0, accept, 0, words)
            forged += 1
    print(
        f"seed {seed}: {chunks} chunks round-tripped, {forged} forged payloads decoded, {routings} routings audited, "
        f"{walks} forged Parquet footers and page headers walked alike, {sorts} token-order routings sorted into layer "
        f"order as numpy sorts them, {layers_coded} context-coded layers round-tripped (and forged), no sanitizer "
        "report"
    )


def _fuzz_context(coder: Any, rng: Any, np: Any, seed: int) -> None:
    """Random tables of one layer's model, a layer coded and decoded, forged streams, and distinct items."""
    sets, below_sets, rows = int(rng.integers(0, 300)), int(rng.integers(0, 50)), int(rng.integers(0, 700))
    keys = np.unique(rng.integers(0, 5000, int(rng.integers(0, 200)))).astype(np.int64)
    counts = rng.integers(1, 9, keys.size) if sets else np.zeros(keys.size, np.int64)
    keys = keys[counts > 0]
    counts = counts[counts > 0]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    candidates = rng.integers(0, max(sets, 1), int(offsets[-1])).astype(np.uint32)
    table = np.zeros(1 << max(1, int(np.ceil(np.log2(2 * max(keys.size, 1))))), np.uint32)
    coder.hash_keys(keys, table)
    below_counts = rng.integers(0, 5, below_sets) if sets else np.zeros(below_sets, np.int64)
    below_offsets = np.concatenate([[0], np.cumsum(below_counts)]).astype(np.uint32)
    below_candidates = rng.integers(0, max(sets, 1), int(below_offsets[-1])).astype(np.uint32)
    tokens = np.where(rng.random(rows) < 0.7, rng.choice(np.r_[keys, 7], rows), rng.integers(-1, 6000, rows))
    tokens = tokens.astype(np.int64)
    below = rng.integers(-1, below_sets + 2, rows).astype(np.int32) if rng.random() < 0.7 else np.zeros(0, np.int32)
    index = rng.integers(-1, sets, rows).astype(np.int32) if sets else np.full(rows, -1, np.int32)
    tables = (tokens, below, keys, table, offsets, candidates, below_offsets, below_candidates)
    out = np.empty(rows * 72 + 16, np.uint8)
    written = coder.encode_layer(index, sets, *tables, out)
    decoded = np.empty(rows, np.int32)
    if written < 0 or coder.decode_layer(out[:written].copy(), sets, *tables, decoded) != (0, -1):
        raise SystemExit(f"seed {seed}: a coded layer does not decode")
    if not np.array_equal(decoded, index):
        raise SystemExit(f"seed {seed}: a coded layer decodes to other sets")
    for _ in range(10):
        stream = rng.integers(0, 256, int(rng.integers(0, 80)), dtype=np.uint8)
        status, row = coder.decode_layer(stream, sets, *tables, decoded)
        stop = rows if status == 0 else row
        if not ((decoded[:stop] >= -1) & (decoded[:stop] < sets)).all():  # -1: an escape
            raise SystemExit(f"seed {seed}: a forged stream decodes to an index outside the list")
    _fuzz_candidate_hits(coder, rng, np, seed, offsets, candidates, index)
    _fuzz_place_rows(coder, rng, np, seed)
    _fuzz_escapes(coder, rng, np, seed)
    _fuzz_referenced(coder, rng, np, seed, sets, tables[2:])
    _fuzz_list(coder, rng, np, seed)
    _fuzz_tables(coder, rng, np, seed, sets, below_sets, tables[2:])
    width = int(rng.integers(1, 17))
    items = rng.integers(0, 3, (int(rng.integers(0, 400)), width)).astype(np.uint8)
    ids, first = np.empty(len(items), np.int32), np.empty(len(items), np.int64)
    found = coder.distinct(items.reshape(-1), width, ids, first)
    numbers: dict[bytes, int] = {}
    expected = [numbers.setdefault(row.tobytes(), len(numbers)) for row in items]
    if found != len(numbers) or list(ids) != expected:
        raise SystemExit(f"seed {seed}: distinct items numbered otherwise than a dict numbers them")


def _fuzz_candidate_hits(coder: Any, rng: Any, np: Any, seed: int, offsets: Any, candidates: Any, index: Any) -> None:
    """The plan's candidate hits on :func:`_fuzz_context`'s tables against a plain loop, and forged keys or offsets
    (past the candidates, descending, keys past the offsets) refused with ValueError."""
    keys = offsets.size - 1
    at = rng.integers(-1, keys + 1, index.size).astype(np.int64) if keys else np.full(index.size, -1, np.int64)
    at[at == keys] = -1
    hit = np.zeros(index.size, np.uint8)
    coder.candidate_hits(at, offsets, candidates, index, hit)
    expected = [
        a >= 0 and int(x) in candidates[offsets[a] : offsets[a + 1]].tolist()
        for a, x in zip(at.tolist(), index, strict=True)
    ]
    if hit.astype(bool).tolist() != expected:
        raise SystemExit(f"seed {seed}: candidate hits other than a plain loop finds")
    forged_offsets = offsets.copy()
    if forged_offsets.size:
        forged_offsets[rng.integers(forged_offsets.size)] = rng.integers(0, 2**32, dtype=np.uint64)
    forged_at = at.copy()
    if forged_at.size:
        forged_at[rng.integers(forged_at.size)] = rng.integers(keys, 2**40)
    for forged in ((forged_at, offsets), (at, forged_offsets)):
        with contextlib.suppress(ValueError):  # refused, or (a value forged into range) read inside the arrays
            coder.candidate_hits(*forged, candidates, index, hit)


def _fuzz_place_rows(coder: Any, rng: Any, np: Any, seed: int) -> None:
    """A chunk layer's rows placed from its list and escapes as numpy places them, and forged indices (past the
    list, escapes short or left over, other dtypes or sizes) refused with ValueError."""
    k = int(rng.integers(1, 9))
    dtype = np.uint8 if rng.random() < 0.5 else np.uint16
    sets = rng.integers(0, 256, (int(rng.integers(0, 40)), k)).astype(dtype)
    index = rng.integers(-1, max(len(sets), 1), int(rng.integers(0, 300))).astype(np.int32)
    if not len(sets):
        index[:] = -1
    escapes = rng.integers(0, 256, (int((index < 0).sum()), k)).astype(dtype)
    out = np.empty((index.size, k), dtype)
    coder.place_rows(index, sets.reshape(-1), escapes.reshape(-1), out.reshape(-1), k)
    expected = sets[np.maximum(index, 0)] if len(sets) else np.empty_like(out)
    expected[index < 0] = escapes
    if not np.array_equal(out, expected):
        raise SystemExit(f"seed {seed}: rows placed otherwise than numpy places them")
    forged = index.copy()
    if forged.size:
        forged[rng.integers(forged.size)] = rng.integers(-(2**31), 2**31)
    cut = escapes[: max(0, len(escapes) - 1)]
    for args in (
        (forged, escapes, out),
        (index, cut, out),
        (index, escapes, out[:-1]),
        (index, escapes, out.astype(np.int32)),
    ):
        with contextlib.suppress(ValueError):  # refused, or (a forged index inside the list) placed inside out
            coder.place_rows(args[0], sets.reshape(-1), args[1].reshape(-1), args[2].reshape(-1), k)


def _fuzz_escapes(coder: Any, rng: Any, np: Any, seed: int) -> None:
    """Escaped rows (skewed sets, uint8 or uint16, any order of the experts) coded and decoded, forged streams
    (noise, cut short) decoded to sorted distinct sets, and bad arguments refused with ValueError."""
    experts = int(rng.choice([1, 2, 8, 9, 64, 128, 300, 1024]))
    k = int(rng.integers(1, min(experts, 48) + 1))  # the decoder sorts up to 32 IDs in place, more by marking
    dtype = np.uint8 if experts <= 256 else np.uint16
    rows = int(rng.integers(0, 300))
    weights = rng.dirichlet(np.full(experts, float(rng.choice([0.05, 1.0, 50.0])))) + 1e-9
    ids = np.sort(
        np.stack([rng.choice(experts, k, replace=False, p=weights / weights.sum()) for _ in range(rows)])
        if rows
        else np.zeros((0, k), np.int64),
        axis=1,
    ).astype(dtype)
    order = rng.permutation(experts).astype(np.uint16)
    out = np.empty(rows * k * 4 + 64, np.uint8)
    written = coder.encode_escapes(ids.reshape(-1), k, experts, order, out)
    if written < 0:
        out = np.empty(rows * experts * 2 + 64, np.uint8)
        written = coder.encode_escapes(ids.reshape(-1), k, experts, order, out)
    decoded = np.empty_like(ids)
    coder.decode_escapes(out[:written].copy(), k, experts, order, decoded.reshape(-1))
    if not np.array_equal(decoded, ids):
        raise SystemExit(f"seed {seed}: coded escapes decode to other sets")
    for _ in range(5):
        stream = rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8)
        if rng.random() < 0.5 and written:
            stream = out[: int(rng.integers(0, written))].copy()
        coder.decode_escapes(stream, k, experts, order, decoded.reshape(-1))
        if rows and ((decoded >= experts).any() or (np.diff(decoded.astype(np.int64), axis=1) <= 0).any()):
            raise SystemExit(f"seed {seed}: a forged escape stream decodes to something other than sets")
    bad_order = order.copy()
    if experts > 1:
        bad_order[0] = bad_order[1]
        try:
            coder.decode_escapes(out[:written].copy(), k, experts, bad_order, decoded.reshape(-1))
        except ValueError:
            pass
        else:
            raise SystemExit(f"seed {seed}: an order that is no permutation was taken")


def _fuzz_referenced(coder: Any, rng: Any, np: Any, seed: int, sets: int, tables: tuple[Any, ...]) -> None:
    """Version 3's and 4's escapes against the random tables of :func:`_fuzz_context` (``sets`` listed): escaped
    rows near a listed set or drawn afresh, coded and decoded; forged streams decoded to sorted distinct sets (or,
    in version 4, refused for a listed reference past the list); a list with an ID past the experts or twice, and
    candidates past the list, refused with ValueError (or no row reaching them)."""
    experts = int(rng.choice([2, 9, 16, 64, 300, 1024]))
    k = int(rng.integers(1, min(experts, 40) + 1))
    dtype = np.uint8 if experts <= 256 else np.uint16
    listed = np.zeros((sets, k), dtype)
    for s in range(sets):
        listed[s] = np.sort(rng.choice(experts, k, replace=False))
    rows = int(rng.integers(0, 300))
    ids = np.empty((rows, k), dtype)
    for r in range(rows):
        row = listed[rng.integers(0, sets)].copy() if sets and rng.random() < 0.6 else rng.choice(experts, k, False)
        outside = np.setdiff1d(np.arange(experts), row)
        if outside.size:
            row[rng.integers(0, k)] = rng.choice(outside)
        ids[r] = np.sort(row)
    tokens = rng.integers(-1, 6000, rows).astype(np.int64)
    keyed = rng.random(rows) < 0.7  # most rows' tokens have candidates
    tokens[keyed] = rng.choice(np.r_[tables[0], 7], int(keyed.sum()))
    below_keys = tables[4].size - 1
    below = rng.integers(-1, below_keys + 2, rows).astype(np.int32) if rng.random() < 0.7 else np.zeros(0, np.int32)
    order = rng.permutation(experts).astype(np.uint16)
    lists = bool(rng.random() < 0.7)
    args = (k, experts, order, listed.reshape(-1), tokens, below, *tables)
    out = np.empty(rows * experts * 2 + 64, np.uint8)
    written = coder.encode_referenced(ids.reshape(-1), *args, out, lists)
    decoded = np.empty_like(ids)
    coder.decode_referenced(out[:written].copy(), *args, decoded.reshape(-1), lists)
    if not np.array_equal(decoded, ids):
        raise SystemExit(f"seed {seed}: referenced escapes decode to other sets")

    def sets_or_refused(stream: Any, listed_now: Any, what: str) -> None:
        try:
            coder.decode_referenced(
                stream, k, experts, order, listed_now.reshape(-1), tokens, below, *tables, decoded.reshape(-1), lists
            )
        except ValueError as exc:
            if listed_now is listed and not (lists and "reference outside the list" in str(exc)):
                raise
            return
        if rows and ((decoded >= experts).any() or (np.diff(decoded.astype(np.int64), axis=1) <= 0).any()):
            raise SystemExit(f"seed {seed}: {what} decodes to something other than sets")

    for _ in range(5):
        stream = rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8)
        if rng.random() < 0.5 and written:
            stream = out[: int(rng.integers(0, written))].copy()
        sets_or_refused(stream, listed, "a forged referenced stream")
    if sets and k > 1:  # an ID twice or past the experts: refused; a forged list still of sets: read as sets
        forged = listed.copy()
        forged[rng.integers(0, sets), 1] = forged[rng.integers(0, sets), 0] if rng.random() < 0.5 else experts - 1
        sets_or_refused(out[:written].copy(), forged, "a stream read with a forged list")
    if sets:  # candidates past the list: refused, unless no row reaches one
        sets_or_refused(out[:written].copy(), listed[: int(rng.integers(0, sets))], "a stream read with a cut list")


def _fuzz_list(coder: Any, rng: Any, np: Any, seed: int) -> None:
    """Model version 3's lists: sets near earlier ones (some further back than the writer's window) or drawn afresh,
    coded and decoded; forged streams (noise, cut short) decoded to sorted distinct sets up to the set they stop at."""
    experts = int(rng.choice([1, 2, 9, 64, 300, 1024]))
    k = int(rng.integers(1, min(experts, 40) + 1))
    dtype = np.uint8 if experts <= 256 else np.uint16
    n = int(rng.integers(0, 1200))
    rows = np.zeros((n, k), dtype)
    for i in range(n):
        row = rows[rng.integers(0, i)].copy() if i and rng.random() < 0.7 else rng.choice(experts, k, replace=False)
        outside = np.setdiff1d(np.arange(experts), row)
        if outside.size and rng.random() < 0.9:
            row[rng.integers(0, k)] = rng.choice(outside)
        rows[i] = np.sort(row)
    order = np.arange(experts, dtype=np.uint16)
    out = np.empty(n * experts * 2 + 64, np.uint8)
    written = coder.encode_list(rows.reshape(-1), k, experts, order, out)
    decoded = np.zeros_like(rows)
    if coder.decode_list(out[:written].copy(), k, experts, order, decoded.reshape(-1)) != (0, -1):
        raise SystemExit(f"seed {seed}: a coded list does not decode")
    if not np.array_equal(decoded, rows):
        raise SystemExit(f"seed {seed}: a coded list decodes to other sets")
    for _ in range(5):
        stream = rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8)
        if rng.random() < 0.5 and written:
            stream = out[: int(rng.integers(0, written))].copy()
        status, stop = coder.decode_list(stream, k, experts, order, decoded.reshape(-1))
        read = decoded[: stop if status else n].astype(np.int64)
        if read.size and ((read >= experts).any() or (np.diff(read, axis=1) <= 0).any()):
            raise SystemExit(f"seed {seed}: a forged list decodes to something other than sets")


def _fuzz_tables(coder: Any, rng: Any, np: Any, seed: int, sets: int, below_sets: int, tables: tuple[Any, ...]) -> None:
    """Model version 4's candidate tables (:func:`_fuzz_context`'s random ones, their keys spread over the token ids):
    coded and decoded; forged streams (noise, cut short) read to a status, with keys ascending up to the largest
    token id and candidates inside the list wherever it is OK."""
    keys, _, offsets, candidates, below_offsets, below_candidates = tables
    keys = keys * int(rng.choice([1, 1000, 400_000]))
    n_below = int(np.count_nonzero(np.diff(below_offsets.astype(np.int64))))
    arrays = (keys, offsets, candidates, below_offsets, below_candidates)
    out = np.empty(128 * (keys.size + candidates.size + below_sets + below_candidates.size) + 64, np.uint8)
    written = coder.encode_tables(*arrays, sets, below_sets, out)

    def read(stream: Any) -> tuple[int, tuple[Any, ...]]:
        got = (
            np.empty(keys.size, np.int64),
            np.empty(keys.size + 1, np.uint32),
            np.empty(keys.size * 8, np.uint32),
            np.empty(below_sets + 1, np.uint32),
            np.empty(below_sets * 4, np.uint32),
        )
        return coder.decode_tables(stream, sets, below_sets, n_below, *got), got

    status, got = read(out[:written].copy())
    if status != 0 or any(not np.array_equal(g[: a.size], a) for g, a in zip(got, arrays, strict=True)):
        raise SystemExit(f"seed {seed}: coded tables decode to other tables")
    for _ in range(5):
        stream = rng.integers(0, 256, int(rng.integers(0, 60)), dtype=np.uint8)
        if rng.random() < 0.5 and written:
            stream = out[: int(rng.integers(0, written))].copy()
        status, (k, to, tc, bo, bc) = read(stream)
        if status == 0 and (
            (np.diff(k) < 1).any()
            or (k.size and (k[0] < 0 or k[-1] > 2**31 - 1))
            or (tc[: to[-1]] >= sets).any()
            or (bc[: bo[-1]] >= sets).any()
        ):
            raise SystemExit(f"seed {seed}: forged tables read as OK past their limits")


def _fuzz_sort(kernels: Any, rng: Any, np: Any, seed: int) -> None:
    """The writer's sort (token order -> sorted rows in layer order) against numpy's, rows valid or not: a few
    tokens or several blocks of them, one layer or many, uint8 or uint16 IDs."""
    tokens, layers = int(rng.integers(0, 2000)), int(rng.integers(1, 64))
    dtype = np.uint16 if rng.random() < 0.2 else np.uint8
    largest = int(rng.integers(7, 300 if dtype == np.uint8 else 70000)) if rng.random() < 0.9 else 7
    largest = min(largest, np.iinfo(dtype).max)
    ids = (
        np.argsort(rng.random((tokens * layers, largest + 1)), axis=1)[:, :8].astype(dtype)
        if largest < 512
        else (rng.choice(largest + 1, (tokens * layers, 8)).astype(dtype))
    )
    if rng.random() < 0.3 and ids.size:  # a few rows with a repeated or too large ID
        broken = rng.integers(0, ids.shape[0], int(rng.integers(1, 4)))
        ids[broken, rng.integers(0, 8)] = rng.integers(0, np.iinfo(dtype).max, broken.size)
    out = np.zeros((layers, tokens, 8), dtype)
    bad = kernels.sort_rows_of_eight(ids.reshape(-1), out.reshape(-1), tokens, layers, largest)
    ordered = np.sort(ids.reshape(tokens, layers, 8), axis=2)
    wrong = (ordered[..., -1] > largest) | (ordered[..., 1:] == ordered[..., :-1]).any(axis=2)
    expected = int(np.argmax(wrong.reshape(-1))) if wrong.any() else -1
    if bad != expected or (bad < 0 and not np.array_equal(out, ordered.transpose(1, 0, 2))):
        raise SystemExit(
            f"seed {seed}: the sort of {tokens} tokens x {layers} layers ({dtype.__name__}) is not numpy's"
        )


def _parquet_objects() -> list[bytes]:
    """Parquet objects as routelog writes its index (strings, lists, lists of structs, nulls), in a few codecs."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "sample_id": ["a", "bb", None],
            "token_ids": pa.array([[1, 2], [], None], pa.list_(pa.int32())),
            "spans": pa.array([[{"row": 1}], [], None], pa.list_(pa.struct([("row", pa.int64())]))),
        }
    )
    objects = []
    for options in ({}, {"compression": "zstd", "data_page_version": "2.0"}, {"use_dictionary": False}):
        sink = io.BytesIO()
        pq.write_table(table, sink, **options)
        objects.append(sink.getvalue())
    return objects


def _fuzz_thrift(thrift: Any, objects: list[bytes], rng: Any, seed: int) -> None:
    """The compiled Thrift walks on a forged footer or page header (bytes overwritten, cut short, grown, or
    random), against the Python walks of routelog.format.parquet_limits: the same values or the same problem."""
    from routelog.errors import CorruptDataError
    from routelog.format import parquet_limits as limits

    data = objects[int(rng.integers(len(objects)))]
    end = len(data) - 8
    start = end - int.from_bytes(data[-8:-4], "little")
    footer = rng.random() < 0.5
    if not footer:  # a page header: the first column chunk's, right after the magic
        start, end = 4, start
    body = bytearray(data[start:end] if rng.random() < 0.9 else rng.bytes(int(rng.integers(1, 200))))
    for _ in range(int(rng.integers(0, 8))):
        body[int(rng.integers(len(body)))] = int(rng.integers(256))
    cut = int(rng.integers(len(body) + 1))
    body = body[:cut] + rng.bytes(int(rng.integers(0, 9))) if rng.random() < 0.5 else body
    forged = data[:start] + bytes(body)
    end = len(forged)
    max_rows = int(rng.choice([0, 3, 1 << 40]))
    outcomes = []
    for compiled in (True, False):
        try:
            if footer and compiled:
                value: Any = thrift.footer(forged, start, end, limits.MAX_SCHEMA_ELEMENTS, max_rows + 1, 16)
            elif footer:
                rows, elements, groups = limits._footer_walk(limits._Thrift(forged, start, end, "w"), max_rows)
                value = (rows, elements, groups)  # named tuples: equal to the compiled walk's tuples
            else:
                value = (
                    thrift.page_header(forged, start, end)
                    if compiled
                    else limits._page_header(limits._Thrift(forged, start, end, "w"))
                )
            outcomes.append(("ok", value))
        except (ValueError, CorruptDataError) as exc:  # the compiled walk's, the Python walk's
            outcomes.append(("error", str(exc).removeprefix("w: ")))
    if outcomes[0] != outcomes[1]:
        raise SystemExit(f"seed {seed}: the Thrift walks disagree: {outcomes}")


def _fuzz_audit(audit: Any, rng: Any, np: Any, seed: int) -> None:
    """The audits' kernels on one random routing pair, against numpy: expert counts (stopping at an ID past E)
    and set differences, on views with any strides."""
    from routelog.audit.r3 import routing_differences

    dtype = np.uint8 if rng.random() < 0.6 else np.uint16
    layers, tokens, k = int(rng.integers(0, 5)), int(rng.integers(0, 300)), int(rng.integers(1, 10))
    top = 255 if dtype == np.uint8 else 3000
    a = rng.integers(0, top + 1, (layers, tokens + 3, 2 * k)).astype(dtype)
    b = a.copy()
    b[rng.random(b.shape) < 0.2] = rng.integers(0, top + 1)
    step = int(rng.integers(1, 3))  # every ID, or every other one (an inner stride)
    a, b = a[:, 1 : tokens + 1, : k * step : step], b[:, 1 : tokens + 1, : k * step : step]
    valid = rng.random(tokens) < 0.8
    experts = int(rng.integers(1, top + 2))
    counts = np.zeros((layers, experts), np.int64)
    bad = audit.count_experts(a, valid, counts)
    expected = np.zeros_like(counts)
    first_bad = -1
    for j in range(layers):
        chosen = a[j][valid]
        if (chosen >= experts).any():
            t = int(np.flatnonzero((a[j] >= experts).any(axis=1) & valid)[0])
            first_bad = (j * tokens + t) * k + int(np.flatnonzero(a[j, t] >= experts)[0])
            break
        expected[j] = np.bincount(chosen.ravel(), minlength=experts)
    if bad != first_bad or not np.array_equal(counts, expected):
        raise SystemExit(f"seed {seed}: count_experts disagrees with numpy")
    router, token = np.zeros(k + 1, np.int64), np.zeros(layers * k + 1, np.int64)
    per_layer = np.zeros(layers, np.int64)
    rows, differing = audit.compare_rows(a, b, valid, router, token, per_layer)
    lacking = routing_differences(a[:, valid], b[:, valid])  # the audits' numpy definition, [L, T]
    histograms = (
        (router, np.bincount(lacking.ravel(), minlength=k + 1)),
        (token, np.bincount(lacking.sum(axis=0), minlength=layers * k + 1)),
        (per_layer, (lacking > 0).sum(axis=1)),
    )
    if (rows, differing) != (int(valid.sum()), int(lacking.sum())) or any(
        got.tolist() != want.tolist() for got, want in histograms
    ):
        raise SystemExit(f"seed {seed}: compare_rows disagrees with numpy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fuzz(Path(args.child), args.seconds, args.seed)
        return
    with tempfile.TemporaryDirectory(prefix="routelog-fuzz-") as scratch:
        build(Path(scratch))
        raise SystemExit(rerun_sanitized(__file__, scratch, args.seconds, args.seed))


if __name__ == "__main__":
    main()
