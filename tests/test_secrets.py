"""Credentials never show: a store URL carrying them in its userinfo is refused when a store is opened or created,
in one line naming the URL redacted and where credentials go instead, by every command that takes a URL and by the
API; URLs in messages and reprs are redacted on every scheme; a secret given as a storage option appears in no
message or repr; an unknown storage option is a usage error naming it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import routelog
from routelog.cli.main import EXIT_USAGE, main
from routelog.errors import CredentialsInUrlError, StoreError
from routelog.store.storage import Storage
from routelog.synth import SynthConfig, synth_records, synthetic_spec
from routelog.urls import has_userinfo, redact_url

KEY, SECRET = "AKIAEXAMPLEKEY", "SeCrEtVaLuE123"
SECRET_URL = f"s3://{KEY}:{SECRET}@bucket/run"
SPEC = synthetic_spec(2, 8, 2)


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command line in this process (as ``routelog ARGS``): its exit code, stdout and stderr."""
    saved = sys.argv
    sys.argv = ["routelog", *args]
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        sys.argv = saved
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code: int, out: str, err: str, expected: int, *words: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expected, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    assert KEY not in out + err and SECRET not in out + err, out + err
    return lines[0]


def _takes_a_url(param: Any) -> bool:
    """A parameter holding a store URL: a string whose help names a URL or a store."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    help_text = param.help or ""
    return annotation in (str, str | None) and bool(re.search(r"\bURL\b|\bstore\b", help_text))


def _value(param: Any, tmp_path: Path) -> str:
    """A harmless value for a required parameter that is no URL (the command fails on the URL first)."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    help_text = param.help or ""
    if annotation is int:
        return "0"
    if annotation in (Path, list[Path]):
        suffix = re.search(r"\.[a-z]+\b", help_text)
        path = tmp_path / f"{param.name}{suffix.group(0) if suffix else '.json'}"
        if annotation == list[Path]:  # an input
            path.write_text("{}\n")
        return str(path)
    return help_text.split(" | ")[0] if " | " in help_text else "a"  # a choice: its first


def _url_commands() -> list[tuple[str, str]]:
    """Every (command, URL parameter) of the Typer app."""
    import typer

    from routelog.cli import app

    group = typer.main.get_command(app)
    return [
        (name, param.name)
        for name, command in sorted(group.commands.items())  # type: ignore[attr-defined]
        for param in command.params
        if _takes_a_url(param)
    ]


URL_COMMANDS = _url_commands()


@pytest.fixture(scope="module")
def good_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A store with a step of records: what the other URL of a two-store command names."""
    url = str(tmp_path_factory.mktemp("good") / "store")
    with routelog.open_writer(url, 0, model_spec=SPEC) as writer:
        for record in synth_records(SPEC, SynthConfig(records=2, tokens=8)):
            writer.append(record)
    return url


def test_every_url_command_is_found() -> None:
    """The control: the commands the brief names are among those found."""
    commands = {name for name, _ in URL_COMMANDS}
    assert {"inspect", "ls", "cat", "verify", "seal", "gc", "drop", "synth", "ingest", "diff", "drift"} <= commands
    assert ("drift", "other") in URL_COMMANDS and ("diff", "url_b") in URL_COMMANDS


@pytest.mark.parametrize(("command", "parameter"), URL_COMMANDS, ids=[f"{c}-{p}" for c, p in URL_COMMANDS])
def test_a_url_with_credentials_is_refused_in_one_line_that_never_shows_them(
    command: str, parameter: str, good_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``s3://KEY:SECRET@bucket/run`` once ended ``routelog inspect`` in "internal error" (exit 4) quoting botocore's
    message with the secret in it. Every other URL of the command line is a real store, so the command reaches
    this one."""
    import typer

    from routelog.cli import app

    cli = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    args: list[str] = [command]
    for param in cli.params:
        if param.name == parameter:
            value = SECRET_URL
        elif _takes_a_url(param) and param.required:
            value = good_store
        elif param.required:
            value = _value(param, tmp_path)
        else:
            continue
        args += [value] if param.param_type_name == "argument" else [param.opts[0], value]
    args += {"drop": ["--sample", "a"], "demo": ["--out", str(tmp_path / "demo")]}.get(command, [])
    line = _one_line(*_run(capsys, *args), EXIT_USAGE, "s3://***@bucket/run", "storage_options", "AWS_")
    assert "--storage-options" in line


