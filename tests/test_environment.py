"""Configuration from the environment is input: every ``ROUTELOG_*`` variable is read by one typed accessor of
:mod:`routelog.environment`, and a value it does not take is refused with a typed error naming the variable, the
value and the values it takes, when the integration installs its hooks (never turned into a default, never at the
first step). And a veRL engine whose install failed is never handed out unpatched."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import routelog
from routelog.errors import EnvironmentVariableError, ReplayConfigError, RoutelogError

CREDENTIALS = "s3://AKIAEXAMPLEKEY:SeCrEtVaLuE123@bucket/run"
SHAPES = ["", "../x", "rank 0"]
"""Refused by every variable: empty (unset it instead), a path out of the working directory, a space."""
NUMBERS = ["nan", "inf", "-1", "abc"]
"""Refused by every variable but the writer id (to which they are names)."""
BAD: dict[str, list[str]] = {
    "ROUTELOG_URL": [*SHAPES, "store", " s3://bucket/run", "s3://bucket/run\n", CREDENTIALS],
    "ROUTELOG_FIDELITY_WRITER": [*SHAPES, "a" * 65, "a/b", "a.b", "rank\t0", "é"],
    "ROUTELOG_MAX_ROUTER_DIFF": [*SHAPES, *NUMBERS, "-inf", "NaN", "1.0001", "-0.1", "2", "0.5.1", "1e400"],
    "ROUTELOG_POLICY_VERSIONS": [*SHAPES, *NUMBERS, "latest", "step-", "step-x", "step+1", "step--1", "step-²"],
    "ROUTELOG_SLIME_ROLLOUT_FUNCTION": [*SHAPES, *NUMBERS, "generate", "pkg..fn", "pkg.fn.", ".pkg.fn", "1pkg.fn"],
    "ROUTELOG_KERNELS": [*SHAPES, *NUMBERS, "nump", "compiled", " numpy"],
    "ROUTELOG_DEBUG": [*SHAPES, *NUMBERS, "2", "yes please", "0 "],
}
GOOD: dict[str, list[tuple[str, Any]]] = {
    "ROUTELOG_URL": [(u, u) for u in ("s3://bucket/run", "/abs/store", "file:///abs/store", "memory://x/run")],
    "ROUTELOG_FIDELITY_WRITER": [("train", "train"), ("rank-0_a", "rank-0_a"), ("a" * 64, "a" * 64)],
    "ROUTELOG_MAX_ROUTER_DIFF": [("0", 0.0), ("1", 1.0), ("0.2", 0.2), ("1e-1", 0.1)],
    "ROUTELOG_POLICY_VERSIONS": [("step", "step"), ("any", "any")],
    "ROUTELOG_SLIME_ROLLOUT_FUNCTION": [("my_pkg.rollout.generate", "my_pkg.rollout.generate"), ("a.b", "a.b")],
    "ROUTELOG_KERNELS": [("numpy", "numpy"), ("NumPy", "numpy"), ("auto", "auto")],
    "ROUTELOG_DEBUG": [("1", True), ("true", True), ("on", True), ("0", False), ("False", False), ("off", False)],
}
UNSET: dict[str, Any] = {
    "ROUTELOG_URL": None,
    "ROUTELOG_FIDELITY_WRITER": None,
    "ROUTELOG_MAX_ROUTER_DIFF": None,
    "ROUTELOG_POLICY_VERSIONS": "step",
    "ROUTELOG_SLIME_ROLLOUT_FUNCTION": None,
    "ROUTELOG_KERNELS": "auto",
    "ROUTELOG_DEBUG": False,
}


def _accessor(name: str) -> tuple[Callable[[], Any], Any]:
    """The variable's accessor and its table entry."""
    from routelog import environment

    accessors = {
        environment.URL: environment.store_url,
        environment.FIDELITY_WRITER: environment.fidelity_writer,
        environment.MAX_ROUTER_DIFF: environment.max_router_diff,
        environment.POLICY_VERSIONS: environment.policy_versions,
        environment.SLIME_ROLLOUT_FUNCTION: environment.slime_rollout_function,
        environment.KERNELS: environment.kernels,
        environment.DEBUG: environment.debug,
    }
    variable = next(v for v in accessors if v.name == name)
    return accessors[variable], variable


def _assert_refusal(error: BaseException, name: str, value: str) -> None:
    """The message names the variable, the value (redacted) and the values the variable takes."""
    from routelog import environment
    from routelog.urls import redact_url

    variable = next(v for v in environment.VARIABLES if v.name == name)
    message = str(error)
    assert f"{name}={redact_url(value)!r}" in message, message
    assert variable.accepted in message, message
    assert "SeCrEtVaLuE123" not in message


