"""NeMo-RL: record the rollout routing once and carry sample ids; replay it through routelog in the policy workers.

**Why.** With ``policy.router_replay.enabled`` NeMo-RL carries the routing of every sample as a dense
``routed_experts`` tensor ``[B, S, L, K]`` (all layers) inside ``train_data`` and ``logprob_data``; the policy
sends the whole data-parallel shard to every CP, TP and PP worker of that shard, and each worker packs, CP-shards
and SP-splits it again in ``process_microbatch`` before ``build_router_replay_assignments`` picks its own rows and
layers. This module keeps the routing in a routelog store instead: the driver writes each rollout batch to a step
and ``train_data`` carries two small list columns (:data:`SAMPLE_ID_KEY`, :data:`STEP_KEY`), which ride NeMo-RL's
own sharding, sequence-packing bins and micro-batching like any other column. Where the rows go is NeMo-RL's
decision: each micro-batch gets a ``routed_experts`` of row codes (``[B, S, 1, 1]``, each token's place in the
micro-batch), which NeMo-RL's own ``process_microbatch`` packs and CP-shards, and its own
``_split_for_sequence_parallel`` splits, exactly as it would the routes, so ``routed_experts_cp_sharded`` stays a
tensor, NeMo-RL's. Each worker reads, a few micro-batches ahead, only its micro-batches' records and only its
pipeline stage's layers, puts each route at the row NeMo-RL's codes name, and installs them with
:class:`~routelog.megatron.MegatronReplay`.

**What differs from NeMo-RL's own replay** (commit 7ea279ab): rows without a recorded route (the -1 sentinel)
take the router's own top-k, as NeMo-RL's fallback does (``missing="router"``), and so do padding rows and each
sequence's final row, which NeMo-RL forces to experts ``arange(K)`` (no loss-bearing token depends on them: they
come after every real token of their sequence). MTP routers are never handed decoder routes: NeMo-RL at that
commit walks them too, so on megatron-core 0.16 it refuses a model with MTP layers ("Router layer 9 is not present
in MoE layer pattern") and on 0.19, whose MTP layers are numbered from 1 again, it hands them decoder layer 1's
routes. The router diff is measured on
every replayed row, judged by a :class:`~routelog.store.fidelity.FidelityGate` and published with
:func:`~routelog.store.fidelity.write_fidelity`; the tokens fed are checked against the recorded ones.

**The lines a user adds** (NeMo-RL itself is imported lazily, only by :func:`install` and :func:`install_driver`).
In the driver script (``examples/run_grpo.py`` or yours), before ``init_ray()`` and ``grpo.setup``::

    from routelog.integrations import nemo_rl as routelog_nemo_rl
    routelog_nemo_rl.install_driver("s3://bucket/run-1", spec=routelog.ModelSpec.from_hf_config(hf_config))
    os.environ[routelog_nemo_rl.URL_ENV] = "s3://bucket/run-1"  # before init_ray(): it forwards the environment

and in the policy workers, through a worker extension class given to ``grpo.setup(..., policy_factory=
functools.partial(Policy, worker_extension_cls_fqn="my_workers.RoutelogMegatronPolicyWorker"))``::

    @ray.remote(runtime_env=get_runtime_env_for_policy_worker("megatron_policy_worker"))
    class RoutelogMegatronPolicyWorker(MegatronPolicyWorkerImpl):
        def __init__(self, *args, **kwargs):
            routelog_nemo_rl.install()  # the store from URL_ENV; gate=, fidelity_writer= as wanted
            super().__init__(*args, **kwargs)

Keep ``policy.router_replay.enabled: true``: it makes vLLM return the routing, builds the model with
``moe_enable_routing_replay`` and rejects virtual pipeline stages. ``examples/nemo_rl_r3.py`` is the flow to copy.

**Patched names, and why there.** :func:`install_driver` replaces ``nemo_rl.algorithms.grpo.
_preserve_router_replay_routed_experts`` (called by name from ``grpo.py``, so the module attribute is what it
finds). :func:`install` replaces, in the worker process, ``nemo_rl.models.megatron.data.
make_processed_microbatch_iterator`` (it sees every micro-batch of a pass before the first runs: it gives each its
row codes, and the pass its read-ahead), and ``set_router_replay_forward``, ``set_router_replay_backward`` and
``clear_router_replay`` **in ``nemo_rl.models.megatron.train``'s namespace**: ``train.py`` binds them with
``from nemo_rl.models.megatron.router_replay import ...`` at import, so replacing them in ``router_replay`` would not
reach the calls in ``forward_with_post_processing_fn`` and ``megatron_forward_backward``. It also replaces
``megatron_policy_worker._should_use_router_replay`` so that a batch carrying sample ids instead of
``routed_experts`` is replayed. Micro-batches without sample ids, and every other caller, get NeMo-RL's own code.

The fixtures the tests compare with (``tests/fixtures/nemo_rl/``) were captured from NeMo-RL's code at commit
7ea279ab by ``tools/make_nemo_rl_fixtures.py``.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog import environment
from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.align.plan import MicroBatchReplay, OtherVersions, PolicyVersions, gather, versions_for
from routelog.align.positions import PAD
from routelog.engines import nemo_rl as envelope
from routelog.engines.common import Payload, payload_to_record
from routelog.errors import AlignmentError, IngestError, RecordNotFoundError, ReplayConfigError
from routelog.format.record import Record
from routelog.format.routing import RecordRouting
from routelog.format.spec import ModelSpec
from routelog.integrations.readahead import ReadAhead
from routelog.integrations.transfer import host_sequences
from routelog.megatron import MegatronReplay, rows_of_sequences
from routelog.store.fidelity import FidelityGate, ReplayFidelityError, StepFidelity, write_fidelity
from routelog.store.reader import StepSnapshot
from routelog.store.store import Store, create_store, open_store

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
"""The NeMo-RL revision this integration was written against and its fixtures were captured from."""
SAMPLE_ID_KEY = "routelog_sample_id"
"""``train_data`` / ``logprob_data`` column: each sample's id in the store (a list of str)."""
STEP_KEY = "routelog_step"
"""``train_data`` / ``logprob_data`` column: the store step holding each sample's routing (a list of int)."""
ROUTES_KEY = "routed_experts"
"""NeMo-RL's dense routing column, which :func:`carry_sample_ids` removes."""
URL_ENV = environment.URL.name
"""The store URL :func:`install` uses when given none (NeMo-RL's ``init_ray`` passes the driver's environment
to every worker)."""
MISSING = -1
"""NeMo-RL's missing-route sentinel (``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL``): a whole row of -1."""


