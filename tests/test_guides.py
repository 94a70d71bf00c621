"""The commands the README and the docs show run as written: every ``coevo ...`` line parses with
today's command table and, where it names config fields (``--set``, ``--config``, flags), those fields
exist and validate; the ones that can run here in seconds are run and their documented output is
compared with the real one. Every command of the README and the guides (docs/guides) is in a registry:
run by the tests it names (RUN_BY), or not runnable here, and why (NOT_HERE); a command added to them
must join it. (The debugging guide's commands run on a recorded run in test_replay.py.)"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path

import pytest

from coevo.runtime.bus import NatsBus
from tests.conftest import PYTHON, REPO, subprocess_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
GUIDES = [REPO / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md"))]
"""the pages a newcomer follows: each of their commands is run by a test, or says why it cannot be"""
COEVO = str(Path(PYTHON).parent / "coevo")  # the console entry a user types, as `source .venv/bin/activate` gives it

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


@pytest.mark.parametrize("needs_openai", ["litellm:openai", "configs/litellm-judge.toml"])
def test_an_external_judge_of_the_guide_without_its_key_stops_in_one_line(tmp_path: Path, needs_openai: str) -> None:
    text = (REPO / "docs" / "guides" / "external-judges.md").read_text()
    command = next(c for c in documented_commands(text) if needs_openai in c)
    env = {k: v for k, v in subprocess_env().items() if k != "OPENAI_API_KEY"}
    # from the checkout's root, where the guide's configs/... is
    out = coevo(*as_argv(command), "--run.runs_dir", str(tmp_path / "runs"), cwd=REPO, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "OPENAI_API_KEY is not set" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "runs").exists(), "a run that cannot start leaves nothing behind"


def test_the_schema_export_of_the_running_guide_writes_every_event(tmp_path: Path) -> None:
    text = (REPO / "docs" / "guides" / "running.md").read_text()
    assert "coevo schemas export DIR" in text
    out = coevo("schemas", "export", str(tmp_path / "schemas"))
    assert out.returncode == 0, out.stderr[-2000:]
    from coevo.schemas import json_schemas

    written = {p.name for p in (tmp_path / "schemas").glob("*.json")}
    assert written == {f"{kind}.json" for kind in json_schemas()} and "step.taken.json" in written


# ---- which test runs each command of the README and the guides ------------------------------------

RUN_BY: dict[str, tuple[str, ...]] = {
    # a test runs the command with its placeholders (R, FILE, DIR...) filled, and extra flags that point it
    # at test resources (a runs directory, a model cache, a port, a server's URL) or shorten it (--steps,
    # --minutes); the runs of test_loop, test_byo_*, test_gym_env also shrink the task pool (--set policy.n,
    # env.n_train, ...), and test_replay's debugging commands run on a run it recorded
    # README.md, docs/guides/getting-started.md
    "coevo run --minutes 3": ("tests/test_guides.py::test_the_getting_started_run_prints_what_the_guide_shows",),
    # docs/guides/running.md
    "coevo run --lora": ("tests/test_guides.py::test_coevo_run_lora_trains_and_publishes_adapters_only",),
    "coevo run --resume RUN": ("tests/test_loop.py::test_coevo_run_stops_cleanly_and_resume_continues",),
    "coevo schemas export DIR": (
        "tests/test_guides.py::test_the_schema_export_of_the_running_guide_writes_every_event",
    ),
    "coevo server --host 0.0.0.0 --run-id R": (
        "tests/test_guides.py::test_the_distributed_commands_of_the_running_guide_play_a_group",
    ),
    "coevo agent policy --nats URL --run-id R --nats.credentials_file STORE/credentials/policy.json": (
        "tests/test_guides.py::test_the_distributed_commands_of_the_running_guide_play_a_group",
    ),
    "coevo agent env --family textworld": (
        "tests/test_guides.py::test_the_running_guides_textworld_env_worker_plays_a_game",
    ),
    "coevo agent ROLE": ("tests/test_cli.py::test_the_agent_command_a_server_prints_runs_as_printed",),
    "coevo agent metrics --nats URL --run-id R": (
        "tests/test_guides.py::test_the_running_guides_metrics_agent_aggregates_a_runs_events",
    ),
    "coevo dashboard --run R": (
        "tests/test_observe_live.py::test_offline_report_dashboard_and_trace_of_the_finished_run",
    ),
    "coevo report --run R": (
        "tests/test_observe_live.py::test_offline_report_dashboard_and_trace_of_the_finished_run",
    ),
    "coevo report --bench FILE.json": ("tests/test_observe.py::test_report_of_bench_results",),
    "coevo rejudge --run R --judge FILE --steps N": (
        "tests/test_replay.py::test_rejudge_with_another_local_judge_on_a_spread_sample_of_steps",
    ),
    # docs/guides/debugging.md: the whole block, on a recorded run
    "coevo trace policy:3000 --run R": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    "coevo replay --run R --into scorer": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    "coevo replay --run R --into scorer --set scorer.lam=0.5": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    "coevo replay --run R --into judge": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    "coevo replay --run R --into rewriter --from 1200 --to 5000": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    "coevo rejudge --run R --judge other.toml": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    "coevo rejudge --run R --judge FILE": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
        "tests/test_replay.py::test_rejudge_with_another_local_judge_on_a_spread_sample_of_steps",
    ),
    "coevo events export --run R out.jsonl": (
        "tests/test_replay.py::test_the_debugging_guide_runs_as_written_on_a_recorded_run",
    ),
    # docs/guides/byo-agent.md, docs/guides/environments.md
    "coevo run --family external --run-id mine": (
        "tests/test_guides.py::test_the_byo_agent_guides_two_lines_train_the_model_on_the_example_agent",
    ),
    "coevo run --family external": (
        "tests/test_guides.py::test_the_byo_agent_guides_two_lines_train_the_model_on_the_example_agent",
        "tests/test_byo_guide_agent.py::test_the_example_agent_waits_out_429_and_is_trained",
        "tests/test_byo_example.py::test_the_example_agent_is_trained_through_the_endpoint",
    ),
    "coevo agent env": ("tests/test_env_service.py::test_two_workers_in_separate_processes_serve_one_client",),
    "coevo run --family demo-counter": ("tests/test_byo_plugin.py::test_coevo_run_trains_on_a_plugin_family",),
    # my_module:MyEnv filled with tests/gym_text_env.py's TextWalk
    "coevo run --family gym:my_module:MyEnv": ("tests/test_gym_env.py::test_coevo_run_trains_on_a_gymnasium_env",),
    # docs/guides/external-judges.md: without a key here, each stops at its start-up check in one line
    "coevo run --judge litellm:openai/gpt-4.1-mini": (
        "tests/test_guides.py::test_an_external_judge_of_the_guide_without_its_key_stops_in_one_line",
        "tests/test_cli.py::test_an_external_judge_without_its_key_is_one_line_at_start",
    ),
    "coevo run --config configs/litellm-judge.toml": (
        "tests/test_guides.py::test_an_external_judge_of_the_guide_without_its_key_stops_in_one_line",
    ),
    # its URL pointed at a local port nothing answers on: the start-up probe's one line
    "coevo run --judge litellm:hosted_vllm/my-judge --judge-api-base http://10.0.0.5:8000/v1": (
        "tests/test_cli.py::test_an_external_judge_whose_endpoint_does_not_answer_is_one_line_at_start",
    ),
    # docs/guides/configuration.md: the example of a refusal, and what it prints
    "coevo run --set learner.lrr=3": (
        "tests/test_guides.py::test_the_configuration_guide_shows_what_a_misspelt_field_prints",
    ),
}
"""documented command -> the tests that run it (``tests/test_x.py::test_name``)"""

_SMOLLM2 = (
    "trains a real pretrained model (SmolLM2-135M) for minutes; its loop runs in tests/test_smollm2.py, in process"
)
_BENCH = "a benchmark of a real model over hours; its result is the JSON in docs/benchmarks (docs/benchmarks.md)"
NOT_HERE: dict[str, str] = {
    "coevo run --lora --base smollm2-135m-instruct --minutes 15": _SMOLLM2,
    "coevo run --lora --base smollm2-135m-instruct --config configs/smollm2.toml": _SMOLLM2,
    "coevo bench ladder --rungs full --seeds 5 --budget minutes:6 --eval-every 100000 --episodes 16 "
    "--base smollm2-135m-instruct --lora-lanes --heldout-tasks 64 --eval-seeds 2 --set tasks.eval_every=100000 "
    "--set learner.dtype=float32 --set learner.lr=1e-3": _BENCH,
    "coevo bench ladder --rungs policy-only,policy+judge,full --seeds 2 --budget minutes:15 --eval-every 100000 "
    "--episodes 16 --base smollm2-135m-instruct --lora-lanes --heldout-tasks 64 --eval-seeds 2 --heldout-measure steps "
    "--set tasks.eval_every=100000": _BENCH,
    "coevo bench heldout --base smollm2-135m-instruct --heldout-tasks 64 --eval-seeds 2 --used-form-only": _BENCH,
    "coevo bench heldout --family tw-coin_collector --base smollm2-135m-instruct --heldout-tasks 64 --eval-seeds 1 "
    "--used-form-only": _BENCH,
    "coevo run --policy-model DIR --policy-url http://127.0.0.1:8000/v1": (
        "needs a vLLM server (tests/test_vllm.py trains against vLLM's CPU build, in process, when .ci/run provides it)"
    ),
    "coevo run --lora --base DIR --policy-url URL": (
        "needs a vLLM server started with --enable-lora --max-loras 2 (tests/test_lora.py, with .ci/run's vLLM)"
    ),
}
"""documented command -> why no test of this suite can run it"""


def registry_problems(
    documented: set[str], run_by: Mapping[str, tuple[str, ...]], not_here: Mapping[str, str], root: Path = REPO
) -> list[str]:
    """What is wrong with a registry of ``documented`` commands: a command in neither part (or in both),
    an entry for a command no longer documented, a test named that is not defined in its file, an empty
    reason."""
    problems = [f"{c}: documented, in neither RUN_BY nor NOT_HERE" for c in sorted(documented - {*run_by, *not_here})]
    problems += [f"{c}: in both RUN_BY and NOT_HERE" for c in sorted(run_by.keys() & not_here.keys())]
    problems += [f"{c}: no longer documented" for c in sorted({*run_by, *not_here} - documented)]
    problems += [f"{c}: NOT_HERE without a reason" for c, why in not_here.items() if not why.strip()]
    defined: dict[str, set[str]] = {}
    for command, tests in run_by.items():
        if not tests:
            problems.append(f"{command}: RUN_BY names no test")
        for test in tests:
            path, _, name = test.partition("::")
            name = name.split("[")[0]  # a parametrized id
            if path not in defined:
                file = root / path
                tree = ast.parse(file.read_text()) if path.startswith("tests/") and file.is_file() else None
                defined[path] = (
                    {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
                    if tree
                    else set()
                )
            if not name.startswith("test_") or name not in defined[path]:
                problems.append(f"{command}: {test} is not a test defined in {path}")
    return problems


def guide_commands() -> set[str]:
    return {c for f in GUIDES for c in documented_commands(f.read_text())}


def test_every_command_of_the_readme_and_the_guides_is_run_by_a_test_or_says_why_not() -> None:
    documented = guide_commands()
    assert len(documented) > 30
    problems = registry_problems(documented, RUN_BY, NOT_HERE)
    assert problems == [], "\n".join(problems)


def test_the_registry_check_refuses_a_new_command_a_stale_entry_and_a_test_that_does_not_exist() -> None:
    documented = {"coevo run --minutes 3", "coevo run --new-flag"}
    run_by = {
        "coevo run --minutes 3": ("tests/test_guides.py::test_no_such_test",),
        "coevo run --gone": ("tests/test_guides.py::test_the_getting_started_run_prints_what_the_guide_shows[x]",),
    }
    assert registry_problems(documented, run_by, {"coevo run --new-flag": " "}) == [
        "coevo run --gone: no longer documented",
        "coevo run --new-flag: NOT_HERE without a reason",
        "coevo run --minutes 3: tests/test_guides.py::test_no_such_test is not a test defined in tests/test_guides.py",
    ]
    assert registry_problems(documented, {}, {}) == [
        "coevo run --minutes 3: documented, in neither RUN_BY nor NOT_HERE",
        "coevo run --new-flag: documented, in neither RUN_BY nor NOT_HERE",
    ]
    missing = registry_problems({"coevo agent env"}, {"coevo agent env": ("tests/test_nosuch.py::test_x",)}, {})
    assert missing == ["coevo agent env: tests/test_nosuch.py::test_x is not a test defined in tests/test_nosuch.py"]


# ---- guide commands as a user types them, in processes ---------------------------------------------


class Said:
    """A process's output (stdout and stderr together), read line by line by a thread: ``until`` waits
    for a line, as long as the process may take to print it, and no longer than it lives."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.ended = False
        self._new = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self.ended = True
            self._new.notify_all()

    def until(self, marker: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                if (hit := next((line for line in self.lines if marker in line), None)) is not None:
                    return hit
                left = deadline - time.monotonic()
                if self.ended or left <= 0:
                    raise AssertionError(f"no line with {marker!r} in {timeout} s:\n" + self.tail())
                self._new.wait(left)

    def ending(self, timeout: float) -> None:
        with self._new:
            self._new.wait_for(lambda: self.ended, timeout)

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])


