"""veRL plugin: routelog's replay installed in every veRL process by configuration, not code.

veRL imports the entry points of its ``verl.plugins`` group at ``import verl``, in every process (the driver and
each Ray worker; ``VERL_USE_EXTERNAL_PLUGINS`` chooses which). routelog registers this module there. It does
nothing unless :data:`URL_ENV` is set in the process's environment (put it in the Ray job's runtime env, which
reaches every worker); then, once veRL's Megatron engine module is imported, it is patched by
:func:`routelog.integrations.verl.install` with the store at that URL, and once an agent-loop module is (the
legacy or the V1 workers'), its workers write each trajectory's routing to the store
(:mod:`routelog.integrations.verl_agent_loop`): neither the driver nor the workers need routelog code.
:data:`FIDELITY_ENV` names the fidelity writer, :data:`GATE_ENV` the gate's ``max_router_diff`` and
:data:`VERSIONS_ENV` the policy versions replayed (all optional).

Each module is patched right after it is first imported, not at ``import verl``: the plugin is loaded while
``verl`` itself is being imported, before its modules can be.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the plugin loads at every ``import verl``: nothing of routelog until it is configured
    from routelog.align.plan import PolicyVersions

URL_ENV = "ROUTELOG_URL"
"""The store's URL: set, the plugin installs routelog's replay in the process."""
FIDELITY_ENV = "ROUTELOG_FIDELITY_WRITER"
"""Optional: the writer id the router diff is published under."""
GATE_ENV = "ROUTELOG_MAX_ROUTER_DIFF"
"""Optional: a :class:`~routelog.store.fidelity.FidelityGate`'s ``max_router_diff``."""
VERSIONS_ENV = "ROUTELOG_POLICY_VERSIONS"
"""Optional: ``step`` (the default: only routing of the step's own policy version), ``any`` (not checked), or
``step-N`` (routing of version ``step - N``: N-step off-policy training)."""
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
AGENT_LOOP_MODULES = ("verl.experimental.agent_loop.agent_loop", "verl.trainer.ppo.v1.agent_loop_tq")
"""The legacy and the V1 agent-loop workers' modules: patched to write each trajectory's routing to the store."""


def _install_engine(module: ModuleType) -> None:
    from routelog.integrations import verl
    from routelog.store.fidelity import FidelityGate

    del module  # verl.install patches the module it imports (this one, already in sys.modules)
    limit = os.environ.get(GATE_ENV)
    gate = FidelityGate(max_router_diff=float(limit)) if limit else None
    verl.install(
        os.environ[URL_ENV],
        gate=gate,
        fidelity_writer=os.environ.get(FIDELITY_ENV) or None,
        policy_versions=_versions(os.environ.get(VERSIONS_ENV) or "step"),
    )


@functools.cache
def _routing() -> Any:
    """This process's agent-loop routing writer (one, however many agent-loop modules are imported)."""
    from routelog.integrations import verl_agent_loop

    return verl_agent_loop.AgentLoopRouting(os.environ[URL_ENV])


def _install_agent_loop(module: ModuleType) -> None:
    from routelog.integrations import verl_agent_loop

    verl_agent_loop.patch_module(module, _routing())


def _versions(text: str) -> PolicyVersions:
    from routelog.errors import ReplayConfigError

    if text in ("step", "any"):
        return text  # type: ignore[return-value]
    lag = text.removeprefix("step-")
    if lag != text and lag.isdigit():
        return lambda step: {step - int(lag)}
    raise ReplayConfigError(f"{VERSIONS_ENV}={text!r}: expected 'step', 'any' or 'step-N' (N-step off-policy)")


_INSTALLERS: dict[str, Callable[[ModuleType], None]] = {
    ENGINE_MODULE: _install_engine,
    **dict.fromkeys(AGENT_LOOP_MODULES, _install_agent_loop),
}


class _Patching(importlib.abc.Loader):
    """Runs a module's own loader, then installs routelog's patches into it."""

    def __init__(self, loader: importlib.abc.Loader, install: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.install = install

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.install(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds each of veRL's patched modules once, through the other finders, and patches it as it loads."""

    def __init__(self) -> None:
        self.pending = {name for name in _INSTALLERS if name not in sys.modules}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)  # once: later imports find the patched module in sys.modules
        sys.meta_path.remove(self)  # the module itself is found by the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending:
                sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader, _INSTALLERS[fullname])
        return spec


def activate() -> None:
    """Install routelog's replay and rollout recording in this process when :data:`URL_ENV` is set (the entry
    point's work): modules already imported are patched now, the others as they are imported."""
    if not os.environ.get(URL_ENV):
        return
    for name, install in _INSTALLERS.items():
        if name in sys.modules:
            install(sys.modules[name])
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        finder = _AfterImport()
        if finder.pending:
            sys.meta_path.insert(0, finder)


activate()
