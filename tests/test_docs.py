"""The documentation a user reads: the site builds in strict mode (a broken link, a missing anchor or
a page left out of the navigation fails it), and every relative link of the README leads to a file."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

MKDOCS = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "mkdocs"


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for page in ("index.html", "guides/byo-agent/index.html", "benchmarks/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_a_broken_link_fails_the_site(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](nosuch.md)\n")
    (tmp_path / "mkdocs.yml").write_text((REPO / "mkdocs.yml").read_text().split("\nnav:")[0] + "\n")
    out = subprocess.run(
        [str(MKDOCS), "build", "--strict"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert out.returncode != 0 and "nosuch.md" in out.stderr


def readme_links(text: str) -> list[str]:
    """The relative targets of the Markdown links and images in ``text`` (no URLs, no anchors alone)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_relative_link_of_the_readme_leads_to_a_file() -> None:
    links = readme_links((REPO / "README.md").read_text())
    assert "docs/guides/byo-agent.md" in links and "docs/img/dashboard.png" in links
    missing = [t for t in links if not (REPO / t).exists()]
    assert missing == []
    assert readme_links("[a](x.md#y) [b](https://e.org) [c](#here) ![d](img/p.png)") == ["x.md", "img/p.png"]


def test_the_bring_your_own_agent_snippet_defines_what_it_calls() -> None:
    import ast
    import builtins

    text = (REPO / "docs" / "guides" / "byo-agent.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    tree = ast.parse(code.group(1))  # top-level awaits parse as expressions
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    defined |= {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names
    }
    defined |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    defined |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) for a in n.args.args}
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"call", "play"} <= called  # the retrying helper and one episode (tests/test_byo_guide_agent.py runs it)
    assert called - defined - set(dir(builtins)) == set(), called - defined


def test_every_benchmark_file_is_referenced_and_named_by_what_it_measured() -> None:
    """Each result in docs/benchmarks/ is linked from the docs (superseded results live in git history) and
    named by what it measured, not by the tracker issue or work session that produced it."""
    # a bench running with --json X.json keeps X.partial.json beside it until it ends (git ignores those)
    files = sorted(
        p.name for p in (REPO / "docs" / "benchmarks").glob("*.json") if not p.name.endswith(".partial.json")
    )
    assert files
    docs = (REPO / "docs" / "benchmarks.md").read_text() + (REPO / "README.md").read_text()
    unreferenced = [name for name in files if not re.search(rf"(?<![\w.-]){re.escape(name)}", docs)]
    assert unreferenced == []
    assert [name for name in files if re.search(r"issue|session", name, re.I)] == []
    assert not re.search(r"no JSON|JSON was not kept", docs), "every result has its JSON file"
    sections = re.split(r"\n(?=#{2,4} )", (REPO / "docs" / "benchmarks.md").read_text())
    tables_without = [p.split("\n")[0] for p in sections if "\n|" in p and not re.search(r"benchmarks/\S+\.json", p)]
    assert tables_without == [], "a table of results in a section that links no JSON"


def test_the_configuration_and_cli_references_are_generated_from_the_code() -> None:
    """docs/reference/*.md are what the config tree and the command table declare today: a new field, a
    changed default or a new flag fails this until the pages are regenerated."""
    from coevo.cli.reference import REFERENCES, cli_reference, config_reference

    for name, render in REFERENCES.items():
        assert (REPO / "docs" / "reference" / name).read_text() == render(), (
            f"regenerate: python -m coevo.cli.reference docs/reference ({name})"
        )
    from coevo.cli import COMMANDS
    from coevo.cli._config import field_flags

    config, cli = config_reference(), cli_reference()
    assert [n for n in field_flags() if f"| `{n}` |" not in config] == [] and "| `learner.lr` |" in config
    assert [c.path for c in COMMANDS if c.run and f"## `coevo {c.path}`" not in cli] == []
    assert "## `coevo run` (*config*)" in cli and "## `coevo bench ladder`" in cli and "`--lora-lanes`" in cli


