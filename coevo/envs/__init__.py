"""Environments: task families that know nothing of NATS. ``make_family`` builds one from config.

Every named family, coevo's own (quickgame, quickgame-hard, textworld, coding) as much as a plugin's,
is an entry point of the group ``coevo.families`` (coevo's are in its ``pyproject.toml``): a
``Family`` subclass (built without arguments) or a callable taking the ``EnvConfig`` and returning a
``Family``, whose ``name`` is the entry point's name (task specs carry it). Two kinds are not names:
``external`` (the environment is a program outside coevo, talking to the policy endpoint: the pool
comes from ``env.tasks_from``, or there is none and agents bring their own tasks) and
``gym:<module>:<EnvClass or id>`` (a Gymnasium env, ``coevo.envs.gym_env``). Families declare knobs and
a precheck, so the rewriter rewrites any family's tasks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coevo.config import FAMILY_ENTRY_POINTS, family_problem, registered_families

if TYPE_CHECKING:
    from coevo.config import EnvConfig
    from coevo.envs.base import Family

__all__ = ["FAMILY_ENTRY_POINTS", "make_family", "registered_families", "registered_family"]


def make_family(cfg: EnvConfig) -> Family:
    if cfg.family == "external":
        if cfg.tasks_from is not None:  # the pool of that family, played by agents outside coevo
            return make_family(cfg.model_copy(update={"family": cfg.tasks_from, "tasks_from": None}))
        from coevo.envs.external import ExternalFamily

        family: Family = ExternalFamily()
    elif cfg.family.startswith("gym:"):
        from coevo.envs.gym_env import GymFamily

        family = GymFamily(cfg.family, cfg)
    else:
        family = registered_family(cfg.family, cfg)
    family.start_from(cfg.start_knobs)
    return family


def registered_family(name: str, cfg: EnvConfig) -> Family:
    """The family registered as ``name`` in the entry-point group ``coevo.families``."""
    from importlib.metadata import entry_points

    from coevo.envs.base import Family

    found = [ep for ep in entry_points(group=FAMILY_ENTRY_POINTS) if ep.name == name]
    if not found:
        raise ValueError(family_problem(name) or f"unknown family {name!r}")
    if len({ep.value for ep in found}) > 1:
        raise ValueError(
            f"family {name!r} is registered twice under {FAMILY_ENTRY_POINTS!r}: "
            f"{', '.join(sorted({ep.value for ep in found}))} (uninstall one)"
        )
    target = found[0].load()
    family = target() if isinstance(target, type) and issubclass(target, Family) else target(cfg)
    if not isinstance(family, Family):
        raise TypeError(
            f"entry point {found[0].value} of family {name!r} gave {type(family).__name__}, not a "
            "coevo.envs.base.Family (register a Family subclass or a callable (EnvConfig) -> Family)"
        )
    if family.name != name:
        raise ValueError(
            f"entry point {name!r} built a family named {family.name!r}: the names must agree "
            "(task specs carry the family's name)"
        )
    return family
