"""External LLM APIs through LiteLLM, offline: LiteLLM's own mock_response drives every case."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coevo.agents.judge import JudgeAgent
from coevo.agents.scorer import Group, score_group
from coevo.algorithm.rewriter import LLMRewriter
from coevo.config import ApiConfig, CoevoConfig, load_config
from coevo.envs.quickgame import QuickGame
from coevo.errors import ExternalCallFailed, OverBudget
from coevo.inference.litellm_client import LiteLLMClient
from coevo.runtime.agent import run_agents
from coevo.runtime.bus import NatsBus
from coevo.schemas import (
    FailureDigest,
    GroupScored,
    Source,
    StepJudged,
    StepTaken,
    TaskScheduled,
    TaskSpec,
    TrajectoryCompleted,
)
from tests.conftest import PYTHON, REPO, subprocess_env
from tests.samples import sample_events

MODEL = "openai/gpt-4.1-mini"  # in LiteLLM's bundled price map, so costs are real numbers
SRC = Source(agent_id="test", role="test")


def api(**kw) -> ApiConfig:
    return ApiConfig(**{"backoff_s": 0.01, "retries": 2, **kw})


def judge_cfg(base: CoevoConfig, **api_kw) -> CoevoConfig:
    return load_config(
        overrides={
            "run.runs_dir": str(base.run.runs_dir),
            "judge.backend": "litellm",
            "judge.model": MODEL,
            "judge.m": 3,
            "log.console": "off",
            "bus.fetch_timeout_s": 0.2,
            "agent.heartbeat_s": 0.5,
            **{f"judge.api.{k}": v for k, v in {"backoff_s": 0.01, **api_kw}.items()},
        }
    )


def step(run_id: str, i: int, group: str = "g") -> StepTaken:
    """Each step's judge prompt differs (the room), so no vote is a cache hit of another step's."""
    return StepTaken(
        run_id=run_id,
        source=SRC,
        trajectory_id=f"{group}-t{i}",
        task_id="t",
        group_id=group,
        step_index=0,
        objective="take the coin",
        observation=f"room: hall {i}. items: coin.",
        action_text="take coin",
        next_observation="you take the coin.",
        done=True,
        policy_version=0,
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        logprobs=[-0.5],
    )


async def judge_steps(bus: NatsBus, cfg: CoevoConfig, steps: list[StepTaken]) -> tuple[JudgeAgent, list[StepJudged]]:
    agent = JudgeAgent(bus, cfg)
    for s in steps:
        await bus.publish(s)
    await bus.flush()
    stop = asyncio.Event()

    async def until() -> None:
        async with asyncio.timeout(60):
            while len(await bus.events(["step.judged"])) < len(steps):
                await asyncio.sleep(0.1)
        stop.set()

    await asyncio.gather(run_agents([agent], handle_signals=False, until=stop), until())
    return agent, [e for e in await bus.events(["step.judged"]) if isinstance(e, StepJudged)]


def won_and_lost_group(run_id: str, steps: list[StepTaken], judged: list[StepJudged]) -> Group:
    """A group of two one-step trajectories, the first won, the second lost."""
    g = Group(
        scheduled=TaskScheduled(
            run_id=run_id, source=SRC, task=TaskSpec(task_id="t", family="quickgame"), group_id="g", n_rollouts=2
        )
    )
    for s, outcome in zip(steps, ("won", "lost"), strict=True):
        g.add(s)
        g.add(
            TrajectoryCompleted(
                run_id=run_id,
                source=SRC,
                trajectory_id=s.trajectory_id,
                task_id="t",
                group_id="g",
                rollout_index=int(s.trajectory_id[-1]),
                outcome=outcome,
                num_steps=1,
                step_event_ids=[s.event_id],
            )
        )
    for j in judged:
        g.add(j)
    return g


async def test_mocked_judge_votes_reach_the_scorer_with_the_right_numbers(bus: NatsBus, cfg: CoevoConfig) -> None:
    jcfg = judge_cfg(cfg, mock_response=r"The agent took the coin, which wins. \boxed{1}")
    steps = [step(bus.run_id, i) for i in range(2)]
    _, judged = await judge_steps(bus, jcfg, steps)
    assert all(
        v.value == 1 and v.status == "ok" and not v.cached and v.cost_usd > 0 and v.model_version is None
        for j in judged
        for v in j.votes
    )
    g = won_and_lost_group(bus.run_id, steps, judged)
    score = score_group(g, jcfg, train_judge=False)
    # R = O + mean(votes) = 2 (won) and 0 (lost); one step index: z-scores +1 / -1
    assert sorted(s.advantage for s in score.policy_samples) == pytest.approx([-1.0, 1.0])
    assert score.judge_samples == []  # an external judge is not trained
    assert score.judge_consistency == pytest.approx((2 * 3 + 0 * 3) / 6)  # R·S over the six +1 votes
    assert score.judge_vote_positive == 1.0 and score.judge_steps_silent == 1.0  # unanimous: nothing to learn
    assert score.accuracy == 0.5


async def test_a_judge_does_not_judge_the_steps_of_a_group_already_scored(bus: NatsBus, cfg: CoevoConfig) -> None:
    """A step comes after its group was scored (the scorer stopped waiting for its votes): the judge
    acknowledges it unjudged, counts it, and judges the steps of a group still open."""
    agent = JudgeAgent(bus, judge_cfg(cfg, mock_response=r"\boxed{1}"))
    group = next(e for e in sample_events(bus.run_id) if isinstance(e, GroupScored))
    scored = group.model_copy(update={"group_id": "done"})
    stop = asyncio.Event()

    async def scenario() -> None:
        async with asyncio.timeout(60):
            await bus.publish(scored)
            while not agent.scored("done").is_set():  # the judge has read the score
                await asyncio.sleep(0.05)
            await bus.publish(step(bus.run_id, 0, group="done"))
            await bus.publish(step(bus.run_id, 1, group="open"))
            while not (agent.counters["steps.skipped_scored"] and await bus.events(["step.judged"])):
                await asyncio.sleep(0.05)
        stop.set()

    await asyncio.gather(run_agents([agent], handle_signals=False, until=stop), scenario())
    judged = [e for e in await bus.events(["step.judged"]) if isinstance(e, StepJudged)]
    assert [j.group_id for j in judged] == ["open"] and agent.counters["steps.skipped_scored"] == 1
    assert [v.value for v in judged[0].votes] == [1, 1, 1]


async def test_a_judge_abandons_the_votes_in_flight_of_a_group_scored_meanwhile(bus: NatsBus, cfg: CoevoConfig) -> None:
    """The scorer scores a group while the judge's votes on one of its steps are in flight (each mocked
    answer takes 60 s): the judge cancels them at once, acknowledges the step unjudged and counts it."""
    agent = JudgeAgent(bus, judge_cfg(cfg, mock_response=r"\boxed{1}", mock_delay_s=60.0))
    group = next(e for e in sample_events(bus.run_id) if isinstance(e, GroupScored))
    stop = asyncio.Event()

    async def scenario() -> None:
        async with asyncio.timeout(30):  # well inside one mocked answer
            await bus.publish(step(bus.run_id, 0, group="slow"))
            while "slow" not in agent._groups:  # the judge is asking for its votes
                await asyncio.sleep(0.05)
            await bus.publish(group.model_copy(update={"group_id": "slow"}))
            while not agent.counters["steps.abandoned_scored"]:
                await asyncio.sleep(0.05)
        stop.set()

    await asyncio.gather(run_agents([agent], handle_signals=False, until=stop), scenario())
    assert await bus.events(["step.judged"]) == [] and agent.counters["steps.skipped_scored"] == 0


async def test_rate_limit_then_success(bus: NatsBus, cfg: CoevoConfig) -> None:
    client = LiteLLMClient(MODEL, api(mock_response=["litellm.RateLimitError", r"\boxed{-1}"]))
    c = await client.complete("judge this", max_tokens=32)
    assert c.text == r"\boxed{-1}" and client.errors == 0 and client.calls == 1


async def test_persistent_failure_gives_error_votes_and_a_flagged_group(bus: NatsBus, cfg: CoevoConfig) -> None:
    jcfg = judge_cfg(cfg, mock_response="litellm.RateLimitError", retries=1)
    steps = [step(bus.run_id, i) for i in range(2)]
    agent, judged = await judge_steps(bus, jcfg, steps)
    assert all(v.status == "error" and v.value is None for j in judged for v in j.votes)
    assert agent.counters["vote_errors"] == 6
    g = won_and_lost_group(bus.run_id, steps, judged)
    score = score_group(g, jcfg, train_judge=False)
    assert score.flagged and "judge errors" in score.flagged
    assert score.policy_samples == []  # kept out of training
    with pytest.raises(ExternalCallFailed, match="RateLimitError"):
        await LiteLLMClient(MODEL, api(mock_response="litellm.RateLimitError", retries=0)).complete("x")


async def test_invalid_rewriter_json_is_retried_then_rejected_with_the_reason() -> None:
    game = QuickGame()
    task = TaskSpec(
        task_id="q1",
        family="quickgame",
        params={"seed": 1},
        knobs={"steps": 3, "distractors": 1, "slack": 1, "hints": 0},
    )
    bad = LiteLLMClient(
        MODEL, api(mock_response=["no json here", '{"knobs": {"steps": 99}}', '{"knobs": {"steps": 2}}'])
    )
    proposal = await LLMRewriter(bad, retries=2).propose(game, task, "harder", [])
    assert proposal.candidate is None
    assert "invalid rewriter output after 3 tries" in (proposal.error or "")
    assert "does not make the task harder" in (proposal.error or "")  # the last answer's validation error
    good = LiteLLMClient(MODEL, api(mock_response=["no json", 'Sure: {"knobs": {"steps": 4}, "reason": "longer"}']))
    ok = await LLMRewriter(good, retries=2).propose(
        game, task, "harder", [FailureDigest(trajectory_id="t", outcome="lost")]
    )
    assert ok.candidate is not None and ok.candidate.knobs["steps"] == 4 and ok.candidate.parent_id == "q1"


async def test_tasks_agent_records_the_rejection_in_a_decision_event(bus: NatsBus, cfg: CoevoConfig) -> None:
    from coevo.agents.tasks import TasksAgent
    from coevo.schemas import GroupScored, TaskDecided

    tcfg = load_config(
        overrides={
            "run.runs_dir": str(cfg.run.runs_dir),
            "tasks.rewriter.backend": "litellm",
            "tasks.rewriter.model": MODEL,
            "tasks.rewriter.api.mock_response": "not json",
            "tasks.rewriter.retries": 1,
            "tasks.rewriter.api.backoff_s": 0.01,
            "tasks.min_groups_between_rewrites": 0,
            "log.console": "off",
        }
    )
    agent = TasksAgent(bus, tcfg)
    await agent.load()
    slot = next(s for s in agent.slots.values() if s.split == "train")
    scored = GroupScored(
        run_id=bus.run_id,
        source=SRC,
        task_id=slot.active.task_id,
        group_id="g1",
        slot_id=slot.slot_id,
        accuracy=1.0,
        n_trajectories=8,
        policy_band_ok=False,
        judge_band_ok=False,
    )
    async with agent.llm_client:
        await agent.maybe_rewrite(slot, scored)
    await bus.flush()
    (decided,) = [e for e in await bus.events(["task.decided"]) if isinstance(e, TaskDecided)]
    assert not decided.accepted and decided.reason.startswith("invalid proposal: invalid rewriter output")
    assert "no JSON object" in decided.reason and "after 2 tries" in decided.reason and slot.candidate is None


async def test_cache_hit_on_the_second_identical_call(bus: NatsBus) -> None:
    kv = await bus.kv("llmcache_judge")
    first = LiteLLMClient(MODEL, api(mock_response=r"\boxed{1}"))
    first.attach_cache(kv)
    a = await first.complete("same prompt", max_tokens=16, temperature=0.8, index=0)
    # a second client whose API would fail: the answer must come from the cache, without a call
    second = LiteLLMClient(MODEL, api(mock_response="litellm.RateLimitError", retries=0))
    second.attach_cache(kv)
    b = await second.complete("same prompt", max_tokens=16, temperature=0.8, index=0)
    assert b.text == a.text and b.cached and second.calls == 0 and second.cache_hits == 1 and b.cost_usd == 0
    with pytest.raises(ExternalCallFailed):  # another vote index is another call
        await second.complete("same prompt", max_tokens=16, temperature=0.8, index=1)


async def test_max_usd_stops_calls(bus: NatsBus, cfg: CoevoConfig) -> None:
    client = LiteLLMClient(MODEL, api(mock_response=r"\boxed{1}", max_usd=1e-6))
    await client.complete("one")
    assert client.spent_usd > 1e-6
    with pytest.raises(OverBudget, match="max_usd"):
        await client.complete("two")
    jcfg = judge_cfg(cfg, mock_response=r"\boxed{1}", max_usd=1e-6, cache=False, max_concurrency=1)
    _, judged = await judge_steps(bus, jcfg, [step(bus.run_id, i) for i in range(3)])
    statuses = [v.status for j in judged for v in j.votes]
    assert statuses.count("ok") == 1 and statuses.count("error") == 8  # one call, then none
    budget = await bus.events(["budget.exceeded"])
    assert len(budget) == 1 and budget[0].max_usd == 1e-6


@pytest.fixture
def hanging_up_api() -> Iterator[str]:
    """An API endpoint that answers the start's TCP probe and then hangs up on every request: down
    once the run is under way."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def hang_up() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                conn.close()

    thread = threading.Thread(target=hang_up)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/v1"
    stop.set()
    thread.join(5)
    server.close()