@contextlib.contextmanager
def started(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], Said]]:
    """``argv`` as a process; stopped as Ctrl-C stops it (killed if it does not go) when the block ends."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env or subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc, Said(proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def finished(proc: subprocess.Popen[str], said: Said, timeout: float) -> int:
    """The exit status of ``proc`` once it ended by itself (within ``timeout``) and its output was read."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.args!s} still runs after {timeout} s:\n{said.tail()}") from None
    said.ending(30)
    return rc


def run_as_typed(command: str, home: Path, model_cache: Path) -> tuple[list[str], Path]:
    """``coevo run ...`` of a guide, typed in ``home`` (its runs in ``home/runs``), ended by a first learner
    step; the lines it printed from its closing summary on, and its run directory."""
    argv = [COEVO, *as_argv(command), "--steps", "1", "--env.cache_dir", str(model_cache), "--dashboard-port", "0"]
    with started(argv, home) as (proc, said):
        rc = finished(proc, said, 240)
    assert rc == 0, said.tail()
    at = next((i for i, line in enumerate(said.lines) if re.match(r"Run \S+ finished: ", line)), None)
    assert at is not None, said.tail()
    closing = said.lines[at:]
    run_id = closing[0].split()[1]
    return closing, home / "runs" / run_id


WHERE = {"summary", "report", "tensorboard", "dashboard"}
"""the closing summary's lines that say where things are: as the guide shows them, word for word"""


