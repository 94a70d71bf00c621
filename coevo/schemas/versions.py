"""Event schema versions (``MAJOR.MINOR``), and which versions may read and join which run.

Invariants:
- a minor bump only adds optional fields (each with a default) or event kinds; anything else (a field
  removed, retyped, given another default or another meaning) is a major bump
  (``coevo.schemas.snapshot`` checks the exported schemas against the committed snapshot);
- a reader decodes every event of its own major, whatever the minor (a newer minor's unknown fields
  ignored and counted, an older minor's missing fields defaulted), and of every older major (upcast,
  ``coevo.schemas.registry``); it refuses a newer major;
- a run records the version of the process that created its stream; a process joins a run only when
  its major is the run's, and reads a run's history only when its major is not older than the run's.

On the wire ``schema_version`` is the string ``"MAJOR.MINOR"``; an integer ``n`` (what coevo wrote
before minors existed) reads as ``n.0``. Pure: the standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

RUN_SCHEMA_KEY = "coevo_schema_version"
"""The stream metadata key holding the schema version of the process that created the run's stream."""
LEGACY_MAJOR = 1
"""What coevo wrote before schema versions had a minor (``schema_version: 1``, readers refusing any
unknown field): a stream without ``RUN_SCHEMA_KEY`` was created by such code."""

_WIRE = re.compile(r"(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})")


class SchemaVersion(NamedTuple):
    major: int
    minor: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"

    @classmethod
    def parse(cls, value: object) -> SchemaVersion:
        """The version a payload's ``schema_version`` holds: ``"MAJOR.MINOR"``, or an integer ``n``
        (written before minors existed) as ``n.0``. ``ValueError`` for anything else."""
        if type(value) is int and 0 <= value < 1_000_000:
            return cls(value, 0)
        if isinstance(value, str) and (m := _WIRE.fullmatch(value)):
            return cls(int(m[1]), int(m[2]))
        raise ValueError(f"schema_version {value!r} is neither MAJOR.MINOR nor a non-negative integer")

    def wire_pattern(self) -> str:
        """The regular expression ``schema_version`` matches on a reader's fast path: its own major, any minor."""
        return rf"^{self.major}\.(0|[1-9][0-9]{{0,5}})$"


def run_version(metadata: Mapping[str, str] | None) -> SchemaVersion:
    """The version a run's stream records (``RUN_SCHEMA_KEY``); a stream created before versions were
    recorded is of the legacy major. ``ValueError`` for a value that is not a version."""
    value = (metadata or {}).get(RUN_SCHEMA_KEY)
    return SchemaVersion(LEGACY_MAJOR, 0) if value is None else SchemaVersion.parse(value)


def join_refusal(run_id: str, run: SchemaVersion, code: SchemaVersion, *, reading: bool) -> str | None:
    """Why a process of schema ``code`` may not connect to run ``run_id`` of schema ``run`` (None: it
    may). Joining (publishing, consuming) needs the same major; reading history needs a major no
    older than the run's (older majors are upcast; a newer major cannot be read)."""
    if run.major == code.major or (reading and run.major < code.major):
        return None
    said = f"run {run_id} records event schema {run}, this code's is {code}"
    if run.major > code.major:
        return f"{said}: upgrade this process to a release of schema {run.major}.x (a newer major cannot be read)"
    return (
        f"{said}: a new major cannot join a running run; finish the run with the code that started it, or "
        f"start a new run with this code (this run's events stay readable here: coevo replay, coevo events export)"
    )
