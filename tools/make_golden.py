"""Write the golden fixture stores of this format version under ``tests/fixtures/golden-v<N>/``.

Golden stores are written once per format version and committed; every later routelog must still read them
(``tests/test_golden.py``). Never regenerate an existing version's fixtures: add a new version's instead.

    python tools/make_golden.py [--force]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

import routelog
from routelog import ModelSpec, PartOptions, Record, Segment
from routelog.format import FORMAT_VERSION

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / f"golden-v{FORMAT_VERSION}"


def _routing(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    return np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :k]


def _expect_sorted(expected: dict[str, np.ndarray], store: str, record: Record) -> None:
    """What a reader must return for ``record`` written with sorted sets: ascending rows, -1 where missing."""
    valid = np.asarray(record.valid)
    ids = np.sort(np.asarray(record.expert_ids), axis=-1).astype(np.int16)
    ids[~valid] = -1
    expected[f"{store}/{record.sample_id}/ids"] = ids
    expected[f"{store}/{record.sample_id}/valid"] = valid


def write_dense_first(root: Path, expected: dict[str, np.ndarray]) -> None:
    """DeepSeek-V3 style (3 dense layers, E=64, K=6), two steps, several parts, missing rows, multi-turn segments."""
    spec = ModelSpec.from_hf_config(
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 7,
            "first_k_dense_replace": 3,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "n_group": 8,
            "topk_group": 4,
            "_name_or_path": "golden/dense-first",
        }
    )
    rng = np.random.default_rng(2026)
    url = str(root / "dense-first")
    options = PartOptions(chunk_rows=32, chunk_layers=3)
    for step in (0, 1):
        with routelog.open_writer(
            url,
            step,
            model_spec=spec,
            writer_id=f"rollout-{step}",
            options=options,
            flush_bytes=3000,
            run_id="golden-dense-first",
            config={"purpose": "golden fixture"},
        ) as writer:
            for i in range(5):
                tokens = 20 + 13 * i
                ids = _routing(rng, tokens, spec.num_moe_layers, spec.num_experts, spec.topk)
                valid = np.ones(tokens, bool)
                valid[-1] = False
                if i == 3:
                    valid[8:11] = False  # a tool observation never prefilled
                record = Record(
                    sample_id=f"step{step}/req-{i}/0",
                    expert_ids=ids,
                    prompt_len=8,
                    response_len=tokens - 8,
                    valid=valid,
                    token_ids=rng.integers(0, 50000, tokens),
                    group_id=f"group-{i // 2}",
                    policy_version=step,
                    engine="vllm",
                    engine_version="0.22.0",
                    segments=[
                        Segment(start=0, end=8, policy_version=step, source="prompt"),
                        Segment(start=8, end=tokens, policy_version=step, source="response"),
                    ],
                    extra={"reward": float(i) / 4},
                )
                writer.append(record)
                _expect_sorted(expected, "dense-first", record)


def write_wide(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Kimi-K2 style width (E=384 > 256: uint16 byte planes), score order kept, one step."""
    spec = ModelSpec(name="golden/wide", num_layers=3, moe_layers=(1, 2), num_experts=384, topk=8)
    rng = np.random.default_rng(384)
    url = str(root / "wide")
    with routelog.open_writer(
        url, 0, model_spec=spec, writer_id="w", options=PartOptions(topk_order="score"), run_id="golden-wide"
    ) as writer:
        for i in range(3):
            tokens = 17 + i
            ids = _routing(rng, tokens, 2, 384, 8)
            writer.append(Record(sample_id=f"wide-{i}", expert_ids=ids, prompt_len=5, response_len=tokens - 5))
            expected[f"wide/wide-{i}/ids"] = ids.astype(np.int16)
            expected[f"wide/wide-{i}/valid"] = np.ones(tokens, bool)


def _skewed_routing(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    """Sets drawn from skewed per-layer popularity, a third of the tokens repeating the previous token's set."""
    out = np.empty((tokens, layers, k), np.int64)
    for j in range(layers):
        popularity = rng.dirichlet(np.full(experts, 0.3))
        for t in range(tokens):
            repeat = t > 0 and rng.random() < 0.33
            out[t, j] = out[t - 1, j] if repeat else rng.choice(experts, size=k, replace=False, p=popularity)
    return out


def write_grpo_groups(root: Path, expected: dict[str, np.ndarray]) -> None:
    """Format 2: GRPO groups whose prompts are stored once (one sample's prompt routed differently from token 10
    on, so only its first 10 tokens are shared), skewed routing with repeats (ranked layers), E = 96 and E = 384
    (uint16) in two stores, several parts and edge chunks."""
    for experts in (96, 384):
        spec = ModelSpec(
            name=f"golden/grpo-{experts}", num_layers=5, moe_layers=(1, 2, 3, 4), num_experts=experts, topk=4
        )
        rng = np.random.default_rng(experts)
        name = f"grpo-{experts}"
        with routelog.open_writer(
            str(root / name),
            0,
            model_spec=spec,
            writer_id="rollout",
            options=PartOptions(chunk_rows=64, chunk_layers=3),
            flush_bytes=4000,
            run_id=f"golden-{name}",
        ) as writer:
            for group in range(3):
                prompt = rng.integers(0, 50000, 40)
                prompt_routing = _skewed_routing(rng, 40, 4, experts, 4)
                for sample in range(4):
                    tokens = 40 + int(rng.integers(10, 30))
                    ids = _skewed_routing(rng, tokens, 4, experts, 4)
                    ids[:40] = prompt_routing
                    if group == 1 and sample == 2:
                        ids[10:40] = _skewed_routing(rng, 30, 4, experts, 4)  # batch-variant numerics
                    valid = np.ones(tokens, bool)
                    valid[-1] = False
                    record = Record(
                        sample_id=f"g{group}/{sample}",
                        expert_ids=ids,
                        prompt_len=40,
                        response_len=tokens - 40,
                        valid=valid,
                        token_ids=np.concatenate([prompt, rng.integers(0, 50000, tokens - 40)]),
                        group_id=f"g{group}",
                    )
                    writer.append(record)
                    _expect_sorted(expected, name, record)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="replace existing fixtures of this version")
    args = parser.parse_args()
    if FIXTURES.exists():
        if not args.force:
            print(f"{FIXTURES} exists; golden fixtures are never regenerated (use --force only before release)")
            return 1
        shutil.rmtree(FIXTURES)
    FIXTURES.mkdir(parents=True)
    expected: dict[str, np.ndarray] = {}
    write_dense_first(FIXTURES, expected)
    write_wide(FIXTURES, expected)
    if FORMAT_VERSION >= 2:
        write_grpo_groups(FIXTURES, expected)
    np.savez_compressed(FIXTURES / "expected.npz", **expected)  # type: ignore[arg-type]
    print(f"wrote {FIXTURES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
