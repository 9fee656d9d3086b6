"""Every operational error through the real command line: one line on stderr naming the fix, the documented exit
code, a traceback only with ``--debug``; and what does not exist is refused, never printed as an empty result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import routelog
from routelog import __version__
from routelog.cli.main import EXIT_STORAGE, EXIT_USAGE
from tests.not_installed import run_without


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "routelog", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
        check=False,
    )


def _one_line_error(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


SYNTH = ("--records", "2", "--tokens", "8", "--layers", "2", "--experts", "8", "--topk", "2")


def test_s3_without_credentials(s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env |= {
        "HOME": str(tmp_path),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    result = _cli("inspect", f"s3://{s3_bucket}/run", env=env)
    _one_line_error(result, EXIT_STORAGE, "no usable credentials", "AWS_ACCESS_KEY_ID", "--storage-options")


def test_s3_missing_bucket(s3_endpoint: str) -> None:
    for command in (("inspect",), ("synth", *SYNTH)):
        result = _cli(command[0], "s3://no-such-bucket/run", *command[1:])
        _one_line_error(result, EXIT_USAGE, "bucket 'no-such-bucket' does not exist", s3_endpoint)


def test_s3_unreachable_endpoint_fails_fast_naming_it(s3_endpoint: str) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    result = _cli("ls", "s3://bucket/run", "--step", "0", env=env)
    _one_line_error(result, EXIT_STORAGE, f"cannot reach the S3 endpoint {endpoint}", "AWS_ENDPOINT_URL")
    options = json.dumps({"endpoint_url": endpoint})
    via_options = _cli("inspect", "s3://bucket/run", "--storage-options", options)
    _one_line_error(via_options, EXIT_STORAGE, endpoint, "--storage-options")


def test_s3_url_that_is_an_object(s3_endpoint: str, s3_bucket: str) -> None:
    """As a local file is refused, an object is: neither read as an empty store nor written under."""
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key="notes.txt", Body=b"not a store")
    url = f"s3://{s3_bucket}/notes.txt"
    _one_line_error(_cli("inspect", url), EXIT_USAGE, "is an object", "prefix")
    _one_line_error(_cli("synth", url, *SYNTH), EXIT_USAGE, "is an object")
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=s3_bucket)
    assert [o["Key"] for o in listed.get("Contents", [])] == ["notes.txt"], "nothing written under it"


def test_url_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("not a store")
    _one_line_error(_cli("inspect", str(path)), EXIT_USAGE, "is a file")
    _one_line_error(_cli("synth", str(path), *SYNTH), EXIT_USAGE, "is a file")
    _one_line_error(_cli("synth", str(path / "below"), *SYNTH), EXIT_USAGE, "not a directory")
    assert path.read_text() == "not a store"


def test_a_url_with_one_slash_is_refused_not_taken_as_a_local_path(tmp_path: Path) -> None:
    """``s3:/bucket``, ``s3//bucket`` (or ``memory:name``) would be a relative local path, a directory named ``s3:``
    written beside the user's work: refused, naming the URL meant. A local name with a colon or a double slash that is
    no filesystem's stays a path."""
    for command, meant in (
        (("inspect", "s3:/bad/store"), "s3://bad/store"),
        (("inspect", "s3//bad/store"), "s3://bad/store"),
        (("synth", "memory:store", *SYNTH), "memory://store"),
        (("synth", "gcs//bucket/run", *SYNTH), "gcs://bucket/run"),
    ):
        _one_line_error(_cli(*command, cwd=tmp_path), EXIT_USAGE, "is no URL", meant)
    assert list(tmp_path.iterdir()) == []
    for local in ("run:1", "./s3//bucket", "runs//s3"):
        result = _cli("synth", local, *SYNTH, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert (tmp_path / local / "routelog.json").exists()


def test_missing_input_and_output_paths(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    missing = _cli("ingest", str(tmp_path / "nope.jsonl"), "--engine", "vllm", "--to", url, "--step", "0")
    _one_line_error(missing, EXIT_USAGE, "nope.jsonl: no such input file")
    assert _cli("synth", url, *SYNTH).returncode == 0
    out = tmp_path / "no-dir" / "x.npy"
    _one_line_error(_cli("cat", url, "--step", "0", "--sample", "000000", "--npy", str(out)), EXIT_USAGE, "no-dir")


def test_invalid_writer_id_creates_nothing(tmp_path: Path) -> None:
    url = tmp_path / "run"
    result = _cli("synth", str(url), "--writer-id", "a/b c", *SYNTH)
    _one_line_error(result, EXIT_USAGE, "writer id 'a/b c'", "letters, digits")
    assert not url.exists()


def test_what_does_not_exist_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    assert _cli("synth", url, *SYNTH).returncode == 0
    for args in (
        ("ls", url, "--step", "99"),
        ("stats", url, "--step", "99"),
        ("drift", url, "--step", "0", "--step", "99"),
        ("diff", url, url, "--step", "99"),
        ("diff", url, url, "--step", "0", "--step-b", "99"),
        ("convert", url, "--to", "moe", "--step", "99", str(tmp_path / "x.npz")),
        ("cat", url, "--step", "99", "--sample", "000000", "--npy", str(tmp_path / "x.npy")),
    ):
        _one_line_error(_cli(*args), EXIT_USAGE, "no step 99", "its steps are [0]")
    _one_line_error(_cli("cat", url, "--step", "0", "--sample", "nope", "--npy", "x.npy"), EXIT_USAGE, "'nope'")
    _one_line_error(_cli("mismatch", url), EXIT_USAGE, "logprob_infer", "logprob_train", "Store.annotate")

    sealed = _cli("seal", url, "--step", "7")
    _one_line_error(sealed, EXIT_USAGE, "step 7", "no records", "--allow-empty")
    assert routelog.open_store(url).steps() == [0], "a refused seal leaves no trace"
    allowed = _cli("seal", url, "--step", "7", "--allow-empty", "--json")
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["records"] == 0

    empty = str(tmp_path / "empty")
    routelog.create_store(empty, routelog.open_store(url).model_spec)
    for args in (("stats", empty), ("mismatch", empty), ("drift", empty), ("ls", empty, "--step", "0")):
        line = _one_line_error(_cli(*args), EXIT_USAGE)
        assert "no records yet" in line or "no steps yet" in line, line
    with pytest.raises(routelog.RecordNotFoundError, match="no step 99"):
        routelog.open_store(url).step(99)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    plain = _cli("inspect", missing)
    _one_line_error(plain, EXIT_USAGE, "no routelog store")
    for result in (
        _cli("--debug", "inspect", missing),
        _cli("inspect", missing, env={**os.environ, "ROUTELOG_DEBUG": "1"}),
    ):
        assert result.returncode != 0
        assert "Traceback" in result.stderr and "StoreNotFoundError" in result.stderr


def test_version_and_usage_errors() -> None:
    version = _cli("--version")
    assert version.returncode == 0 and __version__ in version.stdout and "format" in version.stdout
    _one_line_error(_cli("ls"), EXIT_USAGE, "Missing argument", "routelog ls --help")
    _one_line_error(_cli("no-such-command"), EXIT_USAGE, "no-such-command")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--records", "-3"), ("'--records'", "greater than or equal to 1")),
        (("--tokens", "0"), ("'--tokens'",)),
        (("--experts", "70000"), ("'--experts'", "65536")),
        (("--topk", "0"), ("'--topk'",)),
        (("--bogus",), ("No such option: --bogus", "synth --help")),
    ],
)
def test_a_users_mistake_is_a_one_line_usage_error(
    tmp_path: Path, args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    """Never "internal error ... please report it": a bad option value is exit 2, one line, what to change; and
    nothing is created."""
    url = tmp_path / "run"
    line = _one_line_error(_cli("synth", str(url), *args), EXIT_USAGE, *words)
    assert "internal error" not in line and not url.exists()


def test_a_figure_path_is_checked_before_any_work(tmp_path: Path) -> None:
    url = str(tmp_path / "run")
    assert _cli("synth", url, *SYNTH).returncode == 0
    _one_line_error(_cli("stats", url, "--plot", str(tmp_path / "x.txt")), EXIT_USAGE, "x.txt", ".png, .svg, .pdf")
    assert not (tmp_path / "x.txt").exists()


def test_debug_anywhere_keeps_the_exit_code_and_json_failures_reach_stdout(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    for args in (("--debug", "inspect", missing), ("inspect", missing, "--debug")):
        result = _cli(*args)
        assert result.returncode == EXIT_USAGE, result.stderr  # the code the plain run has
        assert "Traceback" in result.stderr and result.stderr.rstrip().splitlines()[-1].startswith("error: ")
    failed = _cli("inspect", missing, "--json")
    assert failed.returncode == EXIT_USAGE
    document = json.loads(failed.stdout)
    assert document["exit_code"] == EXIT_USAGE and "no routelog store" in document["error"]


def test_messages_keep_their_brackets(tmp_path: Path) -> None:
    """Printed without markup: ``routelog[s3]`` stays whole (a rich console would eat ``[s3]``)."""
    spec = tmp_path / "spec.json"
    spec.write_text("{")
    result = _cli("synth", str(tmp_path / "run"), "--model-spec", str(spec), "--sample-prefix", "[x]")
    line = _one_line_error(result, EXIT_USAGE)
    assert str(spec) in line
    code = "import sys; from routelog.cli.main import _fail; _fail(\"pip install 'routelog[s3]'\", 2)"
    captured = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "routelog[s3]" in captured.stderr and captured.returncode == EXIT_USAGE


def test_an_output_path_the_os_refuses_names_the_path_and_the_fix(tmp_path: Path) -> None:
    golden = Path(__file__).parent / "fixtures" / "golden-v2" / "grpo-96"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = _cli("cat", str(golden), "--step", "0", "--sample", "g0/0", "--npy", str(blocker / "out.npy"))
    _one_line_error(result, EXIT_USAGE, str(blocker / "out.npy"), "choose a path under a directory")


QWEN_CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"num_hidden_layers": 2**31 - 1}, "num_hidden_layers"),
        ({"num_hidden_layers": -4}, "num_hidden_layers"),
        ({"num_hidden_layers": "4"}, "num_hidden_layers"),
        ({"num_experts": 70000}, "num_experts"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ],
)
def test_out_of_range_hf_config_is_a_usage_error(tmp_path: Path, update: dict[str, object], field: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**QWEN_CONFIG, **update}))
    line = _one_line_error(_cli("spec", "--hf-config", str(config)), EXIT_USAGE, repr(field), "config.json")
    assert "internal error" not in line and "pydantic" not in line


