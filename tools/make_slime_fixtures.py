"""Capture what slime's own R3 code records, rank by rank, into ``tests/fixtures/slime/*.npz``.

slime (THUDM/slime) is not installable from PyPI (the ``slime`` there is an unrelated package), so the tests of
:mod:`routelog.integrations.slime` compare against outputs captured here from slime's real source at one commit.
For each configuration (TP/SP, zigzag CP, ``--allgather-cp``, PP with virtual stages and uneven stages, dense
layers, several micro-batches per DP rank, padding multipliers) this script:

1. draws a rollout of samples shaped as slime's SGLang path leaves them (``Sample.tokens``, ``response_length``,
   ``rollout_routed_experts`` ``[len(tokens) - 1, num_layers, K]`` int32 in score order, zeros in dense layers);
2. splits it over DP ranks and micro-batches with slime's own ``build_dp_schedule``
   (``slime/utils/dp_schedule.py``), and builds each DP rank's ``rollout_data`` as ``_split_train_data_by_dp`` does;
3. for every (DP, TP, CP, PP) rank, runs slime's real ``MegatronTrainRayActor.fill_routing_replay``
   (``slime/backends/megatron_utils/actor.py``, taken out of the file with :mod:`ast` because the module imports
   ``torch_memory_saver``) over slime's real ``DataIterator``, which calls the real
   ``prepare_routed_experts_for_routing_replay`` and ``slice_with_cp`` (``cp_utils.py``) with ``mpu`` replaced by
   that rank's coordinates and megatron-core's own ``get_num_layers_to_build`` / ``get_transformer_layer_offset``
   on a real ``TransformerConfig``;
4. stores every tensor each ``RoutingReplay`` instance (slime's real class) recorded: ``out__dp{d}_tp{t}_cp{c}_pp{p}
   __r{router}_m{micro_batch}`` (int32 ``[T_local, K]``).

The only substitution: ``RoutingReplay.record`` copies into pinned host memory, which CPU-only torch cannot
allocate, so here it keeps a plain contiguous copy of the same values.

Inputs are stored beside the outputs (``tokens__{i}``, ``experts__{i}``, ``response_length``) with ``meta`` (JSON:
the configuration, slime's args, the DP schedule, the slime commit and the SHA-256 of each source file used), so
the tests need neither slime nor this script. Every run draws the same data, so rerunning rewrites identical
arrays. Needs a slime git directory (``fetch github:THUDM/slime``) and megatron-core; no slime source is written to
the output. ``--check-routelog`` also runs, on every rank, routelog's replay (:class:`routelog.integrations.slime.
SlimeReplay`) with slime's real ``prepare_routed_experts_for_routing_replay`` placing the rows and slime's real
``RoutingReplay`` keeping the lazy references, and fails unless every router pops exactly slime's tensor::

    python tools/make_slime_fixtures.py --slime-git-dir /path/to/slime/.git [--commit SHA] [--out DIR] \
        [--check-routelog]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "slime"
COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
SOURCES = (
    "slime/backends/megatron_utils/actor.py",
    "slime/backends/megatron_utils/cp_utils.py",
    "slime/backends/megatron_utils/data.py",
    "slime/utils/routing_replay.py",
    "slime/utils/dp_schedule.py",
)


@dataclass(frozen=True)
class Config:
    """One captured configuration (slime's args that decide the rows and routers)."""

    name: str
    description: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    allgather_cp: bool = False
    data_pad_size_multiplier: int = 4
    num_layers: int = 8
    moe_layer_freq: int | list[int] = field(default_factory=lambda: [0, 1, 1, 1, 0, 1, 1, 1])
    num_experts: int = 10
    """Not a divisor of num_layers * topk: slime's pad route of a row then depends on its place in its pad block."""
    topk: int = 2
    num_layers_in_first_pipeline_stage: int | None = None
    dp: int = 2
    samples: int = 12
    max_len: int = 40
    max_tokens_per_gpu: int = 48
    siblings: bool = False
    """Agentic rollouts: pairs of training samples share ``index`` and ``rollout_id`` (slime/agent/trajectory.py)."""


CONFIGS = (
    Config(
        "tp2_sp",
        "TP=2 with sequence parallelism, no CP: the local stream padded to TP*4, split in TP halves",
        tp=2,
        sequence_parallel=True,
    ),
    Config("cp2_zigzag", "CP=2 zigzag: each sequence padded to 2CP*ceil(L/2CP), chunks r and 2CP-1-r", cp=2),
    Config(
        "tp2_cp2_zigzag",
        "TP=2 SP and CP=2 zigzag, agentic siblings sharing Sample.index",
        tp=2,
        cp=2,
        sequence_parallel=True,
        siblings=True,
    ),
    Config(
        "tp2_cp2_allgather",
        "--allgather-cp (DSA): the global stream padded to CP*TP*4, split contiguously",
        tp=2,
        cp=2,
        sequence_parallel=True,
        allgather_cp=True,
    ),
    Config(
        "pp2_vpp2_cp2",
        "PP=2 with 2 virtual stages and CP=2: each chunk records its own layers, dense skipped",
        cp=2,
        pp=2,
        vpp=2,
    ),
    Config(
        "pp3_uneven_freq2",
        "PP=3 with 2 layers on the first stage, moe_layer_freq=2 (int), TP=2 SP",
        tp=2,
        sequence_parallel=True,
        pp=3,
        num_layers_in_first_pipeline_stage=2,
        moe_layer_freq=2,
        num_experts=20,
        topk=3,
    ),
    Config(
        "tp2_default_mult",
        "TP=2 SP with slime's default --data-pad-size-multiplier 128",
        tp=2,
        sequence_parallel=True,
        data_pad_size_multiplier=128,
        samples=6,
        dp=1,
        num_experts=12,
    ),
)


def extract(git_dir: Path, commit: str, into: Path) -> dict[str, str]:
    """``slime/`` at ``commit`` under ``into``; returns the SHA-256 of each source file the capture uses."""
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", "--format=tar", commit, "slime"], check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryFile() as handle:
        handle.write(archive)
        handle.seek(0)
        with tarfile.open(fileobj=handle) as tar:
            tar.extractall(into, filter="data")
    return {path: hashlib.sha256((into / path).read_bytes()).hexdigest() for path in SOURCES}


def take(path: Path, qualname: str, namespace: dict[str, Any]) -> Any:
    """Run one top-level class or one method (``Class.method``) of a source file in ``namespace``; return it."""
    source = path.read_text()
    tree = ast.parse(source)
    outer, _, inner = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == outer:
            if inner:
                assert isinstance(node, ast.ClassDef)
                node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == inner)  # noqa: PLW2901
            segment = ast.get_source_segment(source, node)
            assert segment is not None
            exec(compile(textwrap.dedent(segment), f"{path}:{qualname}", "exec"), namespace)
            return namespace[node.name]
    raise LookupError(f"{qualname} not found in {path}")


