"""docs/architecture.md's subject table is what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from coevo.config import load_config
from coevo.tools.topology import topology
from tests.conftest import REPO


def test_subject_table_matches_the_agents(model_cache: Path) -> None:
    cfg = load_config(overrides={"env.cache_dir": str(model_cache), "log.console": "off"})
    table = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = re.match(r"\| `coevo\.<run>\.ev\.([a-z.]+)` \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            split = lambda cell: {c.strip() for c in re.split(r",(?![^(]*\))", cell) if c.strip() not in ("", "—")}  # noqa: E731
            table[m.group(1)] = {"producers": split(m.group(2)), "consumers": split(m.group(3))}
    assert table == topology(cfg)
