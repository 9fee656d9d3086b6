"""Write tests/fixtures/kernels/reference.npz: chunks of routing and the two sections the format-2 encoder wrote
for them, so every later build of the kernels is held to the same bytes (tests/test_kernels.py).

The sections were written by the numba kernels routelog used before its C kernels (git history: the commit that
added this script); both agreed on about 30,000 random chunks (uint8 and uint16 IDs, K of 1 to 8, skewed and
uniform loads, repeats, invalid rows, every dictionary policy) before the numba ones were removed. Running this
script again regenerates the file with the current kernels (it must then be unchanged)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from routelog.format import kernels

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "kernels" / "reference.npz"


def chunks(seed: int, count: int) -> list[tuple[np.ndarray, int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for n in range(count):
        dtype = np.uint8 if n % 3 else np.uint16
        k = int(rng.choice([1, 2, 6, 8, 8]))
        experts = int(rng.integers(max(k, 8), 256 if dtype == np.uint8 else 700))
        layers, rows = int(rng.integers(1, 4)), int(rng.integers(1, 300))
        load = rng.dirichlet(np.full(experts, 0.2 if n % 2 else 5.0))
        pool = [np.sort(rng.choice(experts, k, replace=False, p=load)) for _ in range(int(rng.integers(1, 40)))]
        ids = np.empty((layers, rows, k), dtype)
        for j in range(layers):
            for r in range(rows):
                u = rng.random()
                if r and u < 0.3:
                    ids[j, r] = ids[j, r - 1]
                elif u < 0.6:
                    ids[j, r] = pool[rng.integers(len(pool))]
                else:
                    ids[j, r] = np.sort(rng.choice(experts, k, replace=False, p=load))
                if rng.random() < 0.02:  # a row that is no set: an exception
                    ids[j, r, rng.integers(k)] = rng.integers(0, experts + 5)
        out.append((ids, experts, n % 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=60)
    args = parser.parse_args()
    arrays: dict[str, np.ndarray] = {}
    for n, (ids, experts, policy) in enumerate(chunks(2026, args.count)):
        gaps, rest, placed, matched = kernels.encode_chunk(ids, experts, policy)
        arrays[f"ids_{n}"] = ids
        arrays[f"meta_{n}"] = np.array([experts, policy, placed, matched], np.int64)
        arrays[f"gaps_{n}"] = gaps
        arrays[f"rest_{n}"] = rest
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {args.count} chunks)")


if __name__ == "__main__":
    main()