def _environment_reads(path: Path) -> list[str]:
    """Where ``path`` reads a ``ROUTELOG_*`` variable from ``os.environ`` (by name or by an ``*_ENV`` constant)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv") and node.args:
            key = node.args[0]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) == "os.environ"
        ):
            key = node.slice
        else:
            continue
        if "ROUTELOG_" in ast.unparse(key) or ast.unparse(key).endswith("_ENV"):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_the_environment_is_read_in_one_place() -> None:
    """Only routelog/environment.py reads routelog's variables."""
    package = Path(routelog.__file__).parent
    reads = {
        str(path.relative_to(package)): found
        for path in sorted(package.rglob("*.py"))
        if (found := _environment_reads(path)) and path.name != "environment.py"
    }
    assert not reads, reads


def test_every_variable_is_in_the_table() -> None:
    from routelog import environment

    assert {v.name for v in environment.VARIABLES} == set(BAD) == set(GOOD) == set(UNSET)
    names = set()
    for path in Path(routelog.__file__).parent.rglob("*.py"):
        names |= set(re.findall(r"ROUTELOG_[A-Z_]+", path.read_text()))
    assert names == set(BAD), names


@pytest.mark.parametrize(("name", "value"), [(n, v) for n, values in BAD.items() for v in values])
def test_a_value_a_variable_does_not_take_is_refused_naming_it_and_what_it_takes(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    accessor, variable = _accessor(name)
    monkeypatch.setenv(name, value)
    with pytest.raises(variable.error) as refused:
        accessor()
    _assert_refusal(refused.value, name, value)
    replay = name not in ("ROUTELOG_KERNELS", "ROUTELOG_DEBUG")
    assert isinstance(refused.value, ReplayConfigError if replay else EnvironmentVariableError)


@pytest.mark.parametrize(("name", "value", "parsed"), [(n, v, p) for n, pairs in GOOD.items() for v, p in pairs])
def test_the_values_a_variable_takes_are_taken(
    name: str, value: str, parsed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    accessor, _ = _accessor(name)
    monkeypatch.setenv(name, value)
    got = accessor()
    assert math.isclose(got, parsed) if isinstance(parsed, float) else got == parsed
    monkeypatch.delenv(name)
    assert accessor() == UNSET[name]


def test_policy_versions_lag_n_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from routelog.align.plan import versions_for
    from routelog.environment import policy_versions

    monkeypatch.setenv("ROUTELOG_POLICY_VERSIONS", "step-2")
    assert versions_for(policy_versions(), 7) == frozenset({5})
    monkeypatch.setenv("ROUTELOG_POLICY_VERSIONS", "any")
    assert versions_for(policy_versions(), 7) is None
    monkeypatch.setenv("ROUTELOG_POLICY_VERSIONS", "step")
    assert versions_for(policy_versions(), 7) == frozenset({7})


# -- refused where the integrations install their hooks -------------------------------------------------------------
VERL_BAD = [
    *[("ROUTELOG_MAX_ROUTER_DIFF", v) for v in ("", "abc", "nan", "inf", "-0.1", "1.5")],
    *[("ROUTELOG_FIDELITY_WRITER", v) for v in ("", "../x", "rank 0")],
    ("ROUTELOG_POLICY_VERSIONS", "step-x"),
    *[("ROUTELOG_URL", v) for v in ("", "relative/store", CREDENTIALS)],
]


@pytest.mark.parametrize(("name", "value"), VERL_BAD)
def test_the_verl_plugin_refuses_a_bad_setting_before_it_installs_anything(
    name: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ROUTELOG_MAX_ROUTER_DIFF=abc`` once raised a bare ``ValueError``, ``nan`` the gate's own, and a writer id
    ``../x`` or ``rank 0`` was installed as given."""
    from routelog.integrations import verl_plugin

    monkeypatch.setenv("ROUTELOG_URL", str(tmp_path / "store"))
    monkeypatch.setenv(name, value)
    for install in (verl_plugin._install_engine, verl_plugin._install_agent_loop):
        with pytest.raises(ReplayConfigError) as refused:
            install(types.ModuleType("verl.stand_in"))
        _assert_refusal(refused.value, name, value)


@pytest.mark.parametrize("value", ["", "../x", "rank 0", "nodots", "pkg..fn"])
def test_slime_refuses_a_bad_rollout_function_at_install_and_before_a_rollout(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routelog.integrations import slime

    monkeypatch.setenv("ROUTELOG_URL", "memory://environment/slime")
    monkeypatch.setenv("ROUTELOG_SLIME_ROLLOUT_FUNCTION", value)
    for call in (lambda: slime.install(None), lambda: slime.generate_rollout(None, 0, None)):
        with pytest.raises(ReplayConfigError) as refused:
            call()
        _assert_refusal(refused.value, "ROUTELOG_SLIME_ROLLOUT_FUNCTION", value)


@pytest.mark.parametrize("value", ["", "relative/store", CREDENTIALS])
def test_nemo_rl_and_slime_refuse_a_bad_store_url_at_install(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from routelog.integrations import nemo_rl, slime

    monkeypatch.setenv("ROUTELOG_URL", value)
    for call in (lambda: nemo_rl.install(modules={}), lambda: slime.install(None)):
        with pytest.raises(ReplayConfigError) as refused:
            call()
        _assert_refusal(refused.value, "ROUTELOG_URL", value)


@pytest.mark.parametrize("value", ["", "2", "abc", "rank 0"])
def test_the_command_line_refuses_a_bad_debug_setting_in_one_line(
    value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ROUTELOG_DEBUG=2`` once meant "on", and so did ``abc``."""
    from routelog.cli.main import EXIT_USAGE, main

    monkeypatch.setenv("ROUTELOG_DEBUG", value)
    monkeypatch.setattr(sys, "argv", ["routelog", "inspect", str(tmp_path / "none")])
    with pytest.raises(SystemExit) as ended:
        main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert ended.value.code == EXIT_USAGE
    assert len(lines) == 1, lines
    _assert_refusal(RoutelogError(lines[0]), "ROUTELOG_DEBUG", value)


# -- a failed install is never left behind -------------------------------------------------------------------------
def _probe(body: str, env: dict[str, str]) -> list[str]:
    """What a fresh process with veRL and routelog's plugin prints running ``body``."""
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROUTELOG_")}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", body],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean | env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_a_verl_engine_whose_install_failed_is_patched_on_the_next_import_or_refused_again(tmp_path: Path) -> None:
    """veRL's plugin patches the engine module as it is imported. Its install once counted as done before it ran:
    after an install that raised (a bad setting, a store not there yet), the next import ran veRL's module again
    unwatched, and veRL's engine registry refused it (an ``AssertionError``, whatever the setting). Now each import
    installs into the module that ran, raising while the cause stays, until one succeeds."""
    url = tmp_path / "store"
    probe = f"""
import os, routelog
from routelog.synth import synthetic_spec
import verl

def engine():
    try:
        from verl.workers.engine.megatron import transformer_impl
    except Exception as exc:
        return type(exc).__name__
    return transformer_impl.set_router_replay_data.__module__

print(engine())
print(engine())  # the cause stays: refused again
os.environ["ROUTELOG_MAX_ROUTER_DIFF"] = "0.2"
print(engine())  # the store is not there yet
routelog.create_store({str(url)!r}, synthetic_spec(2, 8, 2))
print(engine())
print(engine())  # imported once patched: the module in sys.modules
"""
    printed = _probe(probe, {"ROUTELOG_URL": str(url), "ROUTELOG_MAX_ROUTER_DIFF": "nan"})
    assert printed[-5:] == [
        "ReplayConfigError",
        "ReplayConfigError",
        "StoreNotFoundError",
        "routelog.integrations.verl",
        "routelog.integrations.verl",
    ], printed


def test_an_agent_loop_whose_install_failed_is_never_handed_out_unpatched(tmp_path: Path) -> None:
    """The agent-loop module has no registry to trip over: after a failed install its next import was veRL's
    own, unpatched, and the rollout went on without recording its routing."""
    probe = """
import routelog.integrations.verl_agent_loop as hooks

real, calls = hooks.patch_module, []

def failing_once(module, routing):
    calls.append(module)
    if len(calls) == 1:
        raise RuntimeError("the first install fails")
    real(module, routing)

hooks.patch_module = failing_once
import verl

def agent_loop():
    try:
        from verl.experimental.agent_loop import agent_loop
    except RuntimeError as exc:
        return type(exc).__name__
    return type(vars(agent_loop.AgentLoopWorker)["_run_agent_loop"]).__module__

print(agent_loop())
print(agent_loop())
"""
    printed = _probe(probe, {"ROUTELOG_URL": str(tmp_path / "store")})
    assert printed[-2:] == ["RuntimeError", "routelog.integrations.verl_agent_loop"], printed
