"""The entropy bonus's coefficient per batch (docs/algorithm.md §3): a pure decision, no I/O.

Fixed (``learner.entropy_target`` unset): every batch is trained with η = ``learner.entropy_coef``.

Adaptive (a target H* in nats per response token): the lane keeps a coefficient c, starting at
``entropy_coef``. Each batch's entropy H is measured before its step, under the weights being trained
(``StepMetrics.entropy``); then

    c ← clip(c + Δ, 0, c_max)  if H < H*,   else clip(c − Δ, 0, c_max)
    η = c if H < H*, else 0

with Δ = ``entropy_coef_step`` and c_max = ``entropy_coef_max``. So a policy at or above its target
is trained exactly as without a bonus, and one below it is pushed back harder for every batch it stays
there. The bonus has to act before a collapse: a policy that always plays one line leaves every group
unanimous, and a batch that never comes cannot carry a bonus.

Invariants: c stays in [0, c_max] (given a start inside it); η is 0 or c; every rank decides alike,
because H is averaged over ranks before the decision.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EntropyControl:
    """What decides η: the target (None: fixed), the coefficient's step and its bound."""

    target: float | None
    step: float
    most: float

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def bounded(self, coef: float) -> float:
        """``coef`` within [0, c_max] (an adaptive coefficient resumed under a lower bound, or a step)."""
        return min(self.most, max(0.0, coef))

    def decide(self, coef: float, entropy: float) -> tuple[float, float]:
        """(η for this batch, the coefficient after it), for a batch of ``entropy`` nats per token
        trained while the coefficient is ``coef``."""
        if self.target is None:
            return coef, coef
        below = entropy < self.target
        after = self.bounded(coef + (self.step if below else -self.step))
        return (after if below else 0.0), after
