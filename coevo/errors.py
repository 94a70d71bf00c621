"""coevo's exceptions, every one of them, in one place (the sandbox harness's ``NotPlainData`` excepted:
``envs/harness.py`` runs inside the sandbox with only the standard library).

    CoevoError                      every error coevo raises on purpose
    ├── ConfigError                 .field: the dotted name of the bad config value
    │   └── SchemaMismatch          .run_version, .code_version: a run of another event schema major
    ├── BusError                    the message bus failed
    │   ├── NoResponders            a request found nobody serving its subject
    │   ├── PayloadUnavailable      a claimed object cannot be read now (read again on a later delivery)
    │   ├── ClaimError              (also a ValueError) a claim that does not lead to its bytes
    │   ├── ConsumerGone            .consumer: the server deleted the consumer a fetch pulled from
    │   └── PublishError            .subject, .event_id
    ├── ServerError                 the embedded nats-server could not start or stopped
    ├── InjectedFault               a failure injected at a fault point (COEVO_FAULTS)
    ├── HandlerOutcome              raised by a handler to choose its message's acknowledgement
    │   ├── Retry                   .delay_s: nak, redeliver after it
    │   └── Reject                  terminate and dead-letter with the reason
    ├── AgentFailed                 .agent_id, .restarts: an agent exceeded its restart budget
    ├── EnvError                    an environment used wrongly or unable to go on
    │   ├── EnvTimeout              .worker_id: an environment worker did not answer in time
    │   ├── SandboxUnavailable      the configured isolation cannot run on this host
    │   ├── ChannelClosed           the sandboxed process closed its channel
    │   └── BadFrame                (also a ValueError) the sandboxed process sent a malformed frame
    ├── InferenceError              a model server or API did not answer as asked
    │   ├── VLLMError               .status, .param: the HTTP answer (None: no answer at all)
    │   ├── ExternalCallFailed      .model: a LiteLLM call failed after its retries and fallbacks
    │   │   └── OverBudget          api.max_usd is spent: no further call is made
    │   ├── InvalidTokens           (also a ValueError) .token_id, .vocab_size: prompt ids outside the vocabulary
    │   └── GrammarError            (also a ValueError) a constraint that cannot be compiled, a sequence it refuses
    │       ├── SchemaUnsupported   .keywords: JSON-schema keywords the grammar engine cannot enforce
    │       └── GrammarOverBudget   .limit, .value, .bound: over a size or compile-time budget (config field)
    ├── NonFiniteStep               .loss, .grad_norm: a learner step that would put inf/NaN into the weights
    ├── LoadFailed                  a weights version was not loaded (the server serves the one before)
    ├── TransferRefused             the learner refused a server's weight-transfer connect or push
    ├── ApiError                    .status, .type, .code, .param, .retry_after: the policy endpoint's answer
    ├── HostsUnavailable            network namespaces cannot be made here (bench hosts)
    └── HarnessError                (also a RuntimeError) a bench could not set an attack up

Callers branch on types and on the attributes after the dots, never on messages. Handler outcomes
map to acknowledgements explicitly: returning normally acks; ``Retry`` naks with a delay; ``Reject``
terminates the message and dead-letters it with the reason; any other exception is a crash: nak
with backoff, counted, dead-lettered after ``bus.max_deliver`` tries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CoevoError(Exception):
    """Base of every error coevo raises on purpose."""


class ConfigError(CoevoError):
    """A config value is missing, unknown or of the wrong type. ``field`` is its dotted name."""

    def __init__(self, message: str, field: str | None) -> None:
        super().__init__(message)
        self.field = field

    @classmethod
    def from_validation(cls, exc: Any, known: Callable[[str], str | None] | None = None) -> ConfigError:
        """One line per error; ``known``: the closest real field to a name that is not one (a "did you
        mean" for an extra field)."""
        errors = exc.errors()
        lines = []
        for err in errors:
            loc = ".".join(str(p) for p in err["loc"])
            close = known(loc) if known is not None and err["type"] == "extra_forbidden" else None
            lines.append(
                f"{loc}: {err['msg']}"
                + (f" (did you mean {close}?)" if close else "")
                + (f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else "")
            )
        first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        return cls("invalid config: " + "; ".join(lines), field=first)


class SchemaMismatch(ConfigError):
    """This code's event schema major is not the run's (``coevo.schemas.versions``): the process
    refuses to connect rather than write events the run's other processes cannot read."""

    def __init__(self, message: str, run_version: str, code_version: str) -> None:
        super().__init__(message, field=None)
        self.run_version = run_version
        self.code_version = code_version


class BusError(CoevoError):
    """The message bus failed (connection, stream setup, publish acknowledgement)."""


class NoResponders(BusError):
    """A request found nobody serving its subject."""


class PayloadUnavailable(BusError):
    """A claimed object of a large event cannot be read now (a leader change, a timeout): the event
    is intact and will be read on a later delivery (not an invalid message: never dead-lettered as one)."""


class ClaimError(BusError, ValueError):
    """A claim that does not lead to its bytes (missing object, digest mismatch, malformed claim)."""


class ConsumerGone(BusError):
    """The consumer a fetch pulled from was deleted (by a role, or as inactive past its threshold):
    nothing more comes from it until it is created again (``coevo.runtime.revival``)."""

    def __init__(self, consumer: str) -> None:
        super().__init__(f"consumer {consumer} was deleted")
        self.consumer = consumer


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


class EnvError(CoevoError):
    """The environment was used wrongly (e.g. a step after the episode ended), or cannot go on."""


class EnvTimeout(EnvError):
    def __init__(self, worker_id: str, timeout_s: float) -> None:
        super().__init__(f"environment worker {worker_id} did not answer a step within {timeout_s}s")
        self.worker_id = worker_id


class SandboxUnavailable(EnvError):
    """The configured isolation cannot run on this host (e.g. bubblewrap is missing)."""


class ChannelClosed(EnvError):
    """The sandboxed process closed its channel (it exited, or was killed)."""


class BadFrame(EnvError, ValueError):
    """The sandboxed process sent something that is not a well-formed frame."""


class InferenceError(CoevoError):
    """A model server or API did not answer as asked."""


class VLLMError(InferenceError):
    """A vLLM server refused a request (``status``: its HTTP status; ``param``: the request field it
    named) or did not answer (``status`` None)."""

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class ExternalCallFailed(InferenceError):
    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"{model}: {reason}")
        self.model = model


