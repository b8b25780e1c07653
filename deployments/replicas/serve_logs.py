"""TileInfer's own logs, inside a Serve replica, go where Serve's go: the replica's log file under
/tmp/ray/session_latest/logs/serve/ (and stderr with RAY_SERVE_LOG_TO_STDERR=1).

Serve configures its "ray.serve" logger only. Without this, the INFO lines of the deployments, the
engine and the proposers ("engine built in ...") were dropped, and their warnings reached only the
worker's raw stderr, not the replica's log.
"""

from __future__ import annotations

import logging

# every module's logger (logging.getLogger(__name__)) is below it
NAMESPACE = "tileinfer"


def route_to_serve() -> None:
    """Give this process's TileInfer loggers Serve's handlers (which carry Serve's filters: replica and
    request ids). Call from a replica's constructor, when Serve has configured them; calling again is
    harmless."""
    serve_handlers = logging.getLogger("ray.serve").handlers
    namespace = logging.getLogger(NAMESPACE)
    for handler in serve_handlers:
        if handler not in namespace.handlers:
            namespace.addHandler(handler)
    namespace.setLevel(logging.INFO)
    namespace.propagate = False  # Serve's handlers have them; the root's would print them twice
