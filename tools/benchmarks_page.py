"""docs/benchmarks.md's results blocks, rendered from the tools' ``--json`` reports under docs/benchmarks/.

Each tool's block in the page sits between ``<!-- results:TOOL -->`` and ``<!-- /results:TOOL -->``: a compact
table of the report's headline figures, with the machine, the date and the exact command that produced it. The
prose around the blocks (the history of each figure) is written by hand and never touched.

    python tools/benchmarks_page.py --run bench_loader  # runs it, writes docs/benchmarks/bench_loader.json and the page
    python tools/benchmarks_page.py --run all           # every tool, one at a time
    python tools/benchmarks_page.py                     # rewrites every block from the JSON files
    python tools/benchmarks_page.py --check             # exit 1 if the page differs from what the JSON renders

A JSON file holds the tool's report as printed by ``--json`` (``report``), with the command, the date, the wall time
and the machine (CPU model from /proc/cpuinfo, cores) of the run (written by ``--run``).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "benchmarks"

Report = Any
"""A tool's ``--json`` output, as parsed: an object (a list of scenarios for ``sim_commits``)."""


@dataclass(frozen=True)
class Tool:
    """A benchmark: its cheapest honest command line, and what of its report the page shows."""

    name: str
    args: tuple[str, ...]
    render: Callable[[Report], list[str]]
    skipped: str = ""
    """Why the page holds no run of it (its cheapest run is longer than the page's budget), or empty."""

    @property
    def command(self) -> str:
        return shlex.join(["python", f"tools/{self.name}.py", *self.args])


