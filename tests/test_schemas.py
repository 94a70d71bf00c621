"""Event models: strictness, immutability, registry, export, and a light import."""

from __future__ import annotations

import json
import subprocess

import pytest
from pydantic import ValidationError

from coevo.schemas import (
    EVENT_TYPES,
    KIND_TO_MODEL,
    Source,
    TaskScheduled,
    TaskSpec,
    decode,
    encode,
    encode_json,
    kind_from_subject,
    subject_for,
)
from coevo.schemas.registry import UPCASTERS
from tests.conftest import PYTHON, subprocess_env
from tests.samples import sample_events

SRC = Source(agent_id="a", role="r")


def test_every_event_round_trips_in_memory() -> None:
    for e in sample_events("r1"):
        assert decode(encode(e)) == e


def test_kinds_and_subjects_are_unique_and_reversible() -> None:
    assert len(KIND_TO_MODEL) == len(EVENT_TYPES)
    for kind in KIND_TO_MODEL:
        assert kind_from_subject(subject_for("run-1", kind)) == kind
    with pytest.raises(KeyError):
        subject_for("r", "no.such")


def test_strict_frozen_and_closed() -> None:
    e = TaskScheduled(run_id="r", source=SRC, task=TaskSpec(task_id="t", family="f"), group_id="g", n_rollouts=2)
    with pytest.raises(ValidationError):
        e.n_rollouts = 3  # type: ignore[misc]
    with pytest.raises(ValidationError, match="n_rollouts"):
        TaskScheduled(run_id="r", source=SRC, task=e.task, group_id="g", n_rollouts="2")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="extra"):
        TaskScheduled(run_id="r", source=SRC, task=e.task, group_id="g", n_rollouts=2, surprise=1)
    with pytest.raises(ValidationError, match="run_id"):
        TaskScheduled(run_id="a.b", source=SRC, task=e.task, group_id="g", n_rollouts=2)
    assert e.event_id != TaskScheduled(run_id="r", source=SRC, task=e.task, group_id="g", n_rollouts=2).event_id


def test_old_schema_versions_are_upcast(monkeypatch) -> None:
    """Replay reads history: a v0 payload goes through its upcaster before validation."""
    e = TaskScheduled(run_id="r", source=SRC, task=TaskSpec(task_id="t", family="f"), group_id="g", n_rollouts=2)
    old = json.loads(encode_json(e))
    old["schema_version"] = 0
    old["rollouts"] = old.pop("n_rollouts")  # the field's old name

    def v0_to_v1(d: dict) -> dict:
        d["n_rollouts"] = d.pop("rollouts")
        return d

    monkeypatch.setitem(UPCASTERS, ("task.scheduled", 0), v0_to_v1)
    assert decode(json.dumps(old)) == e
    monkeypatch.delitem(UPCASTERS, ("task.scheduled", 0))
    with pytest.raises(ValueError, match="no upcaster"):
        decode(json.dumps(old))


def test_schemas_import_is_light() -> None:
    code = (
        "import sys, coevo.schemas; heavy = {'torch', 'nats', 'vllm', 'transformers', 'litellm', "
        "'structlog', 'aiohttp'}; print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), check=True)
    assert out.stdout.strip() == "[]"


def test_schemas_export(tmp_path) -> None:
    out = subprocess.run(
        [PYTHON, "-m", "coevo", "schemas", "export", str(tmp_path)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        check=True,
    )
    assert "wrote" in out.stdout
    files = sorted(p.stem for p in tmp_path.glob("*.json"))
    assert files == sorted(KIND_TO_MODEL)
    step = json.loads((tmp_path / "step.taken.json").read_text())
    assert "logprobs" in step["properties"] and step["additionalProperties"] is False
