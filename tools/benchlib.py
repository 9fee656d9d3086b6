"""Helpers shared by the benchmark scripts in this directory."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import numpy as np


def peak_rss_mb() -> float:
    """Peak RSS of this process image (VmHWM; ru_maxrss would carry the parent's peak across fork+exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Start :func:`peak_rss_mb` over from the resident set now (Linux: ``/proc/self/clear_refs``), so that what a
    benchmark did before its clock (generating its data) does not count; whether the kernel took it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def current_rss_mb() -> float:
    """This process's resident set now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return peak_rss_mb()


def process_age_seconds() -> float:
    """Seconds since this process started (Linux; 10 ms resolution): what a fresh process paid so far, the
    interpreter's start and every import included."""
    ticks = os.sysconf("SC_CLK_TCK")
    started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def count_reads(storage: Any) -> dict[str, int]:
    """Count what ``storage`` (a routelog Storage) reads from now on: ``routing`` (chunks of routing arrays, and
    the models of ``ranked_context`` ones), ``metadata`` (everything else) and ``requests``; returns the live
    counters."""
    read = {"routing": 0, "metadata": 0, "requests": 0}
    ranges, whole, many = storage.read_ranges, storage.read, storage.read_many

    def count(key: str, data: Any) -> Any:
        read["routing" if "/routing/c/" in key or key.endswith("/routing/model") else "metadata"] += len(data)
        read["requests"] += 1
        return data

    storage.read_ranges = lambda r, *into: [count(k, d) for (k, _, _), d in zip(r, ranges(r, *into), strict=True)]
    storage.read = lambda k: count(k, whole(k))
    storage.read_many = lambda ks: {k: count(k, v) for k, v in many(ks).items()}
    return read


def dense_routing(sid: str, ids: np.ndarray, moe_layers: list[int], num_layers: int) -> Any:
    """A RecordRouting built from a dense ``[tokens, layers, K]`` array (every row routed but the last), as a
    trainer holding the whole tensor would hand it to the alignment."""
    import routelog
    from routelog.format.routing import RecordRouting

    tokens = ids.shape[0]
    valid = np.ones(tokens, bool)
    valid[-1] = False
    info = routelog.IndexRow(
        sample_id=sid,
        step=0,
        prompt_len=tokens // 4,
        response_len=tokens - tokens // 4,
        n_tokens=tokens,
        spans=[],
        segments=[],
    )
    return RecordRouting(
        info=info,
        by_layer=np.ascontiguousarray(np.sort(ids[:, moe_layers], axis=-1).transpose(1, 0, 2), np.uint8),
        valid=valid,
        moe_layers=tuple(moe_layers),
        layers=tuple(moe_layers),
        topk_order="sorted",
        num_moe_layers=num_layers,
    )


def corpus_steps(url: str) -> tuple[list[Any], Any]:
    """A store's records, a list per step, as they were appended (with their token ids), and its model spec."""
    import routelog

    store = routelog.open_store(url)
    steps = [
        [got.to_record() for got in snapshot.read_many(snapshot.sample_ids)]
        for snapshot in map(store.step, store.steps())
    ]
    return steps, store.model_spec


def token_dependent_records(
    rng: np.random.Generator,
    tokens: int,
    spec: Any,
    vocab_size: int,
    preferred_share: float = 0.6,
    record_tokens: int = 1024,
) -> list[Any]:
    """Records of routing that depends on the token (``routelog.synth.token_dependent_routing``: a share of
    token-layers take their token id's preferred set, the rest a Dirichlet(1/3)-skewed draw) over Zipf-distributed
    token ids, ``record_tokens`` each, a quarter of them prompt."""
    from routelog import Record
    from routelog.synth import token_dependent_routing, zipf_token_ids

    ids = zipf_token_ids(rng, tokens, vocab_size)
    routing = token_dependent_routing(rng, ids, spec, preferred_share=preferred_share)
    records = []
    for i, start in enumerate(range(0, tokens - 1, record_tokens)):
        n = min(record_tokens, tokens - start)
        prompt = max(1, n // 4)
        records.append(
            Record(
                sample_id=f"token-dependent-{i:05d}",
                expert_ids=routing[start : start + n],
                prompt_len=prompt,
                response_len=n - prompt,
                token_ids=ids[start : start + n],
            )
        )
    return records


def routed_rows(records: list[Any]) -> np.ndarray:
    """Every routed row of the records (the rows their ``valid`` masks keep), in record order: ``[rows, L, K]``."""
    return np.concatenate(
        [np.asarray(r.expert_ids)[slice(None) if r.valid is None else np.asarray(r.valid, bool)] for r in records]
    )


def zstd19_baseline(records: list[Any], spec: Any) -> dict[str, int | None]:
    """The simplest archive a user would make of ``records``: every routed row in record order (uint8 or uint16, as
    the model's experts need) in one zstd-19 frame, and the int32 token ids in another (None without any); bytes of
    each, the routing in one zstd-3 frame beside them, and the routed token-layers they hold."""
    import zstandard

    routed = routed_rows(records)
    raw = np.ascontiguousarray(routed, dtype=spec.id_dtype).tobytes()
    with_tokens = [r for r in records if r.token_ids is not None]
    tokens = np.concatenate([np.asarray(r.token_ids, dtype="<i4") for r in with_tokens]) if with_tokens else None
    compressor = zstandard.ZstdCompressor(level=19)
    return {
        "token_layers": int(routed.shape[0] * routed.shape[1]),
        "zstd19_routing_bytes": len(compressor.compress(raw)),
        "zstd3_routing_bytes": len(zstandard.ZstdCompressor(level=3).compress(raw)),
        "zstd19_token_ids_bytes": None if tokens is None else len(compressor.compress(tokens.tobytes())),
    }


def build_sanitized(source: Path, target: Path) -> None:
    """Compile the C extension ``source`` into ``target`` with AddressSanitizer and UndefinedBehaviorSanitizer (the
    fuzzers' build: no recovery from undefined behaviour, no contracted floating point, as pip builds it)."""
    import subprocess
    import sysconfig

    command = [
        "gcc",
        "-O1",
        "-g",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
        "-ffp-contract=off",
        "-std=c11",
        "-shared",
        "-fPIC",
        f"-I{sysconfig.get_paths()['include']}",
        str(source),
        "-o",
        str(target),
    ]
    subprocess.run(command, check=True)


def rerun_sanitized(script: str, scratch: str, seconds: float, seed: int) -> int:
    """Run ``script --child scratch`` with the sanitizers' runtimes preloaded (an interpreter not built with them
    loads a sanitized extension only so); its exit status."""
    import subprocess
    import sys

    libraries = [
        subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
        for name in ("libasan.so", "libubsan.so")
    ]
    env = dict(
        os.environ,
        LD_PRELOAD=" ".join(libraries),
        ASAN_OPTIONS="detect_leaks=0",  # the interpreter's own allocations outlive it
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    command = [sys.executable, script, "--child", scratch, "--seconds", str(seconds), "--seed", str(seed)]
    return subprocess.run(command, env=env, check=False).returncode
