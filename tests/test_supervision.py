"""Safe defaults of long runs: restart budgets per time window, and a task pool that never re-seeds
over saved slots because a KV read failed."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coevo.agents.tasks import TasksAgent
from coevo.config import CoevoConfig, load_config
from coevo.errors import AgentFailed, BusError, ConfigError
from coevo.runtime.agent import RestartBudget, run_agents
from coevo.runtime.bus import NatsBus
from tests.agents_for_tests import Flaky


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the decision, without I/O ---------------------------------------------------------------------


def test_crashes_within_the_window_exhaust_the_budget() -> None:
    clock = FakeClock()
    budget = RestartBudget(max_restarts=2, window_s=60.0, clock=clock)
    for expected in (1, 2):
        assert budget.crash() == expected
        assert not budget.exhausted
        clock.now += 10
    assert budget.crash() == 3
    assert budget.exhausted


def test_crashes_older_than_the_window_no_longer_count() -> None:
    clock = FakeClock()
    budget = RestartBudget(max_restarts=2, window_s=60.0, clock=clock)
    for _ in range(1000):  # a week of rare crashes: one every 61 s never adds up
        assert budget.crash() == 1
        assert not budget.exhausted
        clock.now += 61
    budget.crash()
    clock.now += 59.9
    assert budget.crash() == 2  # the previous one is 59.9 s old: still counts
    clock.now += 60.0
    assert budget.crash() == 1  # both earlier ones are at least 60 s old


def test_zero_restarts_fails_at_the_first_crash() -> None:
    budget = RestartBudget(max_restarts=0, window_s=1.0, clock=FakeClock())
    budget.crash()
    assert budget.exhausted


def test_backoff_grows_with_recent_crashes_and_resets_after_a_quiet_window() -> None:
    clock = FakeClock()
    budget = RestartBudget(max_restarts=10, window_s=30.0, clock=clock)
    delays = [0.1, 0.5, 2.0]
    seen = []
    for _ in range(4):
        budget.crash()
        seen.append(budget.backoff(delays))
        clock.now += 1
    assert seen == [0.1, 0.5, 2.0, 2.0]
    clock.now += 30
    budget.crash()
    assert budget.backoff(delays) == 0.1


@given(
    st.integers(min_value=0, max_value=5),
    st.floats(min_value=0.5, max_value=100.0),
    st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=1, max_size=40),
)
def test_budget_counts_exactly_the_crashes_of_the_last_window(
    max_restarts: int, window_s: float, gaps: list[float]
) -> None:
    clock = FakeClock()
    budget = RestartBudget(max_restarts, window_s, clock=clock)
    times: list[float] = []
    for gap in gaps:
        clock.now += gap
        times.append(clock.now)
        recent = budget.crash()
        assert recent == sum(1 for t in times if t > clock.now - window_s)
        assert budget.exhausted == (recent > max_restarts)
        if budget.exhausted:
            break  # the supervisor fails the agent here
        assert budget.recent <= max_restarts  # bounded: it never holds more than it needs


def test_restart_window_is_configured_and_constrained() -> None:
    assert CoevoConfig().agent.restart_window_s == 3600.0
    assert load_config(overrides={"agent.restart_window_s": 5}).agent.restart_window_s == 5.0
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"agent.restart_window_s": 0})
    assert err.value.field == "agent.restart_window_s"


# ---- an agent under supervision (real server) ------------------------------------------------------


def _with_agent(cfg: CoevoConfig, **fields: object) -> CoevoConfig:
    agent = type(cfg.agent).model_validate({**cfg.agent.model_dump(), **fields})
    return cfg.model_copy(update={"agent": agent})


async def test_spread_out_crashes_never_fail_the_agent(bus: NatsBus, cfg: CoevoConfig) -> None:
    # each restart waits 0.2 s, longer than the 0.1 s window: no two crashes are ever in one window
    agent = Flaky(bus, _with_agent(cfg, max_restarts=1, restart_window_s=0.1, restart_backoff_s=[0.2]))
    agent.fail_times = 6
    async with asyncio.timeout(20):
        await run_agents([agent], handle_signals=False)
    assert agent.attempts == 7
    assert agent.counters["restarts.main"] == 6
    assert agent.state == "stopped"


async def test_crashes_in_one_window_fail_the_agent(bus: NatsBus, cfg: CoevoConfig) -> None:
    agent = Flaky(bus, _with_agent(cfg, max_restarts=1, restart_window_s=60.0, restart_backoff_s=[0.2]))
    agent.fail_times = 6
    with pytest.raises(AgentFailed) as err:
        async with asyncio.timeout(20):
            await agent.run()
    assert agent.attempts == 2 and err.value.restarts == 2
    assert agent.state == "failed"


# ---- the task pool: only "no keys" means empty -----------------------------------------------------


async def test_an_empty_bucket_seeds_the_pool_and_a_full_one_resumes(bus: NatsBus, cfg: CoevoConfig) -> None:
    first = TasksAgent(bus, cfg)
    await first.load()
    assert len(first.slots) == cfg.env.n_train + cfg.env.n_heldout
    kv = await bus.kv("tasks")
    assert set(await kv.keys()) == {f"slot.{s}" for s in first.slots} | {"inflight"}
    slot = next(iter(first.slots.values()))
    slot.last_accuracy, slot.groups_since_rewrite = 0.375, 7
    await first.save(slot)
    again = TasksAgent(bus, cfg)
    await again.load()
    assert again.slots[slot.slot_id].last_accuracy == 0.375
    assert again.slots[slot.slot_id].groups_since_rewrite == 7


class KvReadFails(NatsBus):
    """The bucket lookup succeeds; then the real server fails the read, for a reason set by ``how``."""

    how = "closed"

    async def kv(self, name: str):
        handle = await super().kv(name)
        if self.how == "closed":  # the connection is gone by the time the keys are listed
            await self.nc.close()
        else:  # the bucket vanished under the handle
            await self.js.delete_key_value(f"coevo_{self.run_id}_{name}")
        return handle


@pytest.mark.parametrize(
    ("how", "error"), [("closed", nats.errors.ConnectionClosedError), ("deleted", nats.js.errors.NotFoundError)]
)
async def test_a_failing_kv_read_propagates_and_seeds_nothing(
    bus: NatsBus, cfg: CoevoConfig, nats_url: str, run_id: str, how: str, error: type[Exception]
) -> None:
    first = TasksAgent(bus, cfg)
    await first.load()
    saved = await _stored_slots(bus)
    failing = await KvReadFails.connect(nats_url, run_id, nats_cfg=cfg.nats, bus=cfg.bus, stream=cfg.stream)
    failing.how = how
    agent = TasksAgent(failing, cfg)
    try:
        with pytest.raises(error) as raised:
            await agent.load()
    finally:
        await failing.close()
    assert not isinstance(raised.value, nats.js.errors.NoKeysError)
    assert agent.slots == {}  # not seeded over what was saved
    if how == "closed":
        assert await _stored_slots(bus) == saved  # the saved pool is untouched


async def _stored_slots(bus: NatsBus) -> dict[str, bytes]:
    kv = await bus.kv("tasks")
    return {k: v for k in await kv.keys() if k.startswith("slot.") and (v := await kv.get(k)) is not None}


async def test_no_keys_listed_but_entries_stored_is_not_an_empty_pool(bus: NatsBus, cfg: CoevoConfig) -> None:
    """A listing can come back empty while the bucket is not (a replica catching up after a restart
    serves it; here: every key deleted, whose markers stay): the leader's count decides, nothing is
    seeded; deleting the bucket starts a fresh pool."""
    await TasksAgent(bus, cfg).load()
    kv = await bus.kv("tasks")
    keys = await kv.keys()
    for key in keys:
        await kv.delete(key)
    with pytest.raises(BusError, match="lists no keys but holds"):
        await kv.keys()
    assert [await kv.get(key) for key in keys] == [None] * len(keys)  # deleted: no value, not an error
    agent = TasksAgent(bus, cfg)
    with pytest.raises(BusError, match="lists no keys but holds"):
        await agent.load()
    assert agent.slots == {}
    await bus.js.delete_key_value(f"coevo_{bus.run_id}_tasks")
    fresh = TasksAgent(bus, cfg)
    await fresh.load()
    assert len(fresh.slots) == cfg.env.n_train + cfg.env.n_heldout
    kv = await bus.kv("tasks")  # create: stored once, the first writer's value stays
    assert await kv.create("probe", b"first") and not await kv.create("probe", b"second")
    assert await kv.get("probe") == b"first" and await kv.get("never-written") is None
