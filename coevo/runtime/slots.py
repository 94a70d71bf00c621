"""A role's own consumer names: what its connection may create, read, pull, ack and delete.

NATS permissions match whole subject tokens, and a consumer's name is one token of every subject
that touches it (``$JS.API.CONSUMER.*.<stream>.<name>``, ``$JS.ACK.<stream>.<name>.>``): a role can be
given only names listed in advance. Each role therefore consumes the run's events under
``coevo.runtime.credentials.consumer_names(role)``: its shared durable (the role's name) and ``CONSUMER_SLOTS`` numbered names
``<role>_<k>`` for everything else (an agent instance's own consumer, a history or tail reader).

Invariant: a numbered name is held by one owner at a time. It is created with JetStream's
``action: "create"`` and the owner's nonce in its metadata (``OWNER_KEY``): the server refuses a
name that exists with another config (``ALREADY_EXISTS``), so a claim takes the first free name,
and a recreation finds out when another owner took the name meanwhile (``owned_by``).
"""

from __future__ import annotations

import json
import random
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import api

from coevo.errors import BusError
from coevo.runtime.credentials import CONSUMER_SLOTS, slot_name

OWNER_KEY = "coevo_owner"
ALREADY_EXISTS = 10148
"""JetStream's error code for ``action: "create"`` on a name that exists with another config"""


def owned_by(info: api.ConsumerInfo, owner: str) -> bool:
    return (info.config.metadata or {}).get(OWNER_KEY) == owner


class NameTaken(BusError):
    """The numbered name exists with another owner's config."""


async def create(nc: NATS, stream: str, config: api.ConsumerConfig, timeout_s: float) -> api.ConsumerInfo:
    """Create the consumer ``config.name`` only if it is absent or is this very config (``NameTaken``
    when another config holds the name). Sent on the subject that carries the filter when there is
    one (``CONSUMER.CREATE.<stream>.<name>.<filter>``), as nats-py does."""
    name = config.name or ""
    subject = f"$JS.API.CONSUMER.CREATE.{stream}.{name}"
    if config.filter_subject and config.filter_subject != ">":
        subject += f".{config.filter_subject}"
    body = {"stream_name": stream, "config": config.as_dict(), "action": "create"}
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout_s)
    data = json.loads(reply.data)
    error = data.get("error")
    if error is not None:
        if error.get("err_code") == ALREADY_EXISTS:
            raise NameTaken(f"consumer {name} of {stream} is held by another owner")
        raise BusError(f"creating consumer {name} of {stream}: {error.get('description', error)}")
    info: api.ConsumerInfo = api.ConsumerInfo.from_response(data)
    return info


async def claim(
    nc: NATS, stream: str, config: api.ConsumerConfig, role: str, owner: str, timeout_s: float
) -> api.ConsumerInfo:
    """Create ``config`` under the first of ``role``'s numbered names that is free (tried from a
    random one on: replicas starting together rarely collide), held by ``owner``."""
    config = _owned(config, owner)
    start = random.randrange(CONSUMER_SLOTS)
    for i in range(CONSUMER_SLOTS):
        name = slot_name(role, (start + i) % CONSUMER_SLOTS)
        try:
            return await create(nc, stream, _renamed(config, name), timeout_s)
        except NameTaken:
            continue
    raise BusError(
        f"every consumer name of role {role} is taken ({CONSUMER_SLOTS}: {slot_name(role, 0)} to "
        f"{slot_name(role, CONSUMER_SLOTS - 1)}); unshared consumers of stopped agents are freed after "
        "bus.unshared_inactive_s"
    )


def _owned(config: api.ConsumerConfig, owner: str) -> api.ConsumerConfig:
    return config.evolve(metadata={**(config.metadata or {}), OWNER_KEY: owner})


def _renamed(config: api.ConsumerConfig, name: str) -> api.ConsumerConfig:
    return config.evolve(name=name, durable_name=None)


async def open_own(bus: Any, config: api.ConsumerConfig, owner: str, held: str | None) -> str:
    """``bus``'s role's own consumer for ``owner`` (``bus.user``'s numbered names): ``held`` again
    when it is free or already ``owner``'s, else the first free name. Its name."""
    timeout_s = bus.cfg.publish_ack_timeout_s
    if held is not None:
        try:
            await create(bus.nc, bus.stream, own_config(config, held, owner), timeout_s)
            return held
        except NameTaken:  # its own still, recreated from another start (``coevo.runtime.revival``)?
            if owned_by(await bus.js.consumer_info(bus.stream, held), owner):
                return held
    info = await claim(bus.nc, bus.stream, config, bus.user, owner, timeout_s)
    return str(info.name)


def own_config(config: api.ConsumerConfig, name: str, owner: str) -> api.ConsumerConfig:
    """``config`` under the numbered ``name``, held by ``owner``."""
    return _renamed(_owned(config, owner), name)
