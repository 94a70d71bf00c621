"""Fault points: named places where a failure or a delay can be injected into a running process,
for ``coevo bench chaos`` and for tests of processes they cannot reach into (a torchrun rank).

Off unless ``COEVO_FAULTS`` is set (one dictionary lookup per pass otherwise). Its value is JSON,
one rule per point::

    {"lane.optimizer_step": {"rank": 1, "after": 2, "times": 1},
     "claims.fetch": {"p": 0.05},
     "handler": {"p": 0.1, "delay_s": 3.0, "error": false}}

A rule fires on a pass through its point when: the process is the named torchrun ``rank``
(``RANK``) and ``restart`` (``TORCHELASTIC_RESTART_COUNT``), if given; ``after`` passes have gone
by; fewer than ``times`` firings happened; and a draw falls below ``p`` (default 1; the draws
are seeded by ``seed`` and the process id). A firing sleeps ``delay_s`` (0) and then, unless
``error`` is false, raises ``InjectedFault``; each firing is logged (``fault.injected``). A rule with a field it does not know is a
``ConfigError`` naming it.

Points: ``claims.fetch`` (reading a claimed payload: a transient object-store failure),
``handler`` (before a consumer's handler: a slow or failing handler), ``lane.optimizer_step``
(inside a learner step, between its collectives), ``lane.step_kl`` (the KL guard's forward pass,
after a batch's optimiser steps), ``endpoint.publish_step`` (the policy agent publishing a step
its endpoint recorded), ``follower.load`` (a follower loading weights:
lag), ``publish`` (a publish, or a retry of one, refused as if no stream answered: retried under
its id, never dropped).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field, fields

import structlog

from coevo.errors import ConfigError, InjectedFault

__all__ = ["ENV", "InjectedFault", "ahit", "armed", "fired", "hit", "parse", "reset"]

ENV = "COEVO_FAULTS"
log = structlog.get_logger("coevo.faults")


@dataclass
class Rule:
    p: float = 1.0
    delay_s: float = 0.0
    error: bool = True
    after: int = 0
    times: int | None = None
    rank: int | None = None
    restart: int | None = None
    seed: int = 0
    passes: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)
    rng: random.Random = field(default_factory=random.Random, init=False)

    def __post_init__(self) -> None:
        self.rng.seed(f"{self.seed}:{os.getpid()}")

    def fires(self) -> bool:
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return False
        if self.restart is not None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != self.restart:
            return False
        self.passes += 1
        if self.passes <= self.after or (self.times is not None and self.fired >= self.times):
            return False
        if self.rng.random() >= self.p:
            return False
        self.fired += 1
        return True


def parse(text: str) -> dict[str, Rule]:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV} is not JSON: {exc}", ENV) from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{ENV} must be an object of point -> rule", ENV)
    known = {f.name for f in fields(Rule) if f.init}
    rules = {}
    for point, spec in raw.items():
        unknown = set(spec) - known if isinstance(spec, dict) else {"(not an object)"}
        if unknown:
            raise ConfigError(
                f"{ENV}: unknown field(s) {sorted(unknown)} for {point!r} (known: {sorted(known)})", f"{ENV}.{point}"
            )
        rules[point] = Rule(**spec)
    return rules


_rules: dict[str, Rule] | None = None


def _active() -> dict[str, Rule]:
    global _rules
    if _rules is None:
        _rules = parse(os.environ[ENV]) if os.environ.get(ENV) else {}
    return _rules


def reset() -> None:
    """Read ``COEVO_FAULTS`` again at the next pass (tests that set it in-process)."""
    global _rules
    _rules = None


def armed(point: str) -> bool:
    """Whether ``point`` has a rule in this process (tested before an ``ahit`` on a hot path: a
    coroutine per pass costs a small event's handling measurably)."""
    return point in _active()


def fired(point: str) -> int:
    """How often ``point``'s rule fired in this process (0 without one)."""
    rule = _active().get(point)
    return rule.fired if rule is not None else 0


def _fire(point: str) -> Rule | None:
    rule = _active().get(point)
    if rule is None or not rule.fires():
        return None
    log.warning("fault.injected", point=point, passes=rule.passes, delay_s=rule.delay_s, error=rule.error)
    return rule


def hit(point: str) -> None:
    """A pass through ``point`` in synchronous code (a worker thread)."""
    if (rule := _fire(point)) is None:
        return
    if rule.delay_s:
        time.sleep(rule.delay_s)
    if rule.error:
        raise InjectedFault(f"fault injected at {point} (pass {rule.passes})")


async def ahit(point: str) -> None:
    """A pass through ``point`` in a coroutine."""
    if (rule := _fire(point)) is None:
        return
    if rule.delay_s:
        await asyncio.sleep(rule.delay_s)
    if rule.error:
        raise InjectedFault(f"fault injected at {point} (pass {rule.passes})")
