"""Families as plugins: a separate distribution registers one under the entry-point group
``coevo.families`` (tests/plugin_site holds it: a package and its ``.dist-info`` with real entry
points, found by ``importlib.metadata`` once the folder is on ``sys.path``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from coevo.config import load_config, registered_families
from coevo.envs import make_family
from coevo.errors import ConfigError
from coevo.schemas import Event
from tests.conftest import PYTHON, REPO, subprocess_env

PLUGIN_SITE = REPO / "tests" / "plugin_site"


@pytest.fixture
def plugin_on_path(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(PLUGIN_SITE))
    return PLUGIN_SITE


def test_a_family_is_found_through_its_entry_point(plugin_on_path: Path) -> None:
    from importlib.metadata import distribution

    assert distribution("coevo-demo-family").version == "0.1.0"  # a real distribution, not a patch
    assert {"demo-counter", "demo-broken"} <= set(registered_families())
    cfg = load_config(overrides={"env.family": "demo-counter"})
    family = make_family(cfg.env)
    assert family.name == "demo-counter" and [k.name for k in family.knobs] == ["target", "hints"]
    tasks = family.initial_tasks(2, 1, 0)
    assert [t.split for t in tasks] == ["train", "train", "heldout"] and all(t.family == "demo-counter" for t in tasks)


def test_coevo_s_own_families_are_entry_points_like_a_plugin_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import distribution

    own = {ep.name: ep.value for ep in distribution("coevo").entry_points if ep.group == "coevo.families"}
    assert set(own) == {"quickgame", "quickgame-hard", "textworld", "coding", "arithmetic"} | {
        "tw-coin_collector",
        "tw-treasure_hunter",
        "tw-cooking",
    }
    for name in own:
        assert make_family(load_config(overrides={"env.family": name}).env).name == name
    # a second distribution registering one of those names: refused, naming both, not a silent pick
    info = tmp_path / "coevo_twin-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: coevo-twin\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[coevo.families]\ncoding = coevo.envs.quickgame:QuickGame\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"registered twice.*coevo.envs.coding:family.*coevo.envs.quickgame:QuickGame"):
        make_family(load_config(overrides={"env.family": "coding"}).env)


async def test_a_plugin_family_plays_rewrites_and_prechecks(plugin_on_path: Path) -> None:
    family = make_family(load_config(overrides={"env.family": "demo-counter"}).env)
    task = family.initial_tasks(1, 0, 0)[0]
    env = family.make_env()
    obs = await env.reset(task)
    assert obs.candidates == ["add 1", "add 2"]
    result = None
    for _ in range(family.max_steps_cap):
        result = await env.step("add 1")
        if result.done:
            break
    assert result is not None and result.outcome == "won"
    harder = family.apply(task, family.operators("harder")[0])
    assert harder is not None and harder.knobs["target"] == task.knobs["target"] + 1
    assert harder.parent_id == task.task_id and harder.family == "demo-counter"
    assert (await family.precheck(harder)).ok
    bad = harder.model_copy(update={"knobs": {"target": 99, "hints": 0}})
    assert not (await family.precheck(bad)).ok


def test_unknown_and_broken_plugins_fail_clearly(plugin_on_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"env\.family: .*unknown family 'demo-typo'.*demo-counter"):
        load_config(overrides={"env.family": "demo-typo"})
    with pytest.raises(TypeError, match=r"not a coevo\.envs\.base\.Family"):
        make_family(load_config(overrides={"env.family": "demo-broken"}).env)


def test_without_the_distribution_the_name_is_unknown() -> None:
    with pytest.raises(ConfigError, match="unknown family 'demo-counter'"):
        load_config(overrides={"env.family": "demo-counter"})


# ---- `coevo run` on a family from elsewhere --------------------------------------------------------

RUN_FLAGS = [
    "--set",
    "policy.n=4",
    "--set",
    "env.n_train=2",
    "--set",
    "env.n_heldout=1",
    "--set",
    "learner.batch_samples=8",
    "--set",
    "judge.m=2",
    "--set",
    "tasks.band=[0.49, 0.51]",
    "--set",
    "tasks.min_groups_between_rewrites=0",
    "--log.console",
    "off",
    "--no-dashboard",
    "--no-report",
]


def run_coevo(
    tmp_path: Path, model_cache: Path, run_id: str, *args: str, pythonpath: tuple[Path, ...] = (), timeout: float = 420
) -> tuple[dict[str, Any], list[Event]]:
    """``coevo run`` as a process (its own embedded NATS); its summary and every event of its stream."""
    from coevo.tools.events import open_run

    runs = tmp_path / "runs"
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env["PYTHONPATH"]])
    proc = subprocess.run(
        [
            PYTHON,
            "-m",
            "coevo",
            "run",
            "--run-id",
            run_id,
            "--run.runs_dir",
            str(runs),
            "--env.cache_dir",
            str(model_cache),
            *RUN_FLAGS,
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    summary = json.loads((runs / run_id / "summary.json").read_text())

    async def read() -> list[Event]:
        async with open_run(run_id, runs) as bus:
            return await bus.events()

    return summary, asyncio.run(read())


@pytest.mark.slow
def test_coevo_run_trains_on_a_plugin_family(tmp_path: Path, model_cache: Path) -> None:
    summary, events = run_coevo(
        tmp_path,
        model_cache,
        "plugin",
        "--family",
        "demo-counter",
        "--steps",
        "2",
        "--minutes",
        "5",
        # The rewrite is asserted by construction, not by timing: no accuracy of 4 trajectories (0, 1/4 ...
        # 1) lies in this band, so the first train group the tasks agent scores is rewritten before it
        # schedules another; and 2 steps of 4 scored groups each need 8 groups, more than the 4 it
        # schedules before it has scored one. (Stepping on samples, a loaded machine stepped twice first.)
        "--set",
        "tasks.band=[0.3, 0.45]",
        "--set",
        "learner.batch_groups=4",
        pythonpath=(PLUGIN_SITE,),
    )
    assert summary["learner_steps"] >= 2
    scheduled = [e for e in events if e.kind == "task.scheduled"]
    assert scheduled and all(e.task.family == "demo-counter" for e in scheduled)  # type: ignore[attr-defined]
    stepped = [e for e in events if e.kind == "learner.stepped" and e.role == "policy"]  # type: ignore[attr-defined]
    trained = {g for e in stepped for g in e.group_ids}  # type: ignore[attr-defined]
    assert trained <= {e.group_id for e in scheduled}  # type: ignore[attr-defined]
    rewritten = [e for e in events if e.kind == "task.rewritten"]
    assert rewritten and all(e.parent.family == "demo-counter" for e in rewritten)  # type: ignore[attr-defined]
    assert any(e.precheck_ok for e in rewritten)  # type: ignore[attr-defined]  # the plugin's precheck ran
