"""The ``coevo`` command off the happy path, run as a user types it (#39): a wrong path, a wrong run
id, a dead server or a typo fails in a second with one line, ``coevo: <what>``, a non-zero exit, and
nothing left on disk; every command coevo prints runs as printed."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PYTHON, REPO, subprocess_env

COEVO = str(Path(PYTHON).parent / "coevo")  # the console entry pyproject.toml installs


def coevo(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [COEVO, *args], cwd=cwd, capture_output=True, text=True, env=subprocess_env(), timeout=timeout
    )


def one_line(out: subprocess.CompletedProcess[str], *words: str, rc: int | None = None) -> str:
    """The failure was told in one line ``coevo: ...`` naming ``words``, with a non-zero exit."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and (rc is None or out.returncode == rc), (out.returncode, out.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("coevo: "), out.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A working directory a newcomer types commands in: nothing may appear in it on a failure."""
    d = tmp_path / "home"
    d.mkdir()
    return d


# ---- 1. the command a server prints runs as printed ----------------------------------------------


def _line_with(proc: subprocess.Popen[str], marker: str, timeout: float, before: list[str] | None = None) -> str:
    """The first line of ``proc``'s stdout holding ``marker`` (waits on the pipe, at most ``timeout``);
    ``before`` gets the lines printed before it."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in iter(proc.stdout.readline, ""):  # type: ignore[union-attr]
            lines.put(line)
        lines.put("")  # the end of its output

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if marker in line:
            return line
        if not line:
            break
        if before is not None:
            before.append(line)
    raise AssertionError(f"no line with {marker!r} within {timeout} s")


@pytest.fixture
def served(home: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    server = subprocess.Popen(
        [COEVO, "server", "--port", "-1", "--store", str(home / "store"), "--run-id", "D1"],
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        said: list[str] = []
        printed = _line_with(server, "agents connect with:", 60, said).split("agents connect with:", 1)[1].strip()
        assert said[0].startswith("nats-server ready at") and not any("debug" in line for line in said), said
        yield printed, server
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=30)


def test_the_agent_command_a_server_prints_runs_as_printed(served, home: Path) -> None:
    printed, _ = served
    assert printed.startswith("coevo agent ROLE ") and "--run-id D1" in printed
    argv = [*printed.replace("ROLE", "scorer").split()[1:], "--metrics-port", "0"]  # ROLE (twice) as a user fills it
    agent = subprocess.Popen(
        [COEVO, *argv], cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert "Prometheus metrics at" in _line_with(agent, "Prometheus metrics at", 60)  # connected and serving
    finally:
        agent.send_signal(signal.SIGINT)
        _, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in (home / "runs").iterdir()) == ["D1"]  # the run the server serves, no other


def test_an_agent_with_a_roles_credentials_and_no_run_id_is_refused_in_one_line(served, home: Path) -> None:
    printed, _ = served
    without = printed.replace(" --run-id D1", "").replace("ROLE", "scorer").split()[1:]
    out = coevo(*without, cwd=home, timeout=20)
    one_line(out, "--run-id", "coevo server --run-id", rc=2)
    assert not (home / "runs").exists()


def test_an_agent_for_a_run_the_server_does_not_serve_says_so_and_leaves_nothing(served, home: Path) -> None:
    printed, _ = served
    other = printed.replace("--run-id D1", "--run-id D2").replace("ROLE", "scorer").split()[1:]
    out = coevo(*other, cwd=home, timeout=90)
    logged = [line for line in out.stderr.splitlines() if line[:2] == "20"]  # the agent's own log lines
    assert any("permissions violation" in line for line in logged)  # what the server said, logged
    said = subprocess.CompletedProcess(out.args, out.returncode, out.stdout, out.stderr.split(logged[-1], 1)[1])
    one_line(said, "timeout", "coevo server --run-id RUN", "is D2 one of them?", rc=1)
    assert "Traceback" not in out.stderr
    assert not (home / "runs" / "D2").exists()  # its log was all it had written


# ---- 2, 3, 4: wrong run, wrong model, broken configs, dead server --------------------------------


def test_resume_of_a_run_that_does_not_exist_starts_nothing(home: Path) -> None:
    out = coevo("run", "--resume", "nosuchrun", cwd=home, timeout=20)
    one_line(out, "--resume nosuchrun", "no run nosuchrun", rc=2)
    assert list(home.iterdir()) == []


@pytest.mark.parametrize("what", ["missing", "empty", "docs", "file"])
def test_policy_model_that_is_not_a_model_fails_before_anything_loads(home: Path, what: str) -> None:
    empty = home.parent / "empty"
    empty.mkdir(exist_ok=True)
    given = {
        "missing": str(home.parent / "no-such-model"),
        "empty": str(empty),
        "docs": str(REPO / "docs"),
        "file": str(REPO / "README.md"),
    }[what]
    t0 = time.monotonic()
    out = coevo("run", "--policy-model", given, cwd=home, timeout=20)
    assert time.monotonic() - t0 < 10  # nothing was built or loaded (was 8-13 s of transformers)
    line = one_line(out, "--policy-model", given, "config.json", "*.safetensors", rc=2)
    assert {"missing": "does not exist", "empty": "empty", "docs": "no config.json", "file": "not a directory"}[
        what
    ] in line
    assert list(home.iterdir()) == []


def test_resolve_model_path_names_the_flag_and_accepts_a_model(tmp_path: Path, model_cache: Path) -> None:
    from coevo.errors import ConfigError
    from coevo.inference.models import ensure_default_model, model_dir_problem, resolve_model_path

    model = ensure_default_model("policy", model_cache)
    assert model_dir_problem(model) is None and resolve_model_path(model, "--base") == model
    weights_only = tmp_path / "w"
    weights_only.mkdir()
    (weights_only / "config.json").write_text("{}")
    (weights_only / "model.safetensors").write_bytes(b"")
    assert model_dir_problem(weights_only) == "has no tokenizer (tokenizer.json, tokenizer_config.json, ...)"
    with pytest.raises(ConfigError) as err:
        resolve_model_path(weights_only, "--judge local:DIR", "judge.model")
    assert err.value.field == "judge.model" and str(err.value).startswith("--judge local:DIR ")


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("bad.yaml", "log:\n  level: [debug\n", "does not parse"),
        ("bad.toml", "[bus\n", "does not parse"),
        ("dir", None, "is a directory"),
        ("absent.toml", None, "does not exist"),
    ],
)
def test_a_bad_config_file_is_one_line(home: Path, name: str, text: str | None, says: str) -> None:
    path = home.parent / name
    if text is not None:
        path.write_text(text)
    elif name == "dir":
        path.mkdir()
    out = coevo("run", "--config", str(path), cwd=home, timeout=20)
    one_line(out, str(path), says, rc=2)
    assert list(home.iterdir()) == []


def test_events_import_of_a_missing_file_is_one_line(home: Path) -> None:
    out = coevo("events", "import", "nosuch.jsonl", cwd=home, timeout=20)
    one_line(out, "nosuch.jsonl", "No such file", rc=1)
    assert list(home.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ("run",),
        ("agent", "scorer", "--run-id", "r1"),
        ("trace", "policy:1", "--run", "r1"),
        ("events", "export", "out.jsonl", "--run", "r1"),
        ("events", "import", "in.jsonl"),
        ("report", "--run", "r1"),
        ("dashboard", "--run", "r1"),
        ("replay", "--run", "r1", "--into", "scorer"),
        ("rejudge", "--run", "r1"),
    ],
    ids=lambda a: "-".join(a[:2]),
)
def test_a_dead_nats_server_is_one_line_in_seconds(home: Path, args: tuple[str, ...]) -> None:
    url = f"nats://127.0.0.1:{closed_port()}"
    (home.parent / "in.jsonl").write_text("")
    t0 = time.monotonic()
    out = coevo(*args, "--nats", url, cwd=home, timeout=30)
    assert time.monotonic() - t0 < 10  # was 30 s of retries
    one_line(out, "cannot reach NATS", url, rc=1)
    assert list(home.iterdir()) == []


def test_an_external_judge_without_its_key_is_one_line_at_start(home: Path) -> None:
    env = {k: v for k, v in subprocess_env().items() if k not in ("OPENAI_API_KEY", "MY_JUDGE_KEY")}

    def run(*extra: str, **more: str) -> subprocess.CompletedProcess[str]:
        argv = [COEVO, "run", "--judge", "litellm:openai/gpt-4.1-mini", "--minutes", "0.5", *extra]
        return subprocess.run(argv, cwd=home, capture_output=True, text=True, env={**env, **more}, timeout=60)

    one_line(run(), "judge litellm:openai/gpt-4.1-mini", "OPENAI_API_KEY is not set", "judge.api.api_key_env", rc=2)
    named = run("--set", "judge.api.api_key_env=MY_JUDGE_KEY")
    one_line(named, "MY_JUDGE_KEY is not set", rc=2)
    assert list(home.iterdir()) == []  # nothing was started
    assert run("--set", "judge.api.api_key_env=MY_JUDGE_KEY", "--dry-run", MY_JUDGE_KEY="k").returncode == 0
    assert run("--dry-run", OPENAI_API_KEY="k").returncode == 0
    rewriter = run(
        *("--set", "judge.api.api_key_env=MY_JUDGE_KEY", "--set", "tasks.rewriter.backend=litellm"),
        *("--set", "tasks.rewriter.model=openai/x"),
        MY_JUDGE_KEY="k",
    )
    one_line(rewriter, "tasks.rewriter litellm:openai/x", "OPENAI_API_KEY is not set", "tasks.rewriter.api.api_key_env")


def test_an_external_judge_whose_endpoint_does_not_answer_is_one_line_at_start(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as bound:  # bound, never listening: every connect is refused while the test runs
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/v1"
        argv = [COEVO, "run", "--judge", "litellm:hosted_vllm/my-judge", "--judge-api-base", url, "--minutes", "0.5"]

        def run(*extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*argv, *extra], cwd=home, capture_output=True, text=True, env=subprocess_env(), timeout=90
            )

        out = run()
        one_line(out, "judge litellm:hosted_vllm/my-judge", f"cannot reach judge.url {url}", "is the server up", rc=2)
        assert list(home.iterdir()) == []  # before any model or server was started
        assert run("--dry-run").returncode == 0  # printing the config needs no network
        # not probed: with fallbacks (the primary may be down by design), or where a proxy carries the calls
        from coevo.cli._checks import check_endpoints
        from coevo.config import load_config

        judge = {"judge.backend": "litellm", "judge.model": "hosted_vllm/my-judge", "judge.url": url}
        check_endpoints(load_config(overrides={**judge, "judge.api.fallbacks": ["openai/gpt-4.1-mini"]}))
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, "http://proxy.invalid:3128")
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.setenv(name, "")
        check_endpoints(load_config(overrides=judge))


def test_debug_keeps_the_traceback(home: Path) -> None:
    out = coevo("--debug", "events", "import", "nosuch.jsonl", cwd=home, timeout=20)
    assert out.returncode == 1 and "Traceback" in out.stderr and "FileNotFoundError" in out.stderr
    out = coevo("events", "import", "nosuch.jsonl", "--debug", cwd=home, timeout=20)
    assert "Traceback" in out.stderr


# ---- 5, 6: a recorded run (sample events, imported as a user would) -------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """tests.samples' events imported with ``coevo events import`` as run ``rec`` (no training)."""
    from tests.samples import sample_events

    home = tmp_path_factory.mktemp("recorded")
    export = home / "export.jsonl"
    from coevo.schemas import StepJudged, StepTaken

    events = sample_events("old")
    step = next(e for e in events if isinstance(e, StepTaken))
    events = [e.model_copy(update={"step_event_id": step.event_id}) if isinstance(e, StepJudged) else e for e in events]
    rows = [{"seq": i + 1, "subject": "x", "event": json.loads(e.model_dump_json())} for i, e in enumerate(events)]
    export.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = coevo("events", "import", str(export), "--run-id", "rec", "--runs-dir", str(home / "runs"), cwd=home)
    assert out.returncode == 0, out.stderr[-3000:]
    return home, "rec"


