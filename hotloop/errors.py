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


class Conflict(FailedPrecondition):
    """The request contradicts the current state in a way the caller cannot change by asking
    again (a tenant declared in config cannot be deleted through the API). HTTP 409."""


class AlreadyExists(RecoverableError):
    """What the request would create exists already (a tenant's name). HTTP 409."""

    code = "ALREADY_EXISTS"


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


class PermissionDenied(RecoverableError):
    """The caller is known but may not do this (a user key on the admin API). HTTP 403."""

    code = "PERMISSION_DENIED"


class DeadlineExceeded(RecoverableError):
    """The request ran past its deadline; whatever it started upstream was cancelled."""

    code = "DEADLINE_EXCEEDED"
