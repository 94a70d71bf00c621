"""The committed snapshot of every event's JSON Schema, one entry per schema version, and the check
that a change of the schemas came with the bump it needs.

Invariant: ``snapshot.json`` holds, for every version it names, the export (``json_schemas``) of the
code that declared that version, and each entry differs from the one before only as its version
step allows: a minor step adds optional fields (or kinds, or definitions), a major step may do
anything. Descriptions and titles are documentation: they may change within a version. The check
(``problems``) and the comparison (``changes``) are pure; ``main`` reads and writes the file:

    python -m coevo.schemas.snapshot            # check (what CI runs, through tests/test_schema_snapshot.py)
    python -m coevo.schemas.snapshot --write    # record this version's export (refused when the bump is short)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coevo.schemas.base import SCHEMA_VERSION
from coevo.schemas.versions import SchemaVersion

SNAPSHOT = Path(__file__).with_name("snapshot.json")
WRITE = "python -m coevo.schemas.snapshot --write"
"""The command that refreshes the snapshot (named in every refusal)."""
_DOCS = frozenset({"description", "title"})

Bump = Literal["minor", "major"]
Export = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Change:
    where: str
    """``<kind>`` or ``<kind>: <path>`` (a path through the schema: properties, $defs)"""
    what: str
    needs: Bump

    def __str__(self) -> str:
        return f"{self.where}: {self.what} ({self.needs})"


def export() -> Export:
    """Today's schemas (``coevo.schemas.json_schemas``), as the snapshot stores them."""
    from coevo.schemas.registry import json_schemas

    plain: Export = json.loads(json.dumps(json_schemas(), sort_keys=True))  # plain JSON: tuples as lists
    return plain


def _wire(node: Any) -> Any:
    """What of a schema the wire sees: without documentation, and without the envelope's default
    version (the version itself, which the snapshot keys its entries by)."""
    if isinstance(node, dict):
        out = {k: _wire(v) for k, v in node.items() if k not in _DOCS}
        version = out.get("properties", {}).get("schema_version")
        if isinstance(version, dict):
            version.pop("default", None)
        return out
    if isinstance(node, list):
        return [_wire(v) for v in node]
    return node


def changes(old: Export, new: Export) -> list[Change]:
    """What changed on the wire from ``old`` to ``new``, each with the bump it needs: a kind, an
    optional field (one with a default) or a definition added is ``minor``; anything else
    (removed, retyped, made required, another default or constraint) is ``major``."""
    out: list[Change] = []
    for kind in sorted(old.keys() - new.keys()):
        out.append(Change(kind, "event kind removed", "major"))
    for kind in sorted(new.keys() - old.keys()):
        out.append(Change(kind, "event kind added", "minor"))
    for kind in sorted(old.keys() & new.keys()):
        _diff(_wire(old[kind]), _wire(new[kind]), kind, "", out)
    return out


