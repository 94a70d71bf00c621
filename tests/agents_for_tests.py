"""Small agents used by the runtime tests (started in-process or as ``coevo agent module:Class``)."""

from __future__ import annotations

import asyncio
import os
import time

from coevo.runtime.agent import Agent
from coevo.runtime.consumer import Subscription
from coevo.schemas import TaskScheduled, TaskSpec, TrajectoryCompleted


class Producer(Agent):
    """Publishes ``COEVO_TEST_N`` scheduled tasks, stops once each has a completed trajectory."""

    role = "test-producer"
    emits = (TaskScheduled,)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.expected = int(os.environ.get("COEVO_TEST_N", "10"))
        self.completed: set[str] = set()

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("test-producer", (TrajectoryCompleted,), self.on_done)]

    async def main(self) -> None:
        for i in range(self.expected):
            await self.emit(
                self.event(
                    TaskScheduled, task=TaskSpec(task_id=f"t{i}", family="quick"), group_id=f"g{i}", n_rollouts=1
                )
            )

    async def on_done(self, event: TrajectoryCompleted, _d) -> None:
        self.completed.add(event.task_id)
        if len(self.completed) >= self.expected:
            self.stop()


class Echo(Agent):
    """Answers every scheduled task with a completed trajectory, after ``COEVO_TEST_DELAY`` s (and
    ``COEVO_TEST_THREAD_S`` s of work in a worker thread, as a forward pass would be)."""

    role = "test-echo"
    emits = (TrajectoryCompleted,)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.delay = float(os.environ.get("COEVO_TEST_DELAY", "0"))
        self.thread_s = float(os.environ.get("COEVO_TEST_THREAD_S", "0"))

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("test-echo", (TaskScheduled,), self.on_task, concurrency=4)]

    async def on_task(self, event: TaskScheduled, _d) -> None:
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.thread_s:
            self.counters["threads_started"] += 1
            self.log.info("echo.thread_started")
            await asyncio.to_thread(time.sleep, self.thread_s)
        await self.emit(
            self.event(
                TrajectoryCompleted,
                cause=event,
                trajectory_id=f"tr-{event.task.task_id}",
                task_id=event.task.task_id,
                group_id=event.group_id,
                outcome="won",
                num_steps=0,
            )
        )
        self.counters["echoed"] += 1


class Flaky(Agent):
    """``main()`` crashes ``fail_times`` times, then succeeds."""

    role = "test-flaky"
    fail_times = 2

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.attempts = 0

    async def main(self) -> None:
        self.attempts += 1
        if self.attempts <= self.fail_times:
            raise RuntimeError(f"crash {self.attempts}")
        self.stop()
