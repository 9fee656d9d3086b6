"""A re-run never breaks a store: the retries users make (fix a line and run again, Ctrl-C and run again, run twice)
through the real command line, and repair with ``drop`` + ``gc``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import routelog
from routelog.format import keys
from routelog.store.gc import collect_garbage

from .test_engines import DSV3, truth, vllm_022_choice

RECORDS = 6


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "routelog", *args], capture_output=True, text=True, timeout=180, check=False
    )


def _line(i: int, *, broken: bool = False) -> str:
    ids = truth(DSV3, 8 + i, seed=i)
    routed = vllm_022_choice(DSV3, ids)
    choice = {
        "index": 0,
        "token_ids": list(range(ids.shape[0] - 4)),
        "routed_experts": routed[:-8] if broken else routed,
    }
    request = {"prompt": [1, 2, 3, 4], "metadata": {"uid": f"u{i}"}}
    return json.dumps({"request": request, "response": {"id": f"cmpl-{i}", "choices": [choice]}})


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "spec.json"
    path.write_text(DSV3.model_dump_json())
    return path


def _ingest(log: Path, url: str, spec_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["ingest", str(log), "--engine", "vllm", "--to", url, "--step", "0", "--model-spec", str(spec_file)]
    return _cli(*args, "--sample-id-field", "request.metadata.uid", *extra)


def _each_once(url: str, count: int) -> None:
    store = routelog.open_store(url)
    snapshot = store.step(0)
    assert sorted(snapshot.sample_ids) == sorted(f"u{i}" for i in range(count))
    assert snapshot.shadowed == []
    assert store.verify().ok


def test_fix_a_bad_line_and_run_again(tmp_path: Path, spec_file: Path) -> None:
    """Validation comes first: a bad line writes nothing (not even the store); after the fix the ingest writes
    everything, and a third run adds nothing."""
    log = tmp_path / "rollouts.jsonl"
    url = str(tmp_path / "store")
    log.write_text("\n".join(_line(i, broken=i == 3) for i in range(RECORDS)) + "\n")
    failed = _ingest(log, url, spec_file)
    assert failed.returncode == 2
    assert f"{log}:4" in failed.stderr and "nothing was written" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1, failed.stderr
    assert not (tmp_path / "store").exists(), "a failed validation creates no store"

    log.write_text("\n".join(_line(i) for i in range(RECORDS)) + "\n")
    fixed = _ingest(log, url, spec_file, "--json")
    assert fixed.returncode == 0, fixed.stderr
    report = json.loads(fixed.stdout)
    assert (report["new"], report["already_present"]) == (RECORDS, 0)
    again = json.loads(_ingest(log, url, spec_file, "--json").stdout)
    assert (again["new"], again["already_present"]) == (0, RECORDS)
    assert again["writer_id"] == report["writer_id"], "the default writer id follows from the input"
    _each_once(url, RECORDS)


def test_partial_ingest_then_the_fixed_input(tmp_path: Path, spec_file: Path) -> None:
    log = tmp_path / "rollouts.jsonl"
    url = str(tmp_path / "store")
    log.write_text("\n".join(_line(i, broken=i == 2) for i in range(RECORDS)) + "\n")
    partial = _ingest(log, url, spec_file, "--partial", "--json")
    assert partial.returncode == 1, "some input was left out: exit 1, the valid records written"
    report = json.loads(partial.stdout)
    assert report["new"] == RECORDS - 1 and len(report["invalid"]) == 1 and f"{log}:3" in report["invalid"][0]
    log.write_text("\n".join(_line(i) for i in range(RECORDS)) + "\n")
    rest = json.loads(_ingest(log, url, spec_file, "--json").stdout)
    assert (rest["new"], rest["already_present"]) == (1, RECORDS - 1)
    assert f"0 new, {RECORDS} already present" in _ingest(log, url, spec_file).stderr
    _each_once(url, RECORDS)


def test_on_duplicate_error_refuses_a_rerun(tmp_path: Path, spec_file: Path) -> None:
    log = tmp_path / "rollouts.jsonl"
    url = str(tmp_path / "store")
    log.write_text("\n".join(_line(i) for i in range(2)) + "\n")
    assert _ingest(log, url, spec_file).returncode == 0
    refused = _ingest(log, url, spec_file, "--on-duplicate", "error")
    assert refused.returncode == 2 and "already committed" in refused.stderr
    _each_once(url, 2)


def _interruptible(*args: str) -> subprocess.Popen[str]:
    """``routelog <args>`` started as a terminal starts it, with Ctrl-C's default: a session started in the
    background (nohup, `cmd &` in a script) ignores Ctrl-C, and so would the command it starts (an ignored signal
    stays ignored across exec)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "routelog", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        signal.signal(signal.SIGINT, previous)


