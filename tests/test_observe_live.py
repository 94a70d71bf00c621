"""A real short `coevo run` seen from outside: its dashboard in headless Chromium, its /metrics scraped,
its TensorBoard files read back, its report and its human summary; then the offline commands on it.

Chromium is Debian's `chromium` (`.ci/run` installs it). Outside CI (env CI unset) the browser test
skips when it is absent, saying so; in CI it fails.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import LOOP_OVERRIDES, PYTHON, REPO, _free_port, subprocess_env

pytestmark = pytest.mark.slow

RUN_ID = "observed"


# ---- headless Chromium over the DevTools protocol ---------------------------------------------------


def chromium_binary() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("headless Chromium is not installed (apt-get install -y chromium); CI runs this test")
    return path


class Page:
    """One browser tab, driven over the DevTools protocol (a websocket; no driver package needed)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.n = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        async for msg in self.ws:
            data = json.loads(msg.data)
            if data.get("id") == self.n:
                if "error" in data:
                    raise RuntimeError(f"{method}: {data['error']}")
                return data["result"]
        raise RuntimeError("the browser closed the connection")

    async def js(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return r["result"].get("value")

    async def goto(self, url: str, ready: str, timeout: float = 60.0) -> None:
        """Navigate and wait until the JS expression ``ready`` is truthy."""
        await self.call("Page.navigate", url=url)
        await self.wait(ready, timeout)

    async def wait(self, expression: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.js(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                dom = await self.js("document.body ? document.body.innerText.slice(0, 2000) : ''")
                raise AssertionError(f"timed out waiting for {expression!r}; page text: {dom}")
            await asyncio.sleep(0.5)

    async def screenshot(self, path: Path) -> Path:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


@asynccontextmanager
async def chromium(binary: str) -> AsyncIterator[Page]:
    proc = subprocess.Popen(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            "--window-size=1400,1000",
            "--hide-scrollbars",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = await asyncio.to_thread(_devtools_port, proc)
        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as r:
                target = await r.json(content_type=None)
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _devtools_port(proc: subprocess.Popen[str]) -> int:
    assert proc.stderr is not None
    for line in proc.stderr:
        if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
            return int(m.group(1))
    raise RuntimeError(f"chromium exited ({proc.wait()}) without opening DevTools")


# ---- the run ------------------------------------------------------------------------------------------


@dataclass
class Live:
    proc: subprocess.Popen[str]
    dashboard: str
    metrics: str
    runs: Path
    console: Path
    """the run's stderr, its console log (a file: a pipe nobody reads while it runs could fill and block it)"""
    stdout: str = ""
    stderr: str = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=240)
        self.stdout += out
        self.stderr = self.console.read_text()


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def wait_state(url: str, predicate: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        state = get_json(url + "/api/state")
        if predicate(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the run did not get there in {timeout:.0f} s: {state['summary']}")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Live]:
    runs = tmp_path_factory.mktemp("observed") / "runs"
    port = _free_port()
    overrides = [
        a
        for k, v in {
            **LOOP_OVERRIDES,
            "env.cache_dir": str(model_cache),
            "run.runs_dir": str(runs),
            "agent.heartbeat_s": 1.0,
            "log.console": "pretty",  # as a person sees it (the tests' default is off)
        }.items()
        for a in ("--set", f"{k}={json.dumps(v) if isinstance(v, list) else v}")
    ]
    console = runs.parent / "console.txt"
    with console.open("w") as err:  # the child holds its own copy
        proc = subprocess.Popen(
            [
                PYTHON,
                "-m",
                "coevo",
                "run",
                "--minutes",
                "6",
                "--run-id",
                RUN_ID,
                "--dashboard-port",
                "0",
                "--metrics-port",
                str(port),
                *overrides,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=subprocess_env(),
        )
    assert proc.stdout is not None
    first = proc.stdout.readline() + proc.stdout.readline()
    m = re.search(r"dashboard at (http://127\.0\.0\.1:\d+)", first)
    if m is None:
        proc.kill()
        pytest.fail(f"coevo run printed no dashboard address: {first!r}\n{console.read_text()[-3000:]}")
    run = Live(proc, m.group(1), f"http://127.0.0.1:{port}/metrics", runs, console, stdout=first)
    try:
        wait_state(
            run.dashboard,
            lambda s: (
                s["summary"]["learner_steps"] >= 2
                and s["summary"]["groups_scored"] >= 6
                and s["summary"]["events"].get("weights.applied", 0) >= 2
            ),
            timeout=280,
        )
        yield run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- while it runs ------------------------------------------------------------------------------------


async def test_dashboard_pages_render_live_in_chromium(live: Live, tmp_path: Path) -> None:
    binary = chromium_binary()
    url = live.dashboard
    async with chromium(binary) as page:
        await page.goto(url + "/", "document.getElementById('page').dataset.ready === '1'")
        points = "(c) => Number(document.querySelector(`figure.chart[data-chart=${c}]`).dataset.points || 0)"
        for chart in ("success", "agreement", "reward", "judge", "loss", "kl", "weights"):
            await page.wait(
                f"({points})('{chart}') > 0 && document.querySelectorAll("
                f"'figure.chart[data-chart={chart}] svg .pt').length > 0",
                timeout=30,
            )
        circles = await page.js("document.querySelectorAll('figure.chart[data-chart=success] circle.pt').length")
        assert circles >= 6
        before = await page.js(f"({points})('success')")
        await page.wait(f"({points})('success') > {before}", timeout=90)  # new groups arrive over the live stream
        assert "learner steps (policy / judge)" in await page.js("document.getElementById('headline').innerText")
        shot = await page.screenshot(tmp_path / "dashboard.png")
        assert shot.stat().st_size > 20_000

        await page.goto(url + "/trajectories", "document.querySelectorAll('table.trajectories tbody tr').length > 0")
        trained = await page.js(
            "[...document.querySelectorAll('table.trajectories tbody tr')]"
            ".filter(r => r.innerText.includes('policy step')).length"
        )
        assert trained > 0, "no trajectory shows the learner step that trained it"
        href = await page.js(
            "[...document.querySelectorAll('table.trajectories tbody tr')]"
            ".find(r => r.innerText.includes('policy step')).querySelector('a').getAttribute('href')"
        )
        await page.goto(url + href, "document.querySelectorAll('table.steps .vote').length > 0", timeout=90)
        text = await page.js("document.getElementById('page').innerText")
        assert "trained by policy learner step" in text and "Steps, votes and advantages" in text
        assert await page.js("document.querySelectorAll('table.steps tbody tr').length") >= 1
        await page.screenshot(tmp_path / "trajectory.png")

        await page.goto(url + "/tasks", "document.querySelectorAll('table.slots tbody tr').length > 0")
        assert await page.js("document.querySelectorAll('table.rewrites tbody tr').length") > 0
        await page.goto(url + "/agents", "document.querySelectorAll('table.agents tbody tr').length >= 5")
        roles = await page.js(
            "[...document.querySelectorAll('table.agents tbody tr td:nth-child(2)')].map(x => x.innerText)"
        )
        assert {"policy", "judge", "scorer", "tasks", "learner"} <= set(roles)
        assert await page.js("document.querySelectorAll('table.consumers tbody tr').length") >= 4


def test_metrics_endpoint_scrapes(live: Live) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for url in (live.metrics, live.dashboard + "/metrics"):
        with urllib.request.urlopen(url, timeout=30) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        assert {"coevo_success_train", "coevo_learner_loss", "coevo_events", "coevo_weights_pause_ms"} <= set(families)
        events = {s.labels["kind"]: s.value for s in families["coevo_events"].samples if s.name == "coevo_events_total"}
        assert events["step.taken"] > 0 and events["learner.stepped"] > 0
        loss_roles = {s.labels["role"] for s in families["coevo_learner_loss"].samples}
        assert "policy" in loss_roles
    up = {s.labels["role"]: s.value for s in families_of(live.metrics)["coevo_agent_up"].samples}
    assert up == {"tasks": 1.0, "policy": 1.0, "scorer": 1.0, "learner": 1.0, "judge": 1.0, "retention": 1.0}
    health = get_json(live.metrics.replace("/metrics", "/healthz"))
    assert health["status"] == "ok"


def families_of(url: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


# ---- after it ----------------------------------------------------------------------------------------


GUIDE_SUMMARY = (REPO / "docs" / "guides" / "getting-started.md").read_text().split("```\nRun ")[1].split("```")[0]
"""the closing summary the getting-started guide shows for the quick start's run"""


def summary_labels(text: str) -> list[str]:
    """What each line of a closing summary is about: its words before the first colon, indented lines
    only (the first line names the run)."""
    return [line.strip().split(":")[0] for line in text.splitlines()[1:] if line.startswith("  ")]


def test_the_run_ends_with_a_summary_tensorboard_files_and_a_report(live: Live) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    live.stop()
    assert live.proc.returncode == 0, live.stderr[-3000:]
    run_dir = live.runs / RUN_ID
    out = live.stdout
    # stopped by SIGTERM before its minutes ran out: the summary says so and how to go on
    assert f"Run {RUN_ID} was interrupted (SIGTERM) before its budget:" in out, out[-3000:]
    assert "policy success on train groups:" in out and f"--resume {RUN_ID}" in out
    assert "min of it)" in out  # the minutes are this process's, the counts the run's (#39)
    assert "report:" in out and "tensorboard:" in out and "summary.json" in out
    assert '"policy_success_start"' not in out, "the JSON belongs in summary.json, not on the console"
    # the getting-started guide shows what a run prints: the same lines, in the same order
    printed = summary_labels(out[out.index(f"Run {RUN_ID} was interrupted") :])
    shown = summary_labels(GUIDE_SUMMARY)
    measured_after = ("beside it on the same tasks", "held-out step agreement")  # lines a stopped run may lack
    assert [x for x in printed if x not in ("warning", "resume")] == [
        x for x in shown if x in printed or x not in measured_after
    ], (printed, shown)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] >= 2
    # the console shows what a person acts on; the learner's lanes, checkpoints and weight versions are in
    # the log file only
    logged = (run_dir / "coevo.log.jsonl").read_text()
    assert '"learner.lane"' in logged and '"run.started"' in logged and '"nats.embedded_started"' in logged
    assert "run.started" in live.stderr, live.stderr[-3000:]
    assert not {"learner.lane", "learner.checkpoint", "agent.stopped", "nats.embedded_started"} & set(
        re.findall(r"[a-z_]+\.[a-z_]+", live.stderr)
    )  # from the first record on: the embedded server starts before any agent

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"success/success_train", "loss/learner_loss/policy", "kl/learner_kl/policy", "reward/reward_mean"} <= tags
    assert any(t.startswith("weights/weights_pause_ms/policy/") for t in tags)
    assert len(acc.Scalars("success/success_train")) == summary["groups_scored"]
    steps = [e.step for e in acc.Scalars("loss/learner_loss/policy")]
    assert steps == list(range(1, summary["learner_steps"] + 1))

    report = (run_dir / "report" / "index.html").read_text()
    for plot in ("success", "reward", "judge", "kl", "weights"):
        assert f'id="plot-{plot}"' in report and (run_dir / "report" / "plots" / f"{plot}.png").stat().st_size > 5000
    assert "data:image/png;base64," in report and "<script" not in report


def test_offline_report_dashboard_and_trace_of_the_finished_run(live: Live, tmp_path: Path) -> None:
    if live.proc.poll() is None:
        live.stop()
    common = ["--run", RUN_ID, "--runs-dir", str(live.runs)]
    done = subprocess.run(
        [PYTHON, "-m", "coevo", "report", *common, "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "r" / "plots" / "success.png").exists()
    dash = subprocess.Popen(
        [PYTHON, "-m", "coevo", "dashboard", *common, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert dash.stdout is not None
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", dash.stdout.readline())
        assert m, dash.stderr.read() if dash.stderr else ""
        state = wait_state(m.group(1), lambda s: s["finished"] is not None, timeout=60)
        assert state["finished"]["learner_steps"] == state["summary"]["learner_steps"]
        trajectory = get_json(m.group(1) + "/api/trajectories?limit=50")[0]["trajectory_id"]
        traced = get_json(f"{m.group(1)}/api/trace/{trajectory}")
        assert traced["kind"] == "trajectory" and traced["steps"]
    finally:
        dash.send_signal(signal.SIGINT)
        dash.wait(timeout=60)
    tree = subprocess.run(
        [PYTHON, "-m", "coevo", "trace", trajectory, *common],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert tree.returncode == 0, tree.stderr[-2000:]
    assert "votes" in tree.stdout