# -- formatting ----------------------------------------------------------------------------------------------------
def num(value: Any, digits: int = 3) -> str:
    """A figure with ``digits`` significant digits (thousands separated), or a dash where the report has none."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    number = float(value)
    if number == 0:
        return "0"
    magnitude = abs(number)
    if magnitude >= 10 ** (digits - 1):
        return f"{number:,.0f}"
    text = f"{number:.{digits}g}"
    if "e" in text:
        return f"{number:.{digits - 1}e}"
    return text


def table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    """A markdown table."""
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# -- what each tool's block shows ---------------------------------------------------------------------------------
def met(flag: Any) -> str:
    return "-" if flag is None else ("met" if flag else "**not met**")


def render_cold_start(r: Report) -> list[str]:
    goals, ok = r.get("goals", {}), r.get("met", {})
    rows = [
        (
            "`import routelog`",
            f"{num(r['import_seconds'])} s, {num(r['import_rss_mb'])} MB",
            f"<= {goals.get('import_seconds')} s, <= {goals.get('import_rss_mb')} MB",
            met(ok.get("import_seconds", True) and ok.get("import_rss_mb", True)),
        ),
        (
            "`import numpy`, beside it",
            f"{num(r['numpy_import_seconds'])} s, {num(r['numpy_import_rss_mb'])} MB",
            "",
            "",
        ),
        (
            "a fresh install's first process / the next (create, write, read back)",
            f"{num(r['fresh_over_warm'])} x",
            f"<= {goals.get('fresh_over_warm')} x",
            met(ok.get("fresh_over_warm")),
        ),
        (
            "import + write one record",
            f"{num(r['import_and_write_one_record_seconds'])} s, {num(r['import_and_write_one_record_rss_mb'])} MB",
            "",
            "",
        ),
        (
            "one record read once the step is open (uncached; `np.load` of it)",
            f"{num(r['record_read_ms'])} ms ({num(r['record_read_uncached_ms'])}; {num(r['np_load_record_ms'])})",
            f"<= {goals.get('record_read_ms')} ms",
            met(ok.get("record_read_ms")),
        ),
        (
            "16-token records a second, one writer (a process's first thousand)",
            f"{num(r['small_records_per_second'])} ({num(r['small_records_per_second_first'])})",
            f">= {num(goals.get('small_records_per_second'))}",
            met(ok.get("small_records_per_second")),
        ),
    ]
    return table(("figure", "value", "goal", ""), rows)


CODEC_LAYOUTS = (
    "routelog",
    "routelog v1 (sorted_gaps)",
    "routelog --topk-order score",
    "zstd-3 per inner chunk",
    "zstd-3 raw uint8",
    "Parquet FSB zstd-3",
    "vLLM base64 .npy",
    "raw int16 .npy (veRL)",
    "SGLang base64 int32",
)


def render_codec(r: Report) -> list[str]:
    config = r["config"]
    lines = [
        f"{config['tokens']:,} tokens x {config['layers']} layers, top-{config['topk']} of {config['experts']}, "
        f"chunks of {config['chunk_rows']} rows; {config['repeats']} repeat(s), {config['rounds']} paired round(s). "
        "B per token-layer, and MB/s of raw routing:",
        "",
    ]
    datasets = r["datasets"]
    header = ["layout"] + [f"{name}: B, encode, decode" for name in datasets]
    rows = []
    for layout in CODEC_LAYOUTS:
        cells = [f"`{layout}`"]
        for data in datasets.values():
            result = data["results"].get(layout)
            cells.append(
                "-"
                if result is None
                else ", ".join(num(result[key]) for key in ("bytes_per_token_layer", "encode_MBps", "decode_MBps"))
            )
        rows.append(cells)
    rows.append(["entropy bound (B)"] + [num(d["entropy_bound_bytes_per_token_layer"]) for d in datasets.values()])
    lines += table(header, rows)
    lines += ["", "Goals (`verdict` in the JSON):", ""]
    lines += table(
        ("goal", "dataset", "value", "limit", ""),
        (
            (v["goal"], v["dataset"], num(v["value"]), f"{v['relation']} {v['limit']}", met(v["met"]))
            for v in r.get("verdict", [])
            if v.get("judged", True)
        ),
    )
    archive = r.get("archive") or {}
    if archive:
        lines += ["", "As an archive, every byte of the store, B per token-layer (write / read MB/s):", ""]
        rows = []
        for name, data in archive.items():
            context, gaps = data["ranked_context"], data["ranked_gaps"]
            rows.append(
                (
                    name,
                    f"{num(context['store_every_byte'])} ({num(context['write_MBps'])} / {num(context['read_MBps'])})",
                    f"{num(gaps['store_every_byte'])} ({num(gaps['write_MBps'])} / {num(gaps['read_MBps'])})",
                    num(data["zstd19_whole_routing"]),
                    num(context["store_every_byte_vs_zstd19_routing_and_tokens"]),
                )
            )
        lines += table(
            ("data", "`ranked_context`", "format 2", "zstd-19, whole array", "`ranked_context` / zstd-19 (+ tokens)"),
            rows,
        )
    return lines


def render_dedup(r: Report) -> list[str]:
    lines = [
        f"{r['model']}: {r['num_moe_layers']} MoE layers, top-{r['topk']} of {r['num_experts']}; B per routed "
        f"token-layer (goal: {r.get('goal', '-')}):",
        "",
    ]
    rows = []
    for name, s in r["scenarios"].items():
        rows.append(
            (
                name,
                num(s["format 1 (sorted_gaps)"]["bytes_per_token_layer"]),
                num(s["format 2 codec only"]["bytes_per_token_layer"]),
                num(s["format 2 dedup in part"]["bytes_per_token_layer"]),
                num(s["format 2 (codec + dedup)"]["bytes_per_token_layer"]),
                f"{num(s['v1_size_vs_v2'])} x",
                f"{num(s['dedup_write_time_vs_codec_only'])} x",
            )
        )
    return lines + table(
        (
            "scenario",
            "format 1",
            "format 2 codec only",
            "sharing in part",
            "format 2",
            "format 1 / 2",
            "write time / codec only",
        ),
        rows,
    )


def render_loader(r: Report) -> list[str]:
    c, mine, base = r["config"], r["routelog"], r["baseline_whole_step_int16_npy"]
    lines = [
        f"{c['records']} records x {c['tokens']} tokens x {c['layers']} layers, top-{c['topk']} of {c['experts']}; "
        f"{c['layout']}, rank {c['rank']}, {c['micro_batch_records']} records a micro-batch:",
        "",
    ]
    rows = [
        ("seconds", num(mine["seconds"]), num(base["seconds"]), f"{num(r['ratios']['time_baseline_over_routelog'])} x"),
        (
            "bytes read",
            num(mine["bytes_read"]),
            num(base["bytes_read"]),
            f"{num(r['ratios']['bytes_baseline_over_routelog'])} x",
        ),
        ("requests", num(mine["requests"]), num(base["requests"]), ""),
        (
            "peak RSS, MB",
            num(mine["peak_rss_mb"]),
            num(base["peak_rss_mb"]),
            f"{num(r['ratios']['peak_rss_baseline_over_routelog'])} x",
        ),
        ("steady micro-batches / s", num(mine.get("steady_micro_batches_per_s")), "", ""),
    ]
    return lines + table(("", "routelog", "whole step as int16 `.npy`", "baseline / routelog"), rows)


def render_integration(r: Report) -> list[str]:
    c = r["config"]
    lines = [
        f"{c['records']} records x {c['tokens']} tokens x {c['layers']} layers, top-{c['topk']} of {c['experts']}, "
        f"{c['routing']} routing; {c['layout']}, rank {c['rank']} (goal: {r.get('goal', '-')}):",
        "",
    ]
    rows = []
    for step in ("half_step", "full_step"):
        data = r[step]
        for name, v in data.items():
            if not isinstance(v, dict):
                continue
            rows.append(
                (
                    f"{data['records']} records",
                    name,
                    num(v["bytes_received"]),
                    f"{num(v['bytes_vs_own_share'])} x",
                    num(v.get("requests")),
                    num(v["peak_rss_mb"]),
                )
            )
    return lines + table(("step", "path", "bytes received", "/ own share", "requests", "peak RSS, MB"), rows)


def render_replay_hook(r: Report) -> list[str]:
    c = r["config"]
    lines = [
        f"{c['micro_batches']} micro-batches of {c['tokens_per_micro_batch']} tokens, {c['moe_layers']} MoE layers, "
        f"{c['rounds']} rounds (goal: {r.get('goal', '-')}):",
        "",
    ]
    rows = []
    for name, side in r["sides"].items():
        reads = side.get("device_reads") or {}
        rows.append(
            (
                name,
                num(side["seconds_per_micro_batch"] * 1000),
                f"{num(side['over_native'])} x",
                num(side["added_ms_per_micro_batch"]),
                num(reads.get("per_router_and_forward")),
                num(reads.get("per_step")),
            )
        )
    return lines + table(
        ("side", "ms / micro-batch", "/ native", "added ms", "device reads / router and forward", "/ step"), rows
    )


def render_writers(r: Report) -> list[str]:
    c = r["config"]
    base, zstd = r["np_save_local"]["MBps"], r["zstd3_per_record_local"]["MBps"]
    lines = [
        f"{c['records_per_writer']} records a writer x {c['tokens']} tokens x {c['layers']} layers, top-{c['topk']} "
        f"of {c['experts']}, {c['routing']} routing, parts of {c['flush_mb']} MiB; MB/s of raw routing. One core, "
        f"local disk: `np.save` {num(base)} MB/s, zstd-3 per record {num(zstd)} MB/s.",
        "",
    ]
    rows = []
    for target in ("local", "s3_moto"):
        for w in r[target]:
            rows.append(
                (
                    "local disk" if target == "local" else "S3 (moto)",
                    num(w["writers"]),
                    num(w["MBps"]),
                    f"{num(w['MBps'] / base)} x",
                    f"{num(w['MBps'] / zstd)} x",
                    num(w["peak_rss_mb_per_writer"]),
                    f"{num(w['rss_above_before_over_flush'])} x",
                )
            )
    lines += table(
        ("target", "writers", "MB/s", "/ `np.save`", "/ zstd-3", "peak RSS a writer, MB", "RSS above start / flush"),
        rows,
    )
    goals = r.get("goals", {})
    threads = goals.get("one_writer_over_zstd3_per_record_by_encode_threads") or {}
    lines += [
        "",
        f"Goals: one writer / zstd-3 per record **{num(goals.get('one_writer_over_zstd3_per_record'))} x** (>= 1; "
        f"per CPU second {num(goals.get('one_writer_over_zstd3_per_record_per_cpu_second'))} x); peak RSS above its "
        f"start **{num(goals.get('peak_rss_above_before_over_flush_buffer'))} x** the flush buffer (<= 2). "
        + "; ".join(f"`encode_threads={n}`: {num(v)} x zstd-3" for n, v in threads.items())
        + ("." if threads else ""),
    ]
    return lines


def render_audit(r: Report) -> list[str]:
    c = r["config"]
    lines = [
        f"{c['records']} records x {c['tokens']} tokens x {c['layers']} layers, top-{c['topk']} of {c['experts']} "
        f"({c['token_rows']:,} token rows a step):",
        "",
    ]
    names = {
        "read_only": "read only (the yardstick)",
        "stats": "`stats`",
        "diff": "`diff` (two steps)",
        "stats_ray2": "`stats`, Ray (2 CPUs)",
        "diff_ray2": "`diff`, Ray (2 CPUs)",
    }
    ratio = {
        "stats": "stats_vs_read_only",
        "diff": "diff_vs_read_only",
        "stats_ray2": "stats_ray2_vs_single",
        "diff_ray2": "diff_ray2_vs_single",
    }
    goals = r.get("goals", {})
    rows = []
    for key, label in names.items():
        if key not in r:
            continue
        goal = goals.get(ratio.get(key, "read_only_M_tokens_per_s"))
        rows.append(
            (
                label,
                num(r[key]["tokens_per_s"] / 1e6),
                num(r[key]["seconds"]),
                num(r[key]["peak_rss_mb"]),
                "" if key not in ratio else f"{num(r['ratios'][ratio[key]])} x",
                "" if goal is None else f">= {goal['goal']}: {met(goal['met'])}",
            )
        )
    lines += table(
        ("pass", "M tokens/s", "s", "peak RSS, MB", "ratio (to read only; Ray: to one process)", "goal"), rows
    )
    return lines


def render_archive(r: Report) -> list[str]:
    rows = [
        (
            name,
            f"{d['records']:,}",
            f"{d['zstd19_routing_and_tokens_bytes']:,}",
            f"{num(d['format2_vs_zstd19'])} x",
            f"{num(d['fresh_archive_codec_vs_zstd19'])} x",
            f"**{num(d['every_byte_vs_zstd19'])} x**",
            "sound" if d["verify_ok"] else "**unsound**",
        )
        for name, d in r["sizes"].items()
    ]
    lines = [
        "Every byte of a run written in format 2, sealed, archived and gc'd past the grace, against zstd-19 of its raw "
        "routing plus its token ids (goal <= 1.0 x):",
        "",
        *table(
            ("corpus, writers", "records", "zstd-19 B", "format 2", "fresh, archive codec", "archived", "verify"),
            rows,
        ),
        "",
    ]
    t = r["time"]
    goal = next(v for v in r["verdict"] if v["goal"].startswith("archive time"))
    lines += table(
        ("raw routing", "fresh archive-codec write", "format-2 write", "archive", "archive / fresh", "goal"),
        [
            (
                f"{num(t['raw_mb'])} MB",
                f"{num(t['fresh_archive_codec_write_s'])} s",
                f"{num(t['format2_write_s'])} s",
                f"{num(t['archive_s'])} s ({num(t['archive_MBps'])} MB/s)",
                f"{num(t['archive_vs_fresh_time'])} x",
                f"<= {goal['limit']}: {met(goal['met'])}",
            )
        ],
    )
    return lines


def render_commits(r: Report) -> list[str]:
    lines = [f"{num(r['latency_s'] * 1000)} ms added to every request (moto S3 behind the fault proxy):", ""]
    rows = []
    for s in r["scenarios"]:
        rows.append(
            (
                s["committer"],
                f"{s['writers']} x {s['parts']}",
                f"{s['commits']}/{s['expected_commits']}",
                num(s["failed_writers"]),
                f"{num(s['requests_per_commit'])} ({num(s['protocol_requests_per_commit'])} + "
                f"{num(s['data_puts_per_commit'])})",
                num(s["creates_per_entry"]),
                num(s["entries"]),
                f"{num(s['append_p50_s'])} / {num(s['append_p99_s'])} s",
                num(s["reader_open_requests"]),
                num(s["seal_requests"]),
                num(s["sealed_reader_open_requests"]),
            )
        )
    return lines + table(
        (
            "committer",
            "N x P",
            "commits done",
            "failed writers",
            "requests / commit (protocol + data)",
            "creates / entry",
            "entries",
            "append p50 / p99",
            "reader open (unsealed)",
            "seal",
            "reader open (sealed)",
        ),
        rows,
    )


def render_sim(r: Report) -> list[str]:
    rows = []
    for s in r:  # the report is a list of scenarios
        if s.get("skipped"):
            rows.append((s["path"], f"{s['writers']} x {s['parts']}", f"not modelled ({s['skipped']})", *[""] * 5))
            continue
        opened = s.get("reader_open_s")
        rows.append(
            (
                s["path"],
                f"{s['writers']} x {s['parts']}",
                f"{s['commits']}/{s['expected_commits']}",
                f"{num(s['requests_per_commit'])} ({num(s['protocol_requests_per_commit'])})",
                num(s["creates_per_entry"]),
                f"{num(s['drain_s'])} s",
                f"{num(s['append_p50_s'])} / {num(s['append_p99_s'])} s",
                "" if opened is None else f"{num(opened)} s, {num(s.get('reader_open_requests'))} requests",
            )
        )
    lines = ["Modelled: S3 at 30 ms a request, log-normal jitter, per-prefix request rates:", ""]
    return lines + table(
        (
            "path",
            "N x P",
            "commits done",
            "requests / commit (protocol)",
            "creates / entry",
            "drain",
            "append p50 / p99",
            "reader open of the step",
        ),
        rows,
    )


def render_indexer(r: Report) -> list[str]:
    def row(part: Report, label: str) -> tuple[str, ...]:
        ratios, speeds = part["ratios"], part["speeds_mpos_s"].get("compiled", {})
        return (
            label,
            f"{num(ratios['size / bound'])} x ({part['bound_kind']})",
            f"{num(100 * ratios['size / raw'])} %",
            " / ".join(f"{num(b['vs_codec'])} x" for b in part["baselines"].values()),
            f"{num(speeds.get('encode_mpos_s'))} / {num(speeds.get('decode_mpos_s'))}",
        )

    g = r["generator"]
    rows = [row(r, f"synthetic, k = {g['k']} over {g['tokens']:,} tokens, {100 * g['overlap']:.0f} % adjacent overlap")]
    if "traces" in r:
        m = r["traces"]["model"]
        lengths = ", ".join(str(n) for n in m["lengths"])
        rows.append(
            row(
                r["traces"],
                f"tiny random DeepSeek-V3.2-style model, prefills of {lengths} tokens, index_topk {m['index_topk']}",
            )
        )
    goals = (
        "Goals: size <= 1.1 x the bound and <= 2.5 % of the raw int32 rows; encode >= 50, decode >= 200 M positions/s"
        " a core."
    )
    header = (
        "rows",
        "size / bound",
        "size / raw int32",
        "zstd-19 of raw / row XOR / row gaps, vs routelog",
        "encode / decode, M positions/s",
    )
    return [goals, "", *table(header, rows)]


# -- running a tool ------------------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """The CPU model (/proc/cpuinfo) and the cores this process may run on."""
    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": len(os.sched_getaffinity(0))}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def snapshot(revision: str, into: Path) -> str:
    """The committed tree of ``revision`` under ``into``, with the compiled extension modules of the working tree
    (built by pip from C sources that must equal the revision's); returns the commit's short hash. Benchmarks run
    there, so that edits in progress in the working tree neither break nor colour them."""
    commit = git("rev-parse", "--short=12", revision)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    for module in sorted((ROOT / "routelog").rglob("*.so")):
        source = module.with_name(module.name.split(".", 1)[0] + ".c")
        relative = source.relative_to(ROOT).as_posix()
        if subprocess.run(["git", "diff", "--quiet", commit, "--", relative], cwd=ROOT, check=False).returncode:
            raise SystemExit(f"{relative} differs from {commit}'s: rebuild (pip install -e .) at that revision first")
        target = into / module.relative_to(ROOT)
        target.write_bytes(module.read_bytes())
    return commit


def run(tool: Tool, timeout: float, revision: str = "HEAD") -> Path:
    """Run the tool's command on ``revision``'s tree and write its report, with how it ran, as JSON."""
    with tempfile.TemporaryDirectory(prefix="routelog-benchmarks-page-") as scratch:
        tree = Path(scratch)
        commit = snapshot(revision, tree)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        load = round(os.getloadavg()[0], 2)  # other work on the machine as the run starts
        started = datetime.datetime.now(datetime.UTC)
        clock = time.perf_counter()
        argv = [sys.executable, f"tools/{tool.name}.py", *tool.args]
        with subprocess.Popen(
            argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        ) as process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the tool's own child processes too
                process.communicate()
                raise SystemExit(f"{tool.command} ran past {timeout:.0f} s: stopped") from None
        seconds = time.perf_counter() - clock
    if process.returncode != 0:
        raise SystemExit(f"{tool.command} failed (exit {process.returncode}):\n{stderr[-4000:]}")
    report = json.loads(stdout)
    out = RESULTS / f"{tool.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    envelope = {
        "tool": tool.name,
        "command": tool.command,
        "commit": commit,
        "date": started.strftime("%Y-%m-%d"),
        "seconds": round(seconds, 1),
        "machine": machine(),
        "load_average": load,
        "report": report,
    }
    out.write_text(json.dumps(envelope, indent=1) + "\n")
    return out


TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        Tool("bench_cold_start", ("--json",), render_cold_start),
        Tool(
            "bench_codec",
            ("--corpus", "tests/fixtures/corpus/qwen3moe", "tests/fixtures/corpus/deepseekv3", "--json"),
            render_codec,
        ),
        Tool("bench_dedup", ("--json",), render_dedup),
        Tool("bench_loader", ("--json",), render_loader),
        Tool("bench_writers", ("--json",), render_writers),
        Tool("bench_integration", ("--json",), render_integration),
        Tool("bench_replay_hook", ("--json",), render_replay_hook),
        Tool("bench_audit", ("--json",), render_audit),
        Tool("bench_archive", ("--json", "--raw-mb", "256"), render_archive),
        Tool("bench_commits", ("--json",), render_commits),
        Tool("sim_commits", ("--json",), render_sim),
        Tool("bench_indexer", ("--json", "--traces"), render_indexer),
    )
}
"""Every tool the page has a block for, with the command its JSON comes from, in the page's order."""


# -- the page ------------------------------------------------------------------------------------------------------
BLOCK = re.compile(r"<!-- results:(?P<name>[a-z_]+) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)


def block(tool: Tool) -> str:
    """The block's body as the tool's JSON file renders it."""
    if tool.skipped:
        return f"Not run for this page: {tool.skipped}\n"
    path = RESULTS / f"{tool.name}.json"
    if not path.exists():
        raise SystemExit(f"{path.relative_to(ROOT)} is missing: python tools/benchmarks_page.py --run {tool.name}")
    envelope = json.loads(path.read_text())
    m = envelope["machine"]
    head = (
        f"`{envelope['command']}` at commit `{envelope['commit']}`, {envelope['date']}, {m['cpu']} "
        f"({m['cores']} cores), {envelope['seconds']:.0f} s"
        + (f", load average {envelope['load_average']} as it started:" if "load_average" in envelope else ":")
    )
    return "\n".join([head, "", *tool.render(envelope["report"])]) + "\n"


def render(page: str) -> str:
    """The page with every tool's block rendered from its JSON file."""
    found = [match["name"] for match in BLOCK.finditer(page)]
    unknown = sorted(set(found) - set(TOOLS))
    missing = sorted(set(TOOLS) - set(found))
    if unknown or missing or len(found) != len(set(found)):
        raise SystemExit(
            f"{PAGE.relative_to(ROOT)}: blocks of unknown tools {unknown}, tools without a block "
            f"{missing}, or a tool with two blocks ({found})"
        )

    def body(match: re.Match[str]) -> str:
        name = match["name"]
        return f"<!-- results:{name} -->\n{block(TOOLS[name])}<!-- /results:{name} -->"

    return BLOCK.sub(body, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the JSON renders")
    parser.add_argument(
        "--run", nargs="+", metavar="TOOL", help="run these tools (or 'all'), write their JSON, then the page"
    )
    parser.add_argument("--revision", default="HEAD", help="--run: the committed tree the tools run on")
    parser.add_argument("--timeout", type=float, default=300.0, help="--run: seconds a tool may take")
    args = parser.parse_args(argv)
    if args.run:
        names = [name for name, tool in TOOLS.items() if not tool.skipped] if args.run == ["all"] else args.run
        for name in names:
            if name not in TOOLS or TOOLS[name].skipped:
                parser.error(f"{name}: not a tool this page runs ({', '.join(TOOLS)})")
            print(f"{TOOLS[name].command} ...", file=sys.stderr, flush=True)
            print(run(TOOLS[name], args.timeout, args.revision).relative_to(ROOT))
    page = PAGE.read_text()
    rendered = render(page)
    if args.check:
        if rendered == page:
            return 0
        diff = difflib.unified_diff(
            page.splitlines(keepends=True), rendered.splitlines(keepends=True), "docs/benchmarks.md", "rendered"
        )
        sys.stdout.writelines(diff)
        print(f"{PAGE.relative_to(ROOT)} differs from its JSON: run python tools/benchmarks_page.py", file=sys.stderr)
        return 1
    if rendered != page:
        PAGE.write_text(rendered)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
