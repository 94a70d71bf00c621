"""The soak benchmark's estimators, on series with a known answer (pure, no run)."""

from __future__ import annotations

import math

from coevo.bench.soak import robust_slope_per_hour, slope_per_hour, summarize_samples, window_medians


def _sawtooth(leak_mb_per_h: float, minutes: int = 30, every_s: float = 15.0) -> list[tuple[float, float]]:
    """1 GB plus a leak, plus a ±300 MB swing every 7 minutes that ends at its peak."""
    out = []
    for k in range(int(minutes * 60 / every_s)):
        t = k * every_s
        swing = 300.0 * math.sin(2 * math.pi * t / 420.0 + 1.0)
        out.append((t, 1000.0 + leak_mb_per_h * t / 3600 + swing))
    return out


def test_straight_lines_give_their_slope() -> None:
    line = [(t, 50.0 + 2.0 * t) for t in range(0, 600, 10)]
    assert robust_slope_per_hour(line) == 7200.0
    assert abs(slope_per_hour(line) - 7200.0) < 1e-6
    assert robust_slope_per_hour([(0.0, 1.0)]) == 0.0
    assert robust_slope_per_hour([(5.0, 1.0), (5.0, 9.0)]) == 0.0  # no two distinct times


def test_theil_sen_ignores_a_few_spikes_least_squares_does_not() -> None:
    flat = [(float(t), 1000.0) for t in range(0, 1800, 15)]
    spiked = [(t, v + (400.0 if t > 1700 else 0.0)) for t, v in flat]  # the run ends on a swing up
    assert robust_slope_per_hour(spiked) == 0.0
    assert slope_per_hour(spiked) > 100.0


def test_the_estimators_on_a_sawtooth_with_and_without_a_leak() -> None:
    flat, leaky = _sawtooth(0.0), _sawtooth(120.0)
    assert abs(robust_slope_per_hour(flat)) < abs(slope_per_hour(flat))
    assert abs(robust_slope_per_hour(flat)) < 60.0
    assert robust_slope_per_hour(leaky) - robust_slope_per_hour(flat) > 80.0  # a real leak still shows


def test_window_medians_and_summary() -> None:
    samples = [(float(t), float(t // 300)) for t in range(0, 900, 15)]
    assert window_medians(samples) == [(0.0, 0.0), (300.0, 1.0), (600.0, 2.0)]
    summary = summarize_samples([(t, {"rss_coevo_mb": v, "stream_mb": 2 * v}) for t, v in samples])
    assert summary["samples"] == 60
    assert summary["window_medians"] == {"rss_coevo_mb": [[0, 0.0], [300, 1.0], [600, 2.0]]}
    assert summary["max"] == {"rss_coevo_mb": 2.0}
    slopes = summary["robust_slope_per_hour"]
    assert slopes["rss_coevo_mb"] > 0 and abs(slopes["stream_mb"] - 2 * slopes["rss_coevo_mb"]) < 0.02


def test_soak_passes_the_run_its_flags_after_the_separator() -> None:
    from coevo.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "soak", "--minutes", "1", "--set", "agent.heap_trim_s=0", "--", "--family", "quickgame", "--lora"]
    )
    assert args.set == ["agent.heap_trim_s=0"] and args.run_args == ["--family", "quickgame", "--lora"]
