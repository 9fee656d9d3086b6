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
stand-ins of slime's ``RoutingReplay`` (``routelog.testing.SlimeRoutingReplay``) for its DP rank's micro-batches,
its routers pop them, and the script checks each popped tensor against what slime's own replay records from the
routing it ships.

    python examples/slime_r3.py [STORE_URL]
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

from routelog.extras import exit_unless_installed

exit_unless_installed("examples/slime_r3.py", "torch")

import numpy as np
import torch

import routelog
from routelog.align import RankCoords
from routelog.integrations import slime
from routelog.testing import SlimeRoutingReplay, slime_prepare

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


if len(sys.argv) > 1:
    url = sys.argv[1]
else:  # a scratch store, removed when the script ends
    scratch = tempfile.TemporaryDirectory(prefix="routelog-slime-")
    url = scratch.name

# -- rollout side (inside slime's RolloutManager) ------------------------------------------------------------------
generate_rollout = slime.wrap_rollout_function(slime_rollout, url)  # = what generate_rollout does with the env
output = generate_rollout(args, ROLLOUT_ID, data_source=None)
samples = [s for group in output.samples for s in group]  # the order slime trains them in
assert all(s.rollout_routed_experts is None for s in samples), "only ids travel to training"
print(f"rollout {ROLLOUT_ID}: {len(samples)} samples written, ids {samples[0].metadata[slime.SAMPLE_ID_KEY]!r}...")
store = routelog.open_store(url)

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


# -- training side: what the patched MegatronTrainRayActor.fill_routing_replay and the routers do on each rank ---
payload = sum(ROUTES[j].nbytes for j in partitions[0])  # what slime ships every rank of DP rank 0
for dp, tp, cp, pp in itertools.product(range(2), range(2), range(2), range(2)):
    rank = RankCoords(tp=tp, cp=cp, pp=pp)
    # In slime: install() builds the replay, ranks come from megatron's mpu, and slime's own
    # prepare_routed_experts_for_routing_replay places the rows; slime_prepare stands in for it here.
    place = slime_prepare(tp_rank=tp, tp_size=2, cp_rank=cp, cp_size=2)
    replay = slime.SlimeReplay(store, rank=rank, prepare=place)
    plan = replay.plan(ROLLOUT_ID, args, rollout_data[dp])
    replays = [SlimeRoutingReplay() for _ in plan.routers]
    report = replay.record(ROLLOUT_ID, args, rollout_data[dp], replays)  # lazy references: nothing read yet
    # Check: each router pops exactly what slime's own fill_routing_replay would have recorded from the routing it
    # ships (padding rows included).
    popped = 0
    for batch in plan.micro_batches:
        positions = [int(sid.split("/")[1]) for sid in batch.sample_ids]
        native = place(
            [torch.from_numpy(ROUTES[p]) for p in positions],
            [torch.tensor(samples[p].tokens) for p in positions],
            num_experts=EXPERTS,
            data_pad_size_multiplier=args.data_pad_size_multiplier,
            sequence_parallel=args.sequence_parallel,
            allgather_cp=args.allgather_cp,
        )
        for router, target in zip(plan.routers, replays, strict=True):
            got = target.pop_forward()
            assert torch.equal(got, native[:, router.layer]), (rank, batch, router.layer)
            popped += got.nbytes
    if dp == 0 and tp == 1 and cp == 1:
        print(
            f"dp={dp} {rank}: {report.micro_batches} micro-batches x {report.routers} routers, {popped} B popped "
            f"(slime ships the DP rank's whole payload, {payload} B, to every rank)"
        )
    replay.close()
print("every rank's routers pop what slime's own replay would have recorded")