def test_the_readme_is_one_screen_in_the_order_a_newcomer_needs() -> None:
    """What coevo is, the dashboard, the quick start, the results beside habits, where to go next: in that
    order, the quick start within the first screen, the whole README short enough to read in minutes."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, len(lines)
    heads = [line for line in lines if line.startswith("## ")]
    quick, results_head, nxt = heads[0], heads[1], heads[2]
    assert quick.startswith("## Quick start") and nxt == "## Where to go next", heads
    assert lines.index(quick) < 20 and text.index("docs/img/dashboard.png") < text.index(quick)
    assert lines.index(results_head) < 30 and lines.index(nxt) < 60  # all five parts on the first screen
    assert "](docs/guides/getting-started.md)" in text[: text.index(results_head)]  # what a run prints, next to it
    results = text[text.index(results_head) : text.index(nxt)]
    for column in ("random", "best position rule", "base greedy", "trained"):
        assert f"| {column} |" in results, column  # a learning number stands beside what habits score
    assert "```bash\ncoevo bench" in results  # with the command that reproduces it


def test_the_docs_name_no_tracker_numbers_nor_stages_of_the_work() -> None:
    """User docs say what a thing does and what was measured, not which issue or session changed it."""
    pattern = re.compile(r"\b[Ii]ssue #?\d+|(?<![\w/])#\d{1,3}\b|\b[Ss]ession \d+|\bbefore issue\b")
    files = [REPO / "README.md", REPO / "CHANGELOG.md", *(REPO / "docs").rglob("*.md")]
    files += [*(REPO / "configs").glob("*"), *(REPO / "examples").glob("*.py")]
    hits = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in files for m in pattern.finditer(p.read_text())]
    assert hits == []
    assert pattern.search("fixed in issue 37") and pattern.search("see #36") and not pattern.search("`#3b82f6`")
    # the docs state what is (the CHANGELOG alone tells what changed)
    stages = re.compile(r"\b[Bb]efore this\b|\b[Cc]losed since\b|\(earlier table\)|\bused to (?:be|print|say|fail)\b")
    hits = [
        f"{p.relative_to(REPO)}: {m.group(0)}" for p in [files[0], *files[2:]] for m in stages.finditer(p.read_text())
    ]
    assert hits == [] and stages.search("Before this, it failed")


def test_the_changelog_names_the_packages_version_and_its_event_schema() -> None:
    """The newest release heading of CHANGELOG.md carries pyproject's version and the event schema version
    the code writes (``SCHEMA_VERSION``): an upgrade reads which processes can share a run from it."""
    import tomllib

    from coevo.schemas import SCHEMA_VERSION

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    newest = next(line for line in (REPO / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert newest.startswith(f"## {version} ") and newest.endswith(f"event schema {SCHEMA_VERSION}"), newest


LOST_COMMITS = {"43ae708", "53f1bb4", "632149c"}
"""commits some results ran on that were lost with their branch (docs/benchmarks.md says so; 69dd845
holds their code)"""


def test_every_commit_the_docs_name_is_in_the_history_or_declared_lost() -> None:
    """A result's commit is how a reader repeats it: one missing from git is a dead reference."""
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a full git clone: the history to look commits up in is not here")
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    named = {m for p in files for m in re.findall(r"\bcommits? ([0-9a-f]{7,40})\b", p.read_text())}
    missing = {
        c
        for c in named
        if subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=REPO, capture_output=True).returncode
    }
    assert missing == LOST_COMMITS, missing ^ LOST_COMMITS
    said = re.search(
        r"commits named below, ([^.]*?)\s+were lost with the branch", (REPO / "docs" / "benchmarks.md").read_text()
    )
    assert said is not None and set(re.findall(r"[0-9a-f]{7}", said.group(1))) == LOST_COMMITS
