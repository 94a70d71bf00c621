"""Gymnasium environments as a family: ``env.family = "gym:<module>:<EnvClass or id>"`` (the envs are
in tests/gym_text_env.py). gymnasium is an optional extra: these tests skip without it, except in CI."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from coevo.config import load_config
from coevo.envs import make_family
from coevo.errors import ConfigError, EnvError

if importlib.util.find_spec("gymnasium") is None:
    if os.environ.get("CI"):
        pytest.fail("gymnasium is part of the dev extra: CI must have it", pytrace=False)
    pytest.skip("gymnasium not installed (pip install 'coevo[gym]')", allow_module_level=True)

WALK = "gym:tests.gym_text_env:TextWalk"


def family_of(spec: str, **overrides: object):
    return make_family(load_config(overrides={"env.family": spec, **overrides}).env)


async def play(family, task, actions):
    env = family.make_env()
    obs = await env.reset(task)
    results = []
    try:
        for a in actions:
            results.append(await env.step(a))
            if results[-1].done:
                break
    finally:
        await env.close()
    return obs, results


async def test_a_text_env_class_maps_rewards_and_termination_to_outcomes() -> None:
    family = family_of(WALK)
    assert family.name == WALK and [k.name for k in family.knobs] == ["distance", "slack"]
    task = family.initial_tasks(2, 1, 0)[0]
    assert task.family == WALK and task.knobs == {"distance": 2, "slack": 2}
    obs, results = await play(family, task, ["forward", "forward"])
    assert obs.candidates == ["forward", "back"] and obs.objective == "reach the treasure"
    assert [r.reference_label for r in results] == [1, 1]
    assert results[-1].outcome == "won" and results[-1].info["return"] == 1.0
    _, lost = await play(family, task, ["back"])
    assert lost[-1].outcome == "lost" and lost[-1].reference_label == -1
    _, slow = await play(family, task, ["wait"] * 10)
    assert slow[-1].outcome == "truncated" and len(slow) == 4  # distance + slack


async def test_knobs_are_reset_options_so_the_rewriter_rewrites_gym_tasks() -> None:
    family = family_of(WALK)
    task = family.initial_tasks(1, 0, 0)[0]
    harder = family.apply(task, "distance+")
    assert harder is not None and harder.knobs["distance"] == 3 and harder.family == WALK
    assert (await family.precheck(harder)).ok
    _, results = await play(family, harder, ["forward"] * 3)
    assert [r.outcome for r in results] == [None, None, "won"]


async def test_a_registered_id_and_the_step_cap_of_its_spec() -> None:
    family = family_of("gym:tests.gym_text_env:CoevoTextWalk-v0", **{"env.gym_kwargs": {"distance": 5}})
    assert family.max_steps_cap == 6  # max_episode_steps of the registration (env.max_steps is 50)
    task = family.initial_tasks(1, 0, 0)[0].model_copy(update={"knobs": {"distance": 5, "slack": 4}})
    _, results = await play(family, task, ["forward", "back"] * 5)
    assert len(results) == 6 and results[-1].outcome == "truncated"


async def test_adapters_for_observations_that_are_not_text_and_discrete_actions() -> None:
    spec = "gym:tests.gym_text_env:CountDown"
    with pytest.raises(EnvError, match="gym_observation"):
        await play(family_of(spec), family_of(spec).initial_tasks(1, 0, 0)[0], [])
    family = family_of(spec, **{"env.gym_observation": "tests.gym_text_env:count_text"})
    task = family.initial_tasks(1, 0, 0)[0]
    obs, results = await play(family, task, ["count down"] * 3)
    assert obs.text == "the counter shows 3." and obs.candidates == ["give up", "count down"]
    assert results[-1].outcome == "won"
    _, gave_up = await play(family, task, ["give up"])
    assert gave_up[-1].outcome == "lost"  # info["won"] decides over the return
    _, wasted = await play(family, task, ["dance", "count down"])
    assert wasted[0].info["feedback"] == "invalid action" and not wasted[0].done


def test_bad_specs_fail_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="not gym:<module>"):
        load_config(overrides={"env.family": "gym:no-colon"})
    with pytest.raises(ValueError, match="gymnasium knows no id 'Nope-v0'"):
        family_of("gym:tests.gym_text_env:Nope-v0")
    with pytest.raises(ValueError, match=r"not a gymnasium\.Env"):
        family_of("gym:tests.gym_text_env:count_text")


@pytest.mark.slow
def test_coevo_run_trains_on_a_gymnasium_env(tmp_path: Path, model_cache: Path) -> None:
    from tests.test_byo_plugin import run_coevo

    summary, events = run_coevo(tmp_path, model_cache, "gym", "--family", WALK, "--steps", "2", "--minutes", "5")
    assert summary["learner_steps"] >= 2
    steps = [e for e in events if e.kind == "step.taken"]
    assert steps and {e.candidates[0] for e in steps} == {"forward"}  # type: ignore[attr-defined]
    outcomes = {e.outcome for e in events if e.kind == "trajectory.completed"}  # type: ignore[attr-defined]
    assert {"won", "lost"} <= outcomes
    assert all(e.task.family == WALK for e in events if e.kind == "task.scheduled")  # type: ignore[attr-defined]
