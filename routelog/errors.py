"""The one error hierarchy of routelog.

Every error derives from :class:`RoutelogError` and, where one fits, from the builtin it resembles, so callers
can catch either. Messages name what was wrong (the sample, the field, the object) and how to fix it.
"""

from __future__ import annotations


class RoutelogError(Exception):
    """Base class of every error routelog raises on purpose."""


class InvalidRecordError(RoutelogError, ValueError):
    """A record handed to a writer (or produced by an adapter) breaks the format's rules.

    Nothing is written for the offending record; records appended or committed before it are untouched.
    """

    def __init__(self, sample_id: str | None, field: str, problem: str, fix: str) -> None:
        self.sample_id = sample_id
        self.field = field
        self.problem = problem
        self.fix = fix
        who = f"sample {sample_id!r}" if sample_id is not None else "record"
        super().__init__(f"{who}, field {field!r}: {problem}. Fix: {fix}")


class DuplicateSampleError(InvalidRecordError):
    """A sample id occurs twice in one step."""


class ModelSpecError(RoutelogError):
    """A model spec is inconsistent, cannot be derived from a config, or does not match the store's.

    Deliberately not a ``ValueError``: pydantic would wrap one raised by the spec's own validation into a
    ``ValidationError`` and lose the type.
    """


class IngestError(RoutelogError, ValueError):
    """An engine payload cannot be converted exactly; the message names the request and the field."""


class RoutingAbsentError(IngestError):
    """The engine returned no routing for a sample, for a reason it states (``reason``): the request was aborted,
    it finished on a stop string (vLLM 0.21), it was preempted, or the server does not return routing at all.
    ``routelog ingest --skip-absent`` counts such samples instead of stopping."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ValuesNotFoundError(RoutelogError, LookupError):
    """The records asked about hold no values of a column an operation needs (e.g. ``mismatch`` without
    ``logprob_infer`` and ``logprob_train``)."""


class AlignmentError(RoutelogError, ValueError):
    """Routing cannot be aligned to the trainer's batch or parallel layout as described."""


class SynthConfigError(RoutelogError, ValueError):
    """Options of synthetic routing out of their range (``routelog synth``); nothing was written."""


class ReplayConfigError(RoutelogError, ValueError):
    """A training configuration in which routing replay would be silently bypassed or wrong."""


class MissingExtraError(RoutelogError, ImportError):
    """An optional part of routelog is used without the packages it needs; the message names the install command."""


class ForkedWriterError(RoutelogError, RuntimeError):
    """A writer is used in a process forked from the one that opened it: its background threads, its buffer's
    owner and its committer live in the parent, so it refuses at once rather than wait for them. Open a writer in
    the child."""


class FormatVersionError(RoutelogError):
    """A store (or one of its documents) was written by a newer, unknown format version or feature set."""


class StoreError(RoutelogError, OSError):
    """A store cannot be opened, read or written as asked."""


class WriteInterruptedError(RoutelogError):
    """Ctrl-C while writing: what was committed stays, and the message says how many records that is and how to
    resume (running the same command again skips what is committed)."""


class StoreAccessError(StoreError, PermissionError):
    """The storage refused us: no credentials were found, or they do not grant access. The message says where
    credentials come from."""


class StoreUnreachableError(StoreError, ConnectionError):
    """The storage endpoint cannot be reached (connection refused, unknown host, timeout); the message names the
    endpoint in use and how to change it."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No routelog store (no run document) exists at the URL."""


class RecordNotFoundError(RoutelogError, KeyError):
    """A step or sample id asked for is not committed in the store."""

    def __str__(self) -> str:  # KeyError would quote the whole message again
        return str(self.args[0]) if self.args else ""


class HistoryReclaimedError(RecordNotFoundError):
    """An as-of view of a step needs a part that a later drop removed and ``routelog gc`` has reclaimed since: that
    view of the history is no longer stored (as-of views reach back as far as gc's grace period keeps parts)."""


class CorruptDataError(StoreError):
    """Stored bytes fail their checksum or cannot be decoded; the message names the object and records."""


class CommitConflictError(StoreError, FileExistsError):
    """A commit or seal object already exists with different content (two writers claimed one name)."""


class StepSealedError(StoreError):
    """The step is sealed (or being sealed): it accepts no more commits. A writer that raises it names the
    records that are not part of the step; append them to the next step."""


class StepNotSealedError(StoreError):
    """An operation that needs a sealed step (archive) was asked of one that is not."""


class CommitUndecidedError(StoreError):
    """The storage never confirmed a commit's create (every attempt failed, the last without an answer), and the
    commit is not there when read back: its records may still appear if a delayed request lands. They are not
    reported as committed nor as refused; sending them again is safe (a record already present is skipped, and a
    second copy is never read)."""


class UnsafeKeyError(RoutelogError, ValueError):
    """A name that would become part of an object key is not a plain name inside the store (``..``, ``/``,
    characters outside the allowed set): refused before any storage call."""


class GcRefusedError(StoreError):
    """``routelog gc`` will not delete: a document it needs is damaged, or the grace period is unsafe."""


class ReplayFidelityError(RoutelogError):
    """Replay is not doing what it should: the trainer's routers disagree with the replayed routes more than the
    gate allows, or a rank was handed routing recorded for other tokens (also :mod:`routelog.store.fidelity`'s)."""


class StaleRoutingError(ReplayFidelityError):
    """Routing recorded under another policy version than the one a replay takes (another step's, or tokens of a
    partial rollout generated before a weight update)."""


class CredentialsInUrlError(StoreError):
    """A store URL carries credentials in its userinfo (``s3://KEY:SECRET@bucket/run``): refused when the store is
    opened or created, as every message, log line and repr naming the store would show them. The message shows the
    URL redacted and says where credentials go instead (``storage_options``, the ``AWS_*`` environment)."""


class EnvironmentVariableError(RoutelogError, ValueError):
    """A ``ROUTELOG_*`` environment variable holds a value it does not accept (:mod:`routelog.environment`); the
    message names the variable, the value given and the values it takes. The trainer integrations' variables raise
    :class:`ReplayConfigError` instead."""
