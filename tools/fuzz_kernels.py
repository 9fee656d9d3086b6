"""Fuzz the compiled codec kernels under AddressSanitizer and UndefinedBehaviorSanitizer.

Builds ``routelog/format/_ckernels.c`` with gcc's ``-fsanitize=address,undefined`` into a scratch directory, then
runs it (libasan preloaded) on random chunks and on forged ones for ``--seconds``: every chunk encoded (both the
word and the one-ID-at-a-time path) must decode to itself, and every forged payload (bytes flipped in either
section, the tail section cut short, random windows, every accept rule, misaligned buffers) must return a status
without a sanitizer report. A report aborts the run with the sanitizer's stack.

    python tools/fuzz_kernels.py [--seconds 120] [--seed 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent.parent / "routelog" / "format" / "_ckernels.c"


def build(directory: Path) -> None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    command = [
        "gcc",
        "-O1",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-omit-frame-pointer",
        "-ffp-contract=off",
        "-std=c11",
        "-shared",
        "-fPIC",
        f"-I{sysconfig.get_paths()['include']}",
        str(SOURCE),
        "-o",
        str(directory / f"_ckernels{suffix}"),
    ]
    subprocess.run(command, check=True)


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


def fuzz(seconds: float, seed: int) -> None:
    import _ckernels as kernels  # the sanitized build, first on sys.path
    import numpy as np

    rng = np.random.default_rng(seed)
    deadline = time.monotonic() + seconds
    chunks = forged = 0
    while time.monotonic() < deadline:
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
    print(f"seed {seed}: {chunks} chunks round-tripped, {forged} forged payloads decoded, no sanitizer report")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, args.child)
        fuzz(args.seconds, args.seed)
        return
    with tempfile.TemporaryDirectory(prefix="routelog-fuzz-") as scratch:
        build(Path(scratch))
        libraries = [
            subprocess.run(
                ["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True
            ).stdout.strip()
            for name in ("libasan.so", "libubsan.so")
        ]
        env = dict(
            os.environ,
            LD_PRELOAD=" ".join(libraries),
            ASAN_OPTIONS="detect_leaks=0",  # the interpreter's own allocations outlive it
            UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        )
        command = [
            sys.executable,
            __file__,
            "--child",
            scratch,
            "--seconds",
            str(args.seconds),
            "--seed",
            str(args.seed),
        ]
        raise SystemExit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