def test_bad_model_specs_reach_no_store(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**QWEN_CONFIG, "num_experts": 70000}))
    url = tmp_path / "run"
    _one_line_error(_cli("synth", str(url), "--model-spec", str(config), "--records", "1"), EXIT_USAGE, "num_experts")
    responses = tmp_path / "responses.jsonl"
    responses.write_text("")
    ingest = _cli(
        "ingest", str(responses), "--engine", "vllm", "--to", str(url), "--step", "0", "--model-spec", str(config)
    )
    _one_line_error(ingest, EXIT_USAGE, "num_experts", "65536")
    # an integer literal too long for Python to parse (over 4300 digits), and a routelog spec JSON over the limits
    config.write_text('{"model_type": "qwen3_moe", "num_hidden_layers": ' + "9" * 5000 + "}")
    _one_line_error(_cli("spec", "--hf-config", str(config)), EXIT_USAGE, str(config))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"num_layers": 2, "moe_layers": [0, 1], "num_experts": 2048, "topk": 2000}))
    _one_line_error(_cli("synth", str(url), "--model-spec", str(spec), "--records", "1"), EXIT_USAGE, "topk", "1024")
    assert not url.exists()


def _numeric_options() -> list[tuple[str, Any]]:
    """Every numeric option of every command (ints, floats and lists of them), from the Typer app itself."""
    import typer

    from routelog.cli import app

    group = typer.main.get_command(app)
    found = []
    for name, command in sorted(group.commands.items()):  # type: ignore[attr-defined]
        for param in command.params:
            annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            if annotation in (int, float, list[int], list[float]):
                found.append((f"{name} {param.opts[0]}", (command, param, annotation)))
    return found


