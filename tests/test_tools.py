"""The tools under tools/ keep working: benchmarks run (quick sizes) and report every baseline; no timings here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import routelog
from routelog import Record
from routelog.format.spec import entropy_bound_bytes
from routelog.synth import TokenRouter, synthetic_spec, token_dependent_routing, zipf_token_ids
from tests.records import random_routing

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, check=False)


def test_bench_codec_reports_every_layout() -> None:
    result = _tool(str(TOOLS / "bench_codec.py"), "--quick", "--json", "--skew", "3", "--locality", "0.3")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report["datasets"]) == ["synthetic skew 3.0 locality 0.3", "uniform"], "uniform in the same run"
    for data in report["datasets"].values():
        assert set(data["results"]) >= {
            "routelog",
            "routelog v1 (sorted_gaps)",
            "zstd-3 raw uint8",
            "zstd-3 per inner chunk",
            "raw int16 .npy (veRL)",
            "vLLM base64 .npy",
            "SGLang base64 int32",
            "Parquet FSB zstd-3",
            "routelog --topk-order score",
        }
        assert data["entropy_bound_bytes_per_token_layer"] > 0 and data["entropy_estimate_bytes_per_token_layer"] > 0
        assert set(data["ratios"]) == {
            "routelog_size_vs_bound",
            "routelog_size_vs_estimate",
            "v1_size_vs_v2",
            "routelog_encode_vs_zstd3",
            "routelog_decode_vs_zstd3",
            "routelog_encode_vs_zstd3_per_chunk",
            "routelog_decode_vs_zstd3_per_chunk",
            "score_order_size_vs_sorted",
        }
        assert data["ratios"]["score_order_size_vs_sorted"] > 1, "keeping the engine's order costs bytes"
    skewed, uniform = report["datasets"].values()
    assert skewed["ratios"]["v1_size_vs_v2"] > 1.1, "format 2 learns skew and repeats"
    assert uniform["ratios"]["v1_size_vs_v2"] > 0.99, "and loses nothing on uniform routing"
    judged = {(row["dataset"], row["goal"]): row for row in report["verdict"] if row["judged"]}
    for name in report["datasets"]:
        for direction in ("encode", "decode"):
            row = judged[name, f"{direction} speed / zstd-3 per inner chunk"]
            assert row["met"] == (row["value"] >= row["limit"]) and "whole_array" in row
    bound = judged["uniform", "size / bound"]
    assert bound["value"] == uniform["ratios"]["routelog_size_vs_bound"] and bound["limit"] == 1.05
    assert 1.0 < bound["gap_huffman_floor"] < bound["format_1"], "format 1 pays zstd's tables on top of the floor"
    # issue 33's comparison: the store as written, every byte, against zstd-19 of the whole array (and the tokens)
    archives = report["archive"]
    assert [name.split(",")[0] for name in archives] == ["token-dependent", "token-dependent", "uniform 8 layers"]
    for name, data in archives.items():
        assert (data["zstd19_token_ids"] is None) == name.startswith("uniform"), "uniform records carry no tokens"
        tokens = data["zstd19_token_ids"] or 0.0
        for transform in ("ranked_context", "ranked_gaps"):
            store = data[transform]
            assert store["store_every_byte"] > store["store_routing"] > 0 and data["zstd3_whole_routing"] > 0
            assert store["store_every_byte_vs_zstd19_routing_and_tokens"] == pytest.approx(
                store["store_every_byte"] / (data["zstd19_whole_routing"] + tokens)
            )
            assert store["write_MBps"] > 0 and store["read_MBps"] > 0
        if not name.startswith("uniform"):
            assert data["ranked_context"]["store_routing"] < data["ranked_gaps"]["store_routing"], "it learns tokens"
    goals = {(row["dataset"], row["goal"]): row for row in report["verdict"] if row["dataset"] in archives}
    assert len(goals) == 4, "both goals on each token-dependent set; uniform routing has no archive goal"
    for row in goals.values():
        assert row["judged"] and row["met"] == (row["value"] <= row["limit"])
        assert row["value"] < row["ranked_gaps"], "judged on the context codec, format 2 beside it"


def test_schemas_are_current() -> None:
    result = _tool(str(TOOLS / "gen_schemas.py"), "--check")
    assert result.returncode == 0, result.stdout


def test_bench_loader_compares_with_the_whole_step_baseline() -> None:
    result = _tool(str(TOOLS / "bench_loader.py"), "--quick", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    ours, base = report["routelog"], report["baseline_whole_step_int16_npy"]
    assert ours["checksum"] == base["checksum"], "both paths must produce the same replay tensors"
    assert ours["bytes_read"] < base["bytes_read"], "the loader reads only one rank's share"
    assert set(report["ratios"]) == {
        "time_baseline_over_routelog",
        "bytes_baseline_over_routelog",
        "peak_rss_baseline_over_routelog",
    }


def test_bench_replay_hook_times_every_integration_and_counts_device_reads() -> None:
    result = _tool(str(TOOLS / "bench_replay_hook.py"), "--quick", "--json")
    assert result.returncode == 0, result.stderr
    sides = json.loads(result.stdout)["sides"]
    assert set(sides) == {"native", "installer", "megatron-hook", "verl", "nemo-rl", "slime-native", "slime"}
    assert all(side["seconds_per_micro_batch"] > 0 for side in sides.values())
    assert sides["native"]["over_native"] == 1.0
    assert sides["slime"]["over_slime_native"] > 0
    for name in ("installer", "megatron-hook"):
        assert sides[name]["device_reads"]["per_router_and_forward"] == 0, f"{name}: no forward waits for the device"
        assert 2 <= sides[name]["device_reads"]["per_step"] <= 3, "the tallies, the token check (once)"
    # veRL's path reads the micro-batch's packed boundaries (cu_seqlens) once per forward, never per router.
    assert sides["verl"]["device_reads"]["per_forward"] == 1
    # slime's: the tokens fed, in one transfer when the rollout's routing is recorded; nothing per forward.
    assert sides["slime"]["device_reads"]["per_forward"] == 0
    assert sides["slime"]["device_reads"]["per_step"] == 1
    # NeMo-RL's: the pass's tokens and lengths in one transfer as it starts, the row codes stay on the host.
    assert sides["nemo-rl"]["device_reads"]["per_forward"] == 0
    assert 2 <= sides["nemo-rl"]["device_reads"]["per_step"] <= 3, "the pass's tokens, the tallies (once)"


@pytest.mark.parametrize("routing", ["uniform", "token-dependent"])
def test_bench_writers_commits_every_record_and_reports_the_np_save_baseline(routing: str) -> None:
    result = _tool(str(TOOLS / "bench_writers.py"), "--quick", "--json", "--routing", routing)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["config"]["routing"] == routing
    assert report["np_save_local"]["MBps"] > 0
    for target in ("local", "s3_moto"):
        assert [r["writers"] for r in report[target]] == [1, 2]
        for row in report[target]:
            assert row["parts"] >= row["writers"], "every writer commits at least one part"
            assert row["objects_per_flush"] >= 2, "a flush writes data objects and one commit record"
    assert set(report["ratios_vs_np_save"]) == {f"{t}_{n}_writers" for t in ("local", "s3_moto") for n in (1, 2)}
    zstd = report["zstd3_per_record_local"]
    assert 0 < zstd["cpu_seconds"] <= zstd["seconds"] + 0.01, "the baseline's CPU is its one thread's"
    assert all(row["cpu_seconds"] > 0 for row in report["local"])
    one = report["local"][0]
    per_cpu_second = report["goals"]["one_writer_over_zstd3_per_record_per_cpu_second"]
    assert per_cpu_second == zstd["cpu_seconds"] / one["cpu_seconds"]


def test_bench_writers_ceiling_commits_every_record_with_each_stage_made_free() -> None:
    result = _tool(str(TOOLS / "bench_writers.py"), "--ceiling", "--quick", "--json")
    assert result.returncode == 0, result.stderr  # run_writers exits non-zero when a record was not committed
    report = json.loads(result.stdout)
    variants = report["variants"]
    frees = [v["free"] for v in variants.values()]
    assert frees == [[], ["entropy"], ["entropy", "fsync"], ["entropy", "fsync", "sha256"]]
    for variant in variants.values():
        assert variant["MBps"] > 0 and len(variant["rounds_over_zstd3"]) == report["config"]["rounds"] == 1
        assert variant["over_zstd3_per_cpu_second"] > 0
    assert len(report["zstd3_per_record_MBps_rounds"]) == 1


def test_bench_writers_free_stages_replace_what_they_name() -> None:
    script = (
        "import hashlib, io, os, sys\n"
        f"sys.path.insert(0, {str(TOOLS)!r})\n"
        "import bench_writers\n"
        "from routelog.format import zstd_frames\n"
        "before = zstd_frames.compress(bytes(range(90)), 1)\n"
        "bench_writers._make_free('entropy,fsync,sha256')\n"
        "assert zstd_frames.compress(bytes(range(90)), 1) == bytes(range(60)) != before\n"
        "os.fsync(-1)  # a no-op: a real fsync of -1 raises\n"
        "assert hashlib.file_digest(io.BytesIO(b'x'), 'sha256').hexdigest() == hashlib.sha256(b'').hexdigest()\n"
        "try:\n"
        "    bench_writers._make_free('compression')\n"
        "except SystemExit as exc:\n"
        "    assert 'unknown stage' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('an unknown stage was accepted')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("routing", ["uniform", "skewed", "token-dependent"])
def test_bench_writers_routing_is_one_valid_top_k_set_per_token_layer(routing: str) -> None:
    bench = _load_tool("bench_writers")
    args = argparse.Namespace(routing=routing, records=3, tokens=64, layers=4)
    arrays = bench._routing(args, seed=5)
    assert len(arrays) == 3
    for ids in arrays:
        assert ids.shape == (64, 4, 8) and ids.dtype == np.uint8 and ids.flags.c_contiguous
        ordered = np.sort(ids, axis=-1)
        assert ordered.max() < 128 and (np.diff(ordered.astype(np.int16), axis=-1) > 0).all()
    again = bench._routing(args, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, again, strict=True)), "a writer's routing is its seed's"


def test_peak_rss_starts_over_from_the_resident_set_now() -> None:
    benchlib = _load_tool("benchlib")
    block = mmap.mmap(-1, 64 << 20)  # 64 MiB made resident, then unmapped (whatever malloc keeps)
    block.write(b"x" * (64 << 20))
    held = benchlib.peak_rss_mb()
    block.close()
    if not benchlib.reset_peak_rss():
        pytest.skip("this kernel keeps its peak RSS")
    assert benchlib.peak_rss_mb() < held - 48


def test_bench_audit_measures_stats_and_diff_against_a_plain_read() -> None:
    result = _tool(str(TOOLS / "bench_audit.py"), "--quick", "--no-ray", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["config"]["token_rows"] == 64 * 1024
    for name in ("read_only", "stats", "diff"):
        assert report[name]["tokens"] == 64 * 1024 and report[name]["tokens_per_s"] > 0
        assert report[name]["peak_rss_mb"] > 0
    assert set(report["ratios"]) == {"stats_vs_read_only", "diff_vs_read_only"}
    goals = report["goals"]
    assert set(goals) == {"read_only_M_tokens_per_s", "stats_vs_read_only", "diff_vs_read_only"}
    assert goals["stats_vs_read_only"]["measured"] == report["ratios"]["stats_vs_read_only"]
    assert goals["diff_vs_read_only"]["met"] == (report["ratios"]["diff_vs_read_only"] >= 0.5)


def _load_tool(name: str) -> Any:
    """A script of ``tools/`` as a module (its sibling ``benchlib`` importable, as when it runs)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_codec() -> Any:
    return _load_tool("bench_codec")


