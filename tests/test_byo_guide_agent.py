"""The bring-your-own-agent guide's agent is complete and is the one in examples/: its first code block is
examples/minimal_agent.py, word for word, and the guide shows one key scheme before its "Other harnesses".
That file, run as its own process against a real `coevo run --family external` whose learner it outpaces,
meets 429 learner_behind, waits out its Retry-After and plays on; its episodes are finished with the
outcomes it printed, scored and trained, and it exits 0 when the run stops."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from coevo.schemas import AgentStatus, GroupScored, LearnerStepped, TaskScheduled, TrajectoryCompleted
from tests.conftest import REPO
from tests.test_byo_endpoint import free_port, need
from tests.test_byo_plugin import run_coevo

GUIDE = REPO / "docs" / "guides" / "byo-agent.md"
EXAMPLE = REPO / "examples" / "minimal_agent.py"
RETRY_AFTER_S = "0.5"
"""policy.serve_retry_after_s of the run: what the agent is told to wait, and says it waits"""


def test_the_guides_first_code_block_is_the_example_agent() -> None:
    text = GUIDE.read_text()
    first = re.search(r"```(\w*)\n(.*?)```", text, re.S)
    assert first is not None and first.group(1) == "python"
    assert first.group(2) == EXAMPLE.read_text(), "the guide's agent and examples/minimal_agent.py differ"
    source = EXAMPLE.read_text()
    assert "import coevo" not in source and "from coevo" not in source


def test_the_guide_shows_one_key_scheme_before_the_other_harnesses() -> None:
    """The episode's own key is the way; the run's key naming an episode and agent keys are for harnesses
    whose key is fixed, said once, at the end."""
    text = GUIDE.read_text()
    main, _, others = text.partition("\n## Other harnesses\n")
    assert others, "the guide has no 'Other harnesses' section"
    for alternative in ("user=", "X-Coevo-Episode", "agent-keys", "agent key", "metadata.user_id", "rotate"):
        assert alternative not in main, alternative
        assert alternative in others, alternative
    assert "## " not in others, "'Other harnesses' is the guide's last section"


def test_the_example_agent_waits_out_429_and_is_trained(
    tmp_path: Path, model_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need("openai")
    port, run_id = free_port(), "guide"
    monkeypatch.setenv("COEVO_POLICY_API_KEY", "guide-key")  # the run's key (run_coevo passes the environment on)
    log = tmp_path / "agent.log"
    with log.open("w") as out:  # started first: it waits for the endpoint, as the guide's user's does
        agent = subprocess.Popen(
            [sys.executable, "-I", str(EXAMPLE)],
            env={"OPENAI_API_KEY": "guide-key", "COEVO_URL": f"http://127.0.0.1:{port}"},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        summary, events = run_coevo(
            tmp_path,
            model_cache,
            run_id,
            *("--family", "external", "--serve-policy", str(port), "--steps", "2", "--minutes", "3"),
            *("--learner.device", "cpu", "--set", f"policy.serve_retry_after_s={RETRY_AFTER_S}"),
            # a step per group, and one finished group holds new episodes back until the learner names it:
            # the agent's next episode after each group is answered 429 learner_behind
            *("--set", "learner.batch_groups=1", "--set", "tasks.max_groups_in_flight=1"),
            timeout=300,
        )
        code = agent.wait(timeout=60)  # the run stopped: the agent ends by itself
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(timeout=30)
    said = log.read_text()
    lines = said.splitlines()
    assert code == 0, said[-3000:]
    assert re.fullmatch(r"coevo stopped \((endpoint_stopping|connection refused)\)", lines[-1]), said[-3000:]

    waits = [i for i, line in enumerate(lines) if line == f"429 learner_behind: waiting {RETRY_AFTER_S} s"]
    played = [m.group(1) for m in map(re.compile(r"guess-\d: (won|lost)").fullmatch, lines) if m]
    assert waits and any(re.fullmatch(r"guess-\d: (won|lost)", line) for line in lines[waits[0] :]), said[-3000:]
    waited = re.compile(r"(429|503) \w+: waiting [0-9.]+ s")  # any answer with a Retry-After, waited out
    assert [line for line in lines[:-1] if not (line.startswith("guess-") or waited.fullmatch(line))] == [], said[
        -3000:
    ]

    theirs = {e.group_id for e in events if isinstance(e, TaskScheduled) and e.task.task_id.startswith("guess-")}
    ended = [e for e in events if isinstance(e, TrajectoryCompleted) and e.group_id in theirs]
    assert Counter(e.outcome for e in ended if e.outcome != "aborted") == Counter(played)  # each as it reported it
    assert len([e for e in ended if e.outcome == "aborted"]) <= 1  # at most the one the stop cut short
    scored = {e.group_id for e in events if isinstance(e, GroupScored) and e.group_id in theirs}
    steps = [e for e in events if isinstance(e, LearnerStepped) and e.role == "policy" and e.is_step]
    # a second group is finished only by episodes opened after the first 429 (answered when the first ended)
    assert len(scored) >= 2 and len(steps) >= 2 and {g for s in steps for g in s.group_ids} <= theirs
    counted = [e.counters.get("endpoint.episodes.refused_behind", 0) for e in events if isinstance(e, AgentStatus)]
    assert max(counted, default=0) >= 1  # the endpoint's own count of the 429s it answered
    assert summary["learner_steps"] >= 2 and summary["train_groups_with_samples"] >= 2, summary
