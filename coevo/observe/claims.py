"""What a run may claim changed between two windows of groups, with its uncertainty (pure).

Invariant: "improved" (or "fell") is said only when the 95 % bootstrap interval of the difference of
the two windows' mean group success lies wholly above (below) zero; with fewer than ``MIN_GROUPS``
groups in a window no interval is computed and the verdict is that the sample is too small to say.
The same inputs always give the same interval (the resampling is seeded).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

MIN_GROUPS = 5
"""fewest groups per window for an interval: below it, "too few groups to say" """
RESAMPLES = 2000
"""bootstrap resamples of each window"""

Verdict = Literal["improved", "fell", "no clear change", "too few groups to say"]


@dataclass(frozen=True)
class Change:
    """``end - start`` of two windows' mean group success, and its 95 % interval (None: too few groups)."""

    start: float
    end: float
    n_start: int
    n_end: int
    interval: tuple[float, float] | None

    @property
    def diff(self) -> float:
        return self.end - self.start

    @property
    def verdict(self) -> Verdict:
        if self.interval is None:
            return "too few groups to say"
        low, high = self.interval
        return "improved" if low > 0 else "fell" if high < 0 else "no clear change"

    def words(self) -> str:
        """``improved, +0.20, 95 % interval +0.08 to +0.31`` / ``too few groups to say: 1 and 1, 5 needed``."""
        if self.interval is None:
            return (
                f"{self.diff:+.2f}, too few groups to say: {self.n_start} and {self.n_end} in the two "
                f"windows, {MIN_GROUPS} needed in each"
            )
        low, high = self.interval
        return f"{self.verdict}, {self.diff:+.2f}, 95 % interval {low:+.2f} to {high:+.2f}"


def change(first: Sequence[float], last: Sequence[float], *, seed: int = 0) -> Change | None:
    """The change from the groups of ``first`` to those of ``last`` (each a group's success); None
    when either window is empty."""
    if not first or not last:
        return None
    start, end = statistics.fmean(first), statistics.fmean(last)
    interval = None
    if len(first) >= MIN_GROUPS and len(last) >= MIN_GROUPS:
        interval = bootstrap_interval(first, last, seed=seed)
    return Change(start, end, len(first), len(last), interval)


def bootstrap_interval(
    first: Sequence[float], last: Sequence[float], *, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(last) - mean(first)``, each window resampled with
    replacement on its own (the groups are independent; the windows need not be the same size)."""
    rng = random.Random(seed)
    diffs = sorted(
        statistics.fmean(rng.choices(last, k=len(last))) - statistics.fmean(rng.choices(first, k=len(first)))
        for _ in range(RESAMPLES)
    )
    tail = (1 - level) / 2
    low = diffs[int(tail * (RESAMPLES - 1))]
    high = diffs[round((1 - tail) * (RESAMPLES - 1))]
    return round(low, 4), round(high, 4)


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a success rate over ``n`` episodes (pure)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre, spread = p + z * z / (2 * n), z * ((p * (1 - p) + z * z / (4 * n)) / n) ** 0.5
    scale = 1 + z * z / n
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def steps_verdict(steps: dict[str, Any]) -> str:
    """The closing summary's step-agreement line (pure): the base and the run's last policy on the
    reader's path through the held-out tasks, the change with its paired interval, and the habits beside
    it; the last policy clears a bar only where its interval's low end lies above it."""
    bars = {**steps["habits"], "base greedy": steps["base greedy"]}
    shown = ", ".join(f"{name} {value:.2f}" for name, value in bars.items())
    under = [name for name, value in bars.items() if steps["low"] <= value]
    said = "clears base and habits" if not under else f"does not clear {', '.join(under)}"
    change = steps["change"]
    return (
        f"held-out step agreement: {steps['base']:.2f} -> {steps['trained']:.2f} ({change['mean']:+.2f}, paired 95 % "
        f"interval {change['low']:+.2f} to {change['high']:+.2f}; base vs last policy, on the reader's path: "
        f"{steps['states']} states); beside it {shown}; the last policy's interval (from {steps['low']:.3f}) {said}"
    )


def run_verdict(end: float, episodes: int, bars: dict[str, float]) -> str:
    """The closing summary's words for the last held-out round against ``bars`` (pure): above them only
    where the round's 95 % interval (Wilson, over its ``episodes``) clears each."""
    low, _ = wilson(end * episodes, episodes)
    shown = ", ".join(f"{name} {value:.2f}" for name, value in bars.items())
    under = [name for name, value in bars.items() if name != "reader" and low <= value]
    # three decimals: a low end of 0.004 clears a bar of 0.00, and "from 0.00" would not say why
    said = "clears base and habits" if not under else f"does not clear {', '.join(under)}"
    return f"beside it on the same tasks: {shown}; the last round's interval (from {low:.3f}) {said}"
