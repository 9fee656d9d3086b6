"""Cold start benchmark: what a process pays before and on its first records, routelog vs the simplest tools.

Every measurement runs in a fresh process (medians of ``--repeats``), with its baseline measured in the same run:

* ``import routelog`` (time and peak RSS) next to ``import numpy``;
* a **fresh install**: a process that creates a store, writes one step and reads it back, run from a new copy of
  the installed package (its modules not yet compiled to bytecode, its extension as pip built it: what the first
  process after ``pip install -e .`` finds; pip compiles the dependencies' bytecode when it installs them), against
  the same copy's next run (``warm``). Nothing else is cached between runs: the kernels are compiled at install.
  The goal: the first run at most 1.2 times the warm one;
* **import + write one record** (time and peak RSS);
* **one record read** once the step is open (``StepSnapshot.read``), records in order (four share each chunk:
  the snapshot keeps the chunks it decoded) and with the snapshot's chunk cache off (each read decompresses every
  chunk it touches), next to ``np.load`` of the record's routing saved as one ``.npy`` file;
* **a thousand 16-token records** written by one writer once it is open (records per second, from the first
  append to the commit of the last): a process's second thousand (the goal), and its first (whose part loads the
  modules a first part needs).

    python tools/bench_cold_start.py [--json] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import routelog

GOALS = {
    "import_seconds": 0.25,
    "import_rss_mb": 50.0,
    "fresh_over_warm": 1.2,
    "record_read_ms": 1.0,
    "small_records_per_second": 5000.0,
}

_RSS = textwrap.dedent(
    """
    def _rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    """
)

IMPORT = (
    "import time; t = time.perf_counter(); import {module}; s = time.perf_counter() - t\n"
    + _RSS
    + ("print(__import__('json').dumps({{'seconds': s, 'rss_mb': _rss()}}))")
)

WORKLOAD = _RSS + textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import routelog
    from routelog.synth import synthetic_spec
    url, records, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spec = synthetic_spec(8, 128, 8)
    rng = np.random.default_rng(0)
    draws = [rng.random((tokens, 8, 128), np.float32) for _ in range(records)]
    ids = [np.argsort(draw, axis=-1)[..., :8].astype(np.uint8) for draw in draws]
    t1 = time.perf_counter()
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        for n in range(records):
            writer.append(routelog.Record(sample_id=f"r{n}", expert_ids=ids[n], prompt_len=4, response_len=tokens - 4))
    t2 = time.perf_counter()
    snapshot = routelog.open_store(url).step(0)
    got = snapshot.read_many([f"r{n}" for n in range(records)])
    t3 = time.perf_counter()
    assert len(got) == records
    print(json.dumps({"seconds": t3 - t0, "write": t2 - t1, "read": t3 - t2, "rss_mb": _rss()}))
    """
)

ONE_RECORD = _RSS + textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import numpy as np
    import routelog
    from routelog.synth import synthetic_spec
    spec = synthetic_spec(8, 128, 8)
    ids = np.argsort(np.random.default_rng(0).random((512, 8, 128)), axis=-1)[..., :8].astype(np.uint8)
    with routelog.open_writer(sys.argv[1], 0, model_spec=spec) as writer:
        writer.append(routelog.Record(sample_id="r0", expert_ids=ids, prompt_len=4, response_len=508))
    print(json.dumps({"seconds": time.perf_counter() - t0, "rss_mb": _rss()}))
    """
)

READS = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import routelog
    from routelog.synth import synthetic_spec
    url, npy = sys.argv[1], sys.argv[2]
    spec = synthetic_spec(48, 128, 8)
    rng = np.random.default_rng(1)
    ids = [np.argsort(rng.random((1024, 48, 128), np.float32), axis=-1)[..., :8].astype(np.uint8) for _ in range(64)]
    with routelog.open_writer(url, 0, model_spec=spec) as writer:
        for n in range(64):
            writer.append(routelog.Record(sample_id=f"r{n}", expert_ids=ids[n], prompt_len=24, response_len=1000))
    np.save(npy, np.sort(ids[7], axis=-1).astype(np.int16))
    def per_read(chunk_budget):
        snapshot = routelog.open_store(url).step(0)
        snapshot._index_cache.chunk_budget = chunk_budget
        snapshot.read("r63")  # the snapshot's index and shard indexes are read once
        times = []
        for n in range(63):  # in order: four records share each chunk
            t = time.perf_counter(); snapshot.read(f"r{n}"); times.append(time.perf_counter() - t)
        return times
    times, uncached = per_read(32 << 20), per_read(0)
    loads = []
    for _ in range(40):
        t = time.perf_counter(); np.load(npy); loads.append(time.perf_counter() - t)
    median = lambda values: sorted(values)[len(values) // 2] * 1e3
    print(json.dumps({"read_ms": median(times), "uncached_read_ms": median(uncached), "np_load_ms": median(loads)}))
    """
)

