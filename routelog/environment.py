"""routelog's own environment variables, read here and nowhere else: one typed accessor each, and :data:`VARIABLES`,
the table of what each takes and means. Configuration from the environment is input: a value a variable does not
accept is refused with a typed error naming the variable, the value given (credentials in a URL redacted) and the
values it takes, never turned into a default. A variable set to the empty string is refused as well (most often a
shell variable that was meant to hold something): unset it to mean its default.

The trainer integrations read theirs when they install their hooks, so a bad value stops a run before its first
step; their errors are :class:`~routelog.errors.ReplayConfigError`, the others'
:class:`~routelog.errors.EnvironmentVariableError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from routelog.errors import EnvironmentVariableError, ReplayConfigError, RoutelogError, UnsafeKeyError
from routelog.urls import has_userinfo, redact_url


@dataclass(frozen=True)
class Variable:
    """One environment variable: what it takes and what it means, as messages and documentation show them."""

    name: str
    accepted: str
    meaning: str
    error: type[RoutelogError]

    def is_set(self) -> bool:
        """Whether the variable is set at all (to any value, even one :meth:`value` refuses)."""
        return self.name in os.environ

    def value(self) -> str | None:
        """The value as set, None when unset; set but empty is refused."""
        value = os.environ.get(self.name)
        if value == "":
            raise self.refused(value, "set but empty; unset it to mean its default")
        return value

    def refused(self, value: str, problem: str | None = None) -> RoutelogError:
        """The error refusing ``value``: the variable, the value, what is wrong and the values it takes."""
        why = f" ({problem})" if problem else ""
        return self.error(f"{self.name}={redact_url(value)!r}{why}: expected {self.accepted}; {self.meaning}")


URL = Variable(
    "ROUTELOG_URL",
    "a store URL (s3://bucket/run, file:///abs/path, memory://name) or an absolute path, without credentials",
    "the store the trainer integrations record the rollout's routing to and replay it from (veRL's plugin does "
    "nothing while it is unset)",
    ReplayConfigError,
)
FIDELITY_WRITER = Variable(
    "ROUTELOG_FIDELITY_WRITER",
    "a writer id: 1-64 letters, digits, '_' or '-'",
    "the writer id each rank's router diff is published under in the store (unset: not published)",
    ReplayConfigError,
)
MAX_ROUTER_DIFF = Variable(
    "ROUTELOG_MAX_ROUTER_DIFF",
    "a number in [0, 1]",
    "the fidelity gate's max_router_diff: the fraction of a layer's replayed rows whose own router would choose "
    "other experts above which training stops (unset: no gate)",
    ReplayConfigError,
)
POLICY_VERSIONS = Variable(
    "ROUTELOG_POLICY_VERSIONS",
    "'step', 'any' or 'step-N' (N a whole number)",
    "the policy versions a step's replay takes: the step's own, any (not checked), or step - N for N-step "
    "off-policy training (unset: step)",
    ReplayConfigError,
)
SLIME_ROLLOUT_FUNCTION = Variable(
    "ROUTELOG_SLIME_ROLLOUT_FUNCTION",
    "a function's dotted path, package.module.function",
    "the rollout function routelog.integrations.slime.generate_rollout wraps (unset: slime's "
    "slime.rollout.sglang_rollout.generate_rollout)",
    ReplayConfigError,
)
KERNELS = Variable(
    "ROUTELOG_KERNELS",
    "'auto' or 'numpy'",
    "the codec's kernels: the compiled ones where they were built (auto, the default), or numpy",
    EnvironmentVariableError,
)
DEBUG = Variable(
    "ROUTELOG_DEBUG",
    "1, true, yes or on; 0, false, no or off",
    "whether the command line prints the traceback of an error, as --debug does (unset: no)",
    EnvironmentVariableError,
)
VARIABLES: tuple[Variable, ...] = (
    URL,
    FIDELITY_WRITER,
    MAX_ROUTER_DIFF,
    POLICY_VERSIONS,
    SLIME_ROLLOUT_FUNCTION,
    KERNELS,
    DEBUG,
)
"""Every ``ROUTELOG_*`` variable routelog reads."""

_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")
_LAG = re.compile(r"step-([0-9]+)")
_DOTTED_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def store_url() -> str | None:
    """``ROUTELOG_URL``. A relative path is refused: each Ray worker would resolve it against its own directory."""
    value = URL.value()
    if value is None:
        return None
    if value != value.strip():
        raise URL.refused(value, "white space around it")
    if has_userinfo(value):
        raise URL.refused(value, "credentials in the URL: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY instead")
    if not _URL_SCHEME.match(value) and not os.path.isabs(value):
        raise URL.refused(value, "a relative path, which each process resolves against its own working directory")
    return value


def fidelity_writer() -> str | None:
    """``ROUTELOG_FIDELITY_WRITER``, checked as every writer id is (:func:`routelog.format.keys.check_writer_id`)."""
    from routelog.format.keys import check_writer_id  # here: the command line loads this module, no format module

    value = FIDELITY_WRITER.value()
    if value is None:
        return None
    try:
        return check_writer_id(value)
    except UnsafeKeyError as exc:
        raise FIDELITY_WRITER.refused(value) from exc


def max_router_diff() -> float | None:
    """``ROUTELOG_MAX_ROUTER_DIFF``: a fraction of rows, so NaN, infinities and values outside [0, 1] are refused."""
    value = MAX_ROUTER_DIFF.value()
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise MAX_ROUTER_DIFF.refused(value, "not a number") from None
    if not 0.0 <= number <= 1.0:  # NaN fails this too
        raise MAX_ROUTER_DIFF.refused(value, "not in [0, 1]")
    return number


def policy_versions() -> Literal["step", "any"] | Callable[[int], frozenset[int]]:
    """``ROUTELOG_POLICY_VERSIONS`` as a :data:`~routelog.align.plan.PolicyVersions` rule."""
    value = POLICY_VERSIONS.value()
    if value is None or value == "step":
        return "step"
    if value == "any":
        return "any"
    lag = _LAG.fullmatch(value)
    if lag is None:
        raise POLICY_VERSIONS.refused(value)
    behind = int(lag.group(1))
    return lambda step: frozenset({step - behind})


def slime_rollout_function() -> str | None:
    """``ROUTELOG_SLIME_ROLLOUT_FUNCTION``: the dotted path, checked for its form (importing it is the caller's)."""
    value = SLIME_ROLLOUT_FUNCTION.value()
    if value is not None and not _DOTTED_PATH.fullmatch(value):
        raise SLIME_ROLLOUT_FUNCTION.refused(value)
    return value


def kernels() -> Literal["auto", "numpy"]:
    """``ROUTELOG_KERNELS`` (any case, as before it was checked)."""
    value = KERNELS.value()
    if value is None:
        return "auto"
    if value.lower() == "numpy":
        return "numpy"
    if value.lower() == "auto":
        return "auto"
    raise KERNELS.refused(value)


def debug() -> bool:
    """``ROUTELOG_DEBUG``."""
    value = DEBUG.value()
    if value is None:
        return False
    if value.lower() not in _BOOLEANS:
        raise DEBUG.refused(value)
    return _BOOLEANS[value.lower()]
