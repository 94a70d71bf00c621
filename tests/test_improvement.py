"""What a finished run may say improved (#39 item 7): only with a 95 % interval that lies above 0,
else "no clear change", or "too few groups to say" below MIN_GROUPS groups a window (pure)."""

from __future__ import annotations

from coevo.config import load_config
from coevo.observe.claims import MIN_GROUPS, bootstrap_interval, change
from coevo.observe.closing import describe
from coevo.observe.tally import Interval, RunTally


def test_a_clear_rise_is_improved_with_its_interval() -> None:
    c = change([0.0, 0.125, 0.25, 0.125, 0.0, 0.25], [0.75, 0.875, 1.0, 0.875, 0.75, 1.0])
    assert c is not None and c.verdict == "improved"
    low, high = c.interval  # type: ignore[misc]
    assert 0 < low < c.diff < high <= 1.0 and abs(c.diff - 0.75) < 1e-9
    assert c.words().startswith("improved, +0.75, 95 % interval +")


def test_noise_is_no_clear_change_and_a_fall_is_a_fall() -> None:
    first, last = [0.0, 1.0, 0.5, 0.0, 1.0, 0.5], [0.5, 0.0, 1.0, 1.0, 0.0, 0.75]
    c = change(first, last)
    assert c is not None and c.diff > 0 and c.verdict == "no clear change"  # a higher mean, but not a claim
    fell = change([0.9] * 6 + [1.0] * 4, [0.1] * 5 + [0.2] * 5)
    assert fell is not None and fell.verdict == "fell"


def test_too_few_groups_to_say() -> None:
    """The issue's run: 8 train groups, one a fifth; a held-out curve 0.12 -> 0.87 -> 0.48."""
    c = change([0.12], [0.87])
    assert c is not None and c.interval is None and c.verdict == "too few groups to say"
    assert "too few groups to say: 1 and 1 in the two windows, 5 needed in each" in c.words()
    assert change([0.5] * (MIN_GROUPS - 1), [1.0] * 9).verdict == "too few groups to say"  # type: ignore[union-attr]
    assert change([], [1.0]) is None


def test_the_interval_is_seeded_and_covers_the_difference() -> None:
    a, b = [0.1, 0.3, 0.2, 0.4, 0.3, 0.2, 0.1], [0.5, 0.6, 0.4, 0.7, 0.5]
    assert bootstrap_interval(a, b) == bootstrap_interval(a, b)
    low, high = bootstrap_interval(a, b)
    assert low < sum(b) / len(b) - sum(a) / len(a) < high
    same = bootstrap_interval([0.5] * 6, [0.5] * 6)
    assert same == (0.0, 0.0)


def test_the_closing_lines_say_the_claim_with_its_uncertainty() -> None:
    cfg = load_config()
    base = {**RunTally().summary("r1", 90.0).model_dump(), "learner_steps": 3, "groups_scored": 8}
    few = {
        **base,
        "policy_success_start": 0.25,
        "policy_success_end": 0.75,
        "policy_success_change": Interval.of([0.25], [0.75]).model_dump(),  # type: ignore[union-attr]
        "heldout_success_start": 0.12,
        "heldout_success_end": 0.48,
        "heldout_success_rounds": [0.12, 0.87, 0.48],
        "heldout_success_change": Interval.of([0.12] * 2, [0.48] * 2).model_dump(),  # type: ignore[union-attr]
    }
    text = describe(few, cfg, {})
    assert "improved" not in text
    assert "policy success on train groups: 0.25 -> 0.75 (+0.50, too few groups to say: 1 and 1" in text
    assert "held-out success: 0.12 -> 0.48 (+0.36, too few groups to say" in text and "rounds 0.12 0.87 0.48" in text
    many = {
        **few,
        "policy_success_change": Interval.of([0.25] * 5 + [0.0] * 5, [0.75] * 5 + [1.0] * 5).model_dump(),  # type: ignore[union-attr]
    }
    assert "0.25 -> 0.75 (improved, +0.50, 95 % interval +" in describe(many, cfg, {})
