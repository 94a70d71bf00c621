"""docs/architecture.md's subject table is what the code does."""

from __future__ import annotations

import ast
import importlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from coevo.config import load_config
from coevo.tools.topology import topology
from tests.conftest import REPO


def test_subject_table_matches_the_agents(model_cache: Path) -> None:
    cfg = load_config(overrides={"env.cache_dir": str(model_cache), "log.console": "off"})
    table = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"\| `coevo\.<run>\.ev\.([a-z.<>]+)` \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            split = lambda cell: {c.strip() for c in re.split(r",(?![^(]*\))", cell) if c.strip() not in ("", "—")}  # noqa: E731
            table[m.group(1)] = {"producers": split(m.group(2)), "consumers": split(m.group(3))}
    assert table == topology(cfg)


# ---- the layout: contracts, table, and the shape of modules ----------------------------------------

LINT = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_import_contracts_hold() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("training/loss.py", "import coevo.agents.policy", "Layers"),
        ("envs/quickgame.py", "import coevo.runtime.bus", "Environments know nothing of NATS"),
        ("algorithm/scoring.py", "import torch", "The algorithm does no I/O"),
        ("schemas/base.py", "import nats", "Events stay light"),
        ("inference/engine.py", "import coevo.weights.follower", "Layers"),
        ("weights/follower.py", "import coevo.agents.policy", "Layers"),
        ("weights/transfer.py", "import coevo.runtime.bus", "What vLLM's workers import"),
    ],
)
def test_import_contracts_catch_a_violation(tmp_path: Path, module: str, line: str, contract: str) -> None:
    shutil.copytree(REPO / "coevo", tmp_path / "coevo", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with (tmp_path / "coevo" / module).open("a") as f:
        f.write(f"\n{line}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts")[-1]
    assert contract in broken and line.split()[-1] in broken


def _layers() -> list[set[str]]:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["id"] == "layers"]  # the packages' (runtime-one-way: modules)
    return [{name.strip() for name in row.split("|")} for row in layers]


def test_where_things_are_table_matches_the_contracts() -> None:
    rows = []
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"\| (\d+) \| ([^|]+) \|", line)
        if m:
            names = re.findall(r"`coevo/([\w/.]+?)(?:\.py)?`", m.group(2))
            rows.append({"coevo." + n.replace("/", ".") for n in names})
    assert rows == _layers()
    top = {
        p.stem
        for p in (REPO / "coevo").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.stem not in ("__init__", "__main__"))
    }
    assert {n.split(".")[1] for row in rows for n in row} == top  # every package has its row


def test_no_client_is_asked_what_it_can_do() -> None:
    """#23: a client's capabilities are Protocols, chosen once (``weights.transports``); nothing probes
    a client with ``hasattr`` or ``getattr``."""
    probes = [
        f"{p.relative_to(REPO)}:{i}"
        for p in sorted((REPO / "coevo").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"(hasattr|getattr)\((self\.)?(agent\.)?(llm_)?client\b", line)
    ]
    assert probes == []


def test_agents_holds_only_agents_and_no_library_package_holds_a_benchmark() -> None:
    from coevo.runtime.agent import Agent

    for path in sorted((REPO / "coevo" / "agents").glob("*.py")):
        if path.stem == "__init__":
            continue
        module = importlib.import_module(f"coevo.agents.{path.stem}")
        agents = [
            v
            for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, Agent) and v.__module__ == module.__name__
        ]
        assert agents, f"coevo/agents/{path.name} defines no agent"
    benches = [
        p
        for p in (REPO / "coevo").rglob("*bench*.py")
        if "bench" not in p.relative_to(REPO / "coevo").parts[:-1] and p != REPO / "coevo" / "cli" / "bench.py"
    ]  # coevo/cli/bench.py: the `coevo bench` command's rows, each importing its bench from coevo.bench
    assert benches == []


MAX_FUNCTION_LINES = 60


def test_no_function_is_longer_than_60_lines() -> None:
    long = []
    for path in sorted((REPO / "coevo").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length} lines)")
    assert long == []


# ---- what a restart costs: roles without a model load none of its stack ----------------------------

MODEL_FREE_ROLES = ("tasks", "scorer", "env", "metrics", "retention")
_START_A_ROLE = """
import asyncio, json, sys, types
from coevo.cli import _agent_metrics, build_parser, resolve_config
from coevo.agents import resolve_role

HEAVY = ("torch", "transformers", "vllm", "litellm", "coevo.observe.live")

async def main(roles):
    seen = {}
    for role in roles:  # what cmd_agent does up to the agent's run(), without a server
        args = build_parser().parse_args(["agent", role, "--set", "log.console=off"])
        cfg = resolve_config(args)
        import coevo.runtime.agent, coevo.runtime.app
        agent = resolve_role(role)(types.SimpleNamespace(run_id="t"), cfg)
        async with _agent_metrics(agent, args) as url:
            assert url is None
        seen[role] = [m for m in HEAVY if m in sys.modules]
    print(json.dumps(seen))

asyncio.run(main(sys.argv[1:]))
"""


def test_roles_without_a_model_start_without_torch() -> None:
    """chaos kill -9s an agent every few seconds: a restarted tasks, scorer, env, metrics or retention
    agent must not pay seconds of CPU for torch or transformers it never uses (nor the observe
    package when it serves no metrics)."""
    import json

    result = subprocess.run(
        [sys.executable, "-c", _START_A_ROLE, *MODEL_FREE_ROLES],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {role: [] for role in MODEL_FREE_ROLES}
