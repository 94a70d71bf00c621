"""Who may connect to a run's NATS, and what each role may publish and subscribe to.

A run's embedded server (``coevo run``, the benches' servers) requires credentials: one user per
role of ``coevo.agents.ROLES`` (``EMITS``) plus ``admin`` (the process that started the run and its tools),
each with a random password in its own file ``<dir>/<user>.json`` (mode 0600, in a 0700 directory;
generated once per run, kept across restarts and ``--resume``). A child agent gets only its role's
file (``--nats.credentials_file``).

Each role's permissions (``role_permissions``, a pure function of the run and the role):
- it publishes events only of the kinds its agent class declares in ``emits`` (``EMITS``; plus its own
  ``agent.status`` and ``dead.lettered``), and of a scoped kind only on its own scopes' subjects
  (``role_subjects``; ``coevo.schemas.registry.SCOPES``): only the learner publishes
  ``weights.published.<lane>``, only the tasks agent ``task.scheduled.tasks`` (every group it
  schedules: train, candidate, eval), only the policy ``task.scheduled.endpoint`` (the groups its
  endpoint opens), each lane's server its own ``weights.applied.<lane>``, each role its own
  ``agent.status.<role>`` and ``dead.lettered.<role>``; no role publishes a scoped kind's bare subject;
- the JetStream API only to read the run's streams (``run_streams``: events, buckets, object
  stores) and to run consumers on them (create, read, pull, ack); on the run's events only its own
  consumers (``consumer_names``: its shared durable, named as the role, and ``CONSUMER_SLOTS``
  numbered names ``<role>_<k>`` claimed by ``coevo.runtime.slots``): create, update, read, pull,
  ack and delete are each granted by name, so no role drains, acks, re-points or deletes another's
  consumer (the unnamed ephemeral create, ``$JS.API.CONSUMER.CREATE.<stream>``, which takes any name
  in its body, is not granted there); no stream or bucket is created,
  changed, deleted or purged by a role (the retention keeper purges old events); a role writes
  objects only to its own object store (``payload_bucket(run, role)``, its large events), and
  never purges it (``claims.put`` needs no purge);
- key-value writes only to its own buckets (tasks: ``tasks``, ``llmcache_tasks``; judge:
  ``judgetests``, ``llmcache_judge``);
- requests only where its agent asks (followers ask the learner for weights, the policy asks env
  hosts), service subjects only where it serves (learner: weights; env: environments), control
  subjects only to answer (``coevo.<run>.ctl.*``: commands come from ``admin``);
- replies only to requests it received (``allow_responses``), and inboxes only under its own prefix
  ``_INBOX_<user>`` (no role reads another's replies or deliveries).

Invariant: every subject a role's agent publishes to in a run is allowed by its permissions (the
tests run every role as its own process under them); everything not listed is refused by the server.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from coevo.errors import ConfigError
from coevo.schemas import SCOPES, control_subject, subject_for, transfer_subject
from coevo.schemas.envproto import env_subject

ADMIN = "admin"
EMITS: dict[str, tuple[str, ...]] = {
    "policy": ("step.taken", "trajectory.completed", "step.agreement", "weights.applied", "task.scheduled"),
    "judge": ("step.judged", "weights.applied", "budget.exceeded"),
    "scorer": ("group.scored",),
    "tasks": ("task.scheduled", "task.rewritten", "task.decided"),
    "learner": ("learner.stepped", "weights.published"),
    "env": (),
    "metrics": (),
    "retention": (),
}
"""The event kinds each role of ``coevo.agents.ROLES`` may publish: its agent class's ``emits``
(a test keeps them equal), besides ``agent.status`` and ``dead.lettered`` which every role publishes."""
EVERY_ROLE_EMITS = ("agent.status", "dead.lettered")
KV_BUCKETS = ("tasks", "judgetests", "llmcache_judge", "llmcache_tasks")
"""Every key-value bucket of a run (``NatsBus.kv``); ``admin`` creates them up front. Each LLM
client caches in its own role's bucket: a shared cache would let one role plant another's answers."""
KV_WRITERS: dict[str, tuple[str, ...]] = {
    "tasks": ("tasks", "llmcache_tasks"),
    "judge": ("judgetests", "llmcache_judge"),
}
REQUESTS: dict[str, tuple[str, ...]] = {"policy": ("weights", "env"), "judge": ("weights",)}
SERVES: dict[str, tuple[str, ...]] = {"learner": ("weights",), "env": ("env",)}
PURGES_STREAM = ("retention",)
CONSUMER_SLOTS = 32
"""numbered consumer names per role on the run's events: each unshared consumer of one of its agent
instances, each history or tail reader, holds one while it exists (``coevo.runtime.slots``)"""


def slot_name(role: str, k: int) -> str:
    return f"{role}_{k}"


def consumer_names(role: str) -> tuple[str, ...]:
    """Every consumer of the run's events that ``role`` may create, read, pull, ack or delete: its
    shared durable (named as the role) and its numbered names."""
    return (role, *(slot_name(role, k) for k in range(CONSUMER_SLOTS)))


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def kv_stream(run_id: str, bucket: str) -> str:
    return f"KV_coevo_{run_id}_{bucket}"


def payload_bucket(run_id: str, owner: str = ADMIN) -> str:
    """The object store holding ``owner``'s large events (claim checks): one per role, so that a
    role writes only its own."""
    return f"COEVO_{run_id}_payloads" + ("" if owner == ADMIN else f"_{owner}")


def payload_buckets(run_id: str) -> tuple[str, ...]:
    return tuple(payload_bucket(run_id, owner) for owner in (ADMIN, *EMITS))


def run_streams(run_id: str) -> tuple[str, ...]:
    """Every JetStream stream of a run: its events, its key-value buckets, its object stores."""
    return (
        f"COEVO_{run_id}",
        *(kv_stream(run_id, b) for b in KV_BUCKETS),
        *(f"OBJ_{b}" for b in payload_buckets(run_id)),
    )


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True

    def conf(self) -> str:
        def subjects(xs: tuple[str, ...]) -> str:
            return ", ".join(json.dumps(x) for x in xs)

        responses = ", allow_responses: true" if self.allow_responses else ""
        return (
            f"permissions: {{ publish: {{ allow: [{subjects(self.publish)}] }}, "
            f"subscribe: {{ allow: [{subjects(self.subscribe)}] }}{responses} }}"
        )


ADMIN_PERMISSIONS = Permissions(publish=(">",), subscribe=(">",), allow_responses=False)


def _service_subject(run_id: str, service: str) -> str:
    """Every subject of a request-reply service: ``coevo.<run>.weights.>`` or ``coevo.<run>.env.>``."""
    example = transfer_subject(run_id, "x", "y") if service == "weights" else env_subject(run_id, "x")
    return example.rsplit(".", 2)[0] + ".>"


def role_subjects(run_id: str, role: str) -> list[str]:
    """The event subjects ``role`` publishes on: each of its kinds' subject, or of a scoped kind the
    subjects of the scopes it produces."""
    out = []
    for kind in sorted({*EMITS[role], *EVERY_ROLE_EMITS}):
        if kind in SCOPES:
            out += [subject_for(run_id, kind, scope) for scope, who in SCOPES[kind].items() if who == role]
        else:
            out.append(subject_for(run_id, kind))
    return out


def role_permissions(run_id: str, role: str) -> Permissions:
    """What ``role`` (a key of ``EMITS``) may do on run ``run_id``'s NATS."""
    if role not in EMITS:
        raise ConfigError(f"no NATS permissions for role {role!r} (known: {', '.join(sorted(EMITS))})", field=None)
    stream, own = f"COEVO_{run_id}", payload_bucket(run_id, role)
    publish = role_subjects(run_id, role)
    publish += ["$JS.API.INFO", f"$O.{own}.>"]
    for name in consumer_names(role):  # the run's events: only its own consumers, by name
        publish += [
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}",
            f"$JS.API.CONSUMER.CREATE.{stream}.{name}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{name}",
            f"$JS.API.CONSUMER.INFO.{stream}.{name}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.API.CONSUMER.DELETE.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>",
        ]
    for s in run_streams(run_id):  # read them, and run consumers on them (pull, ordered, ephemeral)
        if s == stream:
            publish += [
                f"$JS.API.STREAM.INFO.{s}",
                f"$JS.API.STREAM.MSG.GET.{s}",
                f"$JS.API.DIRECT.GET.{s}",
                f"$JS.API.DIRECT.GET.{s}.>",
                f"$JS.API.CONSUMER.LIST.{s}",
                f"$JS.API.CONSUMER.NAMES.{s}",
            ]
            continue
        publish += [
            f"$JS.API.STREAM.INFO.{s}",
            f"$JS.API.STREAM.MSG.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}",
            f"$JS.API.DIRECT.GET.{s}.>",
            f"$JS.API.CONSUMER.CREATE.{s}",
            f"$JS.API.CONSUMER.CREATE.{s}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.*",
            f"$JS.API.CONSUMER.INFO.{s}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{s}.*",
            f"$JS.API.CONSUMER.DELETE.{s}.*",
            f"$JS.API.CONSUMER.LIST.{s}",
            f"$JS.API.CONSUMER.NAMES.{s}",
        ]
    publish += [f"$KV.coevo_{run_id}_{b}.>" for b in KV_WRITERS.get(role, ())]
    publish += [_service_subject(run_id, s) for s in REQUESTS.get(role, ())]
    if role in PURGES_STREAM:
        publish.append(f"$JS.API.STREAM.PURGE.{stream}")
    subscribe = [f"{inbox_prefix(role)}.>", control_subject(run_id, "*"), "$JS.EVENT.ADVISORY.CONSUMER.>"]
    subscribe += [_service_subject(run_id, s) for s in SERVES.get(role, ())]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe))


