"""Who publishes and who consumes each event kind: the table in docs/architecture.md, derived
from the agents' declared ``emits`` and their subscriptions (a test keeps the doc true)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from coevo.config import CoevoConfig

EXTRA_PRODUCERS = {
    "agent.status.<role>": {"every agent"},
    "dead.lettered.<role>": {"every consumer"},
    "run.finished": {"coevo run"},
}
"""Producers besides the agents' ``emits``; ``<kind>.<role>``: each role on its own subject (``BY_ROLE``)."""


def _keys(kind: str) -> tuple[str, ...]:
    from coevo.schemas import BY_ROLE, selector_keys

    return (f"{kind}.<role>",) if kind in BY_ROLE else selector_keys(kind)


def topology(cfg: CoevoConfig) -> dict[str, dict[str, set[str]]]:
    """Subject (run-neutral: ``<kind>`` or ``<kind>.<scope>``) -> its producers and consumers."""
    from coevo.agents import ROLES, resolve_role
    from coevo.schemas import KIND_TO_MODEL, SCOPES, kind_of

    producers: dict[str, set[str]] = defaultdict(set)
    consumers: dict[str, set[str]] = defaultdict(set)
    for role in ROLES:
        cls = resolve_role(role)
        for e in cls.emits:
            kind = kind_of(e)
            for key in _keys(kind):
                if kind not in SCOPES or SCOPES[kind][key.rpartition(".")[2]] == role:
                    producers[key].add(role)
        # subscriptions() reads only the config and bound handlers: no bus, no models to load
        agent: Any = object.__new__(cls)
        agent.cfg = cfg
        for sub in agent.subscriptions():
            for key in (k for selector in sub.kinds for k in _keys(selector)):
                consumers[key].add(f"{role} ({sub.durable}{'' if sub.shared else ', per instance'})")
    for kind, who in EXTRA_PRODUCERS.items():
        producers[kind] |= who
    keys = [key for kind in KIND_TO_MODEL for key in _keys(kind)]
    return {k: {"producers": producers[k], "consumers": consumers[k]} for k in keys}
