"""The Ray session routelog's Ray paths run in: started quietly when the caller has none, and Ray Data's per-run
chatter (execution plans, progress logged line by line, tips) kept out of the caller's terminal.

A cluster the caller started (``ray.init`` before, or ``RAY_ADDRESS``) is used as it is. Ray Data's logger is set
to WARNING: set it back with ``logging.getLogger("ray.data").setLevel(logging.INFO)`` to see its progress lines.
"""

from __future__ import annotations

import logging
from typing import Any


def ray_session() -> Any:
    """The ``ray`` module, connected: to the caller's cluster, or a local one started with Ray's own log lines at
    WARNING (``RAY_ADDRESS`` is honoured by ``ray.init``)."""
    import ray
    import ray.data  # configures its loggers on import: before their level is set

    if not ray.is_initialized():
        ray.init(logging_level=logging.WARNING)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    return ray