def test_the_gap_huffman_floor_is_an_optimal_code_of_the_exact_gaps() -> None:
    bench_codec = _bench_codec()
    assert bench_codec.huffman_mean_length([0.5, 0.25, 0.125, 0.125]) == 1.75  # dyadic: the entropy
    assert bench_codec.huffman_mean_length([0.4, 0.3, 0.3]) == pytest.approx(1.6)  # codes 0, 10, 11
    rng = np.random.default_rng(0)
    for experts, topk in ((64, 8), (128, 8), (16, 4)):
        # The gaps of uniform sets, counted: their Huffman code's mean length is the floor's.
        rows = np.sort(np.argsort(rng.random((40000, experts)), axis=1)[:, :topk], axis=1)
        gaps = np.diff(rows, axis=1, prepend=-1) - 1
        counts = np.bincount(gaps.ravel(), minlength=experts - topk + 1) / gaps.size
        sampled = topk * bench_codec.huffman_mean_length(list(counts)) / 8
        floor = bench_codec.gap_huffman_floor(experts, topk)
        assert floor == pytest.approx(sampled, rel=0.01)
        assert floor > entropy_bound_bytes(experts, topk)
    assert bench_codec.gap_huffman_floor(300, 8) is None


def test_bench_codec_measures_the_rows_a_store_holds_each_shared_prompt_once() -> None:
    """``--corpus`` measures the codec again on what a store holds: a GRPO group's prompt once, every response."""
    bench_codec = _bench_codec()
    model = synthetic_spec(layers=3, experts=16, topk=4)
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(0, 1000, 40)
    prompt = random_routing(rng, 40, 3, 16, 4)
    responses = [random_routing(rng, int(n), 3, 16, 4) for n in rng.integers(5, 20, 4)]
    url = f"memory://bench-codec-tests/{uuid.uuid4().hex}"
    with routelog.open_writer(url, step=0, model_spec=model) as writer:
        for i, response in enumerate(responses):
            writer.append(
                Record(
                    sample_id=f"group/{i}",
                    expert_ids=np.concatenate([prompt, response]),
                    prompt_len=40,
                    response_len=len(response),
                    token_ids=np.concatenate([prompt_ids, rng.integers(0, 1000, len(response))]),
                    group_id="group",
                )
            )
    stored = bench_codec.stored_routing(url)

    def token_rows(routing: np.ndarray) -> list[bytes]:  # each token's sets, in a comparable order
        return sorted(map(bytes, np.sort(routing, axis=-1).astype(np.uint8).reshape(len(routing), -1)))

    assert token_rows(stored) == token_rows(np.concatenate([prompt, *responses])), "the prompt once, every response"


