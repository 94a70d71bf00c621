"""The CI version of ``coevo bench chaos``: a short loop of agent processes on a 3-node cluster while
agents are kill -9'd, a NATS node dies and garbage arrives on every subject; judged from the stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from coevo.bench.chaos import ChaosPlan, bench_chaos

pytestmark = pytest.mark.slow


async def test_nothing_is_lost_or_trained_twice_under_faults(model_cache: Path, tmp_path: Path) -> None:
    plan = ChaosPlan(minutes=1.5, kill_every_s=6.0, node_every_s=40.0, node_down_s=5.0, drain_s=150.0, seed=1)
    result = await bench_chaos(plan, cache=model_cache, baseline=False, workdir=tmp_path)
    chaos = result["chaos"]
    assert chaos["groups_scheduled"] >= 20, chaos
    assert chaos["groups_lost"] == 0, chaos["lost_examples"]
    assert chaos["groups_trained_twice"] == 0
    assert chaos["learner_versions_monotonic"]
    assert chaos["learner_steps"] >= 3
    assert chaos["faults"].get("nats node killed", 0) >= 1
    assert sum(n for f, n in chaos["faults"].items() if f.startswith("kill -9")) >= 8
    assert sum(chaos["dead_lettered"].values()) >= chaos["faults"]["garbage messages"] // 2  # garbage is refused
