"""slime R3 through a routelog store: the rollout writes the routing once, each training rank reads its own rows.

What a slime user adds (slime at THUDM/slime 624b824a, both hooks are slime's own arguments)::

    # the Ray job's runtime env (env_vars), seen by the rollout manager and every training actor:
    ROUTELOG_URL=s3://bucket/run-42

    # slime's command line:
    --use-rollout-routing-replay                                          # SGLang returns routes; replay stages run
    --rollout-function-path routelog.integrations.slime.generate_rollout  # writes routing, strips it from samples
    --custom-megatron-init-path routelog.integrations.slime.install       # training actors read their own rows

A custom rollout function stays yours: set ``ROUTELOG_SLIME_ROLLOUT_FUNCTION=my_pkg.rollout.generate`` (it is
wrapped), or call ``write_samples`` / ``strip_routing`` inside it. An init hook of your own calls
``routelog.integrations.slime.install(args, url=...)``.

This script runs both halves on CPU without slime: a rollout of slime-shaped samples (``Sample.tokens``,
``response_length``, ``rollout_routed_experts`` ``[len(tokens) - 1, num_layers, K]`` int32 with zeros in dense
layers) goes through the rollout wrapper, then every rank of a TP=2 (sequence parallel) x CP=2 x PP=2 layout fills
stand-ins of slime's ``RoutingReplay`` for its DP rank's micro-batches, and the script checks each rank's rows
against the rollout.

    python examples/slime_r3.py [STORE_URL]
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import routelog
from routelog.align import RankCoords
from routelog.align.positions import PAD
from routelog.integrations import slime

LAYERS, EXPERTS, TOPK = 8, 16, 2
FREQ = [0, 1, 1, 1, 0, 1, 1, 1]  # Megatron's moe_layer_freq: layers 0 and 4 are dense
ROLLOUT_ID = 5

# slime's arguments (the Megatron ones routelog reads).
args = SimpleNamespace(
    num_layers=LAYERS,
    num_experts=EXPERTS,
    moe_router_topk=TOPK,
    moe_layer_freq=FREQ,
    tensor_model_parallel_size=2,
    sequence_parallel=True,
    context_parallel_size=2,
    pipeline_model_parallel_size=2,
    allgather_cp=False,
    data_pad_size_multiplier=128,
)

rng = np.random.default_rng(0)


def sglang_sample(index: int) -> SimpleNamespace:
    """A sample as slime's SGLang rollout leaves it."""
    n = int(rng.integers(20, 300))
    routes = np.zeros((n - 1, LAYERS, TOPK), np.int32)
    for layer in np.flatnonzero(FREQ):
        routes[:, layer] = np.argsort(rng.random((n - 1, EXPERTS)), axis=-1)[:, :TOPK]  # SGLang's score order
    return SimpleNamespace(
        tokens=rng.integers(0, 32_000, n).tolist(),
        response_length=n // 2,
        rollout_routed_experts=torch.from_numpy(routes),
        index=index,
        group_index=index // 4,
        metadata={},
    )


GROUPS = [[sglang_sample(4 * g + i) for i in range(4)] for g in range(4)]  # 4 prompts x 4 samples
ROUTES = [s.rollout_routed_experts.numpy().copy() for group in GROUPS for s in group]  # kept only to check below


def slime_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """Stands in for slime.rollout.sglang_rollout.generate_rollout."""
    return SimpleNamespace(samples=GROUPS, metrics={})


url = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="routelog-slime-")

# -- rollout side (inside slime's RolloutManager) ------------------------------------------------------------------
generate_rollout = slime.wrap_rollout_function(slime_rollout, url)  # = what generate_rollout does with the env
output = generate_rollout(args, ROLLOUT_ID, data_source=None)
samples = [s for group in output.samples for s in group]  # the order slime trains them in
assert all(s.rollout_routed_experts is None for s in samples), "only ids travel to training"
print(f"rollout {ROLLOUT_ID}: {len(samples)} samples written, ids {samples[0].metadata[slime.SAMPLE_ID_KEY]!r}...")
store = routelog.open_store(url)
snapshot = store.step(ROLLOUT_ID)

# -- slime's DP split: what RolloutManager._split_train_data_by_dp ships to each DP rank (no routing) -----------
partitions = [[0, 3, 4, 7, 8, 11, 12, 15], [1, 2, 5, 6, 9, 10, 13, 14]]
rollout_data = [
    {
        "partition": part,
        "tokens": [torch.tensor(samples[j].tokens) for j in part],
        "micro_batch_indices": [[0, 1, 2], [3, 4], [5, 6, 7]],
        "num_microbatches": [2, 1],
    }
    for part in partitions
]


class RoutingReplay:
    """Stand-in for slime.utils.routing_replay.RoutingReplay (one per MoE router of a rank, build order)."""

    def __init__(self) -> None:
        self.top_indices_list: list[torch.Tensor] = []

    def record(self, top_indices: torch.Tensor) -> None:
        self.top_indices_list.append(top_indices)


# -- training side: what the patched MegatronTrainRayActor.fill_routing_replay does on each rank -----------------
payload = sum(ROUTES[j].nbytes for j in partitions[0])  # what slime ships every rank of DP rank 0
for dp, tp, cp, pp in itertools.product(range(2), range(2), range(2), range(2)):
    rank = RankCoords(tp=tp, cp=cp, pp=pp)
    replay = slime.SlimeReplay(store, rank=rank)  # in slime: install() builds it, ranks come from megatron's mpu
    plan = replay.plan(ROLLOUT_ID, args, rollout_data[dp])
    replays = [RoutingReplay() for _ in plan.routers]
    report = replay.record(ROLLOUT_ID, args, rollout_data[dp], replays)
    # Check: every row a rank replays is the rollout's route for that token; the rest is slime's padding.
    for m, batch in enumerate(plan.micro_batches):
        lengths = [snapshot.info(sid).n_tokens for sid in batch.sample_ids]
        rows = plan.positions(m, lengths)
        for j, router in enumerate(plan.routers):
            recorded = replays[j].top_indices_list[m].numpy()
            for row, (flat, pos) in enumerate(rows):
                if flat == PAD or pos == lengths[flat - plan.first_index(m)] - 1:
                    continue  # padding, and each sequence's final token (no route): slime's pad values
                position = int(plan.sample_ids[flat].split("/")[1])
                assert (recorded[row] == ROUTES[position][pos, router.layer]).all(), (rank, m, router.layer, row)
    if dp == 0 and tp == 1 and cp == 1:
        print(
            f"dp={dp} {rank}: {report.micro_batches} micro-batches x {report.routers} routers, "
            f"{report.rows} rows per router, {report.recorded_bytes} B recorded (slime ships the DP rank's whole "
            f"payload, {payload} B, to every rank)"
        )
print("every rank's replayed rows are the rollout's routes at its tokens")
