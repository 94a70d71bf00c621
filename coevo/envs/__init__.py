"""Environments: task families that know nothing of NATS. ``make_family`` builds one from config.

A family is found, in order: a built-in (quickgame, quickgame-hard, textworld, coding); ``external``
(the environment is a program outside coevo, talking to the policy endpoint: the pool comes from
``env.tasks_from``, or there is none and agents bring their own tasks); ``gym:<module>:<EnvClass or id>`` (a Gymnasium
env, ``coevo.envs.gym_env``); a plugin, the entry point of that name in the group
``coevo.families`` of any installed distribution: a ``Family`` subclass (built without arguments)
or a callable taking the ``EnvConfig`` and returning a ``Family``, whose ``name`` is the entry
point's name (task specs carry it). Plugins declare knobs and a precheck like any family, so the
rewriter rewrites their tasks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coevo.config import BUILTIN_FAMILIES, FAMILY_ENTRY_POINTS, family_problem

if TYPE_CHECKING:
    from coevo.config import EnvConfig
    from coevo.envs.base import Family

FAMILIES = BUILTIN_FAMILIES

__all__ = ["FAMILIES", "FAMILY_ENTRY_POINTS", "make_family", "plugin_family"]


def make_family(cfg: EnvConfig) -> Family:
    if cfg.family == "quickgame":
        from coevo.envs.quickgame import QuickGame

        return QuickGame()
    if cfg.family == "quickgame-hard":  # the quick game's hard preset: another initial pool
        from coevo.envs.quickgame import QuickGameHard

        return QuickGameHard()
    if cfg.family == "textworld":
        from coevo.envs.textworld_env import TextWorld

        return TextWorld(cfg.cache_dir)
    if cfg.family == "coding":
        from coevo.envs.coding import Coding

        return Coding(cfg.jsonl, sandbox=cfg.sandbox)
    if cfg.family == "external":
        if cfg.tasks_from is not None:  # the pool of that family, played by agents outside coevo
            return make_family(cfg.model_copy(update={"family": cfg.tasks_from, "tasks_from": None}))
        from coevo.envs.external import ExternalFamily

        return ExternalFamily()
    if cfg.family.startswith("gym:"):
        from coevo.envs.gym_env import GymFamily

        return GymFamily(cfg.family, cfg)
    return plugin_family(cfg.family, cfg)


def plugin_family(name: str, cfg: EnvConfig) -> Family:
    """The family registered as ``name`` in the entry-point group ``coevo.families``."""
    from importlib.metadata import entry_points

    from coevo.envs.base import Family

    found = [ep for ep in entry_points(group=FAMILY_ENTRY_POINTS) if ep.name == name]
    if not found:
        raise ValueError(family_problem(name) or f"unknown family {name!r}")
    target = found[0].load()
    family = target() if isinstance(target, type) and issubclass(target, Family) else target(cfg)
    if not isinstance(family, Family):
        raise TypeError(f"entry point {found[0].value} of family {name!r} gave {type(family).__name__}, not a "
                        "coevo.envs.base.Family (register a Family subclass or a callable (EnvConfig) -> Family)")
    if family.name != name:
        raise ValueError(f"entry point {name!r} built a family named {family.name!r}: the names must agree "
                         "(task specs carry the family's name)")
    return family
