"""The numbers of docs/algorithm.md, as pure functions (no I/O, no torch).

- integrated reward  R_{τ_i} = O_τ + λ · mean_j S_{τ_i,j}   (unparseable votes count 0)
- policy advantage   z-score of R across the group's trajectories at the same step index
                     (a step index reached once keeps its raw R clipped to ±(1 + λ), the range of
                     R without environment rewards; std ≤ 1e-8 gives 0)
- environment reward clipped to ±``scorer.max_abs_env_reward`` (a NaN counts 0) before it is added
- consistency reward R_{S} = R_{τ_i} · S, or −2 for an unparseable vote; z-scored over the votes
                     of the same step (a step whose votes all have the same reward is skipped).
                     On a step whose ±1 votes split (none unparseable), |mean S| < 1, so with λ ≤ 1 and
                     no environment reward sign R_{τ_i} = O_τ and the z-score removes |R|: the judge's
                     advantage is its vote's agreement with the outcome alone. A step whose votes
                     agree teaches it nothing (``vote_profile``)
- acceptance gate    harder: 0 < acc(q′) < acc(q) and acc(q′) ≥ α_low;
                     easier: acc(q′) > acc(q) and acc(q′) ≤ α_high

Votes with status ``error`` (the judge failed, e.g. an API outage) are not votes: they are
excluded from both rewards; a step with only error votes has no step signal.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

RewardMode = Literal["integrated", "outcome-only", "steps-only"]


@dataclass(frozen=True)
class VoteRec:
    value: Literal[1, -1] | None
    status: Literal["ok", "unparseable", "error"] = "ok"


@dataclass(frozen=True)
class StepRec:
    step_id: str
    index: int
    votes: tuple[VoteRec, ...] = ()
    reference_label: Literal[1, -1] | None = None
    env_reward: float = 0.0
    """the environment's own reward for the step (0 when it gives none)"""


@dataclass(frozen=True)
class TrajRec:
    trajectory_id: str
    outcome: Literal["won", "lost", "truncated", "aborted"]
    steps: tuple[StepRec, ...] = field(default=())

    @property
    def o(self) -> int:
        return 1 if self.outcome == "won" else -1


def mean_vote(votes: Sequence[VoteRec]) -> float:
    """Mean of the votes that are not errors; unparseable counts 0. No votes -> 0."""
    counted = [v for v in votes if v.status != "error"]
    if not counted:
        return 0.0
    return sum((v.value or 0) if v.status == "ok" else 0 for v in counted) / len(counted)


def bounded(value: float, bound: float) -> float:
    """``value`` clipped to ±``bound`` (NaN: 0): a number a client sent cannot leave the range."""
    return 0.0 if math.isnan(value) else max(-bound, min(bound, value))


def integrated_rewards(
    trajs: Sequence[TrajRec],
    lam: float = 1.0,
    mode: RewardMode = "integrated",
    env_weight: float = 1.0,
    env_bound: float = math.inf,
) -> dict[str, float]:
    """R_i = O + lam * mean vote of step i (docs/algorithm.md §1), plus ``env_weight`` times the
    environment's own reward for the step (clipped to ±``env_bound``), in every mode (it is the
    environment's signal, not the judge's: ``outcome-only`` drops only the votes)."""
    out: dict[str, float] = {}
    for t in trajs:
        if t.outcome == "aborted":
            continue
        for s in t.steps:
            outcome = 0.0 if mode == "steps-only" else float(t.o)
            step = 0.0 if mode == "outcome-only" else lam * mean_vote(s.votes)
            out[s.step_id] = outcome + step + env_weight * bounded(s.env_reward, env_bound)
    return out


def zscore(values: Sequence[float], eps: float = 1e-8, weights: Sequence[float] | None = None) -> list[float]:
    """``values`` standardised by their mean and spread, the ``weights``-weighted ones if given; all 0
    when the spread is at most ``eps``."""
    ws = [1.0] * len(values) if weights is None else weights
    total = sum(ws)
    mu = sum(v * w for v, w in zip(values, ws, strict=True)) / total
    std = math.sqrt(sum(w * (v - mu) ** 2 for v, w in zip(values, ws, strict=True)) / total)
    if std <= eps:
        return [0.0] * len(values)
    return [(v - mu) / std for v in values]