def test_trace_of_a_version_that_never_existed_says_so(recorded) -> None:
    home, run = recorded
    out = coevo("trace", "policy:9999", "--run", run, cwd=home)
    one_line(out, "policy:9999", "policy versions 0, 4 recorded", rc=1)
    out = coevo("trace", "judge:2", "--run", run, cwd=home)
    one_line(out, "judge:2", "judge versions 0 recorded", rc=1)


def test_trace_of_a_pruned_version_says_it_is_gone_and_shows_the_step(recorded) -> None:
    home, run = recorded
    out = coevo("trace", "policy:4", "--run", run, cwd=home)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "/tmp/ckpt/v4 (pruned: no longer on disk)" in text
    assert "clip fraction 0.050" in text and "groups 0" in text  # the README's promise, without --json
    data = json.loads(coevo("trace", "policy:4", "--run", run, "--json", cwd=home).stdout)
    assert data["on_disk"] is False and data["learner_step"]["clip_fraction"] == 0.05


def test_rejudge_with_a_judge_that_never_boxes_its_vote_fails_and_counts_them(recorded) -> None:
    home, run = recorded
    judge = home / "judge.toml"
    judge.write_text('[judge]\nbackend = "litellm"\nmodel = "openai/gpt-4.1-mini"\napi = {mock_response = "+1"}\n')
    out = coevo("rejudge", "--run", run, "--judge", str(judge), cwd=home)
    one_line(out, "3 of the new judge's 3 votes were unparseable", "mean nothing", rc=1)
    result = json.loads(out.stdout)
    assert result["rejudge_votes"] == {"ok": 0, "unparseable": 3, "error": 0}


