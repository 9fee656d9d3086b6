"""Test helpers shipped with routelog: a fault-injecting filesystem to exercise retries and failure paths, a hook
that runs another process's operation inside a writer's commit window (:func:`before_first_log_create`), a clock
hours off the storage's for the documents this process writes (:func:`skewed_clock`), and
megatron-core on CPU (:func:`megatron_on_cpu`; its sparse attention: :func:`dsa_on_cpu`) for tests and examples, a
stand-in for slime's routing preparation (:func:`slime_prepare`) where slime is not installed, and a local S3 server
(:func:`local_s3_server`) whose conditional writes are atomic, as S3's are.

``FaultyFileSystem`` wraps any fsspec filesystem and makes a seeded fraction of calls fail the way object stores
fail: timeouts, dropped connections, throttling (``SlowDown``) and 500s, either before the operation or after it
(the request went through but the response was lost, the ambiguous case of exclusive creates). Keys matching
``permanent`` fail with ``PermissionError`` every time.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import re
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

from fsspec.spec import AbstractFileSystem

from routelog.store.storage import Storage

_TRANSIENT: list[Callable[[str], BaseException]] = [
    lambda path: TimeoutError(f"injected: read timeout on {path}"),
    lambda path: ConnectionResetError(f"injected: connection reset on {path}"),
    lambda path: OSError(errno.EBUSY, f"injected: SlowDown (503) on {path}"),
    lambda path: OSError(getattr(errno, "EREMOTEIO", 121), f"injected: InternalError (500) on {path}"),
]


class FaultyFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """Delegates to ``inner``, injecting transient errors with probability ``rate`` per call."""

    cachable = False

    def __init__(
        self,
        inner: AbstractFileSystem,
        *,
        rate: float = 0.2,
        seed: int = 0,
        after_rate: float = 0.5,
        permanent: str | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.protocol = inner.protocol
        self.rate = rate
        self.after_rate = after_rate
        self.permanent = re.compile(permanent) if permanent else None
        self.injected = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()

    def _roll(self, path: str) -> tuple[BaseException | None, bool]:
        """An error to raise (or None), and whether to raise it after performing the operation."""
        with self._lock:
            if self._random.random() >= self.rate:
                return None, False
            self.injected += 1
            make = self._random.choice(_TRANSIENT)
            return make(path), self._random.random() < self.after_rate

    def _run(self, path: str, operation: Callable[[], Any], *, mutating: bool) -> Any:
        if self.permanent is not None and mutating and self.permanent.search(path):
            raise PermissionError(errno.EACCES, f"injected: access denied to {path}")
        error, after = self._roll(path)
        if error is not None and not (after and mutating):
            raise error
        result = operation()
        if error is not None:
            raise error
        return result

    # -- the primitives routelog.store.storage.Storage uses ------------------------------------------------------------
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        return self._run(path, lambda: self.inner.cat_file(path, start=start, end=end, **kwargs), mutating=False)

    def cat(self, path: Any, recursive: bool = False, on_error: str = "raise", **kwargs: Any) -> Any:
        first = path[0] if isinstance(path, list) and path else str(path)
        return self._run(
            first, lambda: self.inner.cat(path, recursive=recursive, on_error=on_error, **kwargs), mutating=False
        )

    def cat_ranges(
        self, paths: list[str], starts: Any, ends: Any, max_gap: Any = None, on_error: str = "return", **kwargs: Any
    ) -> Any:
        return self._run(
            paths[0] if paths else "",
            lambda: self.inner.cat_ranges(paths, starts, ends, max_gap=max_gap, on_error=on_error, **kwargs),
            mutating=False,
        )

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> Any:
        return self._run(path, lambda: self.inner.pipe_file(path, value, mode=mode, **kwargs), mutating=True)

    def pipe(self, path: Any, value: Any = None, **kwargs: Any) -> Any:
        items = path if isinstance(path, dict) else {path: value}
        for key in items:
            if self.permanent is not None and self.permanent.search(key):
                raise PermissionError(errno.EACCES, f"injected: access denied to {key}")
        return self._run(next(iter(items)), lambda: self.inner.pipe(items, **kwargs), mutating=True)

    def exists(self, path: str, **kwargs: Any) -> bool:
        return bool(self._run(path, lambda: self.inner.exists(path, **kwargs), mutating=False))

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._run(path, lambda: self.inner.ls(path, detail=detail, **kwargs), mutating=False)

    def find(
        self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False, **kwargs: Any
    ) -> Any:
        return self._run(
            path,
            lambda: self.inner.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs),
            mutating=False,
        )

    def size(self, path: str) -> Any:
        return self._run(path, lambda: self.inner.size(path), mutating=False)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> Any:
        first = path[0] if isinstance(path, list) and path else str(path)
        return self._run(first, lambda: self.inner.rm(path, recursive=recursive, maxdepth=maxdepth), mutating=True)

    def invalidate_cache(self, path: str | None = None) -> None:
        self.inner.invalidate_cache(path)


def faulty_storage(
    url: str, *, rate: float = 0.2, seed: int = 0, after_rate: float = 0.5, permanent: str | None = None
) -> tuple[Storage, FaultyFileSystem]:
    """A :class:`~routelog.store.storage.Storage` for ``url`` whose filesystem injects faults (fast retries)."""
    from routelog.store.storage import RetryPolicy

    clean = Storage.open(url)
    faulty = FaultyFileSystem(clean.fs, rate=rate, seed=seed, after_rate=after_rate, permanent=permanent)
    storage = Storage(
        url=clean.url,
        fs=faulty,
        root=clean.root,
        storage_options=clean.storage_options,
        retry=RetryPolicy(attempts=12, base_delay=0.001, max_delay=0.01),
    )
    return storage, faulty


def before_first_log_create(storage: Storage, action: Callable[[], object]) -> Callable[[], None]:
    """Run ``action`` once, just before ``storage``'s first create of a step-log entry (a writer's commit, a drop, a
    seal): what happens there happens after the writer read the log to decide and before its entry lands (another
    writer's commit, a drop, a seal, a barrier two racing writers meet at, or an exception: a crash). Returns the
    function that removes the hook."""
    original, done = storage.create, [False]

    def create(key: str, data: bytes, **options: bool) -> bool:
        if "/log/" in key and not done[0]:
            done[0] = True
            action()
        return original(key, data, **options)

    storage.create = create  # type: ignore[method-assign]

    def remove() -> None:
        storage.create = original  # type: ignore[method-assign]

    return remove


@contextlib.contextmanager
def skewed_clock(offset: float | Callable[[], float]) -> Iterator[None]:
    """Within the block this process writes every document (commits, drops, seals, annotations) with a clock
    ``offset`` seconds (or ``offset()``, read at each write) off the real one, as a host whose clock drifted would:
    what the storage orders and times must not move."""
    from routelog.format import documents

    real = documents.utc_now

    def skewed() -> datetime:
        return real() + timedelta(seconds=offset() if callable(offset) else offset)

    patched = [
        module
        for module in list(sys.modules.values())
        if module.__name__.startswith("routelog") and getattr(module, "utc_now", None) is real
    ]
    for module in patched:
        module.utc_now = skewed  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.utc_now = real  # type: ignore[attr-defined]


def megatron_on_cpu() -> None:
    """Make megatron-core 0.16+ run on CPU in this process, as tests and examples use it: a one-process gloo group,
    megatron's model-parallel state, and the two shims its CPU path needs (``torch.cuda.current_device`` and the
    Transformer Engine GEMM it would otherwise call). Idempotent."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    moe_utils.te_general_gemm = None
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def dsa_on_cpu() -> None:
    """Make megatron-core 0.16.1's DeepSeek Sparse Attention (``DSAIndexer``, ``DSAttention`` inside
    ``MLASelfAttention``) run on CPU in this process, for tests and examples: :func:`megatron_on_cpu`, and two
    patches of megatron-core. Idempotent. Each is exact for what the tests check (the indices attention uses):

    - ``dsa.rotate_activation`` becomes the identity. megatron-core rotates the indexer's q and k by a Hadamard
      transform (``fast_hadamard_transform``, a CUDA extension, bf16 only). Scaled by ``d^-1/2`` it is orthogonal,
      and the rotated q and k are only used in the scores' dot products ``q . k``, which an orthogonal rotation of
      both leaves unchanged in exact arithmetic: only rounding differs, so the indexer's own top-k can differ near
      ties from a GPU's, never the replayed indices the tests check attention receives.
    - ``multi_latent_attention.HAVE_TE`` becomes False. Without Transformer Engine, megatron-core's TE module puts a
      ``MagicMock`` in place of ``transformer_engine``, so MLA's import of ``TELinear`` succeeds and its
      ``isinstance(self.linear_proj, TELinear)`` raises a ``TypeError``; False is the no-TE path that check guards
      (an FP8 memory saving of TE linears).

    ``torch.cuda.current_device`` answering ``"cpu"`` (:func:`megatron_on_cpu`) also places the indexer's
    ``RotaryEmbedding`` (built without ``use_cpu_initialization``; ``get_emb`` moves its frequencies to
    ``torch.cuda.current_device()``) on the CPU. Build the layers with :func:`dsa_layer_spec`."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.experimental_attention_variant import dsa

    megatron_on_cpu()
    dsa.rotate_activation = _identity_rotation
    mla.HAVE_TE = False


def _identity_rotation(x: Any) -> Any:
    return x


def _cpu_linear_class() -> type:
    """A linear layer megatron-core builds as ``backend.linear()``, which its ``LocalSpecProvider`` lacks: the
    indexer's projections (``linear_wq_b``, ``linear_wk``, ``linear_weights_proj``) are ``TELinear`` with
    ``parallel_mode="duplicated"`` on GPU, the same full weight on every TP rank; this is ``torch.nn.Linear`` taking
    megatron's constructor arguments and returning ``(output, None)`` as megatron's linears do."""
    import torch

    class DuplicatedLinear(torch.nn.Module):
        def __init__(self, input_size: int, output_size: int, *, bias: bool = False, **_megatron: Any) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(input_size, output_size, bias=bias)

        def forward(self, x: Any) -> tuple[Any, None]:
            return self.linear(x), None

    return DuplicatedLinear


def dsa_layer_spec() -> Any:
    """megatron-core 0.16.1's local (no Transformer Engine) GPT layer spec with multi-latent attention whose core
    attention is ``DSAttention`` and its ``DSAIndexer``, as ``get_dsa_module_spec_for_backend`` builds it for TE
    (which fails with the local backend: ``LocalSpecProvider`` has no ``linear()``). Call :func:`dsa_on_cpu` first.
    The config must be an ``MLATransformerConfig`` with ``experimental_attention_variant="dsa"``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    linear = _cpu_linear_class()
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    indexer = ModuleSpec(
        module=DSAIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=linear,
            linear_wk=linear,
            k_norm=LocalSpecProvider().layer_norm(rms_norm=False, for_qk=True),
            linear_weights_proj=linear,
        ),
    )
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer)
    )
    return spec


