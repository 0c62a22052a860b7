"""Domain errors raised by engines; the server interceptor maps them to gRPC status codes.

Engines never import grpc: they raise `ValueError` for bad input (INVALID_ARGUMENT) or one of the
errors below, and `services.common.server` turns the class into a status code in one place.
"""


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
