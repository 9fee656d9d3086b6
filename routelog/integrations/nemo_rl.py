"""NeMo-RL: record the rollout routing once and carry sample ids; replay it through routelog in the policy workers.

**Why.** With ``policy.router_replay.enabled`` NeMo-RL carries the routing of every sample as a dense
``routed_experts`` tensor ``[B, S, L, K]`` (all layers) inside ``train_data`` and ``logprob_data``; the policy
sends the whole data-parallel shard to every CP, TP and PP worker of that shard, and each worker packs, CP-shards
and SP-splits it again in ``process_microbatch`` before ``build_router_replay_assignments`` picks its own rows and
layers. This module keeps the routing in a routelog store instead: the driver writes each rollout batch to a step
and ``train_data`` carries two small list columns (:data:`SAMPLE_ID_KEY`, :data:`STEP_KEY`), which ride NeMo-RL's
own sharding, sequence-packing bins and micro-batching like any other column; each worker then reads only its
micro-batches' records and only its pipeline stage's layers, aligned by routelog's plan (which reproduces NeMo-RL's
packing, checked against the ``cu_seqlens_padded`` NeMo-RL computes), and installs them with
:class:`~routelog.megatron.MegatronReplay`.

**What differs from NeMo-RL's own replay** (commit 7ea279ab): rows without a recorded route (the -1 sentinel)
take the router's own top-k, as NeMo-RL's fallback does (``missing="router"``), and so do padding rows and each
sequence's final row, which NeMo-RL forces to experts ``arange(K)`` (no loss-bearing token depends on them: they
come after every real token of their sequence). MTP routers are never handed decoder routes: NeMo-RL at that
commit walks them too, so on megatron-core 0.16 it refuses a model with MTP layers ("Router layer 9 is not present
in MoE layer pattern") and on 0.19, whose MTP layers are numbered from 1 again, it hands them decoder layer 1's
routes. The router diff is measured on
every replayed row, judged by a :class:`~routelog.fidelity.FidelityGate` and published with
:func:`~routelog.fidelity.write_fidelity`; the tokens fed are checked against the recorded ones.

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
make_processed_microbatch_iterator`` (it sees every micro-batch of a pass before the first runs, with NeMo-RL's own
packing numbers: one plan, prefetched), and ``set_router_replay_forward``, ``set_router_replay_backward`` and
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
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from routelog.align import AlignmentPlan, MicroBatch, Packing, ParallelLayout, RankCoords
from routelog.align.packing import pack
from routelog.align.plan import MicroBatchReplay, OtherVersions, PolicyVersions, versions_for
from routelog.engines import nemo_rl as envelope
from routelog.engines.common import Payload, payload_to_record
from routelog.errors import AlignmentError, IngestError, RecordNotFoundError, ReplayConfigError
from routelog.fidelity import FidelityGate, ReplayFidelityError, StepFidelity, write_fidelity
from routelog.loader import ReplayLoader
from routelog.megatron import MegatronReplay, rows_of_sequences
from routelog.record import Record
from routelog.spec import ModelSpec
from routelog.store import Store, create_store, open_store

NEMO_RL_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"
"""The NeMo-RL revision this integration was written against and its fixtures were captured from."""
SAMPLE_ID_KEY = "routelog_sample_id"
"""``train_data`` / ``logprob_data`` column: each sample's id in the store (a list of str)."""
STEP_KEY = "routelog_step"
"""``train_data`` / ``logprob_data`` column: the store step holding each sample's routing (a list of int)."""
ROUTES_KEY = "routed_experts"
"""NeMo-RL's dense routing column, which :func:`carry_sample_ids` removes."""
URL_ENV = "ROUTELOG_URL"
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
    """One micro-batch as NeMo-RL feeds it: ids and lengths read up front, token ids when it is replayed (NeMo-RL
    moves the data dict to the GPU in place before that)."""

    sample_ids: tuple[str, ...]
    lengths: tuple[int, ...]
    seq_len: int
    data: Mapping[str, Any]
    cu_seqlens_padded: tuple[int, ...] | None = None

    def tokens(self) -> list[npt.NDArray[np.int64]]:
        input_ids = _numpy(self.data.get("input_ids"), "micro-batch", "input_ids")
        return [np.asarray(input_ids[b, :n], np.int64) for b, n in enumerate(self.lengths)]


