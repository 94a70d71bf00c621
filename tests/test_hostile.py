"""The hostile-client bench (coevo.bench.hostile): an episode-key and an agent-key holder attack the policy
endpoint of a real run (embedded nats-server, the tiny models, the real learner) while honest agents play.
The run must stay up with finite weights, lose no recorded step, train no group twice, answer every hostile
request with a 4xx (never a 5xx, never a 200 for a reward that is not a bounded number), and train the
honest agents' groups. Against the code before issue 36's fixes a 1e39 reward made every tensor NaN."""

from __future__ import annotations

from pathlib import Path

import pytest

from coevo.bench.hostile import ATTACKS, HostilePlan, attack_verdict, bench_hostile, stream_verdict
from coevo.schemas import Source, StepTaken, TrajectoryCompleted


def test_a_volley_is_judged_by_what_a_sound_endpoint_answers() -> None:
    assert attack_verdict("refused", [400, 403, 409, 413, 429]) is None
    assert "accepted" in (attack_verdict("refused", [400, 200]) or "")
    assert "5xx" in (attack_verdict("refused", [400, 500]) or "")
    assert "not answered" in (attack_verdict("no_5xx", [200, 0]) or "")
    assert attack_verdict("no_5xx", [200, 429, 403]) is None
    assert attack_verdict("one_accepted", [200, 409, 409, 401]) is None
    assert "exactly 1" in (attack_verdict("one_accepted", [200, 200, 409]) or "")
    assert "exactly 1" in (attack_verdict("one_accepted", [409, 409]) or "")


def test_structured_output_attacks_are_refused_before_compiling_and_the_cotenant_is_timed() -> None:
    """The bench's schema attacks: each over a budget or holding a keyword no grammar enforces (the pure
    check refuses it, so the endpoint answers 400 before any compile); the heavy one is within budget."""
    from coevo.bench.hostile import latency_report
    from coevo.bench.hostile_clients import HEAVY_SCHEMA, OVER_BUDGET_SCHEMAS
    from coevo.errors import GrammarError
    from coevo.inference.grammar import json_grammar

    assert ATTACKS["structured_output_schemas"][0] == "refused"
    for name, schema in OVER_BUDGET_SCHEMAS:
        with pytest.raises(GrammarError):
            json_grammar(schema)
        assert name
    assert json_grammar(HEAVY_SCHEMA)
    report = latency_report({"before": [10.0, 30.0, 20.0], "during": [float("nan"), 50.0]})
    assert report["before"] == {"calls": 3, "not_answered": 0, "median_ms": 20.0, "max_ms": 30.0}
    assert report["during"] == {"calls": 2, "not_answered": 1, "median_ms": 50.0, "max_ms": 50.0}


def test_the_harness_error_lives_with_the_others() -> None:
    from coevo import errors
    from coevo.bench import hostile_clients

    assert hostile_clients.HarnessError is errors.HarnessError and issubclass(errors.HarnessError, errors.CoevoError)


def _step(trajectory: str, index: int, reward: float | None = None) -> StepTaken:
    return StepTaken(
        run_id="r",
        source=Source(agent_id="p-1", role="policy"),
        trajectory_id=trajectory,
        task_id="t",
        group_id="g",
        step_index=index,
        observation="o",
        policy_version=0,
        env_reward=reward,
    )


def _completed(trajectory: str, steps: int) -> TrajectoryCompleted:
    return TrajectoryCompleted(
        run_id="r",
        source=Source(agent_id="p-1", role="policy"),
        trajectory_id=trajectory,
        task_id="t",
        group_id="g",
        outcome="won",
        num_steps=steps,
    )


def test_the_stream_verdict_counts_every_way_a_recorded_step_goes_missing() -> None:
    events = [
        _step("a", 0),
        _step("a", 2, reward=1e39),  # index 1 missing: a gap
        _completed("a", 3),
        _step("b", 0),
        _completed("b", 2),  # says 2 steps, 1 stored
        _completed("b", 2),  # ended twice
        _step("c", 0, reward=0.5),
        _step("c", 0),  # stored twice
    ]
    v = stream_verdict(events, {"a": {0, 1, 2}, "b": {0}, "d": {0, 1}}, opened=["a", "b", "c", "d"])
    assert v["steps_lost_accepted_not_stored"] == 3  # a:1, d:0 and d:1
    assert v["steps_lost_index_gaps"] == 1
    assert v["steps_lost_fewer_than_completed_says"] == 1 + 1  # a: 2 of 3, b: 1 of 2
    assert v["steps_lost"] == 3 + 1 + 2
    assert v["steps_stored_twice"] == 1 and v["trajectories_completed_twice"] == 1
    assert v["episodes_never_completed"] == 2  # c and d
    assert v["env_rewards_not_finite_in_float32"] == 1 and v["env_reward_max_abs"] == 1e39
    clean = stream_verdict([_step("a", 0), _step("a", 1), _completed("a", 2)], {"a": {0, 1}}, opened=["a"])
    assert clean["steps_lost"] == 0 and clean["episodes_never_completed"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_hostile_clients_poison_nothing_and_honest_agents_are_trained(tmp_path: Path, model_cache: Path) -> None:
    plan = HostilePlan(seconds=20.0, honest=2, repeat=1, flood=36, finishes=6, attack_limit_s=240.0)
    r = await bench_hostile(plan, cache=model_cache, workdir=tmp_path)
    wrong = {name: r["attacks"][name]["violations"] for name in r["attacks_answered_wrongly"]}
    assert r["attacks_complete"] and not wrong, wrong
    assert {name.split("/")[0] for name in r["attacks"]} == set(ATTACKS)
    for name in ("step_reward_not_bounded", "finish_reward_not_bounded"):  # never a 200 for such a reward
        for holder in ("episode", "agent"):
            statuses = r["attacks"][f"{name}/{holder}"]["statuses"]
            assert all(400 <= int(s) < 500 for s in statuses), (name, holder, statuses)
    assert r["status_5xx_or_none"] == 0 and r["endpoint_errors_500"] == 0
    assert r["stayed_up"], r["up"]
    assert r["flood_orphans"] == 0  # concurrent rotations of one agent key end each other's episodes
    assert r["weights_not_finite"] == 0, r["weights"]
    assert {"learner_policy_model", "published_policy", "engine_policy"} <= r["weights"].keys()
    assert all(w["tensors"] > 0 for w in r["weights"].values())
    assert r["steps_lost"] == 0 and r["steps_recorded_not_stored"] == 0, r["lost_examples"]
    assert r["steps_accepted"] > 0 and r["steps_stored"] == r["endpoint_steps_recorded"]
    assert r["env_rewards_not_finite_in_float32"] == 0
    assert r["groups_trained_twice"] == 0 and r["trajectories_completed_twice"] == 0
    assert r["episodes_never_completed"] == 0 and r["victims_touched"] == 0
    assert r["honest"]["groups_trained"] > 0 and r["learner_steps"] > 0, r["honest"]
    assert r["ok"]