_S3_CONDITIONAL_LOCK = threading.Lock()


def _make_moto_conditional_writes_atomic() -> None:
    """Serialize moto's conditional PUTs and multipart completions (``If-None-Match``, ``If-Match``).

    moto checks the condition, then stores the object, with nothing in between holding off a concurrent request
    for the same key: two processes creating one log position can both get 200, the later silently replacing the
    earlier (a commit the writer saw succeed vanishes). S3 decides a conditional write atomically (one wins, the
    others get 412 or 409), which the commit protocol relies on. Holding one lock over each conditional request's
    check and store gives moto the same behaviour; unconditional requests are not held. Idempotent."""
    from moto.s3.responses import S3Response

    if getattr(S3Response._key_response_put, "routelog_atomic", False):
        return

    def atomic(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.headers.get("If-None-Match") is None and self.headers.get("If-Match") is None:
                return method(self, *args, **kwargs)
            with _S3_CONDITIONAL_LOCK:
                return method(self, *args, **kwargs)

        run.routelog_atomic = True  # type: ignore[attr-defined]
        return run

    for name in ("_key_response_put", "_key_response_post"):
        setattr(S3Response, name, atomic(getattr(S3Response, name)))


@contextlib.contextmanager
def local_s3_server() -> Iterator[str]:
    """A moto S3 server over HTTP on a free 127.0.0.1 port, in this process, with conditional writes made atomic
    (:func:`_make_moto_conditional_writes_atomic`); yields its endpoint URL and stops it on exit. Tests and
    benchmarks point clients at it with ``AWS_ENDPOINT_URL``."""
    from moto.server import ThreadedMotoServer

    _make_moto_conditional_writes_atomic()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


class SlimeRoutingReplay:
    """Stand-in for slime's ``slime.utils.routing_replay.RoutingReplay`` (slime is not on the package index), one
    per MoE router of a rank in build order, as slime at ``624b824a`` behaves: ``record`` keeps what
    ``fill_routing_replay`` hands it (routelog's lazy references as they are, tensors on the host), and a router's
    forward (``pop_forward``) or backward recompute (``pop_backward``) takes the next one, materializing a lazy
    reference in that stage, or moving a tensor to int32 (slime also moves it to the accelerator)."""

    def __init__(self) -> None:
        self.top_indices_list: list[Any] = []
        self.forward_index = 0
        self.backward_index = 0

    def record(self, top_indices: Any) -> None:
        self.top_indices_list.append(top_indices)

    def pop_forward(self) -> Any:
        self.forward_index += 1
        return self._materialized(self.top_indices_list[self.forward_index - 1], "forward")

    def pop_backward(self) -> Any:
        self.backward_index += 1
        return self._materialized(self.top_indices_list[self.backward_index - 1], "backward")

    @staticmethod
    def _materialized(top_indices: Any, stage: str) -> Any:
        if hasattr(top_indices, "materialize_for_routing_replay"):
            return top_indices.materialize_for_routing_replay(stage)
        import torch

        return top_indices.to(dtype=torch.int32)


def slime_prepare(*, tp_rank: int = 0, tp_size: int = 1, cp_rank: int = 0, cp_size: int = 1) -> Callable[..., Any]:
    """A stand-in, for one rank, for slime's ``prepare_routed_experts_for_routing_replay`` (slime 624b824a,
    ``slime/backends/megatron_utils/cp_utils.py``), which :mod:`routelog.integrations.slime` calls where slime is
    installed; slime is not on PyPI. Each sample's ``[T - 1, L, K]`` routing gets one pad row (its final token), is
    cut into ``2 * CP`` chunks of which the rank keeps chunk ``cp_rank`` and its mirror (or, with ``allgather_cp``,
    the samples are joined, padded to ``CP * TP * data_pad_size_multiplier`` and cut into CP contiguous parts),
    the stream is padded to a multiple of ``TP * data_pad_size_multiplier`` and, with sequence parallelism, the rank
    keeps its TP share. Every pad block of ``P`` rows holds ``arange(P * L * K).reshape(P, L, K) % num_experts``.
    ``tests/test_integration_slime.py`` checks that what routelog records through it is, rank by rank, what slime's
    real code recorded on the captured rollouts."""
    import torch

    def padded(rows: Any, count: int, num_experts: int) -> Any:
        if count == 0:
            return rows
        _, layers, topk = rows.shape
        block = torch.arange(count * layers * topk, dtype=rows.dtype).reshape(count, layers, topk) % num_experts
        return torch.cat([rows, block])

    def zigzag(rows: Any, num_experts: int) -> Any:
        if cp_size == 1:
            return rows
        chunk = -(-rows.shape[0] // (2 * cp_size))
        chunks = padded(rows, 2 * cp_size * chunk - rows.shape[0], num_experts).split(chunk)
        return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])

    def prepare(
        experts: list[Any],
        tokens: list[Any],
        *,
        num_experts: int,
        data_pad_size_multiplier: int,
        sequence_parallel: bool,
        allgather_cp: bool,
    ) -> Any:
        for rows, ids in zip(experts, tokens, strict=True):
            if rows.shape[0] != ids.shape[0] - 1:
                raise ValueError(f"routing of {rows.shape[0]} rows for {ids.shape[0]} tokens")
        samples = [padded(rows, 1, num_experts) for rows in experts]
        multiple = tp_size * data_pad_size_multiplier
        if allgather_cp:
            stream = torch.cat(samples)
            stream = padded(stream, -stream.shape[0] % (cp_size * multiple), num_experts).chunk(cp_size)[cp_rank]
        else:
            stream = torch.cat([zigzag(rows, num_experts) for rows in samples])
            stream = padded(stream, -stream.shape[0] % multiple, num_experts)
        if sequence_parallel:
            share = stream.shape[0] // tp_size
            stream = stream[tp_rank * share : (tp_rank + 1) * share]
        return stream

    return prepare


