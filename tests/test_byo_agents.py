"""Four agents written as their frameworks' users write them (examples/agents_sdk_agent.py: OpenAI Agents
SDK over the Responses API; langgraph_agent.py: a LangGraph ReAct agent, streamed Chat Completions;
pydantic_ai_agent.py: pydantic-ai over Chat Completions; anthropic_agent.py: the anthropic SDK over the
Messages API) share ONE `coevo run --family external` as separate processes, each with its own task
ids: the learner steps on groups of every one of them, and what it trains on are their calls' tokens.

The events do not say which API a call came through (each API's request is converted to the same chat
messages before it is sampled and recorded), so which API served the Agents SDK and the Anthropic
agents is read from what they printed: the id of the first answer they got, ``resp_...`` from the
Responses API, ``msg_...`` from the Messages API."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from coevo.schemas import GroupScored, LearnerStepped, StepTaken, TaskScheduled, new_id
from tests.conftest import PYTHON, REPO, subprocess_env
from tests.test_byo_endpoint import free_port, need
from tests.test_byo_plugin import RUN_FLAGS

EXAMPLES = REPO / "examples"
AGENTS = {
    "sdk": "agents_sdk_agent.py",
    "graph": "langgraph_agent.py",
    "pyd": "pydantic_ai_agent.py",
    "claude": "anthropic_agent.py",
}
"""task-id prefix -> the agent playing the tasks of that prefix"""
DEADLINE_S = 360.0
"""from the start until every agent had a group trained (then: 90 s for coevo to stop, 60 for the agents)"""
KINDS = [k.model_fields["kind"].default for k in (TaskScheduled, StepTaken, GroupScored, LearnerStepped)]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]


def tails(logs: dict[str, Path]) -> str:
    return "\n".join(f"---- {name} ----\n{path.read_text(errors='replace')[-3000:]}" for name, path in logs.items())


def trained_prefixes(events: list[Any]) -> set[str]:
    """The prefixes a policy LearnerStepped trained a group of."""
    task_of = {e.group_id: e.task.task_id for e in events if isinstance(e, TaskScheduled)}
    trained = {g for e in events if isinstance(e, LearnerStepped) and e.role == "policy" for g in e.group_ids}
    return {p for p in AGENTS for g in trained if task_of.get(g, "").startswith(f"{p}-")}


def endpoint_up(port: int) -> bool:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer byo-key"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(json.loads(response.read())["data"])
    except (urllib.error.URLError, ConnectionError):
        return False


async def watch(run_id: str, runs: Path, nats_url: str, port: int, procs: dict[str, subprocess.Popen]) -> list[Any]:
    """The run's events, read as they come, until every prefix had a group trained."""
    from coevo.tools.events import open_run

    def alive() -> None:
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        assert not dead, f"exited early: {dead}"

    deadline = time.monotonic() + DEADLINE_S
    while not await asyncio.to_thread(endpoint_up, port):  # the run's stream exists once its endpoint serves
        alive()
        assert time.monotonic() < deadline, "the policy endpoint never came up"
        await asyncio.sleep(0.5)
    events: list[Any] = []
    async with open_run(run_id, runs, url=nats_url) as bus:
        read = 0
        while trained_prefixes(events) != set(AGENTS):
            alive()
            assert time.monotonic() < deadline, f"trained so far: {sorted(trained_prefixes(events))}"
            end = await bus.last_sequence()
            if end > read:
                events += [e async for _, e, _ in bus.history(KINDS, start_seq=read + 1, end_seq=end) if e is not None]
                read = end
            else:
                await asyncio.sleep(0.5)
    return events


def test_four_framework_agents_are_trained_in_one_run(tmp_path: Path, model_cache: Path, nats_url: str) -> None:
    for module in ("agents", "anthropic", "langgraph", "pydantic_ai"):
        need(module)
    for name in ("corridor.py", *AGENTS.values()):
        source = (EXAMPLES / name).read_text()
        assert "import coevo" not in source and "from coevo" not in source, name
    port, runs, run_id = free_port(), tmp_path / "runs", f"t{new_id()[:12]}"
    logs: dict[str, Path] = {}
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, argv: list[str], env: dict[str, str]) -> None:
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as out:
            procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)

    started = time.monotonic()
    spawn(
        "coevo",
        [
            PYTHON,
            "-m",
            "coevo",
            "run",
            "--family",
            "external",
            "--serve-policy",
            str(port),
            "--nats",
            nats_url,
            "--minutes",
            "8",
            "--run-id",
            run_id,
            "--run.runs_dir",
            str(runs),
            "--env.cache_dir",
            str(model_cache),
            "--learner.device",
            "cpu",
            *RUN_FLAGS,
        ],
        {**subprocess_env(), "COEVO_POLICY_API_KEY": "byo-key"},
    )
    agent_env = {
        "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
        "OPENAI_API_KEY": "byo-key",
        "HOME": str(tmp_path),
        "PATH": os.environ.get("PATH", ""),
        "PYTHONUNBUFFERED": "1",
    }
    for prefix, script in AGENTS.items():
        spawn(prefix, [sys.executable, str(EXAMPLES / script), "--prefix", prefix], agent_env)
    try:
        events = asyncio.run(watch(run_id, runs, nats_url, port, procs))
        procs["coevo"].send_signal(signal.SIGINT)
        assert procs["coevo"].wait(timeout=90) == 0
        said = logs["coevo"].read_text()  # Ctrl-C before the budget: the run says so and how to go on
        assert f"Run {run_id} was interrupted (SIGINT) before its budget" in said, said[-2000:]
        assert re.search(rf"^  resume: +coevo run --family external .* --resume {run_id}$", said, re.MULTILINE)
        assert f"--run-id {run_id}" not in said
        gone = time.monotonic()
        for prefix in AGENTS:  # coevo went away: each agent stops by itself
            assert procs[prefix].wait(timeout=max(1.0, gone + 60 - time.monotonic())) == 0, prefix
        printed = {prefix: logs[prefix].read_text() for prefix in AGENTS}
        for prefix, out in printed.items():
            assert re.search(rf"^{prefix}-\d+: (won|lost)( (won|lost))*$", out, re.MULTILINE), prefix
        assert re.search(r"^answered through the Responses API \(resp_\w+\)", printed["sdk"], re.MULTILINE)
        assert re.search(r"^answered through the Messages API \(msg_\w+\)", printed["claude"], re.MULTILINE)

        task_of = {e.group_id: e.task.task_id for e in events if isinstance(e, TaskScheduled)}
        trained = {g for e in events if isinstance(e, LearnerStepped) and e.role == "policy" for g in e.group_ids}
        scored = {e.group_id: e for e in events if isinstance(e, GroupScored)}
        steps = {e.event_id: e for e in events if isinstance(e, StepTaken)}
        for prefix in AGENTS:
            groups = [g for g in trained if task_of.get(g, "").startswith(f"{prefix}-")]
            assert groups, prefix
            for g in groups:
                samples = scored[g].policy_samples
                assert samples, (prefix, g)
                for s in samples:  # trained on the agent's own calls, token for token
                    step = steps[s.step_event_id]
                    assert step.group_id == g and step.task_id.startswith(f"{prefix}-")
                    assert len(step.response_token_ids) > 0 and len(step.logprobs) == len(step.response_token_ids)
                    assert list(s.response_token_ids) == list(step.response_token_ids)
    except BaseException:
        print(f"after {time.monotonic() - started:.0f} s:\n{tails(logs)}")
        raise
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