def test_litellm_logs_its_calls_on_the_console_only_when_they_go_wrong(tmp_path: Path) -> None:
    """Logging set up as ``coevo run`` does it (INFO, a console): LiteLLM's own console handler and ours
    print none of its per-call INFO lines (it printed two a call, 930 lines in 30 s of a failing judge)."""
    script = (
        "import asyncio, sys, pathlib\n"
        "from coevo.runtime.logging import configure_logging\n"
        "configure_logging(pathlib.Path(sys.argv[1]), level='info', console='pretty')\n"
        "from coevo.config import ApiConfig\n"
        "from coevo.inference.litellm_client import LiteLLMClient\n"
        f"client = LiteLLMClient({MODEL!r}, ApiConfig(mock_response='fine', backoff_s=0.01))\n"
        "print(asyncio.run(client.complete('x', max_tokens=4)).text)\n"
    )
    out = subprocess.run(
        [PYTHON, "-c", script, str(tmp_path)], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "fine\n" and out.stderr == "", (out.stdout, out.stderr)


@pytest.mark.slow
def test_run_with_an_api_down_completes_and_never_leaks_the_key(
    tmp_path: Path, model_cache: Path, hanging_up_api: str
) -> None:
    """`coevo run --judge litellm:...` against an API that hangs up on every call: failures are counted,
    rollouts go on, the key never appears."""
    secret = "sk-coevo-test-SECRET-5f1c9a"
    env = subprocess_env() | {"COEVO_TEST_JUDGE_KEY": secret}
    runs = tmp_path / "runs"
    out = subprocess.run(
        [
            PYTHON,
            "-m",
            "coevo",
            "run",
            "--judge",
            f"litellm:{MODEL}",
            "--judge-api-base",
            hanging_up_api,
            "--minutes",
            "0.25",
            "--run-id",
            "keytest",
            "--run.runs_dir",
            str(runs),
            "--env.cache_dir",
            str(model_cache),
            "--set",
            "judge.api.api_key_env=COEVO_TEST_JUDGE_KEY",
            "--set",
            "judge.api.retries=0",
            "--set",
            "judge.api.timeout_s=2",
            "--set",
            "policy.n=4",
            "--set",
            "env.n_train=2",
            "--set",
            "env.n_heldout=1",
            "--log.console",
            "json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((runs / "keytest" / "summary.json").read_text())
    assert summary["judge_errors"] > 0 and summary["judge_cost_usd"] == 0.0
    assert summary["events"]["trajectory.completed"] > 0  # rollouts went on while the judge was down
    leaked = [str(p) for p in runs.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert leaked == [] and secret not in out.stdout + out.stderr
    assert "LiteLLM completion()" not in out.stdout + out.stderr  # not a line per call on the console
    assert os.environ.get("COEVO_TEST_JUDGE_KEY") is None


async def test_coding_judge_writes_tests_and_runs_them_on_every_program(bus: NatsBus, cfg: CoevoConfig) -> None:
    from coevo.agents.scorer import coding_judge_samples
    from coevo.algorithm.scoring import coding_test_advantages
    from coevo.envs.coding import Coding, humaneval_problems

    jcfg = load_config(
        overrides={
            "run.runs_dir": str(cfg.run.runs_dir),
            "env.family": "coding",
            "judge.backend": "litellm",
            "judge.model": MODEL,
            "judge.m": 3,
            "judge.api.mock_response": ["3.5) == 0.5", "1.25) == 0.25", "nonsense (((("],
            "judge.api.max_concurrency": 1,
            "log.console": "off",
            "bus.fetch_timeout_s": 0.2,
        }
    )
    fam = Coding()
    task = next(t for t in fam.initial_tasks(200, 0, 0) if t.params["problem"] == "HumanEval/2")
    env = fam.make_env()
    obs = await env.reset(task)
    programs = [humaneval_problems()["HumanEval/2"].solution or "", "    return 0.0\n"]
    steps = []
    for i, program in enumerate(programs):
        result = await _play(fam, task, program)
        steps.append(
            StepTaken(
                run_id=bus.run_id,
                source=SRC,
                trajectory_id=f"g-r{i}",
                task_id=task.task_id,
                group_id="g",
                step_index=0,
                objective=obs.objective,
                observation=obs.text,
                action_text=program,
                artifact=result.info["program"],
                done=True,
                policy_version=0,
            )
        )
    _, judged = await judge_steps(bus, jcfg, steps)
    by_traj = {j.trajectory_id: j for j in judged}
    assert [(v.value, v.status) for v in by_traj["g-r0"].votes] == [(1, "ok"), (1, "ok"), (None, "unparseable")]
    assert [(v.value, v.status) for v in by_traj["g-r1"].votes] == [(-1, "ok"), (-1, "ok"), (None, "unparseable")]
    assert by_traj["g-r0"].votes[0].rationale == "assert candidate(3.5) == 0.5"
    # tests 0 and 1: the correct program passes, the incorrect one fails (+1 each); test 2 is garbage (0)
    assert coding_test_advantages(
        [[(True, True), (False, False)]] * 2 + [[(True, False), (False, False)]]
    ) == pytest.approx([2**-0.5, 2**-0.5, -(2**0.5)])
    g = won_and_lost_group(bus.run_id, steps, judged)
    assert coding_judge_samples([], g) == []  # no token ids from an external API: nothing to train


async def _play(fam, task, program):
    env = fam.make_env()
    await env.reset(task)
    return await env.step(program)
