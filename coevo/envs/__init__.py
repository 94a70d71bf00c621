"""Environments: task families that know nothing of NATS. ``make_family`` builds one from config."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coevo.config import EnvConfig
    from coevo.envs.base import Family

FAMILIES = ("quickgame", "textworld", "coding")


def make_family(cfg: EnvConfig) -> Family:
    if cfg.family == "quickgame":
        from coevo.envs.quickgame import QuickGame

        return QuickGame()
    if cfg.family == "textworld":
        from coevo.envs.textworld_env import TextWorld

        return TextWorld(cfg.cache_dir)
    if cfg.family == "coding":
        from coevo.envs.coding import Coding

        return Coding(cfg.jsonl, sandbox=cfg.sandbox)
    raise ValueError(f"unknown family {cfg.family!r} (known: {', '.join(FAMILIES)})")