def permissions_for(run_id: str, user: str) -> Permissions:
    return ADMIN_PERMISSIONS if user == ADMIN else role_permissions(run_id, user)


@dataclass(frozen=True)
class Credential:
    """One user's secret, as read from its file (the password is never shown by ``repr``)."""

    user: str
    password: str = field(repr=False)
    path: Path | None = None


def credentials_dir(store: Path) -> Path:
    """Where a server over ``store`` keeps its users' credentials files."""
    return Path(store) / "credentials"


def credential_path(directory: Path, user: str) -> Path:
    """``user``'s credentials file in a credentials directory."""
    return Path(directory) / f"{user}.json"


def write_private(path: Path, text: str) -> None:
    """Write a secret: the file is created (or truncated) with mode 0600 before anything is in it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def generated_token(path: Path) -> str:
    """The token in ``path``, created (random, mode 0600) if missing: a restart keeps it."""
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    write_private(path, token + "\n")
    return token


def read_credential(path: Path) -> Credential:
    """A credentials file written by ``generate_credentials``; refused when others may read it."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = json.loads(path.read_text())
        user, password = str(data["user"]), str(data["password"])
    except OSError as exc:
        raise ConfigError(
            f"nats.credentials_file {path}: cannot read it ({exc.strerror})", field="nats.credentials_file"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f'nats.credentials_file {path}: not a coevo credentials file ({{"user": ..., "password": ...}})',
            field="nats.credentials_file",
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"nats.credentials_file {path}: readable by others (mode {stat.filemode(mode)}); chmod 600 {path}",
            field="nats.credentials_file",
        )
    return Credential(user, password, path)


