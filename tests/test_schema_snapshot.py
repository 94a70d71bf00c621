"""CI's gate on the event schemas: today's export must equal the committed snapshot of today's
``SCHEMA_VERSION``, and every change must come with the bump it needs (optional field added: minor;
removed, retyped, made required: major). The comparison is tested on made-up exports."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

from coevo.schemas import SCHEMA_VERSION, SchemaVersion
from coevo.schemas.snapshot import SNAPSHOT, WRITE, changes, export, load, needed, problems, write
from tests.conftest import PYTHON, REPO, subprocess_env


def test_todays_event_schemas_are_the_snapshot_of_todays_version() -> None:
    """Fails when a field is added or changed without a bump (or the bump without a refresh); the
    message says which bump and the command that refreshes the snapshot."""
    found = problems(load(), export(), SCHEMA_VERSION)
    assert not found, "\n".join(found)


def test_the_snapshot_is_committed_next_to_the_schemas() -> None:
    assert SNAPSHOT == REPO / "coevo" / "schemas" / "snapshot.json" and str(SCHEMA_VERSION) in load()


def _current() -> dict[str, dict[str, Any]]:
    return copy.deepcopy(load()[str(SCHEMA_VERSION)])


def test_an_added_optional_field_needs_a_minor_bump_and_says_how() -> None:
    before = _current()
    after = copy.deepcopy(before)
    after["step.taken"]["properties"]["made_up_optional"] = {
        "anyOf": [{"type": "number"}, {"type": "null"}],
        "default": None,
    }
    found = changes(before, after)
    assert [str(c) for c in found] == ["step.taken: made_up_optional: optional field added (minor)"]
    said = problems({str(SCHEMA_VERSION): before}, after, SCHEMA_VERSION)
    assert len(said) == 1
    assert "bump SCHEMA_VERSION (coevo/schemas/base.py) minor (added fields) or major (removed/changed)" in said[0]
    assert f"run `{WRITE}` to refresh the snapshot" in said[0] and "made_up_optional" in said[0]
    bumped = SchemaVersion(SCHEMA_VERSION.major, SCHEMA_VERSION.minor + 1)
    said = problems({str(SCHEMA_VERSION): before}, after, bumped)  # bumped, not refreshed
    assert said == [f"the snapshot has no entry for SCHEMA_VERSION {bumped}: run `{WRITE}` to refresh the snapshot"]
    assert not problems({str(SCHEMA_VERSION): before, str(bumped): after}, after, bumped)


def test_removed_retyped_or_required_fields_need_a_major_bump() -> None:
    before = _current()
    removed, retyped, required, new_required = (copy.deepcopy(before) for _ in range(4))
    del removed["learner.stepped"]["properties"]["entropy"]
    retyped["task.scheduled"]["properties"]["n_rollouts"] = {"type": "string"}
    required["step.taken"]["required"].append("grammar")
    new_required["step.taken"]["properties"]["made_up_required"] = {"type": "integer"}
    new_required["step.taken"]["required"].append("made_up_required")
    minor = SchemaVersion(SCHEMA_VERSION.major, SCHEMA_VERSION.minor + 1)
    major = SchemaVersion(SCHEMA_VERSION.major + 1, 0)
    for after, what in (
        (removed, "learner.stepped: entropy: field removed"),
        (retyped, "task.scheduled: n_rollouts.type: changed"),
        (required, "step.taken: grammar: became required"),
        (new_required, "step.taken: made_up_required: required field added"),
    ):
        found = changes(before, after)
        assert needed(found) == "major" and any(str(c).startswith(what) for c in found), found
        said = problems({str(SCHEMA_VERSION): before}, after, minor)
        assert len(said) == 1 and "too small a bump" in said[0] and "major (removed/changed)" in said[0]
        assert problems({str(SCHEMA_VERSION): before}, after, major) == [
            f"the snapshot has no entry for SCHEMA_VERSION {major}: run `{WRITE}` to refresh the snapshot"
        ]


def test_nested_models_kinds_and_documentation() -> None:
    before = _current()
    nested, kind, docs, enum = (copy.deepcopy(before) for _ in range(4))
    nested["step.judged"]["$defs"]["Vote"]["properties"]["made_up_nested"] = {"type": "number", "default": 0.0}
    kind["made.up.kind"] = {"type": "object", "properties": {}}
    docs["step.taken"]["properties"]["grammar"]["description"] = "reworded"
    enum["trajectory.completed"]["properties"]["outcome"]["enum"].append("timeout")  # a value old readers refuse
    assert [str(c) for c in changes(before, nested)] == [
        "step.judged: $defs.Vote.made_up_nested: optional field added (minor)"
    ]
    assert [str(c) for c in changes(before, kind)] == ["made.up.kind: event kind added (minor)"]
    assert changes(before, docs) == []  # documentation is not the wire
    assert needed(changes(before, enum)) == "major"
    assert needed(changes(kind, before)) == "major"  # a kind removed


def test_the_snapshots_steps_are_checked_and_versions_never_go_back() -> None:
    before = _current()
    after = copy.deepcopy(before)
    del after["learner.stepped"]["properties"]["entropy"]
    minor = SchemaVersion(SCHEMA_VERSION.major, SCHEMA_VERSION.minor + 1)
    said = problems({str(SCHEMA_VERSION): before, str(minor): after}, after, minor)
    assert said == [f"the snapshot's step {SCHEMA_VERSION} -> {minor} needs a major bump"]
    older = SchemaVersion(SCHEMA_VERSION.major, SCHEMA_VERSION.minor - 1) if SCHEMA_VERSION.minor else (1, 9)
    said = problems({str(SCHEMA_VERSION): before}, before, SchemaVersion(*older))
    assert said and "a version never goes back" in said[0]


def test_write_records_a_bump_and_refuses_a_change_without_one(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.json"
    before = _current()
    assert write({}, before, SCHEMA_VERSION, path) == []
    after = copy.deepcopy(before)
    after["step.taken"]["properties"]["made_up_optional"] = {"type": "number", "default": 1.0}
    refused = write(load(path), after, SCHEMA_VERSION, path)
    assert refused and "without a bump" in refused[0]
    assert load(path) == {str(SCHEMA_VERSION): before}  # nothing written
    bumped = SchemaVersion(SCHEMA_VERSION.major, SCHEMA_VERSION.minor + 1)
    assert write(load(path), after, bumped, path) == []
    assert list(load(path)) == [str(SCHEMA_VERSION), str(bumped)]


def test_the_command_checks_the_committed_snapshot(tmp_path: Path) -> None:
    ok = subprocess.run(
        [PYTHON, "-m", "coevo.schemas.snapshot"], capture_output=True, text=True, env=subprocess_env(), check=False
    )
    assert ok.returncode == 0 and f"event schema {SCHEMA_VERSION} matches" in ok.stdout, ok.stderr
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"1.0": {}}))
    out = subprocess.run(
        [PYTHON, "-m", "coevo.schemas.snapshot", "--path", str(stale)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=False,
    )
    assert out.returncode == 1 and f"no entry for SCHEMA_VERSION {SCHEMA_VERSION}" in out.stderr
