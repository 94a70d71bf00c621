"""``coevo bench merge``: parts that ran disjoint seeds of one setting give what one command would have."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from coevo.bench.learn import LADDER, LEARN, Budget, aggregate_seeds, ladder_result, learn_result
from coevo.bench.merge import merge_results
from coevo.cli import main
from tests.test_bench_learn import _run

RUNS = {  # five seeds per rung, each rung's numbers distinct per seed
    c: [_run(s, 0.3 + 0.1 * s + 0.05 * i, 0.2 + 0.05 * s + 0.1 * i, None, None) for s in range(5)]
    for i, c in enumerate(LADDER)
}
OVER = {"learner.lr": 3e-4, "env.n_heldout": 16}


def _ladder(seeds: list[int], overrides: dict[str, Any] | None = OVER, **header: Any) -> dict[str, Any]:
    runs = {c: [copy.deepcopy(r) for r in rs if r["seed"] in seeds] for c, rs in RUNS.items()}
    args: dict[str, Any] = {
        "family": "quickgame",
        "preset": "default",
        "budget": Budget("seconds", 1800.0),
        "episodes": 128,
    }
    args |= header
    out = ladder_result(aggregate_seeds(runs, seeds=seeds, overrides=overrides, **args))
    if overrides is None:  # a result written before the bench recorded its config fields
        del out["overrides"]
    return json.loads(json.dumps(out))


def test_two_parts_give_what_one_command_over_all_seeds_gives() -> None:
    whole = _ladder([0, 1, 2, 3, 4])
    merged = merge_results([_ladder([3, 4]), _ladder([0, 1, 2])])  # any order of parts
    assert merged["merged_from"] == [
        {"seeds": [3, 4], "overrides_recorded": True, "machine": None},
        {"seeds": [0, 1, 2], "overrides_recorded": True, "machine": None},
    ]
    assert {k: v for k, v in merged.items() if k != "merged_from"} == whole
    assert merged["seeds"] == [0, 1, 2, 3, 4]
    assert merged["configs"]["full"]["summary"]["heldout_success"]["n"] == 5
    assert merged["paired"]["full - policy-only"]["heldout_success"]["mean"] == pytest.approx(0.2)


def test_a_learn_result_merges_with_its_own_pairing() -> None:
    runs = {c: [_run(s, 0.5 + 0.1 * s * (c == "integrated"), 0.4, None, None) for s in range(3)] for c in LEARN}

    def part(seeds: list[int]) -> dict[str, Any]:
        chosen = {c: [r for r in rs if r["seed"] in seeds] for c, rs in runs.items()}
        return learn_result(
            aggregate_seeds(
                chosen, seeds=seeds, family="quickgame", preset="default", budget=Budget("seconds", 60.0), episodes=4
            )
        )

    merged = merge_results([part([0]), part([1, 2])])
    assert {k: v for k, v in merged.items() if k != "merged_from"} == part([0, 1, 2])
    assert merged["paired"]["integrated - outcome_only"]["train_success"]["mean"] == pytest.approx(0.1)


def test_parts_of_different_settings_or_the_same_seed_are_refused_by_name() -> None:
    a = _ladder([0, 1, 2])
    with pytest.raises(ValueError, match="part 2's budget is"):
        merge_results([a, _ladder([3, 4], budget=Budget("steps", 24.0))])
    with pytest.raises(ValueError, match="part 2's episodes_per_evaluation is 64, part 1's 128"):
        merge_results([a, _ladder([3, 4], episodes=64)])
    with pytest.raises(ValueError, match=r"different config fields: learner\.lr"):
        merge_results([a, _ladder([3, 4], {**OVER, "learner.lr": 1e-4})])
    with pytest.raises(ValueError, match=r"seed\(s\) \[2\] of 'policy-only' are in more than one part"):
        merge_results([a, _ladder([2, 3])])
    fewer = _ladder([3, 4])
    fewer["configs"].pop("full")
    with pytest.raises(ValueError, match="part 2 ran"):
        merge_results([a, fewer])
    with pytest.raises(ValueError, match="two or more"):
        merge_results([a])
    with pytest.raises(ValueError, match="not a bench learn or bench ladder result"):
        merge_results([a, {"configs": {}}])


def test_a_part_that_recorded_no_config_fields_is_named_in_the_result() -> None:
    merged = merge_results([_ladder([0, 1, 2], overrides=None), _ladder([3, 4])])
    assert merged["overrides"] == OVER  # what the recording part ran with
    assert merged["overrides_unrecorded_for_seeds"] == [0, 1, 2]
    assert merged["merged_from"][0] == {"seeds": [0, 1, 2], "overrides_recorded": False, "machine": None}


HOST = {"cpu": "AMD EPYC 9R14", "cores": 2, "cpu_bf16": True, "gpu": None, "torch": "2.13.0", "commit": "abc"}


def test_wall_clock_parts_join_only_from_one_kind_of_machine_and_each_keeps_its_own() -> None:
    """A minute buys another number of steps on another machine; a step budget joins across machines."""
    a, b = _ladder([0, 1, 2]), _ladder([3, 4])
    a["machine"], b["machine"] = HOST, {**HOST, "commit": "def", "torch": "2.14.0"}  # same kind: the code moved on
    merged = merge_results([a, b])
    assert [m["machine"]["commit"] for m in merged["merged_from"]] == ["abc", "def"] and "machine" not in merged
    b["machine"] = {**HOST, "cpu": "Intel Xeon Platinum 8488C"}
    with pytest.raises(ValueError, match=r"part 2 ran on \('Intel Xeon Platinum 8488C', 2, None\).*part 1 on"):
        merge_results([a, b])
    b["machine"] = {**HOST, "cores": 16, "gpu": "NVIDIA H100"}
    with pytest.raises(ValueError, match="a wall-clock budget buys other numbers"):
        merge_results([a, b])
    steps = [_ladder(seeds, budget=Budget("steps", 24.0)) for seeds in ([0, 1, 2], [3, 4])]
    steps[0]["machine"], steps[1]["machine"] = HOST, b["machine"]
    assert merge_results(steps)["seeds"] == [0, 1, 2, 3, 4]
    del a["machine"]  # a part written before results recorded their machine: not checked
    assert merge_results([a, b])["merged_from"][0]["machine"] is None


def test_a_bench_result_records_the_machine_and_commit_it_ran_on(tmp_path: Path) -> None:
    from coevo.bench.machine import machine

    here = machine()
    assert here["cores"] >= 1 and here["cpu"] and here["torch"].startswith("2.")
    assert here["commit"] is None or len(here["commit"].removesuffix("+changes")) == 40
    out = tmp_path / "merged.json"
    (tmp_path / "a.json").write_text(json.dumps(_ladder([0, 1, 2])))
    (tmp_path / "b.json").write_text(json.dumps(_ladder([3, 4])))
    assert main(["bench", "merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(out)]) == 0
    assert "machine" not in json.loads(out.read_text())  # a merge keeps its parts' machines, not its own
    from coevo.cli.bench import _emit  # what every other bench writes its result with

    assert _emit({"rate": 1.0}, tmp_path / "bench.json") == 0
    assert json.loads((tmp_path / "bench.json").read_text()) == {"rate": 1.0, "machine": here}


def test_the_command_writes_the_merge_and_names_a_bad_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "merged.json"
    a.write_text(json.dumps(_ladder([0, 1, 2])))
    b.write_text(json.dumps(_ladder([3, 4])))
    assert main(["bench", "merge", str(a), str(b), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["seeds"] == [0, 1, 2, 3, 4]
    b.write_text(json.dumps(_ladder([2, 3])))
    with pytest.raises(SystemExit, match=r"coevo bench merge: seed\(s\) \[2\]"):
        main(["bench", "merge", str(a), str(b)])
    b.write_text("{not json")
    with pytest.raises(SystemExit, match=f"coevo bench merge: {b}"):
        main(["bench", "merge", str(a), str(b)])


def test_the_step_agreement_table_is_recomputed_over_every_part_s_runs() -> None:
    from coevo.bench.steps import Agreement, agreement_fields, agreement_table

    habits = {"random": {"mean": 0.3, "low": 0.3, "high": 0.3}, "ceiling": {"mean": 1.0, "low": 1.0, "high": 1.0}}
    paths: Any = [[[None] * 4]] * 2  # 2 tasks x 1 seed, 4 states each
    runs = copy.deepcopy(RUNS)
    for i, rs in enumerate(runs.values()):
        for r in rs:
            trained = [[0.3 + 0.1 * i + 0.01 * r["seed"]], [0.4]]
            by_verb = {"go": 0.4 + 0.1 * i, "take": 0.9}
            r |= agreement_fields(
                paths, Agreement(trained, trained, by_verb), Agreement([[0.3], [0.3]], [[0.25], [0.5]], {})
            )

    def part(seeds: list[int]) -> dict[str, Any]:
        mine = {c: [r for r in rs if r["seed"] in seeds] for c, rs in runs.items()}
        args: dict[str, Any] = {"family": "quickgame", "preset": "default", "budget": Budget("seconds", 60.0)}
        out = ladder_result(aggregate_seeds(mine, seeds=seeds, overrides=OVER, episodes=8, **args))
        return json.loads(json.dumps(out | {"heldout_steps": agreement_table(mine, habits)}))

    merged = merge_results([part([0, 1]), part([2, 3, 4])])
    whole = json.loads(json.dumps(agreement_table(runs, habits)))
    assert merged["heldout_steps"] == whole and whole["trained"]["full"]["runs"] == 5
    assert merged["heldout_steps"]["paired"]["full - policy-only"]["mean"] == pytest.approx(0.1)
    assert merged["heldout_steps"]["by_verb"]["full"] == {"go": 0.6, "take": 0.9}