@pytest.mark.parametrize(
    "url",
    [
        SECRET_URL,
        f"s3://{KEY}@bucket/run",
        f"s3://{KEY}:{SECRET[:4]}/{SECRET[4:]}@bucket/run",  # AWS secret keys hold '/'
        f"s3:/{KEY}:{SECRET}@bucket/run",  # a mistyped URL is refused for its credentials first
        f"file://{KEY}:{SECRET}@/tmp/run",
        f"memory://{KEY}:{SECRET}@bucket/run",
    ],
)
def test_the_api_refuses_credentials_in_a_url_with_a_typed_error_that_never_shows_them(url: str) -> None:
    calls = (
        lambda: routelog.open_store(url),
        lambda: routelog.create_store(url, SPEC),
        lambda: routelog.ProcessWriter(url, 0, model_spec=SPEC),  # before its process starts
    )
    for call in calls:
        with pytest.raises(CredentialsInUrlError) as caught:
            call()
        shown = f"{caught.value} {caught.value!r} {caught.value.args}"
        assert KEY not in shown and SECRET not in shown and SECRET[4:] not in shown, shown
        assert "***@" in shown and "storage_options" in shown and "AWS_ACCESS_KEY_ID" in shown
        assert isinstance(caught.value, StoreError) and caught.value.__cause__ is None


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (SECRET_URL, "s3://***@bucket/run"),
        (f"file://{KEY}:{SECRET}@/tmp/run", "file://***@/tmp/run"),
        (f"http://{KEY}:{SECRET}@minio:9000/b", "http://***@minio:9000/b"),
        (f"sftp://{KEY}@host/run", "sftp://***@host/run"),
        (f"s3://{KEY}:ab/{SECRET}@bucket/run", "s3://***@bucket/run"),
        ("s3://bucket/run@v2", "s3://bucket/run@v2"),  # an '@' in a key is no userinfo
        ("http://host:9000/a@b", "http://host:9000/a@b"),
        ("/data/run:1@v2", "/data/run:1@v2"),  # nor in a plain path
        ("file:///data/model@v2", "file:///data/model@v2"),
    ],
)
def test_urls_are_shown_with_their_userinfo_redacted_on_every_scheme(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert has_userinfo(url) == (shown != url)


def test_a_secret_in_the_storage_options_shows_in_no_repr_or_message(tmp_path: Path) -> None:
    """Credentials passed the right way stay hidden: the storage's repr once listed its options, secret included."""
    options = {"key": KEY, "secret": SECRET, "endpoint_url": "http://127.0.0.1:1"}
    with pytest.raises(StoreError) as unreachable:  # nothing listens there: the message names the endpoint only
        routelog.open_store("s3://bucket/run", storage_options=options)
    with pytest.raises(StoreError) as unknown:
        routelog.open_store("s3://bucket/run", storage_options={**options, "endpont_url": "http://x"})
    storage = Storage.open(str(tmp_path / "store"), {"use_listings_cache": False})
    storage.storage_options = options  # as an S3 store's would be: only its repr is asked
    shown = " ".join(
        [str(unreachable.value), repr(unreachable.value), str(unknown.value), repr(unknown.value), repr(storage)]
    )
    assert KEY not in shown and SECRET not in shown, shown
    assert repr(storage) == f"Storage({str(tmp_path / 'store')!r})"


@pytest.mark.parametrize(
    ("url", "taker"),
    [("s3://bucket/run", "S3FileSystem"), ("{tmp}/store", "LocalFileSystem"), ("memory://x/run", "MemoryFileSystem")],
)
def test_an_unknown_storage_option_is_a_usage_error_naming_it(
    url: str, taker: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``endpont_url`` once ended in "internal error" (exit 4) on S3, and was silently ignored on local disk."""
    url = url.format(tmp=tmp_path)
    options = json.dumps({"endpont_url": "http://127.0.0.1:9000"})
    line = _one_line(*_run(capsys, "inspect", url, "--storage-options", options), EXIT_USAGE, "'endpont_url'", taker)
    if taker == "S3FileSystem":
        assert "did you mean 'endpoint_url'?" in line
    with pytest.raises(StoreError, match="unknown storage option 'endpont_url'"):
        routelog.create_store(url, SPEC, storage_options={"endpont_url": "http://127.0.0.1:9000"})


def test_known_storage_options_are_still_taken(tmp_path: Path) -> None:
    """The check reads the filesystems' own signatures: what they take passes, s3fs's session options included."""
    routelog.create_store(str(tmp_path / "store"), SPEC, storage_options={"auto_mkdir": True})
    routelog.create_store("memory://secrets/known", SPEC, storage_options={"skip_instance_cache": True})
    from routelog.store.storage import _check_storage_options

    _check_storage_options("s3://b/r", "s3", {"endpoint_url": "x", "anon": True, "profile": "p", "max_paths": 4})