# -- the rollout side ----------------------------------------------------------------------------------------------
def _numpy(value: Any, where: str, name: str) -> npt.NDArray[Any]:
    """A torch tensor (any device) or array-like as a NumPy array."""
    if value is None:
        raise IngestError(f"{where}: the field {name!r} is missing")
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _record(
    sample_id: str,
    rows: npt.NDArray[Any],
    tokens: npt.NDArray[Any] | None,
    prompt_len: int,
    spec: ModelSpec,
    policy_version: int | None,
    engine_version: str | None,
    extra_missing: npt.NDArray[np.bool_] | None = None,
) -> Record:
    """One sample's ``n`` rows as NeMo-RL carries them: -1 rows are missing, the final row is the dummy of the
    token no forward pass computed; every other row replays (NeMo-RL replays it too)."""
    where = f"sample {sample_id!r}"
    if rows.ndim != 3:
        raise IngestError(f"{where}: routed_experts rows have shape {rows.shape}, expected [tokens, layers, topk]")
    if rows.dtype.kind not in "iu":
        raise IngestError(f"{where}: routed_experts has dtype {rows.dtype}, expected NeMo-RL's int8/int16/int32")
    sentinel = rows == MISSING
    missing = sentinel.all(axis=(1, 2))
    partial = sentinel.any(axis=(1, 2)) & ~missing
    if partial.any():
        raise IngestError(
            f"{where}: routed_experts row {int(np.argmax(partial))} is -1 in some slots only; NeMo-RL's missing-route "
            "sentinel fills a whole row (NRL_ROUTER_REPLAY_VALIDATE=1 rejects such rows too). Fix the rollout's "
            "routes, or drop the sample"
        )
    if extra_missing is not None:
        missing |= extra_missing
    if rows.shape[0]:
        missing[-1] = True  # the final token's row: arange(K), never a route
    n = rows.shape[0]
    return payload_to_record(
        Payload(sample_id, rows, 0, missing),
        spec,
        sample_id=sample_id,
        prompt_len=prompt_len,
        response_len=n - prompt_len,
        token_ids=tokens,
        policy_version=policy_version,
        engine="vllm",
        engine_version=engine_version,
        extra={"framework": "nemo-rl"},
    )


def records_from_generation(
    output: Mapping[str, Any],
    spec: ModelSpec,
    *,
    sample_ids: Sequence[str],
    policy_version: int | None = None,
    engine_version: str | None = None,
) -> list[Record]:
    """Records from a NeMo-RL generation output (``GenerationOutputSpec``: ``output_ids`` ``[B, T]``,
    ``unpadded_sequence_lengths``, ``generation_lengths``, ``routed_experts`` ``[B, T, L, K]`` as
    ``pad_and_align_routed_expert_indices`` builds it: vLLM's rows, -1 where vLLM returned none, ``arange(K)``
    for the final row and the padding). ``L`` is vLLM's full layer axis or the MoE-only one."""
    where = "generation output"
    routes = _numpy(output.get(ROUTES_KEY), where, ROUTES_KEY)
    tokens = _numpy(output.get("output_ids"), where, "output_ids")
    lengths = _numpy(output.get("unpadded_sequence_lengths"), where, "unpadded_sequence_lengths")
    generated = _numpy(output.get("generation_lengths"), where, "generation_lengths")
    if len(sample_ids) != routes.shape[0] or routes.ndim != 4:
        raise IngestError(
            f"{where}: routed_experts has shape {routes.shape}, expected [B, T, L, K] with B = {len(sample_ids)} "
            "sample ids"
        )
    records = []
    for b, sid in enumerate(sample_ids):
        n, g = int(lengths[b]), int(generated[b])
        if not 0 <= g <= n <= routes.shape[1]:
            raise IngestError(
                f"sample {sid!r}: unpadded_sequence_lengths {n} and generation_lengths {g} do not fit the "
                f"{routes.shape[1]} positions of the output"
            )
        records.append(_record(sid, routes[b, :n], tokens[b, :n], n - g, spec, policy_version, engine_version))
    return records


def records_from_batch(
    routes: Any,
    tokens: Any,
    lengths: Any,
    spec: ModelSpec,
    *,
    sample_ids: Sequence[str],
    prompt_lengths: Sequence[int] | None = None,
    policy_version: int | None = None,
    engine_version: str | None = None,
) -> list[Record]:
    """Records from the training layout: ``flat_messages["routed_experts"]`` (or ``train_data``'s) ``[B, S, L, K]``
    with the token ids ``[B, S]`` and the input lengths ``[B]``: exactly the rows NeMo-RL would replay (every
    message's routes, environment messages' ``arange(K)`` dummies included), -1 rows and each sequence's final row
    left to the router. ``prompt_lengths`` only label the records' prompt/response segments (default: no prompt)."""
    where = "train data"
    routes_np = _numpy(routes, where, ROUTES_KEY)
    tokens_np = _numpy(tokens, where, "input_ids")
    lengths_np = _numpy(lengths, where, "input_lengths")
    if routes_np.ndim != 4 or routes_np.shape[0] != len(sample_ids) or tokens_np.shape[:2] != routes_np.shape[:2]:
        raise IngestError(
            f"{where}: routed_experts {routes_np.shape} and input_ids {tokens_np.shape} must be [B, S, L, K] and "
            f"[B, S] with B = {len(sample_ids)} sample ids"
        )
    records = []
    for b, sid in enumerate(sample_ids):
        n = int(lengths_np[b])
        if not 0 < n <= routes_np.shape[1]:
            raise IngestError(f"sample {sid!r}: input length {n} outside (0, {routes_np.shape[1]}]")
        prompt = 0 if prompt_lengths is None else int(prompt_lengths[b])
        records.append(_record(sid, routes_np[b, :n], tokens_np[b, :n], prompt, spec, policy_version, engine_version))
    return records