def step_advantages(
    trajs: Sequence[TrajRec], rewards: dict[str, float], eps: float = 1e-8, lam: float = 1.0
) -> dict[str, float]:
    """Standardise rewards across trajectories at the same step index; a step alone at its index
    keeps its raw R clipped to ±(1 + ``lam``): what the reference gives wherever R is within the
    range of outcome and votes, and never more than that (an environment reward, however large,
    cannot make one step outweigh its group)."""
    by_index: dict[int, list[str]] = defaultdict(list)
    for t in trajs:
        if t.outcome == "aborted":
            continue
        for s in t.steps:
            by_index[s.index].append(s.step_id)
    out: dict[str, float] = {}
    for ids in by_index.values():
        if len(ids) == 1:
            out[ids[0]] = bounded(rewards[ids[0]], 1.0 + lam)
            continue
        for sid, a in zip(ids, zscore([rewards[i] for i in ids], eps), strict=True):
            out[sid] = a
    return out


def consistency_rewards(step_reward: float, votes: Sequence[VoteRec]) -> list[float | None]:
    """Per vote: R·S, -2 for an unparseable vote, None for an error (not a vote)."""
    rewards: list[float | None] = []
    for v in votes:
        if v.status == "error":
            rewards.append(None)
        elif v.status == "unparseable" or v.value is None:
            rewards.append(-2.0)
        else:
            rewards.append(step_reward * v.value)
    return rewards


def consistency_advantages(step_reward: float, votes: Sequence[VoteRec], eps: float = 1e-8) -> list[float | None]:
    """Per vote: the standardised consistency reward, or None (error vote, or a skipped step): the
    paper's per-step baseline, a group of one step."""
    (advantages,) = group_consistency_advantages([(step_reward, votes)], eps)
    return advantages


def group_consistency_advantages(
    steps: Sequence[tuple[float, Sequence[VoteRec]]], eps: float = 1e-8, weights: Sequence[float] | None = None
) -> list[list[float | None]]:
    """``scorer.judge_baseline = "group"``: per step (its integrated reward R, its votes), per vote, the
    consistency reward R·S standardised over every vote of the group instead of over the step's own.
    A step whose votes agree is then heard too: its votes gain where they agree with the outcome more
    than the group's average vote does, and lose where less; with the paper's per-step baseline such
    a step is silent, which makes a judge that votes alike everywhere an absorbing state. None: an
    error vote, or every vote of the group earned the same reward.

    ``weights`` (one per step; ``scorer.judge_balance``'s ``outcome_weights``, which the caller multiplies
    the advantages by): the mean and spread are the weighted ones, so the weighted advantages still sum
    to zero and a judge that votes alike everywhere gets no net push either way."""
    rewards = [consistency_rewards(r, votes) for r, votes in steps]
    ws = [1.0] * len(steps) if weights is None else weights
    present = [(x, w) for rs, w in zip(rewards, ws, strict=True) for x in rs if x is not None]
    values = [x for x, _ in present]
    if len(present) < 2 or max(values) - min(values) <= eps:
        return [[None] * len(rs) for rs in rewards]
    z = iter(zscore(values, eps, [w for _, w in present]))
    return [[next(z) if x is not None else None for x in rs] for rs in rewards]


def outcome_weights(trajs: Sequence[TrajRec]) -> tuple[float, float]:
    """``scorer.judge_balance``'s weights of the consistency advantages of a won trajectory's votes and of
    a lost one's: S / (2·S_won) and S / (2·S_lost), S_won and S_lost the steps of the group's won and
    lost trajectories, S their sum. The steps of each outcome then weigh half of the group's, whatever
    the group's accuracy and however long each outcome's trajectories are; (1, 1) when one outcome has
    no step (the group trains no judge then)."""
    won = sum(len(t.steps) for t in trajs if t.outcome == "won")
    lost = sum(len(t.steps) for t in trajs if t.outcome not in ("won", "aborted"))
    if not won or not lost:
        return 1.0, 1.0
    return (won + lost) / (2 * won), (won + lost) / (2 * lost)


def coding_test_advantages(results: Sequence[Sequence[tuple[bool, bool]]], eps: float = 1e-8) -> list[float]:
    """Coding variant (docs/algorithm.md §2): ``results[j]`` lists (program correct, program passed test j).

    A test that every correct program passes earns the number of incorrect programs that fail it;
    any other test earns minus the number of incorrect programs that pass it; with no incorrect
    program the reward is +1 or -1. Rewards are standardised over the task's tests.
    """
    rewards = []
    for per_program in results:
        correct = [p for ok, p in per_program if ok]
        incorrect = [p for ok, p in per_program if not ok]
        good = all(correct)
        if not incorrect:
            rewards.append(1.0 if good else -1.0)
        elif good:
            rewards.append(float(sum(not p for p in incorrect)))
        else:
            rewards.append(-float(sum(incorrect)))
    return zscore(rewards, eps) if len(rewards) > 1 else [0.0] * len(rewards)