def test_unparsed_votes_verdict() -> None:
    from coevo.tools.rejudge import unparsed

    assert unparsed({"ok": 9, "unparseable": 0, "error": 0}) is None
    some = unparsed({"ok": 8, "unparseable": 1, "error": 1})
    assert some is not None and not some[1] and "1 of the new judge's 10" in some[0] and "1 failed" in some[0]
    none = unparsed({"ok": 0, "unparseable": 3, "error": 0})
    assert none is not None and none[1]


# ---- 10: help ------------------------------------------------------------------------------------


def test_help_says_plain_defaults_choices_and_what_matters(home: Path) -> None:
    text = coevo("run", "--help", cwd=home).stdout
    assert "PydanticUndefined" not in text and "PosixPath" not in text
    assert "--tasks.rewriter.backend {builtin,off,litellm,vllm,local}" in text
    assert "--judge.backend {local,vllm,litellm}" in text
    flat = " ".join(text.split())
    assert "parent directory of run directories [default: runs]" in flat
    assert "(with judge.backend vllm|litellm) [required]" in flat
    assert "The flags in 'options' are the ones most runs need" in flat
    usage = text.split("\n\n")[0]
    assert len(usage.splitlines()) < 12 and "--SECTION.FIELD V" in usage  # not the 600 lines of every field
    for command in ("trace", "replay", "rejudge"):
        flat = " ".join(coevo(command, "--help", cwd=home).stdout.split())
        assert "--run RUN id of the run" in flat, command