def nemo_rl_local_rows(
    *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False
) -> Callable[[Any, Any], Any]:
    """A stand-in, for one rank, for NeMo-RL's ``_normalize_routed_experts_for_mcore`` followed by
    ``_split_for_sequence_parallel`` (NeMo-RL 7ea279ab, ``nemo_rl/models/megatron/router_replay.py``), which
    :mod:`routelog.integrations.nemo_rl` calls where NeMo-RL is installed (it needs Python 3.13). A packed
    ``[1, T, L, K]`` tensor becomes ``[T, L, K]``, an unpacked ``[B, S, L, K]`` one ``[S * B, L, K]`` sequence-major;
    with sequence parallelism (NeMo-RL reads it from the model config) the rank keeps its contiguous TP share.
    ``tests/test_integration_nemo_rl.py`` checks that the routes installed through it are, rank by rank, those
    NeMo-RL's real code assigned on the captured rollouts."""

    def local_rows(model_config: Any, routed: Any) -> Any:
        if routed.dim() == 4:
            routed = routed[0] if routed.shape[0] == 1 else routed.transpose(0, 1).reshape(-1, *routed.shape[2:])
        if sequence_parallel and tp_size > 1:
            share = routed.shape[0] // tp_size
            routed = routed[tp_rank * share : (tp_rank + 1) * share]
        return routed

    return local_rows
