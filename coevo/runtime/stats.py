"""The bus's counters, at the bottom of the runtime: the bus, its publishing half and its
request-reply half all count into one ``BusStats`` (none of them imports another to do so)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BusStats:
    published: int = 0
    duplicates: int = 0
    publish_retries: int = 0
    unstored: int = 0
    """publishes never acknowledged when the bus closed (each logged by id: ``bus.closed_unflushed``)"""
    dead_lettered: int = 0
    forged_requests: int = 0
    """messages on a served subject that were not requests (``is_request``): dropped"""
    latencies_ms: list[float] = field(default_factory=list)
    track_latency: bool = False
