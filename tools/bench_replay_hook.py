"""What replay adds to a training step's forward passes: time per micro-batch and reads of the device.

A real megatron-core GPT chunk (megatron-core 0.16 on CPU: dense and MoE layers, E = 8, K = 2) runs each
micro-batch's first-stage forward as a trainer does: the embedding takes the packed token ids, then every MoE layer
routes its hidden states. The sides alternate, ``--rounds`` each, over the same micro-batches:

* **native**: the routers choose their own experts (no routelog);
* **installer**, **megatron-hook**, **verl**, **nemo-rl**: :class:`~routelog.megatron.MegatronReplay` with
  everything on, the installation path every Megatron integration uses (the generic hook; veRL's and NeMo-RL's
  patches install through it): targets handed to every router, the router diff measured (a
  :class:`~routelog.store.fidelity.FidelityGate`), the tokens fed checked row by row, the step judged; with the rows in
  memory, around a forward step reading the store in the background, through veRL's engine patch, and through
  NeMo-RL's (its sharding of the row codes, then its forward and backward calls);
* **slime-native**, **slime**: each router pops its micro-batch's tensor from slime's ``RoutingReplay`` before the
  forward, from slime's own R3 (the routing shipped with the data, padded, sliced and copied per layer at fill) and
  from routelog's lazy references (read from the store a few micro-batches ahead, slime placing the rows).

Reported: the median time per micro-batch of each side and its ratio against native (and slime's against
slime-native), same run, and the host reads routelog's own code makes of a tensor (``int``, ``item``, ``tolist``,
``numpy``, ``cpu``...: on a GPU each one waits for the device) per forward and per step (a step's setup and
judgement), counted. Goal (issue #30): 0 reads per router and forward; the step's judgement reads the device once
for the router diff and once for the token check; slime's fill reads the tokens fed once.

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
from collections.abc import Callable
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
                    policy_version=0,
                )
            )
    return fed


class _DeviceReads:
    """Counts the reads of a tensor back to the host made by routelog's own code: those of a step's setup and
    judgement (:meth:`MegatronReplay.check`, wherever it runs: the generic hook judges inside the step's last
    forward; slime's :meth:`SlimeReplay.record` and :meth:`SlimeReplay.end_rollout`; NeMo-RL's start of a pass)
    apart from the others."""

    NAMES = ("__int__", "__bool__", "__float__", "item", "tolist", "numpy", "cpu")

    def __init__(self) -> None:
        import torch

        import routelog
        from routelog.integrations.nemo_rl import NemoRLReplay
        from routelog.integrations.slime import SlimeReplay
        from routelog.megatron import MegatronReplay

        self.count = 0
        self.per_step = 0
        self._stepping = 0
        self._package = str(Path(routelog.__file__).parent)
        self._originals = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._counting(original))
        self._once_per_step = [
            (owner, name, getattr(owner, name))
            for owner, name in (
                (MegatronReplay, "check"),
                (MegatronReplay, "_counts"),
                (SlimeReplay, "record"),
                (SlimeReplay, "end_rollout"),
                (NemoRLReplay, "make_processed_microbatch_iterator"),
            )
        ]
        for owner, name, original in self._once_per_step:
            setattr(owner, name, self._stepped(original))

    def _counting(self, original: Any) -> Any:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.startswith(self._package):
                if self._stepping:
                    self.per_step += 1
                else:
                    self.count += 1
            return original(tensor, *args, **kwargs)

        return counted

    def _stepped(self, original: Any) -> Any:
        def stepped(replay: Any, *args: Any, **kwargs: Any) -> Any:
            self._stepping += 1
            try:
                return original(replay, *args, **kwargs)
            finally:
                self._stepping -= 1

        return stepped

    def close(self) -> None:
        import torch

        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        for owner, name, original in self._once_per_step:
            setattr(owner, name, original)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import routelog
    from routelog import FidelityGate
    from routelog.align import AlignmentPlan, Packing, ParallelLayout, RankCoords, parse_micro_batches
    from routelog.integrations.megatron import ReplayHook
    from routelog.loader import ReplayLoader
    from routelog.megatron import MegatronReplay

    model, config = _model(args.layers)
    spec = routelog.ModelSpec.from_megatron(
        num_layers=args.layers, num_moe_experts=8, moe_router_topk=2, moe_layer_freq=[0] + [1] * (args.layers - 1)
    )
    samples = args.micro_batches * 2
    workdir = tempfile.TemporaryDirectory(prefix="routelog-bench-hook-")
    url = workdir.name
    fed = _store(url, spec, samples, args.tokens)
    batches = "|".join(f"s{2 * m},s{2 * m + 1}" for m in range(args.micro_batches))
    plan = AlignmentPlan(spec, ParallelLayout(), Packing("verl"), RankCoords(), tuple(parse_micro_batches(batches)))
    loaded = list(ReplayLoader(url, 0, plan, prefetch=0))
    inputs = [torch.from_numpy(np.concatenate([fed[s] for s in mb.sample_ids]))[None] for mb in loaded]
    moe = [layer for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    hidden = [torch.randn(int(ids.shape[1]), 1, 64) for ids in inputs]
    gate = FidelityGate(max_router_diff=1.0)

    def forward(m: int) -> None:
        ids = inputs[m]
        with torch.no_grad():
            model.embedding(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
            for layer in moe:
                layer.mlp(hidden[m])

    def native() -> tuple[list[float], Any]:
        return [_timed(forward, m) for m in range(len(loaded))], None

    def installer() -> tuple[list[float], Any]:
        """MegatronReplay with the rows already in memory: what every Megatron integration installs through."""
        replay = MegatronReplay([model], plan, config=config, gate=gate)

        def one(m: int) -> None:
            with replay.forward(loaded[m]):
                forward(m)

        return [_timed(one, m) for m in range(len(loaded))], (replay.end_step, replay.remove)

    def megatron_hook() -> tuple[list[float], Any]:
        """ReplayHook around a forward step, reading the store in the background (its default prefetch)."""
        hook = ReplayHook(
            url, [model], layout=ParallelLayout(), rank=RankCoords(), packing=Packing("verl"), config=config, gate=gate
        )
        hook.begin_step(0, [mb.sample_ids for mb in loaded])
        step = hook.wrap(lambda data_iterator, chunk, m: forward(m))
        return [_timed(lambda m: step(None, model, m), m) for m in range(len(loaded))], (hook.end_step, hook.remove)

    sides: dict[str, Callable[[], tuple[list[float], Any]]] = {
        "native": native,
        "installer": installer,
        "megatron-hook": megatron_hook,
    }
    verl_side = _verl_side(url, spec, model, config, gate, loaded, inputs, forward)
    if verl_side is not None:
        sides["verl"] = verl_side
    sides["nemo-rl"] = _nemo_rl_side(url, spec, model, gate, loaded, inputs, forward)
    sides.update(_slime_sides(f"{url}-slime", args.layers, loaded, inputs, forward))
    times: dict[str, list[float]] = {side: [] for side in sides}
    reads: dict[str, dict[str, float]] = {}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            counter = _DeviceReads() if side not in ("native", "slime-native") else None
            try:
                measured, finish = sides[side]()
                times[side].extend(measured)
                if counter is not None:
                    end_step, remove = finish
                    end_step()
                    remove()
                    reads[side] = {
                        "per_router_and_forward": counter.count / (len(loaded) * len(moe)),
                        "per_forward": counter.count / len(loaded),
                        "per_step": counter.per_step,
                    }
            finally:
                if counter is not None:
                    counter.close()
    workdir.cleanup()
    base = statistics.median(times["native"])
    per_side = {
        side: {
            "seconds_per_micro_batch": statistics.median(values),
            "over_native": statistics.median(values) / base,
            "added_ms_per_micro_batch": 1e3 * (statistics.median(values) - base),
            **(
                {"over_slime_native": statistics.median(values) / statistics.median(times["slime-native"])}
                if side == "slime"
                else {}
            ),
            **({"device_reads": reads[side]} if side in reads else {}),
        }
        for side, values in times.items()
    }
    return {
        "config": {
            "tokens_per_micro_batch": 2 * args.tokens,
            "micro_batches": len(loaded),
            "moe_layers": len(moe),
            "rounds": args.rounds,
        },
        "sides": per_side,
        "goal": "0 device reads per router and forward",
    }


def _timed(fn: Callable[[int], None], m: int) -> float:
    start = time.perf_counter()
    fn(m)
    return time.perf_counter() - start


def _verl_side(
    url: str, spec: Any, model: Any, config: Any, gate: Any, loaded: list[Any], inputs: list[Any], forward: Any
) -> Callable[[], tuple[list[float], Any]] | None:
    """veRL's path through routelog: the pass read ahead (``begin_pass``), then per micro-batch what veRL's engine
    calls (``prepare_model_inputs``' note, ``set_router_replay_data``'s arm, the model's forward pre-hook with the
    THD ``packed_seq_params`` veRL gives it); None without veRL installed."""
    try:
        import torch
        from megatron.core.packed_seq_params import PackedSeqParams
        from tensordict import NonTensorData, NonTensorStack, TensorDict

        from routelog.integrations.verl import VerlReplay
    except ImportError:
        return None
    micro = []
    for mb, ids in zip(loaded, inputs, strict=True):
        lengths = [int(n) for n in np.bincount(mb.positions[:, 0] - mb.first_index)]
        parts = torch.split(ids[0], lengths)
        batch = TensorDict({"input_ids": torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)}, [len(parts)])
        batch["routelog_sample_id"] = NonTensorStack(*mb.sample_ids)
        batch["routelog_step"] = NonTensorData(0)
        cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
        micro.append((batch, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)))
    whole = TensorDict({}, [sum(len(mb.sample_ids) for mb in loaded)])
    whole["routelog_sample_id"] = NonTensorStack(*[s for mb in loaded for s in mb.sample_ids])
    whole["routelog_step"] = NonTensorData(0)

    def side() -> tuple[list[float], Any]:
        replay = VerlReplay(url, spec=spec, gate=gate)
        replay.begin_pass(whole, config)

        def one(m: int) -> None:
            batch, params = micro[m]
            replay.note_inputs(batch)
            for layer in model.decoder.layers:  # veRL sets the action before its forward step
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.router_replay.set_router_replay_action(_forward_action(router.router_replay))
            replay.arm(config, 0, None, model)
            replay._pre_forward(model, (), {"packed_seq_params": params})
            forward(m)

        return [_timed(one, m) for m in range(len(loaded))], (lambda: replay.end_step(phase="train"), replay.remove)

    return side


def _nemo_rl_side(
    url: str, spec: Any, model: Any, gate: Any, loaded: list[Any], inputs: list[Any], forward: Any
) -> Callable[[], tuple[list[float], Any]]:
    """NeMo-RL's path through routelog, a training pass: the micro-batches carry sample ids, NeMo-RL's iterator
    (packing as NeMo-RL does with CP = TP = 1: the sequences back to back) shards routelog's row codes, and per
    micro-batch NeMo-RL calls ``set_router_replay_forward`` before the forward and ``set_router_replay_backward``
    after it; the pass ends with ``clear_router_replay`` (the step's judgement)."""
    import torch

    from routelog.align import ParallelLayout, RankCoords
    from routelog.integrations import nemo_rl
    from routelog.testing import nemo_rl_local_rows

    raw = []
    for mb, ids in zip(loaded, inputs, strict=True):
        lengths = [int(n) for n in np.bincount(mb.positions[:, 0] - mb.first_index)]
        rows = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
        for b, part in enumerate(torch.split(ids[0], lengths)):
            rows[b, : part.numel()] = part
        raw.append(
            {
                "input_ids": rows,
                "input_lengths": torch.tensor(lengths),
                nemo_rl.SAMPLE_ID_KEY: list(mb.sample_ids),
                nemo_rl.STEP_KEY: [0] * len(lengths),
            }
        )

    def make_processed_microbatch_iterator(
        raw_iterator: Any,
        cfg: Any,
        seq_length_key: Any,
        pad_individual_seqs_to_multiple_of: int,
        pad_packed_seq_to_multiple_of: int,
        straggler_timer: Any,
        pad_full_seq_to: Any,
    ) -> Any:
        for data in raw_iterator:
            codes = data[nemo_rl.ROUTES_KEY]
            packed = torch.cat([codes[b, :n] for b, n in enumerate(data["input_lengths"].tolist())])
            yield type("Processed", (), {"data_dict": data, "routed_experts_cp_sharded": packed[None]})()

    def nothing(*args: Any) -> None:
        return None

    def side() -> tuple[list[float], Any]:
        replay = nemo_rl.NemoRLReplay(
            url, spec=spec, layout=ParallelLayout(), rank=RankCoords(), gate=gate, local_rows=nemo_rl_local_rows()
        )
        items = list(
            replay.make_processed_microbatch_iterator(
                make_processed_microbatch_iterator,
                raw_iterator=iter(raw),
                cfg={"sequence_packing": {"enabled": True}},
                seq_length_key="input_lengths",
                pad_individual_seqs_to_multiple_of=1,
                pad_packed_seq_to_multiple_of=1,
                straggler_timer=None,
                pad_full_seq_to=None,
            )
        )

        def one(m: int) -> None:
            replay.set_router_replay_forward(nothing, model, items[m].routed_experts_cp_sharded)
            forward(m)
            replay.set_router_replay_backward(nothing, model)

        times = [_timed(one, m) for m in range(len(loaded))]
        return times, (lambda: replay.clear_router_replay(nothing), replay.uninstall)

    return side


def _slime_sides(
    url: str, layers: int, loaded: list[Any], inputs: list[Any], forward: Any
) -> dict[str, Callable[[], tuple[list[float], Any]]]:
    """slime's path, the same micro-batches: each router pops its micro-batch's tensor from slime's
    ``RoutingReplay`` before the forward (slime's patched ``compute_topk`` replays it; that part is slime's).
    ``slime-native``: slime's own R3, the DP rank's routing shipped with the data and, at fill, each micro-batch
    padded and sliced by slime's code and each router's layer copied; ``slime``: routelog's lazy references
    (:class:`~routelog.integrations.slime.SlimeReplay`, the store read a few micro-batches ahead in the background,
    slime's row placement through ``prepare``). The fill is before the timed forwards in both."""
    from types import SimpleNamespace

    import torch

    from routelog.align import RankCoords
    from routelog.integrations import slime
    from routelog.testing import SlimeRoutingReplay, slime_prepare

    rng = np.random.default_rng(1)
    args = SimpleNamespace(
        num_layers=layers,
        num_experts=8,
        moe_router_topk=2,
        moe_layer_freq=[0] + [1] * (layers - 1),
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        allgather_cp=False,
        data_pad_size_multiplier=128,
    )
    samples, schedule = [], []
    for mb, ids in zip(loaded, inputs, strict=True):
        lengths = [int(n) for n in np.bincount(mb.positions[:, 0] - mb.first_index)]
        schedule.append(list(range(len(samples), len(samples) + len(lengths))))
        for part in torch.split(ids[0], lengths):
            routes = np.zeros((part.numel() - 1, layers, 2), np.int32)
            routes[:, 1:] = np.argsort(rng.random((part.numel() - 1, layers - 1, 8)), axis=-1)[..., :2]
            samples.append(SimpleNamespace(tokens=part.tolist(), response_length=part.numel() // 2, routes=routes))
    shipped = [SimpleNamespace(**vars(s), rollout_routed_experts=s.routes) for s in samples]
    slime.write_samples(url, 0, shipped, spec=slime.spec_from_args(args))
    tokens = [torch.tensor(s.tokens) for s in samples]
    rollout_data = {
        "partition": list(range(len(samples))),
        "tokens": tokens,
        "micro_batch_indices": schedule,
        "num_microbatches": [len(schedule)],
    }
    place = slime_prepare()
    moe_layers = range(1, layers)

    def timed(replays: list[SlimeRoutingReplay]) -> list[float]:
        def one(m: int) -> None:
            for replay in replays:
                replay.pop_forward()
            forward(m)

        return [_timed(one, m) for m in range(len(loaded))]

    def native() -> tuple[list[float], Any]:
        replays = [SlimeRoutingReplay() for _ in moe_layers]
        for batch in schedule:
            prepared = place(
                [torch.from_numpy(samples[j].routes) for j in batch],
                [tokens[j] for j in batch],
                num_experts=8,
                data_pad_size_multiplier=128,
                sequence_parallel=False,
                allgather_cp=False,
            )
            for replay, layer in zip(replays, moe_layers, strict=True):
                replay.record(prepared[:, layer].contiguous())
        return timed(replays), None

    def routelog_side() -> tuple[list[float], Any]:
        replay = slime.SlimeReplay(url, rank=RankCoords(), prepare=place)
        replays = [SlimeRoutingReplay() for _ in moe_layers]
        replay.record(0, args, rollout_data, replays)
        return timed(replays), (lambda: replay.end_rollout(0), replay.close)

    return {"slime-native": native, "slime": routelog_side}


def _forward_action(router_replay: Any) -> Any:
    from routelog.megatron import _action

    return _action(router_replay, "REPLAY_FORWARD")


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
    config = report["config"]
    print(
        f"{config['tokens_per_micro_batch']} tokens x {config['moe_layers']} MoE layers per micro-batch, "
        f"{config['micro_batches']} micro-batches x {config['rounds']} rounds "
        "(medians; ratios against native, same run)"
    )
    print(
        f"{'side':<15}{'ms/micro-batch':>15}{'x native':>10}{'+ms':>8}{'reads/router/fwd':>18}{'reads/fwd':>11}"
        f"{'reads per step':>16}"
    )
    for side, values in report["sides"].items():
        reads = values.get("device_reads", {})
        print(
            f"{side:<15}{1e3 * values['seconds_per_micro_batch']:>15.2f}{values['over_native']:>10.3f}"
            f"{values['added_ms_per_micro_batch']:>8.2f}{reads.get('per_router_and_forward', 0):>18.3g}"
            f"{reads.get('per_forward', 0):>11.3g}{reads.get('per_step', 0):>16g}"
        )
    print(f"goal: {report['goal']}")


if __name__ == "__main__":
    main()