def records_from_messages(
    message_log: Sequence[Mapping[str, Any]],
    spec: ModelSpec,
    *,
    sample_id: str,
    policy_version: int | None = None,
    engine_version: str | None = None,
) -> Record:
    """A record from one NeMo-RL message log: each message's ``token_ids`` and ``routed_experts`` (a tensor, array,
    nested list or an ``nrlre1:`` envelope). Messages without routes, and -1 rows, are left to the router (NeMo-RL
    back-fills them with -1); the prompt is what precedes the first assistant message."""
    tokens, rows, unrouted = [], [], []
    prompt_len: int | None = None
    position = 0
    layers_k: tuple[int, ...] | None = None
    for j, message in enumerate(message_log):
        where = f"sample {sample_id!r} message {j}"
        ids = _numpy(message.get("token_ids"), where, "token_ids").reshape(-1)
        if prompt_len is None and message.get("role") == "assistant":
            prompt_len = position
        routed = message.get(ROUTES_KEY)
        if isinstance(routed, str):
            routed, _ = envelope.decode(routed, where)  # its own final-row rule applies to whole sequences only
        if routed is None:
            block = None
        else:
            block = _numpy(routed, where, ROUTES_KEY)
            if block.ndim != 3 or block.shape[0] != ids.shape[0]:
                raise IngestError(
                    f"{where}: routed_experts has shape {block.shape}, expected [{ids.shape[0]}, layers, topk] "
                    "(one row per token of the message)"
                )
            layers_k = block.shape[1:]
        tokens.append(ids)
        rows.append(block)
        unrouted.append(np.full(ids.shape[0], routed is None))
        position += ids.shape[0]
    if layers_k is None:
        raise IngestError(f"sample {sample_id!r}: no message carries routed_experts")
    dtype = next(r for r in rows if r is not None).dtype
    full = np.concatenate(
        [r if r is not None else np.zeros((t.shape[0], *layers_k), dtype) for r, t in zip(rows, tokens, strict=True)]
    )
    return _record(
        sample_id,
        full,
        np.concatenate(tokens),
        position if prompt_len is None else prompt_len,
        spec,
        policy_version,
        engine_version,
        extra_missing=np.concatenate(unrouted),
    )


def carry_sample_ids(target: MutableMapping[str, Any], sample_ids: Sequence[str], step: int) -> None:
    """Replace ``target``'s dense ``routed_experts`` by the sample-id and step columns (one entry per row)."""
    target.pop(ROUTES_KEY, None)
    target[SAMPLE_ID_KEY] = [str(s) for s in sample_ids]
    target[STEP_KEY] = [int(step)] * len(sample_ids)