class OverBudget(ExternalCallFailed):
    """``api.max_usd`` has been spent: no further call is made (the judge publishes ``BudgetExceeded``)."""


class InvalidTokens(InferenceError, ValueError):
    """Prompt token ids outside the model's vocabulary (``0 .. vocab_size - 1``): refused before they
    reach the model (an embedding lookup out of range: IndexError on CPU, a device assert on CUDA)."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        super().__init__(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
        self.token_id, self.vocab_size = token_id, vocab_size


class GrammarError(InferenceError, ValueError):
    """A constraint that cannot be compiled, or a sequence its grammar refuses."""


class SchemaUnsupported(GrammarError):
    """A JSON schema holding keywords the grammar engine cannot enforce (``keywords``, each with the
    path where it stands): refused, never compiled with them silently dropped."""

    def __init__(self, keywords: list[str]) -> None:
        super().__init__(
            f"JSON schema keywords the grammar cannot enforce (refused rather than ignored): {', '.join(keywords[:8])}"
        )
        self.keywords = keywords


class GrammarOverBudget(GrammarError):
    """A schema or grammar over one of its budgets: ``limit`` names the config field, ``value`` what was
    asked (bytes, values, seconds), ``bound`` the field's value."""

    def __init__(self, limit: str, value: float, bound: float, what: str) -> None:
        super().__init__(f"{what} ({_number(value)}) is over {limit} = {_number(bound)}")
        self.limit, self.value, self.bound = limit, value, bound


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


class NonFiniteStep(CoevoError):
    """A learner step whose loss or gradient norm is not finite: refused before ``optimizer.step``,
    so the weights and the optimiser state stay as they were (the learner retries its groups alone,
    then dead-letters the one that fails by itself)."""

    def __init__(self, loss: float, grad_norm: float) -> None:
        super().__init__(f"the step's loss ({loss}) or gradient norm ({grad_norm}) is not finite")
        self.loss, self.grad_norm = loss, grad_norm


class LoadFailed(CoevoError):
    """The version was not loaded; the server serves what it served before."""


class TransferRefused(CoevoError):
    """The learner's weight server refused a connect or push: a name not allowed or held by another
    server's link, a token that is not the link's, more workers or links than configured."""


class ApiError(CoevoError):
    """An error the policy endpoint's client gets as ``{"error": {message, type, param, code}}`` with
    ``status`` (``code``: what a client branches on, e.g. ``learner_behind``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.retry_after = retry_after
        """seconds, sent as ``Retry-After`` (429 and 503: the SDKs' own retries wait that long)"""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class HostsUnavailable(CoevoError):
    """Network namespaces cannot be made here (not root, no ``ip``)."""


class HarnessError(CoevoError, RuntimeError):
    """A bench could not set an attack up (reported; the other attacks go on)."""