def generate_credentials(directory: Path) -> dict[str, Credential]:
    """Every user's credential (``admin`` and each role) in ``directory``, created (random, 0600)
    where missing."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    out = {}
    for user in (ADMIN, *EMITS):
        path = credential_path(directory, user)
        if not path.exists():
            write_private(path, json.dumps({"user": user, "password": secrets.token_urlsafe(32)}) + "\n")
        out[user] = read_credential(path)
    return out


def union(perms: list[Permissions]) -> Permissions:
    """Everything any of ``perms`` allows (one user serving several runs of a server)."""
    pub = tuple(dict.fromkeys(x for p in perms for x in p.publish))
    sub = tuple(dict.fromkeys(x for p in perms for x in p.subscribe))
    return Permissions(pub, sub, any(p.allow_responses for p in perms))


@dataclass(frozen=True)
class RoleUsers:
    """A server's ``authorization`` block: one user per credential, each role with its permissions
    on every run of ``run_ids`` (a bench runs several on one server)."""

    run_ids: tuple[str, ...]
    credentials: dict[str, Credential] = field(repr=False)

    def conf(self) -> str:
        users = [
            f"    {{ user: {json.dumps(c.user)}, password: {json.dumps(c.password)}, "
            f"{union([permissions_for(r, c.user) for r in self.run_ids]).conf()} }}"
            for c in self.credentials.values()
        ]
        return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def role_users(directory: Path, run_ids: tuple[str, ...]) -> RoleUsers:
    """The users of a server for ``run_ids``, their credentials generated in ``directory`` if missing."""
    return RoleUsers(tuple(run_ids), generate_credentials(directory))
