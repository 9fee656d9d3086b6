"""HF transformers as an engine: record routing during ``generate``; replay it in a later forward.

Every MoE router in transformers 5.x (``model.layers.{i}.mlp.gate``, ``mlp.router`` for GPT-OSS,
``feed_forward.router`` for Llama 4) returns ``(router_logits, weights, indices)`` with ``indices`` int64
``[tokens, K]``. A forward hook records the indices of every call: the prefill call holds ``[B * P, K]`` rows
(batch-major, left padding included), each decode call ``[B, K]`` for the token fed at that step. The last sampled
token is never fed, so, as in every engine, it has no routing row.

Replay rewrites the router's output: the indices come from the recording, the weights are recomputed from the
live logits exactly as that router computes them (so gradients reach the router weight).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from routelog.errors import ModelSpecError, ReplayConfigError
from routelog.format.documents import Segment
from routelog.format.record import Record
from routelog.format.spec import ModelSpec

ENGINE = "transformers"
_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|feed_forward)\.(?:gate|router)$")


def find_routers(model: Any, spec: ModelSpec) -> dict[int, Any]:
    """The router module of every MoE layer, by global layer index; they must be exactly the spec's MoE layers."""
    routers = {int(m[1]): module for name, module in model.named_modules() if (m := _ROUTER_NAME.search(name))}
    if sorted(routers) != list(spec.moe_layers):
        raise ModelSpecError(
            f"the model's routers sit in layers {sorted(routers)}, the spec's MoE layers are {list(spec.moe_layers)}; "
            "derive the spec from this model's config (ModelSpec.from_hf_config(model.config.to_dict()))"
        )
    return routers


class ForwardHooks:
    """A forward hook on each of ``modules`` (by layer) while the ``with`` block runs, made by :meth:`_hook`."""

    def __init__(self, modules: Mapping[int, Any]) -> None:
        self._hooked = dict(modules)
        self._handles: list[Any] = []

    def __enter__(self) -> Self:
        for layer, module in self._hooked.items():
            self._handles.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int) -> Any:
        raise NotImplementedError


class RoutingRecorder(ForwardHooks):
    """Context manager recording every router call of a HF MoE model.

    >>> with RoutingRecorder(model, spec) as recorder:                                          # doctest: +SKIP
    ...     out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64, do_sample=True)
    >>> records = recorder.records(input_ids, mask, out, sample_ids=[...])                      # doctest: +SKIP
    """

    def __init__(self, model: Any, spec: ModelSpec, *, record_weights: bool = False) -> None:
        self.model = model
        self.spec = spec
        self.routers = find_routers(model, spec)
        super().__init__(self.routers)
        self.record_weights = record_weights
        """Also record the routers' weights of the chosen experts (``Record.weights``)."""
        self.calls: dict[int, list[npt.NDArray[np.int64]]] = {layer: [] for layer in self.routers}
        self.weight_calls: dict[int, list[npt.NDArray[np.float32]]] = {layer: [] for layer in self.routers}

    def _hook(self, layer: int) -> Any:
        def record(module: Any, inputs: Any, output: Any) -> None:
            _check_router_output(layer, output)
            self.calls[layer].append(output[2].detach().to("cpu").numpy().astype(np.int64, copy=True))
            if self.record_weights:
                self.weight_calls[layer].append(output[1].detach().to("cpu").float().numpy().copy())

        return record

    def clear(self) -> None:
        for calls in self.calls.values():
            calls.clear()
        for weights in self.weight_calls.values():
            weights.clear()

    def records(
        self,
        input_ids: Any,
        attention_mask: Any,
        sequences: Any,
        *,
        sample_ids: Sequence[str],
        eos_token_id: int | Sequence[int] | None = None,
        group_ids: Sequence[str] | None = None,
        policy_version: int | None = None,
        engine_version: str | None = None,
    ) -> list[Record]:
        """One record per sequence of a finished ``generate`` call (left-padded batch).

        A response ends at its first ``eos_token_id`` (included); tokens after it are padding. Rows the engine
        never computed (prompt padding is skipped; the final sampled token) are missing.
        """
        prompts = np.asarray(_numpy(input_ids))
        mask = np.asarray(_numpy(attention_mask)).astype(bool)
        seqs = np.asarray(_numpy(sequences))
        batch, width = prompts.shape
        new_tokens = seqs.shape[1] - width
        layers = list(self.spec.moe_layers)
        calls = [self.calls[layer] for layer in layers]
        if any(len(c) != max(new_tokens, 1) for c in calls):
            raise ReplayConfigError(
                f"recorded {[len(c) for c in calls]} router calls per layer for {new_tokens} new tokens; record one "
                "generate call at a time (recorder.clear() between calls) with the KV cache on"
            )
        prefill, decode = _prefill_and_decode(calls, batch, width, self.spec.topk)
        weights = None
        if self.record_weights:
            weights = _prefill_and_decode([self.weight_calls[layer] for layer in layers], batch, width, self.spec.topk)
        stops = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or [])
        records = []
        for b in range(batch):
            prompt = prompts[b, mask[b]]
            response = seqs[b, width:]
            ends = [i for i, t in enumerate(response) if int(t) in stops]
            response = response[: ends[0] + 1] if ends else response
            n_prompt, n_response = prompt.shape[0], response.shape[0]
            fed = min(n_response, decode.shape[1])
            ids = _by_token(prefill, decode, b, mask[b], n_response, fed)
            valid = np.zeros(n_prompt + n_response, dtype=bool)
            valid[: n_prompt + fed] = True
            records.append(
                Record(
                    sample_id=sample_ids[b],
                    expert_ids=ids,
                    prompt_len=n_prompt,
                    response_len=n_response,
                    valid=valid,
                    token_ids=np.concatenate([prompt, response]).astype(np.int64),
                    group_id=None if group_ids is None else group_ids[b],
                    policy_version=policy_version,
                    engine=ENGINE,
                    engine_version=engine_version or _transformers_version(),
                    weights=None if weights is None else _by_token(*weights, b, mask[b], n_response, fed),
                    segments=[
                        Segment(start=0, end=n_prompt, policy_version=policy_version, source="prompt"),
                        Segment(
                            start=n_prompt, end=n_prompt + n_response, policy_version=policy_version, source="response"
                        ),
                    ],
                )
            )
        return records


