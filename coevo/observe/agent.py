"""``coevo agent metrics``: the aggregator as an agent of a distributed run.

Invariant: the agent consumes nothing through a durable (it observes the stream through an
ephemeral, non-acknowledging consumer: ``source.tail``), so adding or removing it changes nothing
for the other agents; a restarted metrics agent resumes its sinks after the last sequence they got.
"""

from __future__ import annotations

from typing import ClassVar

from coevo.config import CoevoConfig
from coevo.observe.aggregate import Aggregator
from coevo.observe.observer import Observer
from coevo.observe.sinks import make_sinks
from coevo.runtime.agent import Agent
from coevo.runtime.bus import NatsBus
from coevo.schemas import Event


class MetricsAgent(Agent):
    """Folds the run's events into metrics: TensorBoard (``runs/<id>/tb``), W&B (``log.wandb``) and,
    with ``coevo agent metrics --metrics-port P``, Prometheus series on ``/metrics``."""

    role: ClassVar[str] = "metrics"
    emits: ClassVar[tuple[type[Event], ...]] = ()

    def __init__(self, bus: NatsBus, cfg: CoevoConfig, *, agent_id: str | None = None) -> None:
        super().__init__(bus, cfg, agent_id=agent_id)
        self.aggregator = Aggregator()

    async def main(self) -> None:
        run_dir = self.cfg.run.runs_dir / self.bus.run_id
        lc = self.cfg.log
        sinks = make_sinks(
            run_dir,
            self.bus.run_id,
            tensorboard=lc.tensorboard,
            wandb=lc.wandb,
            project=lc.wandb_project,
            config=self.cfg.model_dump(mode="json"),
        )
        observer = Observer(self.bus, aggregator=self.aggregator, sinks=sinks, marker=run_dir / "tb" / "observed_seq")
        await observer.run(self.stopping)
        self.counters["events_observed"] = self.aggregator.last_seq
