"""The commands the README and the docs show run as written: every ``coevo ...`` line parses with
today's command table and, where it names config fields (``--set``, ``--config``, flags), those fields
exist and validate; the ones that can run here in seconds are run and their documented output is
compared with the real one. (The debugging guide's commands run on a recorded run in test_replay.py.)"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, subprocess_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# the placeholders the docs write in capitals, and a value of the right kind for each
PLACEHOLDERS = {
    "R": "r1",
    "RUN": "r1",
    "A": "a",
    "B": "b",
    "URL": "nats://127.0.0.1:4222",
    "URL1,URL2,URL3": "nats://127.0.0.1:4222,nats://127.0.0.1:4223",
    "DIR": "some-dir",
    "FILE": "out.json",
    "FILE.json": "out.json",
    "PART.json": "part.json",
    "ALL.json": "all.json",
    "JUDGE": "judge-dir",
    "ID": "policy:1",
    "N": "3",
    "K": "2",
    "MODEL": "smollm2-135m-instruct",
    "M": "1",
    "P": "9100",
    "ROLE": "policy",
    "COMMAND": "run",
    "ROLE.json": "policy.json",
    "STORE/credentials/policy.json": "store/credentials/policy.json",
    "STORE/credentials/admin.json": "store/credentials/admin.json",
}


def documented_commands(text: str) -> list[str]:
    """The ``coevo ...`` commands of a Markdown text: each line of a code block (``$ `` prompts and
    backslash continuations joined, comments cut) and each inline code span that starts with ``coevo``;
    synopses (``[...]``, ``a|b``, ``...``) and bare command groups are left out: they are not commands."""
    found: list[str] = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("coevo "):
                found.append(line.split("  #")[0].split(" # ")[0])
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += re.findall(r"`(coevo [^`]+)`", prose)
    found = [" ".join(c.split()) for c in found]
    return [c for c in found if not re.search(r"[\[|]|\.\.\.", c) and not mention(c)]


def mention(command: str) -> bool:
    """``coevo trace``, ``coevo bench``: a command's name alone, as prose names it; not a command line."""
    from coevo.cli import COMMANDS

    return " ".join(command.split()[1:]) in {c.path for c in COMMANDS}


def as_argv(command: str) -> list[str]:
    return [PLACEHOLDERS.get(word, word) for word in command.split()[1:]]


def all_commands() -> list[tuple[str, str]]:
    return [(str(f.relative_to(REPO)), c) for f in DOCS for c in documented_commands(f.read_text())]


def test_the_extraction_finds_commands_and_leaves_synopses_out() -> None:
    text = (
        "```bash\n$ coevo run --minutes 3   # three minutes\ncoevo bench ladder --seeds 5 \\\n  --minutes 2\n"
        "coevo run [--minutes M]\n```\nThen `coevo trace policy:3\n--run R` or `coevo bench` or `coevo a|b`.\n"
    )
    assert documented_commands(text) == [
        "coevo run --minutes 3",
        "coevo bench ladder --seeds 5 --minutes 2",
        "coevo trace policy:3 --run R",
    ]
    assert as_argv("coevo trace ID --run R") == ["trace", "policy:1", "--run", "r1"]
    commands = all_commands()
    assert len(commands) > 100
    assert {f for f, _ in commands} >= {"README.md", "docs/guides/running.md", "docs/benchmarks.md"}


def parsed(argv: list[str]) -> argparse.Namespace | None:
    """``argv`` through coevo's own parser (None: it printed its help); a refusal fails with argparse's
    message."""
    from coevo.cli import build_parser, parse

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parse(build_parser(), argv)
    except SystemExit as exc:
        if exc.code == 0 and "--help" in argv:
            return None
        pytest.fail(f"coevo {' '.join(argv)}: {err.getvalue().strip()}")


def validated(args: argparse.Namespace | None) -> None:
    """The config fields a command names exist and take its values (``coevo run``'s whole resolution;
    a bench's ``--config`` and ``--set``, as every run of it starts from them)."""
    from coevo.cli._config import parse_value, resolve_config
    from coevo.config import load_config

    if args is None:
        return
    if args._path == "run":
        resolve_config(args)
    elif getattr(args, "set", None) is not None:
        overrides = {k.strip(): parse_value(v) for k, _, v in (kv.partition("=") for kv in args.set)}
        load_config(getattr(args, "config", None), overrides)


def test_every_documented_command_parses_and_names_real_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the docs' relative paths (configs/...) are from a checkout's root
    monkeypatch.syspath_prepend(str(REPO / "tests" / "plugin_site"))  # the environments guide's plugin family
    failures = []
    for where, command in all_commands():
        if command == "coevo run --set learner.lrr=3":  # the configuration guide's example of a refusal
            continue
        try:
            validated(parsed(as_argv(command)))
        except (Exception, pytest.fail.Exception) as exc:  # every refusal is collected, then reported at once
            failures.append(f"{where}: {command}\n    {type(exc).__name__}: {exc}")
    assert failures == [], "\n".join(failures)


def test_a_command_the_docs_cannot_show_is_refused_by_the_check() -> None:
    with pytest.raises(pytest.fail.Exception, match="unrecognized arguments: --no-such-flag"):
        parsed(as_argv("coevo run --no-such-flag"))
    from coevo.errors import ConfigError

    with pytest.raises(ConfigError, match=r"learner\.lrr"):
        validated(parsed(as_argv("coevo run --set learner.lrr=3")))
    with pytest.raises(ConfigError, match=r"tasks\.nosuch"):
        validated(parsed(as_argv("coevo bench ladder --set tasks.nosuch=1")))


def coevo(*argv: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "coevo", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env or subprocess_env(),
        timeout=120,
    )


def test_the_configuration_guide_shows_what_a_misspelt_field_prints() -> None:
    text = (REPO / "docs" / "guides" / "configuration.md").read_text()
    shown = re.search(r"```\n\$ (coevo .*?)\n(.*?)\n```", text, re.S)
    assert shown is not None
    command, output = shown.groups()
    out = coevo(*command.split()[1:])
    assert out.returncode != 0
    assert out.stderr.strip() == output.strip()


def test_the_external_judge_guide_without_its_key_stops_in_one_line(tmp_path: Path) -> None:
    text = (REPO / "docs" / "guides" / "external-judges.md").read_text()
    first = next(c for c in documented_commands(text) if "litellm:openai" in c)
    env = {k: v for k, v in subprocess_env().items() if k != "OPENAI_API_KEY"}
    out = coevo(*as_argv(first), "--run.runs_dir", str(tmp_path / "runs"), cwd=tmp_path, env=env)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "OPENAI_API_KEY" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "runs").exists(), "a run that cannot start leaves nothing behind"


def test_the_schema_export_of_the_running_guide_writes_every_event(tmp_path: Path) -> None:
    text = (REPO / "docs" / "guides" / "running.md").read_text()
    assert "coevo schemas export DIR" in text
    out = coevo("schemas", "export", str(tmp_path / "schemas"))
    assert out.returncode == 0, out.stderr[-2000:]
    from coevo.schemas import json_schemas

    written = {p.name for p in (tmp_path / "schemas").glob("*.json")}
    assert written == {f"{kind}.json" for kind in json_schemas()} and "step.taken.json" in written