SMALL = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import routelog
    from routelog.synth import synthetic_spec
    url, count = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(2)
    small = np.argsort(rng.random((count, 16, 8, 128), np.float32), axis=-1)[..., :8].astype(np.uint8)
    rates = []
    for step in range(2):  # the process's first thousand (its first part: modules load), then the next
        writer = routelog.open_writer(url, step, model_spec=synthetic_spec(8, 128, 8))
        t = time.perf_counter()
        with writer:
            for n in range(count):
                writer.append(routelog.Record(sample_id=f"s{n}", expert_ids=small[n], prompt_len=4, response_len=12))
        rates.append(count / (time.perf_counter() - t))
    print(json.dumps({"first_records_per_second": rates[0], "records_per_second": rates[1]}))
    """
)


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    # -P: the copy on PYTHONPATH, not the current directory, provides routelog
    done = subprocess.run(
        [sys.executable, "-P", "-c", code, *args], capture_output=True, text=True, env=env, check=False, timeout=600
    )
    if done.returncode:
        raise RuntimeError(f"benchmark process failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(run[key] for run in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per measurement (median)")
    parser.add_argument("--records", type=int, default=64, help="records of the fresh/warm workload")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per record of the fresh/warm workload")
    args = parser.parse_args()
    out: dict[str, Any] = {"machine": os.uname().machine, "cpus": os.cpu_count(), "goals": GOALS}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        imports = {m: [_run(IMPORT.format(module=m)) for _ in range(args.repeats)] for m in ("routelog", "numpy")}
        out["import_seconds"] = _median(imports["routelog"], "seconds")
        out["import_rss_mb"] = _median(imports["routelog"], "rss_mb")
        out["numpy_import_seconds"] = _median(imports["numpy"], "seconds")
        out["numpy_import_rss_mb"] = _median(imports["numpy"], "rss_mb")

        fresh, warm = [], []
        installed = Path(routelog.__file__).parent
        for n in range(args.repeats):  # a new copy each time: its first run compiles routelog's bytecode
            copy = root / f"install-{n}"
            shutil.copytree(installed, copy / "routelog", ignore=shutil.ignore_patterns("__pycache__"))
            env = dict(os.environ, PYTHONPATH=str(copy))
            workload = (WORKLOAD, str(root / f"fresh-{n}"), str(args.records), str(args.tokens))
            fresh.append(_run(*workload, env=env))
            warm.append(_run(WORKLOAD, str(root / f"warm-{n}"), *workload[2:], env=env))
        for name, runs in (("fresh", fresh), ("warm", warm)):
            for key in ("seconds", "write", "read", "rss_mb"):
                out[f"{name}_{key}"] = _median(runs, key)
        out["fresh_over_warm"] = out["fresh_seconds"] / out["warm_seconds"]

        one = [_run(ONE_RECORD, str(root / f"one-{n}")) for n in range(args.repeats)]
        out["import_and_write_one_record_seconds"] = _median(one, "seconds")
        out["import_and_write_one_record_rss_mb"] = _median(one, "rss_mb")

        reads = _run(READS, str(root / "reads"), str(root / "record.npy"))
        out["record_read_ms"] = reads["read_ms"]
        out["record_read_uncached_ms"] = reads["uncached_read_ms"]
        out["np_load_record_ms"] = reads["np_load_ms"]
        small = [_run(SMALL, str(root / f"small-{n}"), "1000") for n in range(args.repeats)]
        out["small_records_per_second"] = _median(small, "records_per_second")
        out["small_records_per_second_first"] = _median(small, "first_records_per_second")
    out["met"] = {
        "import_seconds": out["import_seconds"] <= GOALS["import_seconds"],
        "import_rss_mb": out["import_rss_mb"] <= GOALS["import_rss_mb"],
        "fresh_over_warm": out["fresh_over_warm"] <= GOALS["fresh_over_warm"],
        "record_read_ms": out["record_read_ms"] <= GOALS["record_read_ms"],
        "small_records_per_second": out["small_records_per_second"] >= GOALS["small_records_per_second"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"machine: {out['machine']}, {out['cpus']} CPUs; medians of {args.repeats} fresh processes")
    print(
        f"import routelog: {out['import_seconds']:.3f} s, {out['import_rss_mb']:.0f} MB "
        f"(import numpy: {out['numpy_import_seconds']:.3f} s, {out['numpy_import_rss_mb']:.0f} MB; "
        f"goal <= {GOALS['import_seconds']} s, <= {GOALS['import_rss_mb']:.0f} MB)"
    )
    print(
        f"create + write + read {args.records} x {args.tokens} tokens: fresh install {out['fresh_seconds']:.2f} s, "
        f"warm {out['warm_seconds']:.2f} s: {out['fresh_over_warm']:.2f} x (goal <= {GOALS['fresh_over_warm']})"
    )
    print(
        f"import + write one record: {out['import_and_write_one_record_seconds']:.2f} s, "
        f"{out['import_and_write_one_record_rss_mb']:.0f} MB peak RSS"
    )
    print(
        f"one record read (1024 tokens x 48 layers) once the step is open, records in order: "
        f"{out['record_read_ms']:.2f} ms (goal <= {GOALS['record_read_ms']} ms); without the snapshot's chunk cache "
        f"(every read decompresses its chunks): {out['record_read_uncached_ms']:.2f} ms; np.load of the record as one "
        f".npy: {out['np_load_record_ms']:.2f} ms"
    )
    print(
        f"1000 records of 16 tokens, one writer: {out['small_records_per_second']:.0f} records/s "
        f"(goal >= {GOALS['small_records_per_second']:.0f}); a process's first thousand: "
        f"{out['small_records_per_second_first']:.0f} records/s"
    )


if __name__ == "__main__":
    main()