@pytest.mark.timeout(400)
def test_the_getting_started_run_prints_what_the_guide_shows(tmp_path: Path, model_cache: Path) -> None:
    """The guide's run ends with the closing summary the guide shows, line by line (its numbers and the
    run id aside), every path in it is there, and summary.json holds every field the guide shows."""
    text = (REPO / "docs" / "guides" / "getting-started.md").read_text()
    assert "coevo run --minutes 3" in documented_commands(text)
    shown = re.search(r"```\n(Run (\S+) finished: .*?)\n```", text, re.S)
    fields = re.search(r"```json\n(.*?)\n```", text, re.S)
    assert shown is not None and fields is not None
    closing, run_dir = run_as_typed("coevo run --minutes 3", tmp_path, model_cache)
    guide = shown.group(1).replace(shown.group(2), run_dir.name).splitlines()

    def label(line: str) -> str:
        return line.split(":")[0]

    real = [line for line in closing if line.strip() and not line.startswith("  warning:")]
    said = [label(line) for line in real]
    # lines a short run may lack: the held-out round under way when its step came, the baselines beside it
    optional = ("beside it on the same tasks", "held-out step agreement")
    shown_labels = [x for x in map(label, guide) if x in said or x.strip() not in optional]
    assert said == shown_labels, "\n".join(closing)
    port = re.compile(r"127\.0\.0\.1:\d+")
    where = {label(line): port.sub("PORT", line) for line in real if label(line).strip() in WHERE}
    assert where == {label(line): port.sub("PORT", line) for line in guide if label(line).strip() in WHERE}
    for line in real:
        for path in re.findall(r"runs/\S+", line):
            assert (tmp_path / path).exists(), line
    summary = json.loads((run_dir / "summary.json").read_text())
    documented = json.loads(fields.group(1))
    assert {k for k in documented if k != "..."} <= summary.keys()
    assert {k for k in documented["events"] if k != "..."} <= summary["events"].keys()
    assert summary["learner_steps"] >= 1