def accuracy(trajs: Sequence[TrajRec]) -> float | None:
    counted = [t for t in trajs if t.outcome != "aborted"]
    if not counted:
        return None
    return sum(t.outcome == "won" for t in counted) / len(counted)


def in_band(acc: float, low: float, high: float) -> bool:
    return low - 1e-12 <= acc <= high + 1e-12


def accept_rewrite(
    direction: Literal["harder", "easier"], parent_acc: float, candidate_acc: float, low: float = 0.2, high: float = 0.8
) -> tuple[bool, str]:
    if direction == "harder":
        if not 0 < candidate_acc:
            return False, f"candidate unsolved (acc {candidate_acc:.3f} = 0)"
        if not candidate_acc < parent_acc:
            return False, f"not harder: acc {candidate_acc:.3f} >= parent {parent_acc:.3f}"
        if not candidate_acc >= low:
            return False, f"too hard: acc {candidate_acc:.3f} < {low}"
        return True, f"0 < {candidate_acc:.3f} < {parent_acc:.3f} and >= {low}"
    if not candidate_acc > parent_acc:
        return False, f"not easier: acc {candidate_acc:.3f} <= parent {parent_acc:.3f}"
    if not candidate_acc <= high:
        return False, f"too easy: acc {candidate_acc:.3f} > {high}"
    return True, f"{candidate_acc:.3f} > {parent_acc:.3f} and <= {high}"


def rewrite_direction(acc: float, low: float = 0.2, high: float = 0.8) -> Literal["harder", "easier"] | None:
    if acc >= high:
        return "harder"
    if acc <= low:
        return "easier"
    return None


def majority(votes: Sequence[VoteRec]) -> Literal[1, -1] | None:
    m = sum(v.value or 0 for v in votes if v.status == "ok")
    return None if m == 0 else (1 if m > 0 else -1)


@dataclass(frozen=True)
class VoteProfile:
    """How a group's votes lean, beside whether they are right (``judge_accuracies``)."""

    positive: float | None
    """share of the parseable votes that are +1"""
    silent: float | None
    """share of the judged steps (two or more votes) whose votes all earned the same consistency
    reward: with the paper's per-step baseline they give the judge no sample (``consistency_advantages``:
    all None); with ``scorer.judge_baseline = "group"`` they are heard"""
    labelled_good: float | None
    """share of the steps with a reference label whose label is +1 (a judge voting -1 everywhere has
    process accuracy 1 - this)"""

    def fields(self) -> dict[str, float | None]:
        """As ``GroupScore``'s fields."""
        return {
            "judge_vote_positive": self.positive,
            "judge_steps_silent": self.silent,
            "steps_labelled_good": self.labelled_good,
        }


def vote_profile(trajs: Sequence[TrajRec], rewards: dict[str, float]) -> VoteProfile:
    """The ``VoteProfile`` of a group (aborted trajectories left out), ``rewards`` its integrated rewards."""
    steps = [s for t in trajs if t.outcome != "aborted" for s in t.steps]
    ok = [v.value for s in steps for v in s.votes if v.status == "ok"]
    judged = [s for s in steps if sum(v.status != "error" for v in s.votes) >= 2]
    silent = [all(a is None for a in consistency_advantages(rewards[s.step_id], s.votes)) for s in judged]
    labels = [s.reference_label for s in steps if s.reference_label is not None]
    return VoteProfile(
        positive=sum(v == 1 for v in ok) / len(ok) if ok else None,
        silent=sum(silent) / len(silent) if silent else None,
        labelled_good=sum(x == 1 for x in labels) / len(labels) if labels else None,
    )


def judge_accuracies(trajs: Sequence[TrajRec]) -> tuple[float | None, float | None]:
    """(process accuracy, outcome accuracy) of the judge on this group.

    Process: the majority vote of a step equals the environment's reference label (ties are
    wrong). Outcome: the trajectory's mean vote is positive iff it was won.
    """
    proc_hits = proc_n = out_hits = out_n = 0
    for t in trajs:
        if t.outcome == "aborted":
            continue
        all_votes: list[VoteRec] = []
        for s in t.steps:
            ok = [v for v in s.votes if v.status != "error"]
            all_votes += ok
            if s.reference_label is not None and ok:
                proc_n += 1
                proc_hits += majority(ok) == s.reference_label
        if all_votes:
            out_n += 1
            out_hits += (mean_vote(all_votes) > 0) == (t.outcome == "won")
    return (proc_hits / proc_n if proc_n else None, out_hits / out_n if out_n else None)
