"""``--resume RUN`` names a run by its id: ``.``, ``..`` and paths are refused before anything is
created (``(runs_dir / "..").is_dir()`` is true: the check alone let them through)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coevo.cli._checks import check_resume
from coevo.errors import ConfigError
from tests.test_cli import coevo, one_line


@pytest.mark.parametrize("run", [".", "..", "./", "../runs", "a/b", "", "x" * 65])
def test_resume_of_what_is_not_a_run_id_is_refused(tmp_path: Path, run: str) -> None:
    (tmp_path / "runs" / "a" / "b").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"not a run id") as err:
        check_resume(tmp_path / "runs", run)
    assert err.value.field == "run.run_id"


def test_resume_of_an_existing_run_passes(tmp_path: Path) -> None:
    (tmp_path / "runs" / "r-1").mkdir(parents=True)
    check_resume(tmp_path / "runs", "r-1")
    check_resume(tmp_path / "runs", None)
    with pytest.raises(ConfigError, match="no run r-2"):
        check_resume(tmp_path / "runs", "r-2")


@pytest.mark.parametrize("run", [".", ".."])
def test_coevo_run_resume_dot_starts_nothing(tmp_path: Path, run: str) -> None:
    home = tmp_path / "home"
    (home / "runs").mkdir(parents=True)
    one_line(coevo("run", "--resume", run, cwd=home, timeout=30), run, rc=2)
    assert [p.name for p in home.rglob("*")] == ["runs"]
