"""Fuzz the compiled indexer positions coder (routelog/format/_cpositions.c) under AddressSanitizer and
UndefinedBehaviorSanitizer.

Builds the extension with gcc's ``-fsanitize=address,undefined`` into a scratch directory, then runs it (libasan
preloaded) for ``--seconds`` against the Python twin (routelog/format/positions_python.py):

* random canonical rows (k 1..300, missing rows, any overlap, any first position and keyframe interval) must encode
  to the twin's bytes and decode to themselves, whole and over random ranges;
* damaged blocks (bits and bytes flipped, cut short, bytes appended or spliced in, header fields forged, random
  bytes behind a valid header) must decode exactly as the twin decodes them: the same rows, or the same status at
  the same row; rows decoded from a damaged block must be canonical;
* the decoder called with offsets and sizes that do not fit its data must refuse them, and the encoder and the row
  check handed rows that are not canonical must name the same row as the numpy check.

A sanitizer report aborts the run with its stack; a disagreement exits with the seed and what differed.

    python tools/fuzz_positions.py [--seconds 60] [--seed 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import build_sanitized, rerun_sanitized

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "routelog" / "format" / "_cpositions.c"


def build(directory: Path) -> Path:
    target = directory / f"_cpositions{sysconfig.get_config_var('EXT_SUFFIX')}"
    build_sanitized(SOURCE, target)
    return target


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("_cpositions", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(rng: Any, np: Any) -> tuple[Any, int, int]:
    k = int(rng.choice([1, 2, 3, 8, 17, 64, 300]))
    n = int(rng.integers(0, 600))
    first = int(rng.choice([0, 0, 1, max(k - 2, 0), k, k + 50, 2000]))
    overlap = float(rng.choice([0.0, 0.5, 0.95, 0.99, 1.0]))
    missing = float(rng.choice([0.0, 0.0, 0.01, 0.2, 1.0]))
    every = int(rng.choice([1, 2, 7, 64, 256, 100000]))
    rows = np.full((n, k), -1, np.int32)
    prev = None
    for i in range(n):
        p = first + i
        if p + 1 <= k:
            prev = np.arange(p + 1)
        elif prev is None or len(prev) < k:
            prev = np.sort(rng.choice(p + 1, k, replace=False))
        else:
            candidates = p + 1 - k
            d = min(int(rng.binomial(k, 1 - overlap)), candidates)
            kept = np.delete(prev, rng.choice(k, d, replace=False))
            free = np.setdiff1d(np.arange(p + 1), prev)
            prev = np.sort(np.concatenate([kept, rng.choice(free, d, replace=False)]))
        rows[i, : len(prev)] = prev
    rows[rng.random(n) < missing] = -1
    return rows, first, every


def _damage(blob: bytes, rng: Any, np: Any) -> bytes:
    from routelog.format import positions_python as twin

    data = bytearray(blob)
    kind = int(rng.integers(7))
    if kind == 0 and data:  # flip bits
        for _ in range(int(rng.integers(1, 6))):
            at = int(rng.integers(len(data)))
            data[at] ^= 1 << int(rng.integers(8))
    elif kind == 1 and data:  # random bytes
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(len(data)))] = int(rng.integers(256))
    elif kind == 2:  # cut short
        data = data[: int(rng.integers(len(data) + 1))]
    elif kind == 3:  # bytes appended or spliced in
        at = int(rng.integers(len(data) + 1))
        data[at:at] = rng.bytes(int(rng.integers(1, 9)))
    elif kind == 4:  # a forged header field
        try:
            n, k, first, every, pos = twin.read_fields(bytes(data))
        except Exception:  # damaged already
            return bytes(data)
        fields = [n, k, first, every]
        fields[int(rng.integers(4))] = int(rng.choice([0, 1, 2, 255, 256, 65536, 65537, 2**31 - 1, 2**31]))
        data = bytearray([twin.MAGIC]) + b"".join(twin.varint_bytes(field) for field in fields) + data[pos:]
    elif kind == 5:  # random bytes behind the header
        try:
            *_, pos = twin.read_fields(bytes(data))
        except Exception:  # damaged already
            return bytes(data)
        data = data[:pos] + bytearray(rng.bytes(len(data) - pos))
    elif data:  # a run of bytes zeroed or set
        at = int(rng.integers(len(data)))
        end = min(len(data), at + int(rng.integers(1, 40)))
        data[at:end] = bytes([int(rng.choice([0, 255]))]) * (end - at)
    return bytes(data)


def _decode_both(compiled: Any, blob: bytes, start: int | None, stop: int | None, np: Any) -> tuple[Any, Any]:
    from routelog.errors import CorruptDataError
    from routelog.format import positions_python as twin

    try:
        header = twin.parse_header(blob)
    except CorruptDataError as error:
        return ("header", str(error)), ("header", str(error))
    n, k = header.n, header.k
    start = 0 if start is None else min(start, n)
    stop = n if stop is None else max(start, min(stop, n))
    out_c = np.full((stop - start, k), 7, np.int32)
    out_p = np.full((stop - start, k), 7, np.int32)
    status_c = compiled.decode(
        blob, header.offsets, n, k, header.first_position, header.keyframe_every, start, stop, out_c
    )
    status_p = twin.decode(np.frombuffer(blob, np.uint8), header, start, stop, out_p)
    c = (status_c, out_c.tolist() if status_c[0] == 0 else None)
    p = (tuple(status_p), out_p.tolist() if status_p[0] == 0 else None)
    if status_c[0] == 0:
        from routelog.format.positions import check_position_rows

        check_position_rows(out_c, header.first_position + start)
    return c, p


def _bad_calls(compiled: Any, blob: bytes, rng: Any, np: Any) -> None:
    """The decoder handed offsets and sizes that do not fit: BAD_ARGUMENTS (7), never a read out of bounds."""
    from routelog.format import positions_python as twin

    header = twin.parse_header(blob)
    n, k = header.n, header.k
    offsets = header.offsets.copy()
    if len(offsets) > 1:
        offsets[int(rng.integers(len(offsets)))] = int(rng.choice([-1, len(blob) + 1, 2**40]))
        out = np.empty((n, k), np.int32)
        status, _ = compiled.decode(blob, offsets, n, k, header.first_position, header.keyframe_every, 0, n, out)
        if status != twin.BAD_ARGUMENTS:
            raise SystemExit(f"offsets out of the data were not refused: {status}")
    calls = [
        (offsets[:0] if len(offsets) > 1 else header.offsets, 0, n, n * k),  # too few offsets (none)
        (np.concatenate([header.offsets, [len(blob)]]), 0, n, n * k),  # one offset too many
        (header.offsets, 0, n + 1, (n + 1) * k),  # rows past n
        (header.offsets, 1, 0, 0),  # start after stop
        (header.offsets, 0, n, max(n * k - 1, 0) if n else 1),  # an output of the wrong size
    ]
    for table, start, stop, size in calls:
        if len(table) == len(header.offsets) and (start, stop) == (0, n) and size == n * k:
            continue
        out = np.empty(size, np.int32)
        status, _ = compiled.decode(blob, table, n, k, header.first_position, header.keyframe_every, start, stop, out)
        if status != twin.BAD_ARGUMENTS:
            raise SystemExit(f"arguments {(len(table), start, stop, size)} were not refused: {status}")


def fuzz(scratch: Path, seconds: float, seed: int) -> None:
    import numpy as np

    from routelog.errors import CorruptDataError
    from routelog.format import positions
    from routelog.format import positions_python as twin

    compiled = _load(next(scratch.glob("_cpositions*")))
    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + seconds
    blocks = damaged = refused = invalid = 0
    while time.monotonic() < deadline:
        rows, first, every = _rows(rng, np)
        n, k = rows.shape
        blob = compiled.encode(rows, n, k, first, every)
        if blob != twin.encode(rows, first, every):
            raise SystemExit(f"seed {seed}: the compiled coder and the twin write different bytes ({n}x{k})")
        for start, stop in [(None, None)] + [
            tuple(sorted(int(v) for v in rng.integers(0, n + 1, 2))) for _ in range(3)
        ]:
            c, p = _decode_both(compiled, blob, start, stop, np)
            if c != p or c[0] != (0, -1):
                raise SystemExit(f"seed {seed}: a block does not decode to its rows: {c[0]} {p[0]}")
            begin = 0 if start is None else start
            if c[1] != rows[begin : (n if stop is None else stop)].tolist():
                raise SystemExit(f"seed {seed}: rows {start}..{stop} decode wrong")
        blocks += 1
        _bad_calls(compiled, blob, rng, np)
        for _ in range(20):
            forged = _damage(blob, rng, np)
            start, stop = (None, None) if rng.random() < 0.5 else sorted(int(v) for v in rng.integers(0, n + 2, 2))
            c, p = _decode_both(compiled, forged, start, stop, np)
            if c != p:
                raise SystemExit(f"seed {seed}: a damaged block decodes differently: compiled {c[0]}, twin {p[0]}")
            damaged += 1
            refused += c[0] == "header" or c[0][0] != 0
        for _ in range(200):  # more damaged blocks, the compiled decoder alone: canonical rows or a status
            forged = _damage(blob, rng, np)
            try:
                header = twin.parse_header(forged)
            except CorruptDataError:
                continue
            lo = int(rng.integers(0, header.n + 1))
            hi = int(rng.integers(lo, header.n + 1))
            out = np.empty((hi - lo, header.k), np.int32)
            status, _ = compiled.decode(
                forged, header.offsets, header.n, header.k, header.first_position, header.keyframe_every, lo, hi, out
            )
            if (
                status == 0
                and hi > lo
                and compiled.first_invalid_row(out, hi - lo, header.k, header.first_position + lo) >= 0
            ):
                raise SystemExit(f"seed {seed}: a damaged block decodes to rows that are not canonical")
            damaged += 1
            refused += status != 0
        if n:  # rows that are not canonical: the encoder names the first, as the check does
            bad = rows.copy()
            for _ in range(int(rng.integers(1, 4))):
                bad[int(rng.integers(n)), int(rng.integers(k))] = int(rng.integers(-3, first + n + 3))
            found = compiled.encode(bad, n, k, first, every)
            expected = positions._first_invalid_numpy(bad, first)
            named = found if isinstance(found, int) else -1
            if named != expected or compiled.first_invalid_row(bad, n, k, first) != expected:
                raise SystemExit(f"seed {seed}: the compiled check names row {named}, numpy {expected}")
            invalid += expected >= 0
    print(
        f"fuzz_positions: {blocks} blocks round-tripped, {damaged} damaged blocks decoded to canonical rows or"
        f" refused ({refused} refused; a tenth of them against the twin, alike), {invalid} sets of non-canonical"
        f" rows named alike, in {seconds:.0f} s; no sanitizer report"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT))
        fuzz(Path(args.child), args.seconds, args.seed)
        return
    with tempfile.TemporaryDirectory(prefix="routelog-fuzz-positions-") as scratch:
        build(Path(scratch))
        raise SystemExit(rerun_sanitized(__file__, scratch, args.seconds, args.seed))


if __name__ == "__main__":
    main()