def test_an_unknown_flag_gets_its_commands_usage_and_a_suggestion(home: Path) -> None:
    out = coevo("run", "--polcy-model", "x", cwd=home)
    assert out.returncode == 2 and out.stderr.startswith("usage: coevo run ")
    assert "unrecognized arguments: --polcy-model x (did you mean --policy-model?)" in out.stderr
    assert len(out.stderr.splitlines()) < 12
    assert list(home.iterdir()) == []


def test_the_one_error_path() -> None:
    """The error path itself: expected errors are one line, exit 2 for refusals; a bug keeps its traceback."""
    from coevo.cli._failure import exit_status, one_line
    from coevo.errors import BusError, ConfigError

    assert one_line(ConfigError("a\nb", "x")) == "a b" and exit_status(ConfigError("a", None)) == 2
    assert (
        one_line(FileNotFoundError(2, "No such file or directory", "f.jsonl")) == "f.jsonl: No such file or directory"
    )
    group = BaseExceptionGroup("g", [ValueError("bug"), ExceptionGroup("h", [BusError("down")])])
    assert one_line(group) == "down" and exit_status(group) == 1
    assert one_line(ValueError("a bug")) is None


# ---- 9: what the docs tell a newcomer to type ------------------------------------------------------


def test_the_readme_activates_the_venv_before_its_first_coevo_command() -> None:
    readme = (REPO / "README.md").read_text()
    activate = readme.index("source .venv/bin/activate")
    at = [readme.find(f"\n{c}") for c in ("coevo run", "coevo agent", "coevo trace", "coevo bench")]
    assert max(at) > 0 and activate < min(i for i in at if i >= 0)