class FakeMpu:
    """megatron's ``mpu`` as slime's ``cp_utils`` reads it, for one rank."""

    def __init__(self, tp: int, tp_rank: int, cp: int, cp_rank: int) -> None:
        self.tp, self.tp_rank, self.cp, self.cp_rank = tp, tp_rank, cp, cp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_context_parallel_world_size(self) -> int:
        return self.cp

    def get_context_parallel_rank(self) -> int:
        return self.cp_rank


def draw(config: Config) -> dict[str, Any]:
    """A rollout as slime's SGLang path leaves it (seeded by the configuration's name)."""
    rng = np.random.default_rng(int(hashlib.sha256(config.name.encode()).hexdigest()[:8], 16))
    freq = config.moe_layer_freq
    moe = [i % freq == 0 if isinstance(freq, int) else bool(freq[i]) for i in range(config.num_layers)]
    tokens, experts, response_lengths, indices, rollout_ids = [], [], [], [], []
    for i in range(config.samples):
        n = int(rng.integers(3, config.max_len + 1))
        tokens.append(rng.integers(0, 1000, n).astype(np.int64))
        response_lengths.append(int(rng.integers(1, n)))
        routes = np.zeros((n - 1, config.num_layers, config.topk), dtype=np.int32)
        for layer in np.flatnonzero(moe):  # score order: SGLang's top-k order, not sorted
            routes[:, layer] = np.argsort(rng.random((n - 1, config.num_experts)), axis=-1)[:, : config.topk]
        experts.append(routes)
        index = i // 2 if config.siblings else i
        indices.append(index)
        rollout_ids.append(index)
    return {
        "tokens": tokens,
        "experts": experts,
        "response_lengths": response_lengths,
        "indices": indices,
        "rollout_ids": rollout_ids,
    }


