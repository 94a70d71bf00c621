"""Agents of the closed loop. Roles are resolved lazily so that ``coevo --help`` stays fast."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coevo.runtime.agent import Agent

ROLES: dict[str, str] = {
    "policy": "coevo.agents.policy:PolicyAgent",
    "judge": "coevo.agents.judge:JudgeAgent",
    "scorer": "coevo.agents.scorer:ScorerAgent",
    "tasks": "coevo.agents.tasks:TasksAgent",
    "learner": "coevo.training.learner:LearnerAgent",
    "env": "coevo.envs.service:EnvHost",
    "metrics": "coevo.observe.agent:MetricsAgent",
    "retention": "coevo.runtime.retention:RetentionAgent",
}
"""Role name -> ``module:Class``. Any ``module:Class`` path is accepted as a role too."""


def resolve_role(role: str) -> type[Agent]:
    from coevo.errors import ConfigError
    from coevo.runtime.agent import Agent

    target = ROLES.get(role, role)
    if ":" not in target:
        known = ", ".join(sorted(ROLES)) or "none yet"
        raise ConfigError(f"unknown agent role {role!r} (known: {known}; or give module:Class)", field=None)
    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"agent {target}: cannot import it ({exc})", field=None) from None
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise ConfigError(f"{target} is not an Agent subclass", field=None)
    return cls