def _prefill_and_decode(
    calls: list[list[npt.NDArray[Any]]], batch: int, width: int, k: int
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Per-layer router outputs (the prefill call, then one call per decode step) as ``[B, P, L, K]`` and
    ``[B, new_tokens - 1, L, K]``: decode step ``s`` feeds response token ``s - 1``."""
    prefill = np.stack([c[0].reshape(batch, width, k) for c in calls], axis=2)
    if len(calls[0]) > 1:
        decode = np.stack([np.stack([step.reshape(batch, k) for step in c[1:]], axis=1) for c in calls], axis=2)
    else:
        decode = np.zeros((batch, 0, len(calls), k), dtype=prefill.dtype)
    return prefill, decode


def _by_token(
    prefill: npt.NDArray[Any], decode: npt.NDArray[Any], b: int, mask: npt.NDArray[np.bool_], n_response: int, fed: int
) -> npt.NDArray[Any]:
    """Sequence ``b``'s rows ``[prompt + response, L, K]``: its unpadded prompt's, then the decode steps that fed
    its response tokens (zeros for the rest, never computed)."""
    prompt = prefill[b, mask]
    out = np.zeros((prompt.shape[0] + n_response, *prefill.shape[2:]), dtype=prefill.dtype)
    out[: prompt.shape[0]] = prompt
    out[prompt.shape[0] : prompt.shape[0] + fed] = decode[b, :fed]
    return out


def _check_router_output(layer: int, output: Any) -> None:
    if not isinstance(output, tuple) or len(output) != 3:
        count = len(output) if isinstance(output, tuple) else 1
        raise ReplayConfigError(
            f"the router of layer {layer} returns {count} value(s); routelog hooks routers that return "
            "(router_logits, weights, indices), as transformers 5.x Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, "
            "GLM4-MoE and GPT-OSS do"
        )


def _numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _transformers_version() -> str | None:
    try:
        import transformers

        return str(transformers.__version__)
    except ImportError:  # pragma: no cover - the recorder is only used with transformers installed
        return None


# -- replay ---------------------------------------------------------------------------------------------------------
def replay_weights(router: Any, logits: Any, indices: Any, spec: ModelSpec) -> Any:
    """The weights ``router`` would give experts ``indices`` from ``logits``: the router's own formula on the
    replayed selection, so the training logits (and their gradient) decide the weights, the recording the experts."""
    import torch

    scores = logits.float()
    rule = spec.router
    if rule.score_function == "sigmoid":
        weights = torch.sigmoid(scores).gather(-1, indices)
        if rule.norm_topk_prob and spec.topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * (rule.scaling_factor or 1.0)
    elif rule.topk_before_softmax:
        weights = torch.softmax(scores.gather(-1, indices), dim=-1)
    else:
        weights = torch.softmax(scores, dim=-1).gather(-1, indices)
        if rule.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * (rule.scaling_factor or 1.0)
    return weights.to(logits.dtype)


@contextmanager
def replay(model: Any, spec: ModelSpec, indices: Mapping[int, Any], mask: Any | None = None) -> Iterator[None]:
    """Force every MoE router to select ``indices[layer]`` (``[tokens, K]`` int64, the flattened batch in the order
    the router sees it) during the forward passes inside the block.

    ``mask`` (``[tokens]`` bool) limits replay to the rows that have a recorded route (the final token, padding):
    the others keep the router's own choice, as verl's masked replay does.
    """
    import torch

    routers = find_routers(model, spec)
    missing = sorted(set(routers) - set(indices))
    if missing:
        raise ReplayConfigError(f"no replay indices for MoE layers {missing}")
    keep = None if mask is None else torch.as_tensor(mask, dtype=torch.bool)[:, None]
    handles = []

    def hook_for(layer: int) -> Any:
        target = torch.as_tensor(indices[layer], dtype=torch.long)

        def rewrite(module: Any, inputs: Any, output: Any) -> Any:
            _check_router_output(layer, output)
            logits, _, native = output
            if logits.shape[0] != target.shape[0]:
                raise ReplayConfigError(
                    f"layer {layer}: the router sees {logits.shape[0]} tokens, the replay holds {target.shape[0]}"
                )
            chosen = target.to(logits.device)
            if keep is not None:
                chosen = torch.where(keep.to(logits.device), chosen, native)
            return logits, replay_weights(module, logits, chosen, spec), chosen

        return rewrite

    try:
        for layer, router in routers.items():
            handles.append(router.register_forward_hook(hook_for(layer)))
        yield
    finally:
        for handle in handles:
            handle.remove()
