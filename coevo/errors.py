"""coevo's exception hierarchy, in one place.

Handler outcomes map to acknowledgements explicitly: returning normally acks; ``Retry`` naks with
a delay; ``Reject`` terminates the message and dead-letters it with the reason; any other
exception is a crash: nak with backoff, counted, dead-lettered after ``bus.max_deliver`` tries.
"""

from __future__ import annotations

from typing import Any


class CoevoError(Exception):
    """Base of every error coevo raises on purpose."""


class ConfigError(CoevoError):
    """A config value is missing, unknown or of the wrong type. ``field`` is its dotted name."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field

    @classmethod
    def from_validation(cls, exc: Any) -> ConfigError:
        errors = exc.errors()
        lines = []
        for err in errors:
            loc = ".".join(str(p) for p in err["loc"])
            lines.append(f"{loc}: {err['msg']}" + (f" (got {err['input']!r})" if "input" in err and
                                                    not isinstance(err["input"], dict) else ""))
        first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        return cls("invalid config: " + "; ".join(lines), field=first)


class BusError(CoevoError):
    """The message bus failed (connection, stream setup, publish acknowledgement)."""


class NoResponders(BusError):
    """A request found nobody serving its subject."""


class PayloadUnavailable(BusError):
    """A claimed object of a large event cannot be read now (a leader change, a timeout): the event
    is intact and will be read on a later delivery (not an invalid message: never dead-lettered as one)."""


class PublishError(BusError):
    def __init__(self, subject: str, event_id: str, reason: str) -> None:
        super().__init__(f"publish of {event_id} on {subject} failed: {reason}")
        self.subject = subject
        self.event_id = event_id


class InjectedFault(CoevoError):
    """A failure injected at a fault point (``COEVO_FAULTS``, ``coevo.runtime.faults``)."""


class ServerError(CoevoError):
    """The embedded nats-server could not start or stopped unexpectedly."""


class HandlerOutcome(CoevoError):
    """Raised by a handler to choose how its message is acknowledged."""


class Retry(HandlerOutcome):
    """Nak the message; redeliver after ``delay_s`` (counts towards ``max_deliver``)."""

    def __init__(self, reason: str, delay_s: float | None = None) -> None:
        super().__init__(reason)
        self.delay_s = delay_s


class Reject(HandlerOutcome):
    """Terminate the message and dead-letter it with ``reason``; never redelivered."""


class AgentFailed(CoevoError):
    """An agent exceeded its restart budget."""

    def __init__(self, agent_id: str, restarts: int, cause: BaseException | None) -> None:
        super().__init__(f"agent {agent_id} failed after {restarts} restarts: {cause!r}")
        self.agent_id = agent_id
        self.restarts = restarts