def capture(config: Config, slime_root: Path, check_routelog: bool = False) -> dict[str, np.ndarray]:
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    sys.path.insert(0, str(slime_root))
    from slime.backends.megatron_utils import cp_utils
    from slime.utils.dp_schedule import build_dp_schedule
    from slime.utils.routing_replay import RoutingReplay

    fill_routing_replay = take(
        slime_root / "slime/backends/megatron_utils/actor.py",
        "MegatronTrainRayActor.fill_routing_replay",
        {"prepare_routed_experts_for_routing_replay": cp_utils.prepare_routed_experts_for_routing_replay},
    )
    data_iterator_class = take(
        slime_root / "slime/backends/megatron_utils/data.py",
        "DataIterator",
        {"Sequence": Sequence, "RolloutBatch": dict},
    )

    def record(self: Any, top_indices: Any) -> None:  # no pinned allocator on CPU: a plain copy of the same values
        self.top_indices_list.append(top_indices.contiguous().clone())

    # slime's own record keeps lazy references as they are (what routelog records); kept from the first capture
    slime_record = RoutingReplay.__dict__.get("_slime_record", RoutingReplay.record)
    RoutingReplay._slime_record = slime_record
    RoutingReplay.record = record

    rollout = draw(config)
    lengths = [len(t) for t in rollout["tokens"]]
    schedule_args = SimpleNamespace(
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=config.max_tokens_per_gpu,
        balance_by_flops=False,
        balance_data=False,
        micro_batch_size=None,
    )
    vpp = config.vpp or 1
    rollouts = len(dict.fromkeys(rollout["rollout_ids"]))
    partitions, micro_batch_indices, num_microbatches, _ = build_dp_schedule(
        schedule_args,
        {"dp_size": config.dp, "cp_size": config.cp, "vpp_size": vpp, "microbatch_group_size_per_vp_stage": config.pp},
        lengths,
        global_batch_size=max(1, rollouts // 2),
        rollout_indices=rollout["rollout_ids"],
    )
    args = SimpleNamespace(
        num_experts=config.num_experts,
        data_pad_size_multiplier=config.data_pad_size_multiplier,
        sequence_parallel=config.sequence_parallel,
        allgather_cp=config.allgather_cp,
    )
    megatron_config = TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=config.num_experts,
        moe_router_topk=config.topk,
        moe_layer_freq=config.moe_layer_freq,
        pipeline_model_parallel_size=config.pp,
        virtual_pipeline_model_parallel_size=config.vpp,
        num_layers_in_first_pipeline_stage=config.num_layers_in_first_pipeline_stage,
        pipeline_dtype=torch.float32,
    )
    chunks = [SimpleNamespace(module=SimpleNamespace(config=megatron_config)) for _ in range(vpp)]
    check = _RoutelogCheck(config, rollout, chunks, slime_record) if check_routelog else None
    out: dict[str, np.ndarray] = {}
    routers: dict[str, int] = {}
    original_pp_rank = parallel_state.get_pipeline_model_parallel_rank
    try:
        for d, tp_rank, cp_rank, pp_rank in itertools.product(
            range(config.dp), range(config.tp), range(config.cp), range(config.pp)
        ):
            cp_utils.mpu = FakeMpu(config.tp, tp_rank, config.cp, cp_rank)
            parallel_state.get_pipeline_model_parallel_rank = lambda rank=pp_rank: rank
            # One RoutingReplay per TopKRouter this pipeline rank builds, in build order (chunk by chunk).
            moe_here = [
                layer
                for v in range(vpp)
                for layer in _chunk_layers(megatron_config, v, pp_rank)
                if _is_moe(config.moe_layer_freq, layer)
            ]
            RoutingReplay.all_routing_replays = []
            replays = [RoutingReplay() for _ in moe_here]
            partition = partitions[d]
            rollout_data = {
                "partition": partition,
                "tokens": [torch.as_tensor(rollout["tokens"][j]) for j in partition],
                "rollout_routed_experts": [torch.as_tensor(rollout["experts"][j]) for j in partition],
                "sample_indices": [rollout["indices"][j] for j in partition],
                "rollout_ids": [rollout["rollout_ids"][j] for j in partition],
                "micro_batch_indices": micro_batch_indices[d],
                "num_microbatches": num_microbatches,
            }
            iterators = [data_iterator_class(rollout_data, micro_batch_indices[d]) for _ in range(vpp)]
            actor = SimpleNamespace(args=args, model=chunks)
            fill_routing_replay(actor, iterators, num_microbatches, rollout_data)
            assert "rollout_routed_experts" not in rollout_data  # slime deletes the payload after filling
            rank = f"dp{d}_tp{tp_rank}_cp{cp_rank}_pp{pp_rank}"
            if check is not None:
                check.rank(rank, (tp_rank, cp_rank, pp_rank), cp_utils, rollout_data, num_microbatches, replays)
            routers[rank] = len(replays)
            for r, replay in enumerate(replays):
                assert len(replay.top_indices_list) == sum(num_microbatches)
                for m, tensor in enumerate(replay.top_indices_list):
                    assert tensor.dtype == torch.int32
                    out[f"out__{rank}__r{r}_m{m}"] = tensor.numpy()
    finally:
        parallel_state.get_pipeline_model_parallel_rank = original_pp_rank
    if check is not None:
        print(f"check {config.name}: routelog's rows equal slime's on {check.compared} router rows, every rank")
    for i, (tokens, experts) in enumerate(zip(rollout["tokens"], rollout["experts"], strict=True)):
        out[f"tokens__{i}"] = tokens
        out[f"experts__{i}"] = experts
    out["response_length"] = np.asarray(rollout["response_lengths"], dtype=np.int64)
    out["sample_index"] = np.asarray(rollout["indices"], dtype=np.int64)
    out["_schedule"] = np.asarray(
        json.dumps(
            {
                "partitions": partitions,
                "micro_batch_indices": micro_batch_indices,
                "num_microbatches": num_microbatches,
                "routers": routers,
            }
        )
    )
    return out


