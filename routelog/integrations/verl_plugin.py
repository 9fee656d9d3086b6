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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

# The plugin loads at every ``import verl``: nothing of routelog but its environment until it is configured.
from routelog import environment

if TYPE_CHECKING:
    from routelog.align.plan import PolicyVersions

URL_ENV = environment.URL.name
"""The store's URL: set, the plugin installs routelog's replay in the process."""
FIDELITY_ENV = environment.FIDELITY_WRITER.name
"""Optional: the writer id the router diff is published under."""
GATE_ENV = environment.MAX_ROUTER_DIFF.name
"""Optional: a :class:`~routelog.store.fidelity.FidelityGate`'s ``max_router_diff``."""
VERSIONS_ENV = environment.POLICY_VERSIONS.name
"""Optional: ``step`` (the default: only routing of the step's own policy version), ``any`` (not checked), or
``step-N`` (routing of version ``step - N``: N-step off-policy training)."""
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
AGENT_LOOP_MODULES = ("verl.experimental.agent_loop.agent_loop", "verl.trainer.ppo.v1.agent_loop_tq")
"""The legacy and the V1 agent-loop workers' modules: patched to write each trajectory's routing to the store."""


@dataclass(frozen=True)
class _Settings:
    url: str
    fidelity_writer: str | None
    max_router_diff: float | None
    policy_versions: PolicyVersions


def _settings() -> _Settings:
    """Every variable of the plugin, checked whichever module is being patched: a bad value stops the first patched
    import (the driver's agent loop as the workers' engine) with a :class:`~routelog.errors.ReplayConfigError`."""
    url = environment.store_url()
    if url is None:
        raise environment.URL.error(f"{URL_ENV} was unset after veRL's plugin found it set; set it again")
    return _Settings(url, environment.fidelity_writer(), environment.max_router_diff(), environment.policy_versions())


def _install_engine(module: ModuleType) -> None:
    from routelog.integrations import verl
    from routelog.store.fidelity import FidelityGate

    del module  # verl.install patches the module it imports (this one, already in sys.modules)
    settings = _settings()
    limit = settings.max_router_diff
    verl.install(
        settings.url,
        gate=None if limit is None else FidelityGate(max_router_diff=limit),
        fidelity_writer=settings.fidelity_writer,
        policy_versions=settings.policy_versions,
    )


@functools.cache
def _routing() -> Any:
    """This process's agent-loop routing writer (one, however many agent-loop modules are imported)."""
    from routelog.integrations import verl_agent_loop

    return verl_agent_loop.AgentLoopRouting(_settings().url)


def _install_agent_loop(module: ModuleType) -> None:
    from routelog.integrations import verl_agent_loop

    verl_agent_loop.patch_module(module, _routing())


_INSTALLERS: dict[str, Callable[[ModuleType], None]] = {
    ENGINE_MODULE: _install_engine,
    **dict.fromkeys(AGENT_LOOP_MODULES, _install_agent_loop),
}


class _Patching(importlib.abc.Loader):
    """Runs a module's own loader (once), then installs routelog's patches into it."""

    def __init__(self, loader: importlib.abc.Loader, finder: _AfterImport, name: str) -> None:
        self.loader = loader
        self.finder = finder
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        # after a failed install the module whose code ran is taken again: veRL's engine registry refuses to see
        # the engine module's classes registered twice
        return self.finder.unpatched.get(self.name) or self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self.finder.unpatched.get(self.name) is not module:
            self.loader.exec_module(module)
            self.finder.unpatched[self.name] = module
        _INSTALLERS[self.name](module)
        self.finder.patched(self.name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds each of veRL's patched modules through the other finders and patches it as it loads, until it is
    patched: an install that raises fails that import (Python forgets the module), and each later import installs
    into the same module again, raising while the cause stays. The module is never handed out unpatched."""

    def __init__(self) -> None:
        self.pending = {name for name in _INSTALLERS if name not in sys.modules}
        self.unpatched: dict[str, ModuleType] = {}
        """Modules whose code ran but whose install failed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        sys.meta_path.remove(self)  # the module itself is found by the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Patching(spec.loader, self, fullname)
        return spec

    def patched(self, fullname: str) -> None:
        """``fullname`` is patched: later imports find it in ``sys.modules``."""
        self.pending.discard(fullname)
        self.unpatched.pop(fullname, None)
        if not self.pending and self in sys.meta_path:
            sys.meta_path.remove(self)


def activate() -> None:
    """Install routelog's replay and rollout recording in this process when :data:`URL_ENV` is set (the entry
    point's work): modules already imported are patched now, the others as they are imported."""
    if not environment.URL.is_set():  # a bad value is refused by the patched imports (veRL hides a plugin's errors)
        return
    for name, install in _INSTALLERS.items():
        if name in sys.modules:
            install(sys.modules[name])
    if not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        finder = _AfterImport()
        if finder.pending:
            sys.meta_path.insert(0, finder)


activate()
