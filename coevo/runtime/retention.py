"""Retention: keep a run's event stream under ``stream.retain_bytes`` without dropping unfinished work.

JetStream's own size limit (``stream.max_bytes``) drops the oldest messages whether or not a
consumer still needs them, and is reserved up front against the server's storage. This keeper
purges instead, and only what is safe to lose.

Invariants (decided by :func:`purge_below`, a pure function):
- nothing happens while the stream holds at most ``stream.retain_bytes``;
- an event is purged only if every consumer that acknowledges (durable agents, the learner's
  decision readers) has acknowledged it, so a redelivery never finds its input gone;
- an event is purged only if it is older than ``stream.retain_min_age_s``, longer than any
  timeout that may still need it (a scorer rebuilding an unfinished group after a restart, a task
  pool's in-flight group): ages are measured by sequence marks the keeper records as it runs;
- after a purge the stream holds about ``retain_headroom`` × the limit, so purges are rare.
A consumer that stops acknowledging pins the floor; the keeper logs which one (``retention.pinned``).
Tools (replay, trace, report) see the retained suffix of the run.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from nats.js import api

from coevo.config import CoevoConfig
from coevo.runtime.agent import Agent
from coevo.runtime.bus import NatsBus


@dataclass(frozen=True)
class StreamSize:
    first_seq: int
    last_seq: int
    messages: int
    bytes: int


@dataclass(frozen=True)
class ConsumerFloor:
    """The highest stream sequence below which ``name`` needs nothing any more."""

    name: str
    seq: int


def consumer_floor(info: api.ConsumerInfo, last_seq: int) -> ConsumerFloor | None:
    """None for a consumer that never acknowledges (history readers); a consumer with nothing
    pending and nothing unacknowledged needs nothing up to ``last_seq``."""
    cfg = info.config
    if cfg.ack_policy == api.AckPolicy.NONE:
        return None
    name = cfg.durable_name or cfg.name or info.name
    if not info.num_pending and not info.num_ack_pending:
        return ConsumerFloor(name, last_seq)
    return ConsumerFloor(name, info.ack_floor.stream_seq if info.ack_floor else 0)


def aged_sequence(marks: Iterable[tuple[float, int]], now: float, min_age_s: float) -> int:
    """The last sequence recorded at least ``min_age_s`` ago (0 when none is that old)."""
    return max((seq for t, seq in marks if t <= now - min_age_s), default=0)


def purge_below(
    size: StreamSize, floors: Iterable[ConsumerFloor], aged_seq: int, retain_bytes: int, headroom: float
) -> int:
    """The sequence to purge below (JetStream purge ``seq``: messages < it go), or 0 for nothing."""
    if retain_bytes <= 0 or size.bytes <= retain_bytes or size.messages == 0:
        return 0
    keep = int(retain_bytes * headroom / (size.bytes / size.messages))  # newest messages to keep
    wanted = size.last_seq - keep + 1
    acked = min((f.seq for f in floors), default=size.last_seq)
    below = min(wanted, acked + 1, aged_seq + 1)
    return below if below > size.first_seq else 0


def pinning(floors: Iterable[ConsumerFloor], wanted: int) -> list[str]:
    """The consumers whose unacknowledged work stops a purge short of ``wanted``."""
    return sorted(f.name for f in floors if f.seq + 1 < wanted)


class RetentionAgent(Agent):
    """Purges the run's stream down to ``stream.retain_bytes`` every ``stream.retain_check_s``.

    One per run: ``coevo run`` starts it; with agents as processes, run ``coevo agent retention``
    once (two keepers are harmless: a purge below an already purged sequence does nothing)."""

    role: ClassVar[str] = "retention"

    def __init__(
        self,
        bus: NatsBus,
        cfg: CoevoConfig,
        *,
        agent_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(bus, cfg, agent_id=agent_id)
        self.clock = clock
        self.marks: deque[tuple[float, int]] = deque()

    async def main(self) -> None:
        s = self.cfg.stream
        if s.retain_bytes <= 0:
            return
        while not self.stopping.is_set():
            await self.keep()
            if not await self.sleep(s.retain_check_s):
                return

    async def keep(self) -> int:
        """One pass: record a mark, purge what is safe; returns the purge sequence (0: none)."""
        s = self.cfg.stream
        state = (await self.bus.js.stream_info(self.bus.stream)).state
        size = StreamSize(state.first_seq, state.last_seq, state.messages, state.bytes)
        now = self.clock()
        self.marks.append((now, size.last_seq))
        while len(self.marks) > 1 and self.marks[1][0] <= now - s.retain_min_age_s:
            self.marks.popleft()  # the newest mark old enough is all that is needed
        floors = [
            f
            for info in await self.bus.js.consumers_info(self.bus.stream)
            if (f := consumer_floor(info, size.last_seq)) is not None
        ]
        aged = aged_sequence(self.marks, now, s.retain_min_age_s)
        below = purge_below(size, floors, aged, s.retain_bytes, s.retain_headroom)
        wanted = purge_below(size, [], size.last_seq, s.retain_bytes, s.retain_headroom)
        if wanted and below < wanted:
            held = pinning(floors, wanted)
            if held:
                self.log.warning("retention.pinned", consumers=held, bytes=size.bytes, limit=s.retain_bytes)
        if below:
            await self.bus.js.purge_stream(self.bus.stream, seq=below)
            self.counters["purged"] += below - size.first_seq
            self.log.info("retention.purged", below=below, before_bytes=size.bytes, limit=s.retain_bytes)
        return below
