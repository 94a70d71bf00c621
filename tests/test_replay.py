"""Debugging a recorded run: export/import, replay into scorer/judge/rewriter, trace, re-judge."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coevo.tools.events import normalized, read_export
from tests.conftest import PYTHON, REPO, subprocess_env

pytestmark = pytest.mark.slow


def coevo(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [PYTHON, "-m", "coevo", *args], capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=REPO
    )
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, model_cache: Path) -> tuple[Path, str]:
    """A short real `coevo run`, with rewrites frequent enough that some are accepted."""
    runs = tmp_path_factory.mktemp("runs")
    coevo(
        "run",
        "--steps",
        "8",
        "--minutes",
        "4",
        "--run-id",
        "rec",
        "--run.runs_dir",
        str(runs),
        "--env.cache_dir",
        str(model_cache),
        "--set",
        "tasks.band=[0.35,0.65]",
        "--set",
        "tasks.min_groups_between_rewrites=0",
        "--set",
        "env.n_train=4",
        "--set",
        "env.n_heldout=2",
        "--log.console",
        "off",
    )
    summary = json.loads((runs / "rec" / "summary.json").read_text())
    assert summary["rewrites_accepted"] >= 1, summary
    return runs, "rec"


def test_export_import_export_is_identical(recorded, tmp_path: Path) -> None:
    runs, run = recorded
    first = tmp_path / "a.jsonl"
    coevo("events", "export", str(first), "--run", run, "--runs-dir", str(runs))
    rows = read_export(first)
    assert rows and [r["seq"] for r in rows] == sorted(r["seq"] for r in rows)
    coevo("events", "import", str(first), "--run-id", "copy", "--runs-dir", str(tmp_path / "moved"))
    second = tmp_path / "b.jsonl"
    coevo("events", "export", str(second), "--run", "copy", "--runs-dir", str(tmp_path / "moved"))
    again = read_export(second)
    assert all(r["event"]["run_id"] == "copy" for r in again)
    assert normalized(again) == normalized(rows)


def test_parquet_export_matches_jsonl(recorded, tmp_path: Path) -> None:
    runs, run = recorded
    coevo("events", "export", str(tmp_path / "a.jsonl"), "--run", run, "--runs-dir", str(runs))
    coevo("events", "export", str(tmp_path / "a.parquet"), "--run", run, "--runs-dir", str(runs), "--format", "parquet")
    assert read_export(tmp_path / "a.parquet") == read_export(tmp_path / "a.jsonl")


def replay(runs: Path, run: str, into: str, *extra: str) -> tuple[int, dict]:
    out = coevo("replay", "--run", run, "--into", into, "--runs-dir", str(runs), *extra, check=False)
    return out.returncode, json.loads(out.stdout[out.stdout.index("{") :])


def test_replay_into_the_scorer_reproduces_every_advantage(recorded) -> None:
    runs, run = recorded
    rc, report = replay(runs, run, "scorer")
    assert rc == 0 and report["identical"] and report["compared"] >= 8


def test_replay_with_a_changed_reward_weight_reports_the_first_divergence(recorded) -> None:
    runs, run = recorded
    rc, report = replay(runs, run, "scorer", "--set", "scorer.lam=0.25")
    assert rc != 0 and not report["identical"]
    d = report["first_divergence"]
    assert d["kind"] == "group.scored" and d["recorded"] != d["replayed"]
    rc_range, ranged = replay(runs, run, "scorer", "--to", str(d["index"] - 1), "--set", "scorer.lam=0.25")
    assert rc_range == 0 and ranged["identical"]  # nothing diverges before the first divergence


def test_replay_into_judge_and_rewriter(recorded) -> None:
    runs, run = recorded
    rc, report = replay(runs, run, "judge")
    assert rc == 0 and report["identical"] and report["compared"] > 50
    rc, report = replay(runs, run, "rewriter")
    assert rc == 0 and report["identical"] and report["compared"] >= 1
    rc, report = replay(runs, run, "rewriter", "--set", "tasks.band=[0.1,0.9]")
    assert rc != 0 and report["first_divergence"]["kind"] == "task.decided"


def test_replay_into_the_learner_retrains_the_same_steps(recorded) -> None:
    runs, run = recorded
    rc, report = replay(runs, run, "learner")
    assert rc == 0 and report["identical"] and report["compared"] >= 8
    rc, report = replay(runs, run, "learner", "--set", "learner.lr=0.003")
    d = report["first_divergence"]
    assert rc != 0 and d["kind"] == "learner.stepped" and d["recorded"]["loss"] != d["replayed"]["loss"]


def test_trace_of_a_trajectory_shows_the_rewrite_lineage(recorded, tmp_path: Path) -> None:
    runs, run = recorded
    export = tmp_path / "e.jsonl"
    coevo("events", "export", str(export), "--run", run, "--runs-dir", str(runs))
    events = [r["event"] for r in read_export(export)]
    accepted = next(e for e in events if e["kind"] == "task.decided" and e["accepted"])
    traj = next(e for e in events if e["kind"] == "trajectory.completed" and e["task_id"] == accepted["candidate_id"])
    out = coevo("trace", traj["trajectory_id"], "--run", run, "--runs-dir", str(runs), "--json")
    t = json.loads(out.stdout[out.stdout.index("{") :])
    assert t["kind"] == "trajectory" and t["task_id"] == accepted["candidate_id"]
    first = t["lineage"][0]
    assert first["task_id"] == accepted["candidate_id"] and first["parent_id"] == accepted["parent_id"]
    assert first["accepted"] is True and first["reason"] == accepted["reason"]
    assert len(t["steps"]) == traj["num_steps"] and all(len(s["votes"]) == 3 for s in t["steps"])
    tree = coevo("trace", traj["trajectory_id"], "--run", run, "--runs-dir", str(runs)).stdout
    assert "rewrite lineage" in tree and accepted["candidate_id"] in tree
    w = coevo("trace", "policy:1", "--run", run, "--runs-dir", str(runs), "--json").stdout
    weights = json.loads(w[w.index("{") :])
    assert weights["kind"] == "weights" and weights["applied"] and weights["learner_step"]["group_ids"]


def test_rejudge_with_the_recorded_responses_agrees_completely(recorded) -> None:
    runs, run = recorded
    out = coevo("rejudge", "--run", run, "--runs-dir", str(runs))
    r = json.loads(out.stdout[out.stdout.index("{") :])
    assert r["steps"] > 50 and r["agreement"] == 1.0
    assert r["original"] == r["rejudge"]
    out = coevo("rejudge", "--run", run, "--runs-dir", str(runs), "--steps", "10")
    some = json.loads(out.stdout[out.stdout.index("{") :])
    assert some["steps"] == 10 and some["agreement"] == 1.0 and some["original"] == some["rejudge"]


def test_rejudge_with_another_local_judge_on_a_spread_sample_of_steps(recorded, model_cache: Path) -> None:
    """A local judge (the tiny default, one constrained token a vote) over 12 steps spread over the
    run, judged concurrently: every vote parses, and the result says which mode and how long."""
    runs, run = recorded
    judge = runs / "verdict-judge.toml"
    judge.write_text(f'[env]\ncache_dir = "{model_cache}"\n[judge]\nmode = "verdict"\nm = 2\n')
    out = coevo("rejudge", "--run", run, "--runs-dir", str(runs), "--judge", str(judge), "--steps", "12")
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout[out.stdout.index("{") :])
    assert r["steps"] == 12 and r["judge_mode"] == "verdict" and r["rejudge_seconds"] > 0
    assert r["rejudge_votes"] == {"ok": 24, "unparseable": 0, "error": 0}
    assert 0.0 <= r["rejudge"]["process_accuracy"] <= 1.0 and 0.0 <= r["agreement"] <= 1.0


def test_spread_takes_an_even_sample_in_order() -> None:
    from coevo.tools.rejudge import spread

    assert spread(list(range(10)), 4) == [0, 2, 5, 7]
    assert spread(list(range(3)), 5) == [0, 1, 2] and spread(list(range(3)), None) == [0, 1, 2]


async def test_lineage_of_a_candidate_rejected_then_proposed_again_and_accepted(bus) -> None:
    """The same candidate id (same parent, same knobs) decided twice: the acceptance made it a task."""
    from coevo.schemas import TaskDecided, TaskRewritten
    from coevo.tools.trace import trace
    from tests.samples import sample_events

    events = sample_events(bus.run_id)
    rewrite = next(e for e in events if isinstance(e, TaskRewritten))
    decided = next(e for e in events if isinstance(e, TaskDecided))
    candidate = rewrite.candidate.task_id
    await bus.publish_sync(rewrite)
    await bus.publish_sync(
        decided.model_copy(
            update={"event_id": "d-rejected", "accepted": False, "reason": "too easy", "candidate_id": candidate}
        )
    )
    await bus.publish_sync(
        decided.model_copy(
            update={"event_id": "d-accepted", "accepted": True, "reason": "in band", "candidate_id": candidate}
        )
    )
    t = await trace(bus, candidate)
    assert t["kind"] == "task" and t["lineage"][0]["accepted"] is True and t["lineage"][0]["reason"] == "in band"


def test_the_debugging_guide_runs_as_written_on_a_recorded_run(recorded, model_cache: Path, tmp_path: Path) -> None:
    """Every command of docs/guides/debugging.md, with the guide's placeholders filled from this run
    (and ``--runs-dir``: the guide's run lives in ./runs): each exits as the guide says it does."""
    runs, run = recorded
    coevo("events", "export", str(tmp_path / "all.jsonl"), "--run", run, "--runs-dir", str(runs))
    events = [r["event"] for r in read_export(tmp_path / "all.jsonl")]
    trajectory = next(e["trajectory_id"] for e in events if e["kind"] == "trajectory.completed")
    last_step = max(e["version"] for e in events if e["kind"] == "learner.stepped" and e["role"] == "policy")
    judge = tmp_path / "other.toml"
    judge.write_text(f'[env]\ncache_dir = "{model_cache}"\n[judge]\nmode = "verdict"\nm = 1\n')
    fill = {"R": run, "policy:3000": f"policy:{last_step}", "g-5f2c...-r3": trajectory, "other.toml": str(judge)}
    text = (REPO / "docs" / "guides" / "debugging.md").read_text()
    block = text.split("```bash\n")[1].split("```")[0]
    commands = [line.split("#")[0].split() for line in block.splitlines() if line.startswith("coevo ")]
    assert len(commands) == 8
    for words in commands:
        argv = [fill.get(w, str(tmp_path / w) if w.endswith(".jsonl") else w) for w in words[1:]]
        out = coevo(*argv, "--runs-dir", str(runs), check=False)
        diverges = "--set" in argv  # the guide: a changed reward weight prints the first diverging event, exit 1
        assert out.returncode == (1 if diverges else 0), f"{' '.join(words)}\n{out.stderr[-2000:]}"
        assert out.stdout.strip(), " ".join(words)
        if words[1] == "replay":  # a report of what it compared, identical unless the guide changed a weight
            report = json.loads(out.stdout[out.stdout.index("{") :])
            assert report["identical"] is not diverges and (report["compared"] > 0 or "--from" in words), report
    assert (tmp_path / "out.jsonl").stat().st_size > 0