@pytest.mark.timeout(400)
def test_coevo_run_lora_trains_and_publishes_adapters_only(tmp_path: Path, model_cache: Path) -> None:
    """The running guide's `coevo run --lora`: both lanes train PEFT adapters of the tiny default models, and
    what a learner step publishes is the adapter (adapter_model.safetensors, adapter_config.json and
    coevo's manifest), never a whole model."""
    text = (REPO / "docs" / "guides" / "running.md").read_text()
    assert "coevo run --lora" in documented_commands(text)
    closing, run_dir = run_as_typed("coevo run --lora", tmp_path, model_cache)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] >= 1, "\n".join(closing)
    assert json.loads((run_dir / "config.json").read_text())["learner"]["lora"]["rank"] == 16
    for lane, least in (("policy", 2), ("judge", 1)):  # the base's adapter, then one a step
        published = sorted((run_dir / "checkpoints" / lane / "published").iterdir())
        assert len(published) >= least, (lane, published)
        for version in published:
            files = {p.name for p in version.iterdir()}
            assert files == {"adapter_model.safetensors", "adapter_config.json", "manifest.json"}, (version, files)
            assert json.loads((version / "manifest.json").read_text())["files"].keys() == files - {"manifest.json"}


@pytest.mark.timeout(400)
def test_the_byo_agent_guides_two_lines_train_the_model_on_the_example_agent(tmp_path: Path, model_cache: Path) -> None:
    """The bring-your-own-agent guide's two lines, typed in one directory: the run serves the policy and
    writes its key; the example agent, given that key from the file, plays until the run stops (here at its
    first learner step, trained on the agent's games) and exits 0."""
    from tests.test_byo_endpoint import free_port, need

    need("openai")
    text = (REPO / "docs" / "guides" / "byo-agent.md").read_text()
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    at = lines.index("coevo run --family external --run-id mine")
    run, agent = lines[at], lines[at + 1]
    assert agent == 'OPENAI_API_KEY="$(cat runs/mine/policy-endpoint.key)" python examples/minimal_agent.py'
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the guide's paths are from a checkout's root
    port = free_port()  # the guide's 8000, and the agent's COEVO_URL, moved to a free port
    argv = [COEVO, *as_argv(run), "--serve-policy", str(port), "--dashboard-port", "0"]
    with started([*argv, "--steps", "1", "--env.cache_dir", str(model_cache)], tmp_path) as (proc, said):
        said.until(f"coevo policy endpoint at http://127.0.0.1:{port}/v1", 180)
        env = {**subprocess_env(), "COEVO_URL": f"http://127.0.0.1:{port}"}
        env["PATH"] = (
            f"{Path(PYTHON).parent}{os.pathsep}{env.get('PATH', '')}"  # `python` is the environment's, as activated
        )
        env.pop("OPENAI_API_KEY", None)
        played = subprocess.run(
            ["bash", "-c", agent], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        rc = finished(proc, said, 120)
    assert played.returncode == 0, played.stdout[-2000:] + played.stderr[-2000:]
    games = played.stdout.splitlines()
    assert re.fullmatch(r"coevo stopped \((endpoint_stopping|connection refused)\)", games[-1]), played.stdout[-2000:]
    assert any(re.fullmatch(r"guess-\d+: (won|lost)", line) for line in games), played.stdout[-2000:]
    assert rc == 0, said.tail()
    summary = json.loads((tmp_path / "runs" / "mine" / "summary.json").read_text())
    assert summary["learner_steps"] >= 1 and summary["train_groups_with_samples"] >= 1, summary


async def _until(check: Callable[[], Awaitable[bool]], timeout: float, what: str, said: Said) -> None:
    """Poll ``check`` until it holds: what a process does shows in the stream, or on its port."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s; the process said:\n{said.tail()}")
        await asyncio.sleep(0.2)


@pytest.mark.timeout(300)
async def test_the_distributed_commands_of_the_running_guide_play_a_group(tmp_path: Path, model_cache: Path) -> None:
    """`coevo server --host 0.0.0.0 --run-id R`, then `coevo agent policy --nats URL --run-id R
    --nats.credentials_file STORE/credentials/policy.json`, typed in one directory (STORE: the server's
    default store, runs/nats; the server on a free port): the agent connects with the policy role's
    credentials and plays the group a task scheduler (here the admin) asks for."""
    from coevo.config import NatsConfig
    from coevo.schemas import AgentStatus, Source, TaskScheduled, TaskSpec, TrajectoryCompleted

    text = (REPO / "docs" / "guides" / "running.md").read_text()
    server_cmd, agent_cmd = (
        next(c for c in documented_commands(text) if c.startswith(start))
        for start in ("coevo server --host 0.0.0.0", "coevo agent policy")
    )
    fill = {"R": "dist", "STORE/credentials/policy.json": "runs/nats/credentials/policy.json"}
    server_argv = [COEVO, *[fill.get(w, w) for w in server_cmd.split()[1:]], "--port", "-1"]
    with started(server_argv, tmp_path) as (server, said):
        port = (await asyncio.to_thread(said.until, "nats-server ready at ", 60)).split()[3].rsplit(":", 1)[1]
        await asyncio.to_thread(said.until, "agents connect with: ", 30)
        fill["URL"] = f"nats://127.0.0.1:{port}"
        agent_argv = [COEVO, *[fill.get(w, w) for w in agent_cmd.split()[1:]], "--env.cache_dir", str(model_cache)]
        admin = await NatsBus.connect(
            fill["URL"], "dist", nats_cfg=NatsConfig(credentials_file=tmp_path / "runs/nats/credentials/admin.json")
        )
        try:
            with started(agent_argv, tmp_path) as (agent, heard):

                async def running() -> bool:
                    states = await admin.events(["agent.status"])
                    return any(
                        isinstance(e, AgentStatus) and e.role == "policy" and e.state == "running" for e in states
                    )

                async def played() -> list[TrajectoryCompleted]:
                    done = await admin.events(["trajectory.completed"])
                    return [e for e in done if isinstance(e, TrajectoryCompleted) and e.group_id == "g-1"]

                async def both_played() -> bool:
                    return len(await played()) == 2

                await _until(running, 120, "the policy agent running", heard)
                task = TaskSpec(
                    task_id="qg-t0",
                    family="quickgame",
                    params={"seed": 1},
                    knobs={"steps": 3, "distractors": 1, "slack": 1, "hints": 0},
                )
                source = Source(agent_id="tasks-test", role="tasks")
                await admin.publish_sync(
                    TaskScheduled(run_id="dist", source=source, task=task, group_id="g-1", n_rollouts=2)
                )
                await _until(both_played, 120, "the group's two trajectories", heard)
                agent.send_signal(signal.SIGINT)
                assert await asyncio.to_thread(finished, agent, heard, 60) == 0, heard.tail()
            assert {e.source.role for e in await played()} == {"policy"}
        finally:
            await admin.close()
        server.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(finished, server, said, 60) == 0, said.tail()


async def test_the_running_guides_metrics_agent_aggregates_a_runs_events(
    bus: NatsBus, nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """`coevo agent metrics --nats URL --run-id R` (with a port for its /metrics): it folds the run's
    events into Prometheus series and the run's TensorBoard files, and stops on Ctrl-C with exit 0."""
    from tests.test_observe import a_run
    from tests.test_observe_agent import scrape, success_points

    events = [e.model_copy(update={"run_id": run_id}) for e in a_run()]
    for e in events:
        await bus.publish_sync(e)
    text = (REPO / "docs" / "guides" / "running.md").read_text()
    command = next(c for c in documented_commands(text) if c.startswith("coevo agent metrics"))
    fill = {"URL": nats_url, "R": run_id}
    argv = [COEVO, *[fill.get(w, w) for w in command.split()[1:]], "--run.runs_dir", str(tmp_path / "runs")]
    with started([*argv, "--metrics-port", "0"], tmp_path) as (agent, said):
        metrics = (await asyncio.to_thread(said.until, "Prometheus metrics at ", 120)).split(" at ")[1].strip()

        async def folded() -> bool:
            families = await asyncio.to_thread(scrape, metrics)
            train = families.get("coevo_success_train")
            return bool(train and train.samples and train.samples[0].value == 1.0)  # the last group's

        await _until(folded, 60, "the run's success in /metrics", said)
        up = (await asyncio.to_thread(scrape, metrics))["coevo_agent_up"].samples
        assert {s.labels["role"] for s in up} == {"metrics"} and all(s.value == 1.0 for s in up)
        agent.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(finished, agent, said, 60) == 0, said.tail()
    assert success_points(tmp_path / "runs" / run_id / "tb") == [0.25, 0.5, 0.5, 0.75, 0.75, 1.0]


async def test_the_running_guides_textworld_env_worker_plays_a_game(
    bus: NatsBus, nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """`coevo agent env --family textworld` (pointed at the run's server): a TextWorld game is played
    through the worker, and its walkthrough wins there as it does in process."""
    from coevo.envs.service import RemoteEnv
    from coevo.envs.textworld_env import TextWorld
    from tests.test_env_service import wait_workers
    from tests.test_envs import play, twtask

    text = (REPO / "docs" / "guides" / "running.md").read_text()
    assert "coevo agent env --family textworld" in documented_commands(text)
    cache = tmp_path / "games"
    argv = [COEVO, "agent", "env", "--family", "textworld", "--nats", nats_url, "--run-id", run_id]
    argv += ["--env.cache_dir", str(cache), "--run.runs_dir", str(tmp_path / "runs")]
    with started(argv, tmp_path) as (worker, said):
        await wait_workers(bus, 1, timeout=120)
        task = twtask(5)
        walkthrough = await asyncio.to_thread(TextWorld(cache).walkthrough, task)
        env = RemoteEnv(bus.nc, run_id, "textworld")
        results = await play(env, task, walkthrough)
        assert results[-1].outcome == "won" and all(r.reference_label == 1 for r in results), said.tail()
        assert env.worker_id is not None
        worker.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(finished, worker, said, 60) == 0, said.tail()
