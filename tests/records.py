"""Records for tests: random routing in score order, with the final row (and optionally a hole) missing."""

from __future__ import annotations

import numpy as np

from routelog import ModelSpec, Record
from routelog.format import keys
from routelog.format.documents import CommitGroup, CommitRecord, dump_document, parse_log_document
from routelog.format.values import LOGPROB_INFER
from routelog.store.storage import Storage


def random_routing(rng: np.random.Generator, tokens: int, layers: int, experts: int, topk: int) -> np.ndarray:
    """``[tokens, layers, topk]`` int64 rows of distinct experts, in random (score-like) order."""
    keys = rng.random((tokens * layers, experts))
    return np.argsort(keys, axis=1)[:, :topk].reshape(tokens, layers, topk)


def sample_records(
    spec: ModelSpec,
    n: int,
    seed: int,
    prefix: str = "",
    *,
    tokens: tuple[int, int] = (3, 90),
    holes: bool = False,
    logprobs: bool = False,
    policy_version: int = 7,
) -> list[Record]:
    """``n`` records ``<prefix>s<i>`` of 2 prompt tokens and a random length in ``tokens``, grouped in pairs
    (``g<i // 2>``); the final row is missing (engines never forward it), and with ``holes`` every third record
    also misses rows 1-2 (a multi-turn hole). ``logprobs`` attaches ``logprob_infer`` (NaN on the prompt)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(*tokens))
        valid = np.ones(length, bool)
        valid[-1] = False
        if holes and i % 3 == 1:
            valid[1:3] = False
        routing = random_routing(rng, length, spec.num_moe_layers, spec.num_experts, spec.topk)
        values = None
        if logprobs:
            values = {LOGPROB_INFER: np.where(np.arange(length) < 2, np.nan, -rng.random(length)).astype(np.float32)}
        out.append(
            Record(
                sample_id=f"{prefix}s{i}",
                expert_ids=routing,
                prompt_len=2,
                response_len=length - 2,
                valid=valid,
                token_ids=rng.integers(0, 1000, length),
                group_id=f"g{i // 2}",
                policy_version=policy_version,
                token_values=values,
            )
        )
    return out


def replace_commit(storage: Storage, step: int, commit: CommitRecord) -> None:
    """Rewrite the log entry holding ``commit`` (found by its position and slot) with ``commit`` in its place: how
    tests forge one commit of an entry."""
    assert commit.position is not None
    key = keys.log_key(step, commit.position)
    doc = parse_log_document(storage.read(key), key)
    if isinstance(doc, CommitGroup):
        assert commit.slot is not None
        commits = list(doc.commits)
        commits[commit.slot] = commit
        storage.write(key, dump_document(doc.model_copy(update={"commits": commits})))
    else:
        storage.write(key, dump_document(commit))
