"""veRL plugin: routelog's replay installed in every veRL process by configuration, not code.

veRL imports the entry points of its ``verl.plugins`` group at ``import verl``, in every process (the driver and
each Ray worker; ``VERL_USE_EXTERNAL_PLUGINS`` chooses which). routelog registers this module there. It does
nothing unless :data:`URL_ENV` is set in the process's environment (put it in the Ray job's runtime env, which
reaches every worker); then, once veRL's Megatron engine module is imported, it is patched by
:func:`routelog.integrations.verl.install` with the store at that URL. :data:`FIDELITY_ENV` names the fidelity
writer, :data:`GATE_ENV` the gate's ``max_router_diff`` and :data:`VERSIONS_ENV` the policy versions replayed (all
optional).

The engine module is patched right after it is first imported, not at ``import verl``: the plugin is loaded while
``verl`` itself is being imported, before its engine can be.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the plugin loads at every ``import verl``: nothing of routelog until it is configured
    from routelog.align.plan import PolicyVersions

URL_ENV = "ROUTELOG_URL"
"""The store's URL: set, the plugin installs routelog's replay in the process."""
FIDELITY_ENV = "ROUTELOG_FIDELITY_WRITER"
"""Optional: the writer id the router diff is published under."""
GATE_ENV = "ROUTELOG_MAX_ROUTER_DIFF"
"""Optional: a :class:`~routelog.fidelity.FidelityGate`'s ``max_router_diff``."""
VERSIONS_ENV = "ROUTELOG_POLICY_VERSIONS"
"""Optional: ``step`` (the default: only routing of the step's own policy version), ``any`` (not checked), or
``step-N`` (routing of version ``step - N``: N-step off-policy training)."""
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"


def _install() -> None:
    from routelog.fidelity import FidelityGate
    from routelog.integrations import verl

    limit = os.environ.get(GATE_ENV)
    gate = FidelityGate(max_router_diff=float(limit)) if limit else None
    verl.install(
        os.environ[URL_ENV],
        gate=gate,
        fidelity_writer=os.environ.get(FIDELITY_ENV) or None,
        policy_versions=_versions(os.environ.get(VERSIONS_ENV) or "step"),
    )


def _versions(text: str) -> PolicyVersions:
    from routelog.errors import ReplayConfigError

    if text in ("step", "any"):
        return text  # type: ignore[return-value]
    lag = text.removeprefix("step-")
    if lag != text and lag.isdigit():
        return lambda step: {step - int(lag)}
    raise ReplayConfigError(f"{VERSIONS_ENV}={text!r}: expected 'step', 'any' or 'step-N' (N-step off-policy)")


class _Patching(importlib.abc.Loader):
    """Runs the engine module's own loader, then installs routelog's patches into it."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _install()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds veRL's engine module once, through the other finders, and patches it as it loads."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)  # once: later imports find the patched module in sys.modules
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader)
        return spec


def activate() -> None:
    """Install routelog's replay in this process when :data:`URL_ENV` is set (the entry point's work)."""
    if not os.environ.get(URL_ENV):
        return
    if ENGINE_MODULE in sys.modules:
        _install()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


activate()