def _fed(data: Mapping[str, Any], lengths_key: str, m: int) -> tuple[_Fed, int]:
    ids = [str(s) for s in data[SAMPLE_ID_KEY]]
    where = f"micro-batch {m} (samples {ids[:3]}{'...' if len(ids) > 3 else ''})"
    steps = {int(s) for s in data.get(STEP_KEY) or []}
    if len(steps) != 1:
        raise AlignmentError(
            f"{where}: the column {STEP_KEY!r} must hold one store step for every sample, got {sorted(steps)}; "
            "carry the ids with routelog.integrations.nemo_rl.carry_sample_ids"
        )
    input_ids = data.get("input_ids")
    shape = tuple(int(d) for d in getattr(input_ids, "shape", ()))
    lengths = _numpy(data.get(lengths_key), where, lengths_key).reshape(-1)
    if len(shape) != 2 or len(ids) != shape[0] or lengths.shape[0] != len(ids):
        raise AlignmentError(
            f"{where}: {len(ids)} sample ids for input_ids of shape {shape} and {lengths.shape[0]} {lengths_key}"
        )
    return _Fed(tuple(ids), tuple(int(v) for v in lengths), shape[1], data), steps.pop()


class NemoRLMicroBatch:
    """What routelog puts in ``ProcessedMicrobatch.routed_experts_cp_sharded``: a handle to one micro-batch's
    routes, loaded (in the background, with the next ones) only when NeMo-RL replays it; the reference-model
    forward, which does not replay, loads nothing."""

    def __init__(self, batch: _BatchReplay, index: int) -> None:
        self.batch = batch
        self.index = index

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return self.batch.fed[self.index].sample_ids

    @property
    def step(self) -> int:
        return self.batch.step

    def __repr__(self) -> str:
        return f"NemoRLMicroBatch(step {self.step}, micro-batch {self.index}: {list(self.sample_ids)})"


