"""What ``routelog inspect`` and ``routelog ls`` report about a store."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from routelog.format import keys
from routelog.format.limits import FORMAT_VERSION
from routelog.store.reader import StepSnapshot
from routelog.store.root import StoreRoot


def bytes_per_token_layer(snapshots: Iterable[StepSnapshot], num_moe_layers: int) -> float | None:
    """The one figure of routing density that ``inspect`` and ``stats`` print: the routing arrays' stored bytes
    over the routed token rows of the records times the MoE layers (a shared prefix counts in every record that
    has it, so deduplication lowers it; indexes, values and documents excluded; ``None`` when nothing is
    stored)."""
    routing_bytes = rows = 0
    for snapshot in snapshots:
        routing_bytes += snapshot.routing_bytes
        rows += snapshot.routed_rows
    return routing_bytes / (rows * num_moe_layers) if rows else None


def step_summary(snapshot: StepSnapshot) -> dict[str, Any]:
    """Counts and sizes of one step. ``routing_bytes`` counts only the routing arrays (not indexes, metadata);
    ``codecs`` counts the parts by their routing's transform (``ranked_gaps``, ``ranked_context``, ...)."""
    return {
        "step": snapshot.step,
        "records": len(snapshot),
        "tokens": snapshot.n_tokens,
        "stored_rows": snapshot.stored_rows,
        "routed_rows": snapshot.routed_rows,
        "parts": len(snapshot.parts),
        "sealed": snapshot.sealed,
        "stored_bytes": snapshot.stored_bytes,
        "routing_bytes": snapshot.routing_bytes,
        "codecs": dict(Counter(c.routing.transform for c in snapshot.parts)),
    }


def store_summary(store: StoreRoot) -> dict[str, Any]:
    """The whole store: run, model spec, per-step counts and totals.

    ``bytes_per_token_layer`` is :func:`bytes_per_token_layer`.
    """
    spec = store.model_spec
    snapshots = [StepSnapshot.load(store, s) for s in store.steps()]
    steps = [step_summary(snapshot) for snapshot in snapshots]
    return {
        "url": store.url,
        "format_version": store.run.format_version,
        "reader_format_version": FORMAT_VERSION,
        "run_id": store.run.run_id,
        "created_at": store.run.created_at.isoformat(),
        "model_spec": spec.model_dump(mode="json"),
        "steps": [s["step"] for s in steps],
        "per_step": steps,
        "records": sum(s["records"] for s in steps),
        "tokens": sum(s["tokens"] for s in steps),
        "stored_rows": sum(s["stored_rows"] for s in steps),
        "routed_rows": sum(s["routed_rows"] for s in steps),
        "stored_bytes": sum(s["stored_bytes"] for s in steps),
        "run_document_bytes": _run_document_size(store),
        "routing_bytes": sum(s["routing_bytes"] for s in steps),
        "bytes_per_token_layer": bytes_per_token_layer(snapshots, spec.num_moe_layers),
        "dedup_ratio": _ratio(sum(s["routed_rows"] for s in steps), sum(s["stored_rows"] for s in steps)),
        "codecs": dict(sum((Counter(s["codecs"]) for s in steps), Counter())),
    }


def _ratio(routed: int, stored: int) -> float | None:
    """Routed rows per stored row: what storing shared prefixes once saves (1.0 without sharing)."""
    return routed / stored if stored else None


def _run_document_size(store: StoreRoot) -> int:
    return store.storage.size(keys.RUN_DOCUMENT)


def record_listing(snapshot: StepSnapshot) -> list[dict[str, Any]]:
    """One line per record of a step, for ``routelog ls``."""
    return [
        {
            "sample_id": row.sample_id,
            "group_id": row.group_id,
            "tokens": row.n_tokens,
            "prompt_len": row.prompt_len,
            "response_len": row.response_len,
            "missing_rows": row.n_missing,
            "policy_version": row.policy_version,
            "engine": row.engine,
        }
        for row in snapshot.infos()
    ]
