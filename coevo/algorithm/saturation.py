"""Saturated train slots (docs/algorithm.md §4.5): pure decisions, no I/O.

A group whose rollouts are all won or all lost carries no outcome signal: every rollout gets the
same outcome reward, so its group-relative advantage is zero. A train slot whose last
``tasks.saturated_after`` groups were all like that is *saturated*. What follows is
measured by held-out success (``coevo bench ladder``), and none of it forbids a proposal:

- it is scheduled ``tasks.saturated_share`` as often as an unsaturated slot (stride scheduling:
  the rollouts go where there is signal, and no slot is ever starved);
- its rewrite moves further: ``moves`` knob steps at once instead of one, growing with the streak
  up to ``tasks.saturated_moves``, so one accepted rewrite can leave the saturated region that a
  one-step candidate (still all won, hence "not harder") would never leave;
- and a move that overshot is not repeated: once a candidate of k moves came back on the far side
  (a harder one that no rollout won, an easier one that every rollout won), the slot's later
  candidates in that direction move at most k − 1 steps (at least 1), until a rewrite is accepted or
  a candidate at the cap comes back at the near extreme (still all won, or all lost), which lifts it;
- when even one knob step overshot, the next candidates keep the knobs and change the world
  (``Family.fresh_world``): the smallest change there is, and one that a policy which memorised its
  worlds instead of learning to read them cannot pass; a fresh world that comes back at the near
  extreme lifts the cap like any candidate at it.

Invariants: a streak counts consecutive scored train groups of the slot's active task and
restarts at any mixed group or accepted rewrite; the overshoot cap acts only in its own direction,
and is lifted by an accepted rewrite or by a candidate at the cap that did not go far enough; with
``saturated_after = 0`` nothing changes (weights all 1, one move): the plain round-robin and one-step
rewrites.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


def streak_after(streak: int, accuracy: float) -> int:
    """The saturation streak once a group of ``accuracy`` (fraction won) is scored."""
    return streak + 1 if accuracy in (0.0, 1.0) else 0


def is_saturated(streak: int, after: int) -> bool:
    return after > 0 and streak >= after


def weight(streak: int, after: int, share: float) -> float:
    """The slot's scheduling weight: 1, or ``share`` once saturated."""
    return share if is_saturated(streak, after) else 1.0


def moves(streak: int, after: int, most: int) -> int:
    """Knob steps of the slot's next rewrite: 1, then one more per ``after`` saturated groups, at most
    ``most`` (a streak of ``after`` gives 2)."""
    if not is_saturated(streak, after):
        return 1
    return max(1, min(most, 1 + streak // after))


Direction = Literal["harder", "easier"]
Overshoot = tuple[Direction, int]
"""a direction, and the fewest moves a rejected candidate in it went too far with"""


def capped(moves: int, direction: Direction, overshoot: Overshoot | None) -> int:
    """``moves`` below the slot's overshoot in ``direction`` (at least 1)."""
    if overshoot is None or overshoot[0] != direction:
        return moves
    return max(1, min(moves, overshoot[1] - 1))


def fresh(direction: Direction, overshoot: Overshoot | None) -> bool:
    """Whether the slot's next candidate in ``direction`` is a fresh world at the same knobs (one move
    of another kind): even one knob step went too far."""
    return overshoot == (direction, 1)


def overshoot_after(
    overshoot: Overshoot | None, moves: int, direction: Direction, candidate_acc: float
) -> Overshoot | None:
    """The slot's overshoot once a rejected candidate of ``moves`` moves in ``direction`` scored
    ``candidate_acc``. On the far side (a harder one no rollout won, an easier one every rollout won) it
    went too far: the cap falls to it. Still at the near extreme (a harder one every rollout won, an
    easier one none won) with as many moves as the cap allowed, the cap was too tight (the policy has
    moved on, or the overshoot was noise): it is lifted. Otherwise it stays."""
    far = 0.0 if direction == "harder" else 1.0
    same = overshoot is not None and overshoot[0] == direction
    if candidate_acc == far:
        return (direction, min(overshoot[1], moves) if overshoot is not None and same else moves)
    if candidate_acc == 1.0 - far and overshoot is not None and same and moves >= overshoot[1] - 1:
        return None
    return overshoot


@dataclass
class Stride:
    """Weighted round-robin (stride scheduling): each pick takes the key with the lowest pass, ties in the
    order given, and advances its pass by ``1 / weight``. With equal weights it is plain round-robin; a
    key of weight w gets w / Σ weights of the picks over any long window. A key seen for the first time
    starts at the lowest pass of the others, so it neither floods nor waits behind them."""

    passes: dict[str, float] = field(default_factory=dict)

    def pick(self, weights: Mapping[str, float]) -> str:
        if not weights:
            raise ValueError("nothing to pick from")
        if any(w <= 0 for w in weights.values()):
            raise ValueError(f"weights must be > 0: {dict(weights)}")
        known = [self.passes[k] for k in weights if k in self.passes]
        floor = min(known, default=0.0)
        for k in weights:
            self.passes.setdefault(k, floor)
        key = min(weights, key=lambda k: self.passes[k])
        self.passes[key] += 1.0 / weights[key]
        return key
