"""A rollout worker for the concurrency and SIGKILL tests: writes records to a store and prints each commit as it
becomes durable (``COMMITTED id,id,...``). Run as ``python tests/writer_child.py URL WRITER PREFIX N``."""

from __future__ import annotations

import sys

import numpy as np

import routelog
from routelog import ModelSpec, Record

SPEC = ModelSpec(name="children", num_layers=3, moe_layers=(0, 1, 2), num_experts=16, topk=2)


def main() -> None:
    url, writer_id, prefix, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    flush_bytes = int(sys.argv[5]) if len(sys.argv) > 5 else 2000
    store = routelog.create_store(url, SPEC)

    def announce(commit: object, sample_ids: list[str]) -> None:
        print("COMMITTED " + ",".join(sample_ids), flush=True)

    with store.writer(0, writer_id, flush_bytes=flush_bytes, on_commit=announce) as writer:
        for i in range(n):
            tokens = 8 + i % 5
            ids = np.stack([np.argsort(np.random.default_rng(i).random((3, 16)), axis=-1)[:, :2]] * tokens)
            writer.append(
                Record(
                    sample_id=f"{prefix}{i:05d}",
                    expert_ids=ids,
                    prompt_len=2,
                    response_len=tokens - 2,
                    token_ids=np.arange(tokens) + i,
                )
            )
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