class RolloutRecorder:
    """The driver side: writes each rollout batch's routing to the next step of a store and hands
    ``train_data`` / ``logprob_data`` sample ids instead of the dense tensor (:meth:`preserve` replaces
    ``grpo._preserve_router_replay_routed_experts``). Every batch is committed, and by default sealed, before
    the policy workers are asked to read it. A batch goes to the step after the store's last one (``first_step``
    for the first batch when given; a run resumed from a checkpoint goes on after the steps already written), and
    its samples are ``s{step}/{row}``, the row in the batch."""

    def __init__(
        self,
        store: Store | str,
        *,
        spec: ModelSpec | None = None,
        writer_id: str = "nemo-rl-driver",
        first_step: int | None = None,
        seal: bool = True,
        policy_version: int | None = None,
        engine_version: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(store, Store):
            self.store = store
        elif spec is not None:
            self.store = create_store(store, spec, storage_options=storage_options)
        else:
            self.store = open_store(store, storage_options=storage_options)
        self.spec = spec or self.store.model_spec
        self.writer_id = writer_id
        self.seal = seal
        self.policy_version = policy_version
        self.engine_version = engine_version
        self._next_step = first_step
        self._last: tuple[Callable[[], Any], int, list[str]] | None = None  # (flat_messages, step, sample ids)
        self._restore: Callable[[], None] | None = None

    def next_step(self) -> int:
        """The step the next batch goes to: after the store's last one, unless ``first_step`` was given."""
        if self._next_step is None:
            steps = self.store.steps()
            self._next_step = steps[-1] + 1 if steps else 0
        return self._next_step

    def record(self, records: Sequence[Record]) -> tuple[int, list[str]]:
        """Write one batch of records to the next step (committed, and sealed unless ``seal=False``); returns the
        step and the sample ids in order. A record without a policy version gets the recorder's, else the step's
        (what the training side's replay takes by default)."""
        step = self.next_step()
        version = step if self.policy_version is None else self.policy_version
        with self.store.writer(step, self.writer_id) as writer:
            for record in records:
                writer.append(record if record.policy_version is not None else replace(record, policy_version=version))
        if self.seal:
            self.store.seal(step)
        self._next_step = step + 1
        return step, [r.sample_id for r in records]

    def preserve(self, target: MutableMapping[str, Any], flat_messages: Mapping[str, Any], policy_config: Any) -> None:
        """``grpo._preserve_router_replay_routed_experts(target, flat_messages, policy_config)``: the routing of
        ``flat_messages`` goes to the store (once, however many targets share it) and ``target`` carries ids."""
        enabled = bool(((policy_config or {}).get("router_replay") or {}).get("enabled", False))
        if not enabled or ROUTES_KEY not in flat_messages:
            return
        if self._last is not None and self._last[0]() is flat_messages:
            _, step, ids = self._last
        else:
            lengths = target.get("input_lengths")
            if lengths is None:
                raise IngestError(
                    "train data: the field 'input_lengths' is missing; routelog needs it beside routed_experts "
                    "to know each sample's tokens"
                )
            routes = flat_messages[ROUTES_KEY]
            batch = int(routes.shape[0])
            step = self.next_step()
            ids = [f"s{step}/{b}" for b in range(batch)]
            mask = flat_messages.get("token_loss_mask")
            prompts = None
            if mask is not None:
                loss = _numpy(mask, "train data", "token_loss_mask") > 0
                prompts = [
                    int(np.argmax(row)) if row.any() else int(n)
                    for row, n in zip(loss, _numpy(lengths, "train data", "input_lengths"), strict=True)
                ]
            records = records_from_batch(
                routes,
                flat_messages["token_ids"],
                lengths,
                self.spec,
                sample_ids=ids,
                prompt_lengths=prompts,
                policy_version=self.policy_version,
                engine_version=self.engine_version,
            )
            step, ids = self.record(records)
            self._last = (_reference(flat_messages), step, ids)
        carry_sample_ids(target, ids, step)

    def uninstall(self) -> None:
        """Put back the NeMo-RL function :func:`install_driver` replaced."""
        if self._restore is not None:
            self._restore()
            self._restore = None


def _reference(value: Any) -> Callable[[], Any]:
    """A weak reference where the type allows one (NeMo-RL's ``BatchedDataDict`` does), else a strong one: the
    same ``flat_messages`` is handed over twice per step (``train_data``, ``logprob_data``)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


# -- the training side ---------------------------------------------------------------------------------------------
def nemo_packing(policy_config: Mapping[str, Any]) -> Packing:
    """The packing NeMo-RL's ``_get_pack_sequence_parameters_for_megatron`` applies for a policy config:
    ``make_sequence_length_divisible_by`` per sequence, the FP8 recipe's block (16, 32 MXFP8, 128 blockwise) or
    HybridEP's 128 for the total."""
    megatron = policy_config.get("megatron_cfg") or {}
    fp8_cfg = megatron.get("fp8_cfg") or {}
    fp8 = bool(fp8_cfg.get("enabled", False))
    recipe = fp8_cfg.get("fp8_recipe") if fp8 else None
    hybrid_ep = (
        megatron.get("moe_token_dispatcher_type") == "flex"
        and megatron.get("moe_flex_dispatcher_backend") == "hybridep"
    )
    return Packing(
        "nemo",
        divisible_by=int(policy_config.get("make_sequence_length_divisible_by", 1) or 1),
        fp8=fp8,
        fp8_block=128 if recipe == "blockwise" else 32 if recipe == "mxfp8" else 16,
        hybrid_ep=hybrid_ep,
    )


def _model_config(model: Any) -> Any:
    """megatron-core's ``TransformerConfig`` of a (wrapped) model chunk."""
    current, seen = model, set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        config = getattr(current, "config", None)
        if config is not None:
            return config
        current = getattr(current, "module", None)
    raise ReplayConfigError(f"{type(model).__name__} has no megatron-core config (expected a GPTModel chunk)")


def _chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _device(model: Any) -> Any:
    """Where the model's parameters are: the routes are moved there once per micro-batch."""
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return None if first is None else first.device


@dataclass
class _Fed:
    """One micro-batch as NeMo-RL feeds it: ids, lengths and token ids, read to the host when the pass starts (the
    whole pass in one transfer)."""

    sample_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    seq_len: int
    data: Mapping[str, Any]
    host_tokens: list[npt.NDArray[np.int64]]
    """Each sample's tokens, as fed."""

    def tokens(self) -> list[npt.NDArray[np.int64]]:
        return self.host_tokens

    def row_codes(self, device: Any) -> Any:
        """``[B, S, 1, 1]`` int64, what routelog puts in the micro-batch's ``routed_experts`` for NeMo-RL to pack
        and CP-shard: each token's place in the micro-batch plus one (``b * S + s + 1``), 0 on padding (NeMo-RL's
        own pad route for a top-1 tensor, ``arange(1)``)."""
        import torch

        count, width = len(self.lengths), self.seq_len
        codes = torch.arange(1, count * width + 1, dtype=torch.int64).reshape(count, width)
        codes[torch.arange(width)[None, :] >= torch.tensor(self.lengths, dtype=torch.int64)[:, None]] = 0
        return codes.reshape(count, width, 1, 1).to(device)

    def positions(self, codes: npt.NDArray[np.int64], first: int, m: int) -> npt.NDArray[np.int64]:
        """``[T_local, 2]`` (flat sample index, token position), ``-1`` on padding: where NeMo-RL put this rank's
        rows, read from the codes it packed, CP-sharded and SP-split."""
        out = np.full((codes.shape[0], 2), PAD, dtype=np.int64)
        real = np.flatnonzero(codes > 0)
        flat = codes[real] - 1
        sample, position = flat // self.seq_len, flat % self.seq_len
        lengths = np.asarray(self.lengths, np.int64)
        if flat.size and (sample.max() >= len(self.lengths) or (position >= lengths[sample]).any()):
            raise AlignmentError(
                f"micro-batch {m} (samples {list(self.sample_ids)}): NeMo-RL's sharding returned row codes outside "
                "the micro-batch's tokens; this NeMo-RL version transforms routed_experts otherwise than commit "
                f"{NEMO_RL_COMMIT[:8]}"
            )
        out[real, 0] = first + sample
        out[real, 1] = position
        return out


def _pass(raw: Sequence[Mapping[str, Any]], lengths_key: str) -> tuple[list[_Fed], int]:
    """The pass's micro-batches as fed (their token ids and lengths in one transfer to the host) and its store
    step."""
    steps: set[int] = set()
    shapes = []
    for m, data in enumerate(raw):
        ids = [str(s) for s in data[SAMPLE_ID_KEY]]
        where = f"micro-batch {m} (samples {ids[:3]}{'...' if len(ids) > 3 else ''})"
        found = {int(s) for s in data.get(STEP_KEY) or []}
        if len(found) != 1:
            raise AlignmentError(
                f"{where}: the column {STEP_KEY!r} must hold one store step for every sample, got {sorted(found)}; "
                "carry the ids with routelog.integrations.nemo_rl.carry_sample_ids"
            )
        steps |= found
        for name in ("input_ids", lengths_key):
            if data.get(name) is None:
                raise IngestError(f"{where}: the field {name!r} is missing")
        shape = tuple(int(d) for d in getattr(data["input_ids"], "shape", ()))
        count = int(np.prod(getattr(data[lengths_key], "shape", (len(data[lengths_key]),))))
        if len(shape) != 2 or len(ids) != shape[0] or count != len(ids):
            raise AlignmentError(
                f"{where}: {len(ids)} sample ids for input_ids of shape {shape} and {count} {lengths_key}"
            )
        shapes.append(shape)
    if len(steps) != 1:
        raise AlignmentError(f"one pass over the train data mixes store steps {sorted(steps)}")
    host = host_sequences([data[k] for data in raw for k in ("input_ids", lengths_key)])
    fed = []
    for m, (data, shape) in enumerate(zip(raw, shapes, strict=True)):
        tokens, lengths = host[2 * m].reshape(shape), host[2 * m + 1]
        fed.append(
            _Fed(
                tuple(str(s) for s in data[SAMPLE_ID_KEY]),
                tuple(int(n) for n in lengths),
                shape[1],
                data,
                [tokens[b, : int(n)] for b, n in enumerate(lengths)],
            )
        )
    return fed, steps.pop()


class _BatchReplay:
    """One pass over a data-parallel shard's micro-batches (one ``make_processed_microbatch_iterator`` call): each
    micro-batch's records (this stage's layers) read ahead, placed where NeMo-RL's own sharding put the rows."""

    def __init__(self, owner: NemoRLReplay, step: int, fed: list[_Fed], packing: Packing | None) -> None:
        self.owner = owner
        self.step = step
        self.fed = fed
        self.packing = packing
        """``nemo`` packing, or None: NeMo-RL's unpacked ``[B, S]`` micro-batches."""
        self._lock = threading.Lock()
        self._opened: tuple[AlignmentPlan, ReadAhead[dict[str, RecordRouting]]] | None = None

    def plan(self, state: _ModelState) -> AlignmentPlan:
        """The pass's micro-batches, this rank's routers and the policy versions replayed (NeMo-RL places the
        rows)."""
        if self.packing is None and state.layout.cp > 1:
            raise ReplayConfigError(
                "NeMo-RL feeds unpacked micro-batches to every context-parallel rank unsharded (it CP-shards "
                "routes only when packing); enable policy.sequence_packing for router replay with CP > 1"
            )
        return AlignmentPlan(
            state.spec,
            state.layout,
            self.packing or Packing("bshd"),
            state.rank,
            tuple(MicroBatch(f.sample_ids, seq_len=f.seq_len) for f in self.fed),
            missing="router",
            policy_versions=versions_for(self.owner.policy_versions, self.step),
            other_versions=self.owner.other_versions,
        )

    def get(self, m: int, state: _ModelState, codes: npt.NDArray[np.int64]) -> MicroBatchReplay:
        """Micro-batch ``m`` at this rank's rows, ``codes`` being what NeMo-RL made of :meth:`_Fed.row_codes`."""
        with self._lock:
            if self._opened is None:
                self._opened = self._open(state)
            plan, reads = self._opened
        routings = reads.get(m)
        reads.release(m)
        if m == len(self.fed) - 1:  # the pass's last micro-batch: stop reading ahead
            reads.close()
        return gather(plan, m, routings, positions=self.fed[m].positions(codes, plan.first_index(m), m))

    def _open(self, state: _ModelState) -> tuple[AlignmentPlan, ReadAhead[dict[str, RecordRouting]]]:
        plan = self.plan(state)
        snapshot = self._snapshot()
        layers = plan.moe_layers
        reads = ReadAhead(
            lambda i: {r.sample_id: r for r in snapshot.read_many(self.fed[i].sample_ids, moe_layers=layers)},
            len(self.fed),
            window=self.owner.prefetch,
            closed_error=lambda i: AlignmentError(f"step {self.step}: micro-batch {i} replayed after its pass ended"),
            name="routelog-prefetch",
        )
        weakref.finalize(self, reads.close)  # a pass abandoned half-way still stops its thread
        return plan, reads

    def _snapshot(self) -> StepSnapshot:
        """The step, having checked it holds every sample fed, with the lengths fed."""
        try:
            snapshot = self.owner.snapshot(self.step)
        except RecordNotFoundError as exc:
            raise AlignmentError(
                f"{exc}; the driver writes each rollout batch before training on it "
                "(routelog.integrations.nemo_rl.install_driver)"
            ) from None
        for m, fed in enumerate(self.fed):
            for sid, n in zip(fed.sample_ids, fed.lengths, strict=True):
                try:
                    stored = snapshot.info(sid).n_tokens
                except RecordNotFoundError:
                    raise AlignmentError(
                        f"sample {sid!r} (micro-batch {m}) is not in step {self.step} of {self.owner.store.url}; "
                        "the driver wrote another batch there, or the sample-id column was rebuilt"
                    ) from None
                if stored != n:
                    raise AlignmentError(
                        f"sample {sid!r}, field 'input_lengths': NeMo-RL feeds {n} tokens, step {self.step} holds "
                        f"{stored}; the train data was changed after its routing was recorded"
                    )
        return snapshot

    def close(self) -> None:
        if self._opened is not None:
            self._opened[1].close()


@dataclass
class _ModelState:
    """One model chunk's installer, and the plan parts that depend only on the model and the rank."""

    replay: MegatronReplay
    spec: ModelSpec
    layout: ParallelLayout
    rank: RankCoords
    forward: Any = None
    """The entered ``MegatronReplay.forward`` context of the micro-batch in flight."""
    step: int | None = None
    trained: bool = False
    counts: dict[tuple[int, str], StepFidelity] = field(default_factory=dict)


class NemoRLReplay:
    """One policy worker's replay: the replacements :func:`install` puts into NeMo-RL, as methods that take the
    NeMo-RL function they replace as their first argument.

    ``layout`` and ``rank`` default to the model's megatron-core config and ``parallel_state``; ``spec`` to the
    store's. ``gate`` fails the step when the trainer's routers disagree with the replayed routes too often;
    ``fidelity_writer`` publishes each step's router diff per rank and phase (``train``, ``logprob``).
    ``local_rows(model_config, routed_experts_cp_sharded)`` is NeMo-RL's normalisation and sequence-parallel split
    of a CP-sharded routing tensor to this rank's ``[T, L, K]`` rows (default: NeMo-RL's own
    ``_normalize_routed_experts_for_mcore`` and ``_split_for_sequence_parallel``; where NeMo-RL does not install,
    :func:`routelog.testing.nemo_rl_local_rows` stands in).
    """

    def __init__(
        self,
        store: Store | str,
        *,
        spec: ModelSpec | None = None,
        layout: ParallelLayout | None = None,
        rank: RankCoords | None = None,
        gate: FidelityGate | None = None,
        fidelity_writer: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        prefetch: int = 2,
        policy_versions: PolicyVersions = "step",
        other_versions: OtherVersions = "refuse",
        local_rows: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self.store = store if isinstance(store, Store) else open_store(store, storage_options=storage_options)
        self.local_rows = local_rows
        self.spec = spec
        self.layout = layout
        self.rank = rank
        self.policy_versions = policy_versions
        self.other_versions = other_versions
        versions_for(policy_versions, 0)  # a bad rule fails here, not at the first step
        self.gate = gate
        self.fidelity_writer = fidelity_writer
        self.prefetch = prefetch
        self._models: dict[int, _ModelState] = {}
        self._patches: list[tuple[ModuleType, str, Any]] = []
        self._row_codes: dict[int, tuple[weakref.ref[Any], _BatchReplay, int]] = {}
        self._snapshot: StepSnapshot | None = None

    def snapshot(self, step: int) -> StepSnapshot:
        """Step ``step`` of the store, loaded once for the passes over it (the driver sealed it before training)."""
        if self._snapshot is None or self._snapshot.step != step:
            self._snapshot = self.store.step(step)
        return self._snapshot

    # -- make_processed_microbatch_iterator ------------------------------------------------------------------------
    def make_processed_microbatch_iterator(
        self, original: Callable[..., Iterator[Any]], *args: Any, **kwargs: Any
    ) -> Iterator[Any]:
        """NeMo-RL's iterator over micro-batches that carry sample ids, each given row codes as its
        ``routed_experts`` (:meth:`_Fed.row_codes`), which NeMo-RL's ``process_microbatch`` packs and CP-shards as
        it would the routes: each processed micro-batch's ``routed_experts_cp_sharded`` is NeMo-RL's tensor of this
        rank's rows. Micro-batches without sample ids get NeMo-RL's iterator unchanged."""
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        raw = list(arguments["raw_iterator"])
        arguments["raw_iterator"] = iter(raw)
        if not raw or SAMPLE_ID_KEY not in raw[0]:
            return original(*bound.args, **bound.kwargs)
        cfg = arguments.get("cfg") or {}
        packed = bool((cfg.get("sequence_packing") or {}).get("enabled", False))
        lengths_key = (arguments.get("seq_length_key") or "input_lengths") if packed else "input_lengths"
        fed, step = _pass(raw, lengths_key)
        # The codes stay on the host (NeMo-RL shards routed_experts on its own device, so this rank's rows are read
        # without waiting for the GPU), unless the model slices CP with indices on the input's device.
        on_inputs = bool(arguments.get("model_slices_context_parallel_inputs"))
        for data, one in zip(raw, fed, strict=True):
            data[ROUTES_KEY] = one.row_codes(getattr(data.get("input_ids"), "device", None) if on_inputs else "cpu")
        batch = _BatchReplay(self, step, fed, nemo_packing(cfg) if packed else None)
        return self._attach(original(*bound.args, **bound.kwargs), batch)

    def _attach(self, processed: Iterator[Any], batch: _BatchReplay) -> Iterator[Any]:
        for m, item in enumerate(processed):
            if m >= len(batch.fed):
                raise AlignmentError(f"NeMo-RL yielded more micro-batches than the {len(batch.fed)} it was given")
            codes = getattr(item, "routed_experts_cp_sharded", None)
            if codes is None:
                raise ReplayConfigError(
                    f"NeMo-RL's process_microbatch left micro-batch {m}'s routed_experts_cp_sharded empty, though "
                    "routelog gave it row codes in routed_experts: this NeMo-RL version differs from commit "
                    f"{NEMO_RL_COMMIT[:8]}"
                )
            self._row_codes[id(codes)] = (weakref.ref(codes), batch, m)
            weakref.finalize(codes, self._row_codes.pop, id(codes), None)
            yield item

    # -- train.set_router_replay_forward / _backward / clear_router_replay ------------------------------------------
    def _state(self, model: Any) -> _ModelState:
        state = self._models.get(id(model))
        if state is not None:
            return state
        config = _model_config(model)
        if int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1) > 1:
            raise ReplayConfigError("NeMo-RL's router replay does not support virtual pipeline stages")
        from routelog.integrations.megatron import layout_from_config, rank_from_parallel_state

        spec = self.spec or self.store.model_spec
        layout = self.layout or layout_from_config(config)
        rank = self.rank or rank_from_parallel_state()
        plan = AlignmentPlan(spec, layout, Packing("nemo"), rank, (), missing="router")
        replay = MegatronReplay([model], plan, config=config, gate=self.gate, measure=True)
        state = _ModelState(replay, spec, layout, rank)
        self._models[id(model)] = state
        return state

    def set_router_replay_forward(self, original: Callable[..., Any], model: Any, routed_experts: Any) -> None:
        """Install the micro-batch's routes into the model's decoder routers, at the rows NeMo-RL's sharding put
        routelog's row codes (any other tensor: NeMo-RL's own routes, NeMo-RL's own function)."""
        entry = self._row_codes.get(id(routed_experts))
        if entry is None or entry[0]() is not routed_experts:
            original(model, routed_experts)
            return
        _, batch, m = entry
        state = self._state(model)
        self._exit(state)
        if state.step is not None and state.step != batch.step:
            self._publish(state)
        state.step = batch.step
        local = (self.local_rows or _nemo_local_rows())(_model_config(model), routed_experts)
        if local.dim() != 3 or tuple(local.shape[1:]) != (1, 1):
            raise ReplayConfigError(
                f"NeMo-RL's normalisation of micro-batch {m}'s row codes gave shape {tuple(local.shape)} (expected "
                f"[T, 1, 1]): this NeMo-RL version differs from commit {NEMO_RL_COMMIT[:8]}"
            )
        replay = batch.get(m, state, _host(local.reshape(-1)))
        tokens = batch.fed[m].tokens()  # NeMo-RL's own micro-batch, as fed (read when the pass began): row by row
        forward = state.replay.forward(
            replay, device=_device(model), tokens=tokens, fed_rows=rows_of_sequences(replay, tokens)
        )
        forward.__enter__()
        state.forward = forward

    def set_router_replay_backward(self, original: Callable[..., Any], model: Any) -> None:
        """After a training forward: recomputation pops the routes just installed (FIFO)."""
        states = [self._models[id(c)] for c in _chunks(model) if id(c) in self._models]
        if not states:
            original(model)
            return
        for state in states:
            self._exit(state)
            state.trained = True

    def clear_router_replay(self, original: Callable[..., Any], model: Any = None) -> None:
        """End of a forward-only micro-batch or of the schedule: clear the routes, count the router diff."""
        chunks = list(self._models.values()) if model is None else [
            self._models[id(c)] for c in _chunks(model) if id(c) in self._models
        ]  # fmt: skip
        for state in chunks:
            self._exit(state)
            counts = state.replay.end_step()
            if state.step is not None and counts.replayed:
                phase = "train" if state.trained else "logprob"
                key = (state.step, phase)
                state.counts[key] = state.counts[key].merge(counts) if key in state.counts else counts
            state.trained = False
        original(model)

    @staticmethod
    def _exit(state: _ModelState) -> None:
        forward, state.forward = state.forward, None
        if forward is not None:
            forward.__exit__(None, None, None)

    # -- megatron_policy_worker._should_use_router_replay ----------------------------------------------------------
    def should_use_router_replay(
        self, original: Callable[..., bool], *, enabled: bool, data: Any, stage: str, require: bool
    ) -> bool:
        """NeMo-RL's check, satisfied by a batch carrying sample ids instead of ``routed_experts``. A training batch
        that carries them while the worker's replay is off would train on native routes: refused (never inert)."""
        if enabled and require and SAMPLE_ID_KEY in data:
            return True
        if not enabled and stage == "train" and SAMPLE_ID_KEY in data:
            raise ReplayFidelityError(
                f"a training batch carries routelog's sample ids ({SAMPLE_ID_KEY!r}) but this policy worker's router "
                "replay is off, so nothing would replay their routes: set policy.router_replay.enabled=true, or stop "
                "carrying the ids (routelog_nemo_rl.install_driver)"
            )
        return original(enabled=enabled, data=data, stage=stage, require=require)

    # -- fidelity --------------------------------------------------------------------------------------------------
    def fidelity(self) -> dict[tuple[int, str], StepFidelity]:
        """Counts measured and not yet published, per (step, phase), all model chunks summed."""
        out: dict[tuple[int, str], StepFidelity] = {}
        for state in self._models.values():
            for key, counts in state.counts.items():
                out[key] = out[key].merge(counts) if key in out else counts
        return out

    def flush(self) -> dict[tuple[int, str], StepFidelity]:
        """Publish every pending step's counts (when ``fidelity_writer`` is set); returns what was pending."""
        pending = self.fidelity()
        for state in self._models.values():
            self._publish(state)
        return pending

    def _publish(self, state: _ModelState) -> None:
        counts, state.counts = state.counts, {}
        if self.fidelity_writer is None:
            return
        rank = state.rank
        writer = f"{self.fidelity_writer}-pp{rank.pp}-cp{rank.cp}-tp{rank.tp}-dp{_dp_rank()}"
        for (step, phase), fidelity in sorted(counts.items()):
            write_fidelity(self.store, step, writer, fidelity, phase=phase)

    # -- installing ------------------------------------------------------------------------------------------------
    def patch(self, module: ModuleType, name: str, method: Callable[..., Any]) -> None:
        """Replace ``module.name`` by ``method`` called with the original first (undone by :meth:`uninstall`)."""
        original = getattr(module, name, None)
        if original is None:
            raise ReplayConfigError(
                f"{module.__name__} has no {name}: this NeMo-RL version differs from the one routelog supports "
                f"(commit {NEMO_RL_COMMIT[:8]})"
            )

        def replacement(*args: Any, **kwargs: Any) -> Any:
            return method(original, *args, **kwargs)

        replacement.__wrapped__ = original  # type: ignore[attr-defined]
        replacement.__name__ = name
        replacement._routelog = self  # type: ignore[attr-defined]
        setattr(module, name, replacement)
        self._patches.append((module, name, original))

    def uninstall(self) -> None:
        """Put NeMo-RL's functions back and remove the replay wrappers from the models."""
        for module, name, original in reversed(self._patches):
            setattr(module, name, original)
        self._patches.clear()
        for state in self._models.values():
            self._exit(state)
            state.replay.remove()
        self._models.clear()


def _nemo_local_rows(module: ModuleType | None = None) -> Callable[[Any, Any], Any]:
    """NeMo-RL's own normalisation and sequence-parallel split of a CP-sharded routing tensor (``module``, default
    ``nemo_rl.models.megatron.router_replay``, as its ``build_router_replay_assignments`` applies them)."""
    import importlib

    if module is None:
        try:
            module = importlib.import_module("nemo_rl.models.megatron.router_replay")
        except ImportError as exc:
            raise ReplayConfigError(
                f"nemo_rl.models.megatron.router_replay does not import here ({exc}): routelog lets NeMo-RL split "
                "the rows between ranks; run in NeMo-RL's policy worker, or pass local_rows= "
                "(routelog.testing.nemo_rl_local_rows stands in for tests)"
            ) from None
    normalize = getattr(module, "_normalize_routed_experts_for_mcore", None)
    split = getattr(module, "_split_for_sequence_parallel", None)
    if normalize is None or split is None:
        raise ReplayConfigError(
            "nemo_rl.models.megatron.router_replay has no _normalize_routed_experts_for_mcore or "
            f"_split_for_sequence_parallel: this NeMo-RL version differs from commit {NEMO_RL_COMMIT[:8]}"
        )
    return lambda config, routed: split(config, normalize(routed))


def _host(codes: Any) -> npt.NDArray[np.int64]:
    """Row codes as a host array (they stay on the host unless the model slices CP on the device)."""
    on_host = codes if codes.device.type == "cpu" else codes.cpu()
    return np.asarray(on_host, dtype=np.int64)


def _dp_rank() -> int:
    try:
        from megatron.core import parallel_state

        return int(parallel_state.get_data_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


_INSTALLED: dict[str, NemoRLReplay] = {}
"""This process's installation (one at most)."""


def install(
    store: Store | str | None = None,
    *,
    modules: Mapping[str, ModuleType] | None = None,
    **options: Any,
) -> NemoRLReplay:
    """Apply the worker-side patches in this process (call it in each Megatron policy worker, before training);
    returns the :class:`NemoRLReplay` (``options`` are its keyword arguments). ``store`` defaults to the URL in
    :data:`URL_ENV`. A second call returns the first installation. ``modules`` replaces the imported NeMo-RL
    modules (``data``, ``train``, ``worker``, and ``router_replay`` whose row split routelog uses), for tests."""
    if "worker" in _INSTALLED:
        return _INSTALLED["worker"]
    if store is None:
        url = environment.store_url()
        if url is None:
            raise ReplayConfigError(
                f"no routelog store given: pass install(url) or set {URL_ENV} in the driver's environment before "
                "NeMo-RL starts Ray (it forwards the environment to its workers)"
            )
        store = url
    if modules is None:
        import importlib

        modules = {
            "data": importlib.import_module("nemo_rl.models.megatron.data"),
            "train": importlib.import_module("nemo_rl.models.megatron.train"),
            "worker": importlib.import_module("nemo_rl.models.policy.workers.megatron_policy_worker"),
            "router_replay": importlib.import_module("nemo_rl.models.megatron.router_replay"),
        }
    targets = [
        (modules["data"], "make_processed_microbatch_iterator"),
        (modules["train"], "set_router_replay_forward"),
        (modules["train"], "set_router_replay_backward"),
        (modules["train"], "clear_router_replay"),
        (modules["worker"], "_should_use_router_replay"),
    ]
    for module, name in targets:  # all or nothing
        if getattr(module, name, None) is None:
            raise ReplayConfigError(
                f"{module.__name__} has no {name}: this NeMo-RL version differs from the one routelog supports "
                f"(commit {NEMO_RL_COMMIT[:8]})"
            )
    if "router_replay" in modules and options.get("local_rows") is None:
        options["local_rows"] = _nemo_local_rows(modules["router_replay"])
    replay = NemoRLReplay(store, **options)
    for module, name in targets:
        replay.patch(module, name, getattr(replay, name.lstrip("_")))
    _INSTALLED["worker"] = replay
    return replay


def uninstall() -> None:
    """Undo :func:`install` in this process."""
    replay = _INSTALLED.pop("worker", None)
    if replay is not None:
        replay.uninstall()


def install_driver(
    store: Store | str,
    *,
    grpo: ModuleType | None = None,
    **options: Any,
) -> RolloutRecorder:
    """Replace ``nemo_rl.algorithms.grpo._preserve_router_replay_routed_experts`` by a
    :class:`RolloutRecorder` (``options`` are its keyword arguments; ``grpo`` replaces the imported module, for
    tests). Returns the recorder; ``recorder.uninstall()`` puts NeMo-RL's function back."""
    if grpo is None:
        import importlib

        grpo = importlib.import_module("nemo_rl.algorithms.grpo")
    name = "_preserve_router_replay_routed_experts"
    original = getattr(grpo, name, None)
    if original is None:
        raise ReplayConfigError(
            f"{grpo.__name__} has no {name}: this NeMo-RL version differs from the one routelog supports "
            f"(commit {NEMO_RL_COMMIT[:8]})"
        )
    recorder = RolloutRecorder(store, **options)

    def preserve(target: MutableMapping[str, Any], flat_messages: Mapping[str, Any], policy_config: Any) -> None:
        recorder.preserve(target, flat_messages, policy_config)

    preserve.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(grpo, name, preserve)
    module = grpo
    recorder._restore = lambda: setattr(module, name, original)
    return recorder


__all__ = [
    "MISSING",
    "NEMO_RL_COMMIT",
    "ROUTES_KEY",
    "SAMPLE_ID_KEY",
    "STEP_KEY",
    "URL_ENV",
    "NemoRLReplay",
    "RolloutRecorder",
    "carry_sample_ids",
    "install",
    "install_driver",
    "nemo_packing",
    "records_from_batch",
    "records_from_generation",
    "records_from_messages",
    "uninstall",
]
