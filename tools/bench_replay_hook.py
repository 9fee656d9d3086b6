"""What replay adds to a training step's forward passes: time per micro-batch and reads of the device.

A real megatron-core GPT chunk (megatron-core 0.16 on CPU: dense and MoE layers, E = 8, K = 2) runs each
micro-batch's first-stage forward as a trainer does: the embedding takes the packed token ids, then every MoE layer
routes its hidden states. Two sides alternate, ``--rounds`` each, over the same micro-batches:

* **native**: the routers choose their own experts (no routelog);
* **replay**: :class:`~routelog.megatron.MegatronReplay` with everything on, the installation path every
  integration uses (the generic hook; veRL's and NeMo-RL's patches install through it): targets handed to every
  router, the router diff measured (a :class:`~routelog.fidelity.FidelityGate`), the tokens fed checked row by row,
  the step judged.

Reported: the median time per micro-batch of each side and their ratio (same run), and the host reads routelog's
own code makes of a tensor (``int``, ``item``, ``tolist``, ``numpy``, ``cpu``...: on a GPU each one waits for the
device) per forward and per step, counted. Goal (issue #30): 0 reads per router and forward; the step's judgement
reads the device once for the router diff and once for the token check.

    python tools/bench_replay_hook.py [--json] [--quick] [--rounds N] [--micro-batches M] [--tokens T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def _model(layers: int) -> tuple[Any, Any]:
    from routelog.testing import megatron_on_cpu

    megatron_on_cpu()
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        ffn_hidden_size=128,
        moe_layer_freq=[0] + [1] * (layers - 1),
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=False,
        moe_aux_loss_coeff=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=1024,
        max_sequence_length=8192,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    return model, config


def _store(url: str, spec: Any, samples: int, tokens: int) -> dict[str, np.ndarray]:
    import routelog

    rng = np.random.default_rng(0)
    fed = {}
    with routelog.open_writer(url, step=0, model_spec=spec) as writer:
        for i in range(samples):
            fed[f"s{i}"] = rng.integers(0, 1024, tokens)
            ids = np.argsort(rng.random((tokens, spec.num_moe_layers, spec.num_experts)), axis=-1)[..., : spec.topk]
            writer.append(
                routelog.Record(
                    sample_id=f"s{i}",
                    expert_ids=ids,
                    prompt_len=tokens // 4,
                    response_len=tokens - tokens // 4,
                    token_ids=fed[f"s{i}"],
                )
            )
    return fed


class _DeviceReads:
    """Counts the reads of a tensor back to the host made by routelog's own code."""

    NAMES = ("__int__", "__bool__", "__float__", "item", "tolist", "numpy", "cpu")

    def __init__(self) -> None:
        import torch

        import routelog

        self.count = 0
        self._package = str(Path(routelog.__file__).parent)
        self._originals = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counting(original))

    def _counting(self, original: Any) -> Any:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.startswith(self._package):
                self.count += 1
            return original(tensor, *args, **kwargs)

        return counted

    def close(self) -> None:
        import torch

        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import routelog
    from routelog.align import AlignmentPlan, Packing, ParallelLayout, RankCoords, parse_micro_batches
    from routelog.fidelity import FidelityGate
    from routelog.loader import ReplayLoader
    from routelog.megatron import MegatronReplay

    model, config = _model(args.layers)
    spec = routelog.ModelSpec.from_megatron(
        num_layers=args.layers, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=[0] + [1] * (args.layers - 1)
    )
    samples = args.micro_batches * 2
    with tempfile.TemporaryDirectory(prefix="routelog-bench-hook-") as url:
        fed = _store(url, spec, samples, args.tokens)
        batches = "|".join(f"s{2 * m},s{2 * m + 1}" for m in range(args.micro_batches))
        plan = AlignmentPlan(spec, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches(batches)))
        loaded = list(ReplayLoader(url, 0, plan, prefetch=0))
    inputs = [torch.from_numpy(np.concatenate([fed[s] for s in mb.sample_ids]))[None] for mb in loaded]
    moe = [layer for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    hidden = [torch.randn(int(ids.shape[1]), 1, 64) for ids in inputs]

    def forward(m: int) -> None:
        ids = inputs[m]
        with torch.no_grad():
            model.embedding(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
            for layer in moe:
                layer.mlp(hidden[m])

    replay = MegatronReplay([model], plan, config=config, gate=FidelityGate(max_router_diff=1.0))
    replay.remove()
    times: dict[str, list[float]] = {"native": [], "replay": []}
    forward_reads = step_reads = 0
    for round_ in range(args.rounds):
        for side in ("native", "replay") if round_ % 2 == 0 else ("replay", "native"):
            if side == "native":
                for m in range(len(loaded)):
                    start = time.perf_counter()
                    forward(m)
                    times[side].append(time.perf_counter() - start)
                continue
            replay = MegatronReplay([model], plan, config=config, gate=FidelityGate(max_router_diff=1.0))
            reads = _DeviceReads()
            try:
                for m, mb in enumerate(loaded):
                    start = time.perf_counter()
                    with replay.forward(mb):
                        forward(m)
                    times[side].append(time.perf_counter() - start)
                forward_reads = reads.count
                replay.end_step()
                step_reads = reads.count - forward_reads
            finally:
                reads.close()
                replay.remove()
    native, replayed = statistics.median(times["native"]), statistics.median(times["replay"])
    forwards = len(loaded)
    return {
        "config": {
            "tokens_per_micro_batch": 2 * args.tokens,
            "micro_batches": forwards,
            "moe_layers": len(moe),
            "rounds": args.rounds,
        },
        "seconds_per_micro_batch": {"native": native, "replay": replayed},
        "replay_over_native": replayed / native,
        "added_ms_per_micro_batch": 1e3 * (replayed - native),
        "device_reads": {
            "per_router_and_forward": forward_reads / (forwards * len(moe)),
            "per_step_judgement": step_reads,
        },
        "goal": "0 device reads per router and forward",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sample (two samples per micro-batch)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.micro_batches, args.tokens = 2, 2, 64
    warnings.filterwarnings("ignore")
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    seconds = report["seconds_per_micro_batch"]
    reads = report["device_reads"]
    print(
        f"{report['config']['tokens_per_micro_batch']} tokens x {report['config']['moe_layers']} MoE layers per "
        f"micro-batch: native {1e3 * seconds['native']:.2f} ms, with replay {1e3 * seconds['replay']:.2f} ms "
        f"({report['replay_over_native']:.3f} x, +{report['added_ms_per_micro_batch']:.2f} ms)"
    )
    print(
        f"device reads: {reads['per_router_and_forward']:g} per router and forward, "
        f"{reads['per_step_judgement']} to judge the step (goal: {report['goal']})"
    )


if __name__ == "__main__":
    main()