class _BatchReplay:
    """One pass over a data-parallel shard's micro-batches (one ``make_processed_microbatch_iterator`` call)."""

    def __init__(self, owner: NemoRLReplay, step: int, fed: list[_Fed], packing: Packing | None, pad_to: int | None,
                 nemo_multiples: tuple[int, int] | None) -> None:  # fmt: skip
        self.owner = owner
        self.step = step
        self.fed = fed
        self.packing = packing
        """``nemo`` packing, or None: NeMo-RL's unpacked ``[B, S]`` micro-batches."""
        self.pad_to = pad_to
        self.nemo_multiples = nemo_multiples
        self._lock = threading.Lock()
        self._loader: ReplayLoader | None = None
        self._iterator: Iterator[MicroBatchReplay] | None = None
        self._loaded: dict[int, MicroBatchReplay] = {}
        self._next = 0

    def plan(self, state: _ModelState) -> AlignmentPlan:
        if self.packing is None:
            if state.layout.cp > 1:
                raise ReplayConfigError(
                    "NeMo-RL feeds unpacked micro-batches to every context-parallel rank unsharded (it CP-shards "
                    "routes only when packing); enable policy.sequence_packing for router replay with CP > 1"
                )
            packing = Packing("bshd")
            batches = tuple(MicroBatch(f.sample_ids, seq_len=f.seq_len) for f in self.fed)
        else:
            packing = self.packing
            if self.nemo_multiples is not None:
                ours = packing.nemo_multiples(state.layout, state.layout.cp)
                if ours != self.nemo_multiples:
                    raise ReplayConfigError(
                        f"NeMo-RL pads each sequence to a multiple of {self.nemo_multiples[0]} and the packed "
                        f"micro-batch to a multiple of {self.nemo_multiples[1]}; routelog's packing {packing} for "
                        f"TP={state.layout.tp} (SP {state.layout.sp}), CP={state.layout.cp} gives {ours}. The policy "
                        "config's make_sequence_length_divisible_by, fp8_cfg or dispatcher differs from the model's"
                    )
            batches = tuple(MicroBatch(f.sample_ids, pad_to=self.pad_to) for f in self.fed)
        return AlignmentPlan(
            state.spec,
            state.layout,
            packing,
            state.rank,
            batches,
            missing="router",
            policy_versions=versions_for(self.owner.policy_versions, self.step),
            other_versions=self.owner.other_versions,
        )

    def get(self, m: int, state: _ModelState) -> MicroBatchReplay:
        with self._lock:
            if self._iterator is None:
                plan = self.plan(state)
                self._loader = ReplayLoader(self.owner.store, self.step, plan, prefetch=self.owner.prefetch)
                weakref.finalize(self, self._loader.close)  # a pass abandoned half-way still stops its thread
                self._check(plan, self._loader)
                self._iterator = iter(self._loader)
            if m < self._next and m not in self._loaded:
                raise AlignmentError(f"step {self.step}: micro-batch {m} was replayed already in this pass")
            while self._next <= m:
                self._loaded[self._next] = next(self._iterator)
                self._next += 1
            if self._next == len(self.fed):  # every micro-batch is read: stop the prefetch thread
                self.close()
            return self._loaded.pop(m)

    def _check(self, plan: AlignmentPlan, loader: ReplayLoader) -> None:
        """The stored records are the samples fed (lengths), and routelog packs them where NeMo-RL did."""
        try:
            snapshot = loader.snapshot
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
            if fed.cu_seqlens_padded is not None:
                batch = plan.micro_batches[m]
                ours = pack(fed.lengths, plan.packing, plan.layout, pad_to=batch.pad_to).cu_seqlens_padded
                if ours != fed.cu_seqlens_padded:
                    raise AlignmentError(
                        f"micro-batch {m} of step {self.step} (samples {list(fed.sample_ids)}): NeMo-RL packed it to "
                        f"cu_seqlens_padded {list(fed.cu_seqlens_padded)}, routelog's plan to {list(ours)}; the "
                        "packing options (make_sequence_length_divisible_by, FP8 recipe, HybridEP, pad_to) differ"
                    )

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()


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
    ) -> None:
        self.store = store if isinstance(store, Store) else open_store(store, storage_options=storage_options)
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

    # -- make_processed_microbatch_iterator ------------------------------------------------------------------------
    def make_processed_microbatch_iterator(
        self, original: Callable[..., Iterator[Any]], *args: Any, **kwargs: Any
    ) -> Iterator[Any]:
        """NeMo-RL's iterator, with each processed micro-batch's ``routed_experts_cp_sharded`` set to a
        :class:`NemoRLMicroBatch` when the micro-batches carry sample ids (else NeMo-RL's iterator unchanged)."""
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        raw = list(arguments["raw_iterator"])
        if not raw or SAMPLE_ID_KEY not in raw[0]:
            arguments["raw_iterator"] = iter(raw)
            return original(*bound.args, **bound.kwargs)
        for flag in ("delegate_pack_to_model", "model_slices_context_parallel_inputs"):
            if arguments.get(flag):
                raise ReplayConfigError(
                    f"router replay from a routelog store does not support {flag}=True (the model packs or slices "
                    "context parallelism itself, in an order routelog does not reproduce)"
                )
        cfg = arguments.get("cfg") or {}
        packed = bool((cfg.get("sequence_packing") or {}).get("enabled", False))
        lengths_key = (arguments.get("seq_length_key") or "input_lengths") if packed else "input_lengths"
        fed, steps = [], set()
        for m, data in enumerate(raw):
            one, step = _fed(data, lengths_key, m)
            fed.append(one)
            steps.add(step)
        if len(steps) != 1:
            raise AlignmentError(f"one pass over the train data mixes store steps {sorted(steps)}")
        multiples = None
        if packed:
            multiples = (
                int(arguments["pad_individual_seqs_to_multiple_of"]),
                int(arguments["pad_packed_seq_to_multiple_of"]),
            )
        pad_to = arguments.get("pad_full_seq_to")
        batch = _BatchReplay(
            self, steps.pop(), fed, nemo_packing(cfg) if packed else None, None if pad_to is None else int(pad_to),
            multiples,
        )  # fmt: skip
        arguments["raw_iterator"] = iter(raw)
        return self._attach(original(*bound.args, **bound.kwargs), batch)

    @staticmethod
    def _attach(processed: Iterator[Any], batch: _BatchReplay) -> Iterator[Any]:
        for m, item in enumerate(processed):
            if m >= len(batch.fed):
                raise AlignmentError(f"NeMo-RL yielded more micro-batches than the {len(batch.fed)} it was given")
            cu = getattr(item, "cu_seqlens_padded", None)
            if cu is not None:
                batch.fed[m].cu_seqlens_padded = tuple(int(v) for v in _numpy(cu, "micro-batch", "cu_seqlens"))
            item.routed_experts_cp_sharded = NemoRLMicroBatch(batch, m)
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
        """Install the micro-batch's routes into the model's decoder routers (a NeMo-RL tensor: NeMo-RL's own)."""
        if not isinstance(routed_experts, NemoRLMicroBatch):
            original(model, routed_experts)
            return
        state = self._state(model)
        self._exit(state)
        handle = routed_experts
        if state.step is not None and state.step != handle.step:
            self._publish(state)
        state.step = handle.step
        replay = handle.batch.get(handle.index, state)
        fed = handle.batch.fed[handle.index]
        tokens = fed.tokens()  # NeMo-RL's own micro-batch, as it feeds the model: checked row by row
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
    modules (``data``, ``train``, ``worker``), for tests."""
    if "worker" in _INSTALLED:
        return _INSTALLED["worker"]
    if store is None:
        url = os.environ.get(URL_ENV)
        if not url:
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
    "NemoRLMicroBatch",
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