def test_the_external_agent_example_says_which_key_to_send() -> None:
    import ast

    usage = ast.get_docstring(ast.parse((REPO / "examples" / "openai_agent.py").read_text())) or ""
    assert 'OPENAI_API_KEY="$(cat runs/ext/policy-endpoint.key)"' in usage and "--run-id ext" in usage
    assert '"policy-endpoint.key"' in (REPO / "coevo" / "agents" / "policy.py").read_text()  # where run writes it


# ---- 12: torch on a machine without a GPU ---------------------------------------------------------


def _install_torch(*args: str, index: str) -> subprocess.CompletedProcess[str]:
    env = {**subprocess_env(), "COEVO_TORCH_CPU_INDEX": index, "COEVO_TORCH_PYTHON": PYTHON}
    return subprocess.run(
        [str(REPO / "scripts" / "install-torch.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine takes the CUDA build")
def test_setup_takes_the_cpu_build_where_its_index_answers_and_says_which(tmp_path: Path) -> None:
    import functools
    import http.server

    (tmp_path / "torch").mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}"
        out = _install_torch("--dry-run", index=index)
    finally:
        server.shutdown()
    assert out.returncode == 0 and out.stdout.split() == ["--index-url", index, "torch==2.13.0"], out.stderr
    assert f"no GPU: the CPU build from {index}" in out.stderr
    dead = f"http://127.0.0.1:{closed_port()}/whl/cpu"
    out = _install_torch("--dry-run", index=dead)
    assert out.returncode == 0 and out.stdout.split() == ["torch==2.13.0"]
    assert f"{dead} does not answer" in out.stderr and "(fallback)" in out.stderr
    kept = _install_torch(index=dead)  # the interpreter running this test has torch 2.13.0: nothing installed
    assert kept.returncode == 0 and "already installed, kept" in kept.stdout


def _fail_after(runs: Path, *made: str) -> None:
    """Under ``removed_on_failure(runs)``: make ``made`` (paths under runs; a name with a dot is a file), then fail."""
    from coevo.cli._leftovers import removed_on_failure

    def make_and_fail() -> None:
        with removed_on_failure(runs):
            for rel in made:
                path = runs / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                if "." in path.name:
                    path.write_text("{}\n")
                else:
                    path.mkdir()
            raise RuntimeError("failed")

    with pytest.raises(RuntimeError):
        make_and_fail()


def test_a_failed_command_removes_only_the_run_directories_it_created_of_logs_alone(tmp_path: Path) -> None:
    from coevo.cli._leftovers import removed_on_failure

    runs = tmp_path / "runs"
    (runs / "old").mkdir(parents=True)
    (runs / "old" / "coevo.log.jsonl").write_text("{}\n")  # there before: never touched
    _fail_after(runs, "logs-only/coevo.log.jsonl", "logs-only/config.json", "trained/checkpoints/step-1.pt")
    assert sorted(p.name for p in runs.iterdir()) == ["old", "trained"]
    fresh = tmp_path / "fresh-runs"
    _fail_after(fresh, "r1")
    assert not fresh.exists()  # it created runs_dir too: gone with its only run
    with removed_on_failure(fresh):
        (fresh / "r2").mkdir(parents=True)
    assert (fresh / "r2").is_dir()  # a command that succeeded keeps what it made