def test_the_dictionary_cost_model_chooses_as_trial_compressions_do() -> None:
    """The constants the codec ships choose, per chunk layer of the corpus, within 1 % of the better of trial
    compressions with and without a dictionary, on the routing they were fitted to and on the held-out rows the
    corpus' store holds; and a dictionary pays somewhere there (the choice matters)."""
    result = _tool(str(TOOLS / "fit_dictionary_model.py"), "--quick", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["layers"]["record order"] > 0 and report["layers"]["as stored"] > 0
    for data in ("record order (fit)", "as stored (held out)"):
        shipped = report[data]["shipped"]
        assert shipped["chosen_vs_best"] <= 1.01 and shipped["agreement"] >= 0.9, data
        assert shipped["best_bytes"] < 0.95 * shipped["never_bytes"], f"{data}: dictionaries pay on qwen3moe"


def test_bench_dedup_compares_format_1_and_2_on_the_corpus() -> None:
    result = _tool(str(TOOLS / "bench_dedup.py"), "--quick", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(report["scenarios"]) == 16
    for name, scenario in report["scenarios"].items():
        v1, codec, in_part, both = (
            scenario[k]
            for k in (
                "format 1 (sorted_gaps)",
                "format 2 codec only",
                "format 2 dedup in part",
                "format 2 (codec + dedup)",
            )
        )
        assert v1["routed_rows"] == codec["routed_rows"] == both["routed_rows"], name
        assert both["stored_rows"] < codec["stored_rows"] == v1["stored_rows"], f"{name}: shared prefixes stored once"
        assert both["routing_bytes"] < v1["routing_bytes"], name
        if name.endswith("4 writers"):  # a group's samples are spread over writers and parts
            assert both["stored_rows"] < in_part["stored_rows"], f"{name}: shared across parts and writers"
        else:
            assert both["stored_rows"] == in_part["stored_rows"], f"{name}: one part holds everything"


def test_bench_writers_measures_what_a_writer_costs_an_engine_loop() -> None:
    pin = ["--pin"] if len(getattr(os, "sched_getaffinity", lambda _: ())(0)) >= 2 else []
    result = _tool(str(TOOLS / "bench_writers.py"), "--scheduler", "--quick", "--json", *pin)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["pinned"] == bool(pin)
    modes = ["writer in the engine process", "writer process"]
    assert list(report["overhead"]) == modes
    assert all(report["median_steps_per_second"][m] > 0 for m in ["no writer", *modes])
    assert all(0 < report["append_share"][m] < 1 for m in modes), "some time is spent appending, not all"
    for paired in ("paired_overhead", "paired_cpu_overhead"):
        assert list(report[paired]) == modes and all(report[paired][m] > 0 for m in modes)
    assert report["paired_null_test"]["median"] > 0 and report["paired_cpu_null_test"]["median"] > 0
    shares = report["writer_process_cpu_share"]  # where the writer process's CPU fell, as fractions
    assert list(shares) == ["with windows", "settles after them", "without windows and their settles"]
    assert sum(shares.values()) == pytest.approx(1.0) or not any(shares.values())
    assert all(0 < report["engine_cpu_share"][m] < 1 for m in modes), "the writer costs the engine some CPU"


def test_bench_integration_installs_what_the_dense_path_installs_reading_less() -> None:
    result = _tool(str(TOOLS / "bench_integration.py"), "--quick", "--json")
    assert result.returncode == 0, result.stderr
    full = json.loads(result.stdout)["full_step"]
    dense = full["veRL dense tensor"]
    ours = {name: side for name, side in full.items() if name.startswith("routelog")}
    assert list(ours) == [
        "routelog chunk_rows=4096",
        "routelog chunk_rows=256",
        "routelog chunk_rows=128, shard_layers=4",
    ]
    for name, side in ours.items():
        assert (side["checksum"], side["installed_rows"]) == (dense["checksum"], dense["installed_rows"]), name
    received = [side["bytes_received"] for side in ours.values()]
    assert received == sorted(received, reverse=True), "smaller chunks and per-stage shards read less"
    assert received[-1] < dense["bytes_received"] / 10


def test_the_kernel_fuzzer_builds_a_sanitized_kernel_and_finds_nothing() -> None:
    """tools/fuzz_kernels.py: the C kernels built with AddressSanitizer and UndefinedBehaviorSanitizer round-trip
    random chunks, take forged ones and audit random routing without a report (a few seconds here; longer runs by
    hand)."""
    done = _tool(str(TOOLS / "fuzz_kernels.py"), "--seconds", "4", "--seed", "7")
    assert done.returncode == 0, done.stderr[-3000:]
    counts = [int(word) for word in done.stdout.split() if word.isdigit()]
    assert "no sanitizer report" in done.stdout and counts[0] > 0 and counts[1] > 0 and counts[2] > 0, done.stdout


def test_the_archive_comparison_counts_every_object_of_the_store() -> None:
    """``archive`` writes the records and counts every byte the store holds (the log, commits, index, array
    metadata and shards): the sizes of the objects in the store, listed here on their own."""
    bench_codec = _bench_codec()
    spec = synthetic_spec(layers=3, experts=16, topk=4)
    rng = np.random.default_rng(5)
    records = bench_codec.token_dependent_records(rng, 600, spec, vocab_size=50, record_tokens=256)
    assert [len(r.token_ids) for r in records] == [256, 256, 88]
    result = bench_codec.archive([records[:2], records[2:]], spec)
    assert result["token_layers"] == 600 * 3
    for transform in ("ranked_context", "ranked_gaps"):
        written = result[transform]
        store = routelog.open_store(written["store"])
        assert store.steps() == [0, 1] and len(store.step(1).sample_ids) == 1
        assert {c.routing.transform for c in store.step(0).commits} == {transform}
        storage = store.storage
        listed = {path: storage.fs.size(path) for path in storage.fs.find(storage.root)}
        assert sum("/log/" in path for path in listed) >= 2, "each step's log is counted"
        assert written["store_every_byte"] == pytest.approx(sum(listed.values()) / 1800)
        routing = sum(size for path, size in listed.items() if "/routing/" in path)
        assert written["store_routing"] == pytest.approx(routing / 1800) and routing < sum(listed.values())
    assert not any(path.endswith("/routing/model") for path in listed), "format 2 stores no model"


def test_token_dependent_routing_takes_each_tokens_preferred_set() -> None:
    """Synthetic routing that depends on the token: a token id takes the same set in a layer about 60 % of the time
    (its preferred set), Zipf-distributed ids put the most mass on few of them, and every row is a top-k set."""
    spec = synthetic_spec(layers=4, experts=64, topk=8)
    rng = np.random.default_rng(3)
    ids = zipf_token_ids(rng, 40_000, 150_000)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 150_000
    counts = np.sort(np.unique(ids, return_counts=True)[1])[::-1]
    assert counts[:100].sum() > 0.3 * ids.size, "Zipf: a hundred ids of 150k carry a third of the tokens"
    routing = token_dependent_routing(rng, ids, spec)
    assert routing.shape == (40_000, 4, 8) and routing.dtype == np.uint8
    ordered = np.sort(routing, axis=-1)
    assert (ordered[..., 1:] > ordered[..., :-1]).all() and ordered.max() < 64
    present, uses_of = np.unique(ids, return_counts=True)
    frequent = uses_of.max()
    rows = ordered[ids == present[np.argmax(uses_of)]]
    for layer in range(4):
        _, uses = np.unique(rows[:, layer], axis=0, return_counts=True)
        assert 0.55 < uses.max() / frequent < 0.7, "the preferred set, 60 % of the time (and by chance a little more)"
    with pytest.raises(ValueError, match="preferred_share"):
        token_dependent_routing(rng, ids, spec, preferred_share=1.5)


def test_one_token_router_routes_every_record_of_a_step_alike() -> None:
    """Records routed by one TokenRouter share each id's preferred sets (as a trained router would); a router
    refuses ids it was not drawn for."""
    spec = synthetic_spec(layers=3, experts=32, topk=4)
    rng = np.random.default_rng(4)
    step = zipf_token_ids(rng, 2 * 3000, 500).reshape(2, 3000)
    router = TokenRouter.draw(rng, step, spec)
    first, second = (np.sort(router.route(rng, step[i], preferred_share=1.0), axis=-1) for i in range(2))
    common = np.intersect1d(step[0], step[1])[:20]
    assert common.size
    for token in common:
        at0, at1 = int(np.flatnonzero(step[0] == token)[0]), int(np.flatnonzero(step[1] == token)[0])
        np.testing.assert_array_equal(first[at0], second[at1])
    separate = [np.sort(token_dependent_routing(rng, step[i], spec, preferred_share=1.0), axis=-1) for i in range(2)]
    at0, at1 = (int(np.flatnonzero(step[i] == common[0])[0]) for i in range(2))
    assert not np.array_equal(separate[0][at0], separate[1][at1]), "separate calls draw separate routers"
    with pytest.raises(ValueError, match="not drawn for"):
        router.route(rng, np.array([150_001]))


def _explore_part_models() -> Any:
    return _load_tool("explore_part_models")


def test_a_token_table_predicts_every_row_of_a_token_seen_twice() -> None:
    """Where routing is a function of the token, the table predicts every row of each token id seen at least twice
    (one seen once is no entry); where it is not, it predicts next to nothing."""
    explore = _explore_part_models()
    rng = np.random.default_rng(9)
    keys = rng.integers(0, 300, 2000)
    per_token = np.sort(np.stack([rng.permutation(32)[:4] for _ in range(300 * 3)]).reshape(300, 3, 4), axis=-1)
    rows = per_token[keys].astype(np.uint8)
    seen = np.bincount(keys, minlength=300)
    model = explore.table_model(keys, rows, 32)
    assert model["hits"] == 3 * int(seen[seen >= 2].sum())
    assert model["bytes"] == model["table"] + model["flags"] + model["misses"]
    shuffled = np.sort(np.stack([rng.permutation(32)[:4] for _ in range(2000 * 3)]).reshape(2000, 3, 4), axis=-1)
    assert explore.table_model(keys, shuffled.astype(np.uint8), 32)["hits"] < 0.01 * rows.size / 4


def test_explore_part_models_sees_each_stored_row_with_its_token() -> None:
    """The parts' rows come back with the token id each was recorded with and the one before it; the quick run
    reports every candidate on both token-dependent sets."""
    explore = _explore_part_models()
    spec = synthetic_spec(layers=3, experts=16, topk=4)
    steps = [explore.token_dependent_records(np.random.default_rng(1), 700, spec, 40, 0.6, record_tokens=200)]
    url = f"memory://explore-tests/{uuid.uuid4().hex}"
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        for record in steps[0]:
            writer.append(record)

    def triples(tokens: np.ndarray, before: np.ndarray, rows: np.ndarray) -> set[tuple[int, int, bytes]]:
        ordered = np.sort(rows, axis=-1).astype(np.uint8)
        return {(int(t), int(b), bytes(r)) for t, b, r in zip(tokens, before, ordered, strict=True)}

    stored: set[tuple[int, int, bytes]] = set()
    for rows, tokens, before in explore.stored_parts(url):
        stored |= triples(tokens, before, rows)
    recorded: set[tuple[int, int, bytes]] = set()
    for record in steps[0]:
        ids = np.asarray(record.token_ids)
        recorded |= triples(ids, np.r_[-1, ids[:-1]], np.asarray(record.expert_ids))
    assert stored == recorded
    result = _tool(str(TOOLS / "explore_part_models.py"), "--quick", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert len(report) == 2
    for data in report.values():
        assert set(data["bytes_per_token_layer"]) == set(_explore_part_models().CANDIDATES)
        assert data["goal_zstd19_whole_array"] > 0 and 0 < data["predicted_share"]["token table"] < 1


def test_the_context_model_learns_what_the_token_decides() -> None:
    """Restarted at every row the context model knows nothing: each set costs K log2 E - log2 K! bits. Over rows
    that the token decides it pays for each token's first set and little after; adapting over the whole part never
    costs more than restarting every 4096 rows."""
    explore = _explore_part_models()
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 50, 6000)
    per_token = np.sort(np.stack([rng.permutation(32)[:4] for _ in range(50 * 2)]).reshape(50, 2, 4), axis=-1)
    rows = per_token[keys].astype(np.uint8)
    blind = explore.context_model_bits(rows, keys, 32, 1, False)
    assert blind == pytest.approx(6000 * 2 * (4 * np.log2(32) - np.log2(24)))
    for below in (False, True):
        learned = explore.context_model_bits(rows, keys, 32, None, below)
        chunked = explore.context_model_bits(rows, keys, 32, 4096, below)
        assert learned < blind / 20 and learned <= chunked


def test_bench_commits_counts_every_phase_and_commits_every_part() -> None:
    """Small sizes: each committer commits every part, and the requests of each phase are counted at the proxy."""
    result = _tool(
        str(TOOLS / "bench_commits.py"), "--writers", "3", "--parts", "2", "--committer", "own,shared", "--json"
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for row in report["scenarios"]:
        assert row["commits"] == row["expected_commits"] == 6 and row["failed_writers"] == 0
        assert set(row["phases"]) == {"open", "write", "reader", "seal", "sealed reader"}
        assert row["data_puts_per_commit"] == 3.0, "a part is three objects"
        assert row["sealed_reader_open_requests"] < row["reader_open_requests"]
    own, shared = report["scenarios"]
    assert shared["entries"] <= own["entries"] and shared["creates_per_entry"] == 1.0


def test_sim_commits_models_every_path_and_validates_against_a_benchmark_report(tmp_path: Path) -> None:
    """The model commits every part on each path at a small scale, and prints a benchmark's scenarios beside its
    own (``--validate``)."""
    result = _tool(
        str(TOOLS / "sim_commits.py"), "--writers", "8", "--parts", "2", "--paths", "shared,own,lanes,before", "--json"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["path"] for r in rows] == ["shared x1", "own", "lanes", "before"]
    assert all(r["commits"] == 16 and r["failed_parts"] == 0 for r in rows)
    shared = rows[0]
    assert shared["protocol_requests_per_commit"] < min(r["protocol_requests_per_commit"] for r in rows[1:])
    bench = {
        "latency_s": 0.03,
        "scenarios": [
            {"committer": "own", "writers": 4, "parts": 1, "requests_per_commit": 11.5, "creates_per_entry": 2.5}
        ],
    }
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    result = _tool(str(TOOLS / "sim_commits.py"), "--validate", str(tmp_path / "bench.json"), "--seeds", "1", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert rows[0]["what"] == "own (bench)" and 0.5 < rows[0]["requests_per_commit_ratio"] < 2
    assert any(r["what"].startswith("before") for r in rows), "the old protocol's measurements beside its model"


def test_bench_indexer_reports_its_goals_against_the_bound_and_zstd() -> None:
    """tools/bench_indexer.py --quick: the positions codec on the synthetic generator (95 % adjacent overlap) and on
    rows recorded from a tiny DeepSeek-V3.2-style model, each against the entropy bound and zstd-19 baselines of the
    same rows, measured in the same run."""
    done = _tool(str(TOOLS / "bench_indexer.py"), "--quick", "--traces", "--json", "--repeats", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    for part in (report, report["traces"]):
        assert part["encoded_bytes"] > 0 and part["bound_bytes"] > 0
        assert set(part["baselines"]) >= {"zstd-19 raw int32"}, part["baselines"].keys()
        assert part["ratios"]["size / bound"] == part["encoded_bytes"] / part["bound_bytes"]
    assert report["ratios"]["size / bound"] <= 1.1, "the codec is within 10 % of the generator's entropy"
    assert report["traces"]["model"]["lengths"] == [512, 1024]


def test_the_positions_fuzzer_builds_a_sanitized_coder_and_finds_nothing() -> None:
    """tools/fuzz_positions.py: the indexer positions coder built with AddressSanitizer and UndefinedBehaviorSanitizer
    round-trips random blocks and takes damaged ones without a report (a few seconds here)."""
    done = _tool(str(TOOLS / "fuzz_positions.py"), "--seconds", "4", "--seed", "7")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no sanitizer report" in done.stdout and " 0 blocks round-tripped" not in done.stdout, done.stdout


def test_bench_archive_archives_a_format_2_run_and_compares_with_zstd_19() -> None:
    ran = _tool(
        str(TOOLS / "bench_archive.py"),
        "--json",
        "--corpus",
        str(Path(__file__).parent / "fixtures" / "corpus" / "qwen3moe"),
        "--writers",
        "2",
        "--raw-mb",
        "4",
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    [size] = result["sizes"].values()
    assert size["verify_ok"] and size["records"] == 325
    assert size["archived_bytes"] < size["format2_bytes"] and size["reclaimed_bytes"] > 0
    assert size["every_byte_vs_zstd19"] == size["archived_bytes"] / size["zstd19_routing_and_tokens_bytes"]
    assert result["time"]["archive_s"] > 0 and 3.5 < result["time"]["raw_mb"] < 4.5
    assert [row["met"] for row in result["verdict"]] == [
        row["value"] <= row["limit"] for row in result["verdict"]
    ]  # judged on the figures printed beside them