class _RoutelogCheck:
    """``--check-routelog``: on every rank, routelog's slime replay with slime's real
    ``prepare_routed_experts_for_routing_replay`` placing the rows (``mpu`` set to the rank) and slime's real
    ``RoutingReplay`` keeping the lazy references; each router's ``pop_forward`` must return exactly the tensor
    slime's own ``fill_routing_replay`` recorded from the shipped routing."""

    ROLLOUT = 7

    def __init__(self, config: Config, rollout: dict[str, Any], chunks: list[Any], slime_record: Any) -> None:
        import uuid

        sys.path.insert(0, str(REPO))
        from routelog.integrations import slime as integration

        self.integration, self.chunks, self.slime_record = integration, chunks, slime_record
        self.args = SimpleNamespace(
            num_layers=config.num_layers,
            num_experts=config.num_experts,
            moe_router_topk=config.topk,
            moe_layer_freq=config.moe_layer_freq,
            tensor_model_parallel_size=config.tp,
            context_parallel_size=config.cp,
            pipeline_model_parallel_size=config.pp,
            virtual_pipeline_model_parallel_size=config.vpp,
            decoder_first_pipeline_num_layers=config.num_layers_in_first_pipeline_stage,
            sequence_parallel=config.sequence_parallel,
            allgather_cp=config.allgather_cp,
            data_pad_size_multiplier=config.data_pad_size_multiplier,
        )
        samples = [
            SimpleNamespace(tokens=t.tolist(), response_length=n, rollout_routed_experts=e, index=i, metadata={})
            for t, n, e, i in zip(
                rollout["tokens"], rollout["response_lengths"], rollout["experts"], rollout["indices"], strict=True
            )
        ]
        self.url = f"memory://slime-check/{uuid.uuid4().hex}"
        integration.write_samples(self.url, self.ROLLOUT, samples, spec=integration.spec_from_args(self.args))
        self.compared = 0

    def rank(
        self,
        name: str,
        coords: tuple[int, int, int],
        cp_utils: Any,
        shipped: dict[str, Any],
        num_microbatches: list[int],
        slime_replays: list[Any],
    ) -> None:
        import torch
        from slime.utils import accelerator
        from slime.utils.routing_replay import RoutingReplay

        from routelog.align import RankCoords

        accelerator.current_device = lambda: torch.device("cpu")  # no accelerator here
        patched = RoutingReplay.record
        RoutingReplay.record = self.slime_record
        try:
            RoutingReplay.all_routing_replays = []
            ours = [RoutingReplay() for _ in slime_replays]
            replay = self.integration.SlimeReplay(
                self.url,
                rank=RankCoords(tp=coords[0], cp=coords[1], pp=coords[2]),
                prepare=cp_utils.prepare_routed_experts_for_routing_replay,
            )
            data = {k: shipped[k] for k in ("partition", "tokens", "micro_batch_indices", "num_microbatches")}
            replay.record(
                self.ROLLOUT, self.args, data, ours, num_microbatches=num_microbatches, model_chunks=self.chunks
            )
            for m in range(sum(num_microbatches)):
                for r, (mine, theirs) in enumerate(zip(ours, slime_replays, strict=True)):
                    got, want = mine.pop_forward(), theirs.top_indices_list[m]
                    if not torch.equal(got, want):
                        raise RuntimeError(f"{name}, router {r}, micro-batch {m}: routelog's rows differ from slime's")
                    self.compared += int(got.shape[0])
            replay.close()
        finally:
            RoutingReplay.record = patched