NUMERIC_OPTIONS = _numeric_options()


@pytest.mark.parametrize("option", [o for _, o in NUMERIC_OPTIONS], ids=[n for n, _ in NUMERIC_OPTIONS])
def test_every_numeric_option_refuses_values_out_of_its_range_before_the_command_runs(option: Any) -> None:
    """Each command's numeric options declare their range, and a value outside it (or NaN) is refused while the
    command line is parsed: exit 2 naming the option, before the command writes anything (``synth --skew -5`` once
    wrote records and then died with "internal error")."""
    import typer

    command, param, annotation = option
    assert param.min is not None and param.max is not None, f"{param.opts[0]} declares no range"
    floats = annotation in (float, list[float])
    below = param.min - (0.5 if floats else 1)
    above = param.max + (0.5 if floats else 1)
    context = command.make_context(command.name, [], resilient_parsing=True)
    hostile = [str(below), str(above), *(["nan", "inf"] if floats else ["1.5"])]
    for value in hostile:
        given = [value] if param.multiple else value
        with pytest.raises(typer.BadParameter):
            param.process_value(context, given)
    given = [str(param.min)] if param.multiple else str(param.min)
    param.process_value(context, given)  # the bound itself is allowed


@pytest.mark.parametrize("option", ["--skew -5", "--locality 1.5", "--logprob-noise -1", "--tokens 1", "--records 0"])
def test_synth_out_of_range_exits_2_in_one_line_and_writes_nothing(tmp_path: Path, option: str) -> None:
    url = tmp_path / "store"
    result = subprocess.run(
        [sys.executable, "-m", "routelog", "synth", str(url), *option.split(), "--records", "2"]
        if option != "--records 0"
        else [sys.executable, "-m", "routelog", "synth", str(url), "--records", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and option.split(maxsplit=1)[0] in result.stderr
    assert not url.exists(), "nothing is written"


def test_a_failed_output_leaves_no_file_and_an_empty_input_is_refused_naming_it(tmp_path: Path) -> None:
    """Outputs are whole or absent: a convert that fails half-way leaves no file a later command would read as
    "no records"; and ingesting an input that holds no records is a usage error naming the file, not "0 new"."""
    url = str(tmp_path / "store")
    assert _cli("synth", url, *SYNTH).returncode == 0  # records without token ids
    out = tmp_path / "out.jsonl"
    _one_line_error(_cli("convert", url, "--to", "vllm", "--step", "0", str(out)), EXIT_USAGE, "token ids")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"], "no output, not even a temporary one"

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    result = _cli("ingest", str(empty), "--engine", "vllm", "--to", url, "--step", "1")
    _one_line_error(result, EXIT_USAGE, str(empty), "no records")
    assert json.loads(_cli("inspect", url, "--json").stdout)["steps"] == [0], "nothing was written"


def test_a_missing_optional_package_is_a_usage_error_naming_the_install_command(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    assert _cli("synth", url, *SYNTH, "--logprob-noise", "0.1").returncode == 0
    result = run_without(("matplotlib",), "-m", "routelog", "mismatch", url, "--plot", "m.png", tmp_path=tmp_path)
    _one_line_error(result, EXIT_USAGE, "matplotlib is not installed", "pip install 'routelog[plot]'")
    assert not (tmp_path / "m.png").exists()


def test_credentials_in_a_url_and_an_unknown_storage_option_are_one_line_usage_errors() -> None:
    """Both once ended in "internal error" (exit 4), the first quoting botocore's message with the secret in it."""
    url = "s3://AKIAEXAMPLEKEY:SeCrEtVaLuE123@bucket/run"
    for args in (("inspect", url), ("ls", url, "--step", "0"), ("inspect", url, "--debug")):
        result = _cli(*args)
        if "--debug" not in args:  # (which adds the traceback: it too shows the URL redacted only)
            _one_line_error(result, EXIT_USAGE, "s3://***@bucket/run", "--storage-options", "AWS_ACCESS_KEY_ID")
        assert result.returncode == EXIT_USAGE and "s3://***@bucket/run" in result.stderr, result.stderr
        assert "AKIAEXAMPLEKEY" not in result.stdout + result.stderr, result.stderr
        assert "SeCrEtVaLuE123" not in result.stdout + result.stderr, result.stderr
    options = json.dumps({"endpont_url": "http://127.0.0.1:9000"})
    result = _cli("inspect", "s3://bucket/run", "--storage-options", options)
    _one_line_error(result, EXIT_USAGE, "'endpont_url'", "did you mean 'endpoint_url'?")
