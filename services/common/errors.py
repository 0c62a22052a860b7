"""Domain errors raised by engines; the server interceptor maps them to gRPC status codes.

Engines never import grpc: they raise `ValueError` for bad input (INVALID_ARGUMENT) or one of the
errors below, and `services.common.rpc.server` turns the class into a status code in one place.
"""

import asyncio
import errno


class MeshError(Exception):
    """Base of meshrl's domain errors; `status` names the grpc.StatusCode member it maps to."""

    status = "INTERNAL"


class FailedPrecondition(MeshError):
    """The request is valid but the service is not in a state to serve it."""

    status = "FAILED_PRECONDITION"


class NotFound(MeshError):
    """A named run, checkpoint or resource does not exist."""

    status = "NOT_FOUND"


class ResourceExhausted(MeshError):
    """A request exceeds a size or batch limit."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(MeshError):
    """A dependency (replica, trainer) cannot be reached right now; callers may retry."""

    status = "UNAVAILABLE"


class DeadlineExceeded(MeshError):
    """An operation ran past its time limit (a hanging user function, a stuck collective)."""

    status = "DEADLINE_EXCEEDED"


def require(condition: bool, message: str) -> None:
    """Raises ValueError(message) unless condition holds: input checks that name the field."""
    if not condition:
        raise ValueError(message)


# What stops a process or a task: never turned into a status. Every other BaseException a library raises (torch's
# CheckpointException derives from BaseException) is answered like any error, so no call goes unanswered.
PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError)


def passes_through(exc: BaseException) -> bool:
    return isinstance(exc, PASS_THROUGH)


# errno -> (error class, cause): how a file-system failure on a path the caller named is answered.
OS_ERRORS = {
    errno.ENOENT: (NotFound, "does not exist"),
    errno.ENOTDIR: (ValueError, "a file is where a folder belongs"),
    errno.EEXIST: (ValueError, "a file is where a folder belongs"),
    errno.EISDIR: (ValueError, "a folder is where a file belongs"),
    errno.EACCES: (FailedPrecondition, "permission denied"),
    errno.EPERM: (FailedPrecondition, "permission denied"),
    errno.EROFS: (FailedPrecondition, "read-only file system"),
    errno.ENOSPC: (ResourceExhausted, "no space left on device"),
    errno.EDQUOT: (ResourceExhausted, "disk quota exceeded"),
}


def path_error(key: str, what: str, exc: OSError) -> Exception:
    """A file-system error on a path the caller gave, as a domain error naming the key, the path and the cause:
    `path: cannot save checkpoint '/ck': no space left on device ('/ck/dcp/__0_0.distcp')`."""
    cls, cause = OS_ERRORS.get(exc.errno, (FailedPrecondition, exc.strerror or type(exc).__name__))
    where = f" ({exc.filename!r})" if exc.filename else ""
    return cls(f"{key}: cannot {what}: {cause}{where}")
