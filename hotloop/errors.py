"""Error types shared by every service core, and their gRPC status codes.

Cores raise these (never grpc errors); `grpcutil.map_errors` turns them into statuses at the
service edge. The split follows vLLM v1: a `RecoverableError` fails one request and the
service keeps serving; a `FatalError` means the process should stop (the launcher restarts or
reports it).
"""

from __future__ import annotations


class HotloopError(Exception):
    """Base class. `code` names the grpc.StatusCode the edge maps it to."""

    code = "INTERNAL"


class RecoverableError(HotloopError):
    """One request failed; the service is healthy."""


class InvalidArgument(RecoverableError):
    code = "INVALID_ARGUMENT"


class NotFound(RecoverableError):
    code = "NOT_FOUND"


class FailedPrecondition(RecoverableError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(RecoverableError):
    """A bounded resource stayed full for as long as the request could wait (e.g. every
    adapter slot of a rollout replica pinned by running requests); the caller may retry."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(RecoverableError):
    """A dependency is down or the service is shutting down; the caller may retry."""

    code = "UNAVAILABLE"


class FatalError(HotloopError):
    """The process cannot continue (engine died, model missing). Callers see UNAVAILABLE
    (another replica may serve them); the service's watchdog then stops the process."""

    code = "UNAVAILABLE"


class Unauthenticated(RecoverableError):
    """The caller presented no credential, or one this service does not accept."""

    code = "UNAUTHENTICATED"


class DeadlineExceeded(RecoverableError):
    """The request ran past its deadline; whatever it started upstream was cancelled."""

    code = "DEADLINE_EXCEEDED"