def _chunk_layers(config: Any, vp_stage: int, pp_rank: int) -> range:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))


def _is_moe(freq: int | list[int], layer: int) -> bool:
    return layer % freq == 0 if isinstance(freq, int) else bool(freq[layer])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slime-git-dir", type=Path, required=True, help="a git directory of THUDM/slime")
    parser.add_argument("--commit", default=COMMIT)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", action="append", help="configuration name (repeatable)")
    parser.add_argument(
        "--check-routelog",
        action="store_true",
        help="also run routelog's replay on every rank with slime's real row placement and compare",
    )
    options = parser.parse_args(argv)
    commit = subprocess.run(
        ["git", f"--git-dir={options.slime_git_dir}", "rev-parse", f"{options.commit}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    options.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        digests = extract(options.slime_git_dir, commit, root)
        for config in CONFIGS:
            if options.only and config.name not in options.only:
                continue
            arrays = capture(config, root, options.check_routelog)
            schedule = json.loads(str(arrays.pop("_schedule")))
            meta = {
                "slime_commit": commit,
                "sources_sha256": digests,
                "config": asdict(config),
                **schedule,
            }
            arrays["meta"] = np.asarray(json.dumps(meta, sort_keys=True))
            path = options.out / f"{config.name}.npz"
            np.savez_compressed(path, **arrays)
            print(
                f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: "
                f"{sum(k.startswith('out__') for k in arrays)} recorded tensors, {path.stat().st_size} bytes"
            )


if __name__ == "__main__":
    main()