def _diff(old: Any, new: Any, kind: str, path: str, out: list[Change]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(old.keys() | new.keys()):
            here = f"{path}.{key}" if path else key
            if key == "properties" and isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
                _properties(old, new, kind, path, out)
            elif key == "required" and "properties" in old and "properties" in new:
                _required(old, new, kind, path, out)
            elif key not in new:
                out.append(Change(f"{kind}: {here}", "removed", "major"))
            elif key not in old:
                added_def = path == "$defs" or key == "$defs"  # a definition a new field refers to
                out.append(Change(f"{kind}: {here}", "added", "minor" if added_def else "major"))
            else:
                _diff(old[key], new[key], kind, here, out)
    elif old != new:
        out.append(Change(f"{kind}: {path}", f"changed from {_short(old)} to {_short(new)}", "major"))


def _properties(old: dict[str, Any], new: dict[str, Any], kind: str, path: str, out: list[Change]) -> None:
    before, after = old["properties"], new["properties"]
    required = set(new.get("required", ()))
    at = f"{path}." if path else ""
    for name in sorted(before.keys() - after.keys()):
        out.append(Change(f"{kind}: {at}{name}", "field removed", "major"))
    for name in sorted(after.keys() - before.keys()):
        if name in required:
            out.append(Change(f"{kind}: {at}{name}", "required field added (no default)", "major"))
        else:
            out.append(Change(f"{kind}: {at}{name}", "optional field added", "minor"))
    for name in sorted(before.keys() & after.keys()):
        _diff(before[name], after[name], kind, f"{at}{name}", out)


def _required(old: dict[str, Any], new: dict[str, Any], kind: str, path: str, out: list[Change]) -> None:
    """Fields that became required or optional (an added or removed field is told by ``_properties``)."""
    both = old["properties"].keys() & new["properties"].keys()
    before, after = set(old.get("required", ())) & both, set(new.get("required", ())) & both
    at = f"{path}." if path else ""
    for name in sorted(after - before):
        out.append(Change(f"{kind}: {at}{name}", "became required", "major"))
    for name in sorted(before - after):
        out.append(Change(f"{kind}: {at}{name}", "became optional (a default)", "major"))


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def needed(found: list[Change]) -> Bump | None:
    """The bump ``found`` needs (None: none)."""
    if any(c.needs == "major" for c in found):
        return "major"
    return "minor" if found else None


def step_allows(old: SchemaVersion, new: SchemaVersion, bump: Bump | None) -> bool:
    """Whether going from version ``old`` to ``new`` may carry changes that need ``bump``."""
    if bump is None:
        return True
    if bump == "major":
        return new.major > old.major
    return new > old


def problems(snapshot: dict[str, Export], current: Export, version: SchemaVersion) -> list[str]:
    """Why ``snapshot`` and today's export ``current`` (of ``version``) disagree (empty: they agree)."""
    advice = (
        f"bump SCHEMA_VERSION (coevo/schemas/base.py) minor (added fields) or major (removed/changed) "
        f"and run `{WRITE}` to refresh the snapshot"
    )
    out: list[str] = []
    known = sorted((SchemaVersion.parse(v) for v in snapshot), reverse=True)
    for new, old in itertools.pairwise(known):
        bump = needed(changes(snapshot[str(old)], snapshot[str(new)]))
        if not step_allows(old, new, bump):
            out.append(f"the snapshot's step {old} -> {new} needs a {bump} bump")
    if str(version) in snapshot:
        found = changes(snapshot[str(version)], current)
        if found:
            out.append(
                f"event schemas changed without a bump of SCHEMA_VERSION {version}: "
                + "; ".join(map(str, found))
                + f": {advice}"
            )
        return out
    older = [v for v in known if v < version]
    newer = [v for v in known if v > version]
    if newer:
        out.append(f"SCHEMA_VERSION {version} is older than the snapshot's {newer[0]}: a version never goes back")
        return out
    if older:
        found = changes(snapshot[str(older[0])], current)
        bump = needed(found)
        if not step_allows(older[0], version, bump):
            return [
                *out,
                f"{older[0]} -> {version} is too small a bump for: " + "; ".join(map(str, found)) + f": {advice}",
            ]
    out.append(f"the snapshot has no entry for SCHEMA_VERSION {version}: run `{WRITE}` to refresh the snapshot")
    return out


def load(path: Path = SNAPSHOT) -> dict[str, Export]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object of versions")
    return data


def write(snapshot: dict[str, Export], current: Export, version: SchemaVersion, path: Path = SNAPSHOT) -> list[str]:
    """Record ``current`` as ``version``'s entry; refused (the reasons returned, nothing written)
    when the snapshot's entry of ``version`` differs on the wire or the bump from the last entry is
    too small. Documentation-only changes within a version are recorded."""
    pending = [p for p in problems(snapshot, current, version) if "has no entry" not in p]
    if pending:
        return pending
    entries = {**snapshot, str(version): current}
    ordered = {str(v): entries[str(v)] for v in sorted(SchemaVersion.parse(k) for k in entries)}
    path.write_text(json.dumps(ordered, indent=1, sort_keys=False) + "\n")
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coevo.schemas.snapshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="record this version's export in the snapshot")
    parser.add_argument("--path", type=Path, default=SNAPSHOT, help=f"the snapshot file (default: {SNAPSHOT})")
    args = parser.parse_args(argv)
    snapshot, current = load(args.path), export()
    if args.write:
        refused = write(snapshot, current, SCHEMA_VERSION, args.path)
        for line in refused:
            print(f"refused: {line}", file=sys.stderr)
        if not refused:
            print(f"recorded event schema {SCHEMA_VERSION} ({len(current)} kinds) in {args.path}")
        return 1 if refused else 0
    found = problems(snapshot, current, SCHEMA_VERSION)
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print(f"event schema {SCHEMA_VERSION} matches {args.path}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