def test_synth_twice_and_after_ctrl_c(tmp_path: Path) -> None:
    """Ctrl-C in the middle of a write says what was committed and how to resume; the same command then completes
    the step with every record exactly once."""
    url = str(tmp_path / "run")
    args = ["synth", url, "--records", "6000", "--tokens", "64", "--layers", "4", "--experts", "16", "--topk", "2"]
    args += ["--flush-bytes", "20000"]
    proc = _interruptible(*args)
    log = tmp_path / "run" / keys.log_dir(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not (log.exists() and any(log.iterdir())):
        time.sleep(0.05)
    assert proc.poll() is None, "the write finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted:" in err and "run the same command again to resume" in err
    assert "Traceback" not in err
    committed = len(routelog.open_store(url).step(0))
    assert 0 < committed < 6000
    assert f"{committed} records committed" in err

    resumed = _cli(*args, "--json")
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["already_present"] == committed and report["new"] == 6000 - committed
    store = routelog.open_store(url)
    snapshot = store.step(0)
    assert len(snapshot) == 6000 and len(set(snapshot.sample_ids)) == 6000 and snapshot.shadowed == []
    assert json.loads(_cli(*args, "--json").stdout)["new"] == 0
    assert store.verify().ok


@pytest.mark.parametrize("delay", [0.0, 0.15, 0.4, 0.8, 1.5, 2.5])
def test_ctrl_c_at_any_point_of_a_long_synth_ends_it_within_5_s(tmp_path: Path, delay: float) -> None:
    """SIGINT lands between records, never inside the writer's locks (a KeyboardInterrupt there left a lock held and
    the command hanging for ever): sent at many points of a long run, the command ends at once with the usual
    line, and what it committed reads back."""
    url = str(tmp_path / "run")
    args = ["synth", url, "--records", "200000", "--tokens", "32", "--layers", "4", "--experts", "16", "--topk", "2"]
    proc = _interruptible(*args, "--flush-bytes", "20000")
    log = tmp_path / "run" / keys.log_dir(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and not (log.exists() and any(log.iterdir())):
        time.sleep(0.02)
    time.sleep(delay)
    assert proc.poll() is None, "the write finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("Ctrl-C did not end the command within 30 s")
    took = time.monotonic() - sent
    assert proc.returncode == 130 and "run the same command again to resume" in err, err
    # Well under a second when the machine is idle (the goal is 5 s); the bound leaves room for a loaded test
    # machine while still failing the hang this test is about.
    assert took < 10.0, f"Ctrl-C took {took:.1f} s to end the command"
    committed = len(routelog.open_store(url).step(0))
    assert f"{committed} records committed" in err


def test_ctrl_c_in_the_demo_says_what_it_left_and_how_to_start_over(tmp_path: Path) -> None:
    """Interrupted once its first store exists, ``routelog demo`` exits 130 naming the store it had begun and the
    command that starts over; no traceback."""
    out = tmp_path / "demo"
    proc = _interruptible("demo", "--quick", "--out", str(out))
    stores = out / "store"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (stores.exists() and any(stores.iterdir())):
        time.sleep(0.05)
    assert proc.poll() is None, "the demo finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    first = sorted(p.name for p in stores.iterdir() if not p.name.endswith("-train"))[0]
    assert "interrupted: routelog demo stopped" in err and first in err, err
    assert f"routelog demo --out {out}" in err and "Traceback" not in err
    assert not (out / "report.png").exists()


def test_drop_then_gc_reclaims_and_as_of_shows_the_past(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    base = ["--layers", "2", "--experts", "8", "--topk", "2", "--tokens", "12"]
    assert _cli("synth", url, "--records", "4", "--writer-id", "good", *base).returncode == 0
    assert _cli("synth", url, "--records", "3", "--sample-prefix", "bad-", "--writer-id", "bad", *base).returncode == 0
    store = routelog.open_store(url)
    before = max(c.created_at for c in store.step(0).commits)
    time.sleep(0.01)

    unknown = _cli("drop", url, "--step", "0", "--sample", "nope")
    assert unknown.returncode == 2 and "nope" in unknown.stderr
    one = _cli("drop", url, "--step", "0", "--sample", "000001", "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["drop"]["sample_ids"] == ["000001"]
    writer = _cli("drop", url, "--step", "0", "--writer", "bad", "--reason", "wrong model")
    assert writer.returncode == 0, writer.stderr

    now = store.step(0)
    assert sorted(now.sample_ids) == ["000000", "000002", "000003"]
    past = json.loads(_cli("ls", url, "--step", "0", "--as-of", before.isoformat(), "--json").stdout)
    assert len(past) == 7, "a view as of before the drops still shows every record"
    bad_part = next(c.part for c in store.step(0, as_of=before).commits if c.writer_id == "bad")

    assert store.verify().ok
    collect_garbage(store, 0, delete=True, force=True, now=time.time() + 7200)
    assert not (tmp_path / "run" / keys.part_dir(0, bad_part)).exists(), "gc reclaims the dropped writer's part"
    assert sorted(routelog.open_store(url).step(0).sample_ids) == ["000000", "000002", "000003"]
    assert routelog.open_store(url).verify().ok
