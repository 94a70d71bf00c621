"""The learner's delivery invariant with checkpoints off the critical path, on a real nats-server:
a group is acknowledged only once a checkpoint including it is durable; and followers apply weights
in stream order (a restored learner's lower version included)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch

from coevo.config import CoevoConfig, LearnerConfig
from coevo.runtime import faults
from coevo.runtime.agent import run_agents
from coevo.runtime.bus import NatsBus
from coevo.schemas import LearnerStepped, Source, WeightsPublished
from coevo.training.lane import Lane, latest_checkpoint
from coevo.training.learner import LearnerAgent
from coevo.weights.follower import WeightsFollower
from coevo.weights.transports import DiskReload
from tests.test_delivery import _learner_cfg, _samples, _scored
from tests.waiting import until


async def _steps(bus: NatsBus) -> list[LearnerStepped]:
    return [e for e in await bus.events(["learner.stepped"]) if isinstance(e, LearnerStepped)]


async def test_groups_stay_unacknowledged_until_a_checkpoint_including_them_is_durable(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    cfg = _learner_cfg(loop_cfg, **{"learner.checkpoint_every_steps": 1000, "learner.checkpoint_every_s": 1000.0})
    for g in ("g1", "g2"):
        await bus.publish_sync(_scored(bus.run_id, g, f"t-{g}", policy_samples=_samples(g)))
    learner = LearnerAgent(bus, cfg)
    stop = asyncio.Event()

    async def scenario() -> None:
        try:
            await until(lambda: _covered(bus, {"g1", "g2"}), timeout_s=90.0)
            await asyncio.sleep(3.0)  # longer than bus.ack_wait_s: held with in_progress, not redelivered
            held = await bus.js.consumer_info(bus.stream, "learner")
            assert held.num_ack_pending == 2 and held.num_redelivered == 0
            root = cfg.run.runs_dir / bus.run_id / "checkpoints" / "policy"
            assert latest_checkpoint(root) is None  # trained, published, not durable yet
            published = [e for e in await bus.events(["weights.published"]) if isinstance(e, WeightsPublished)]
            assert [e.version for e in published] == [0, 1]
        finally:
            stop.set()

    await asyncio.gather(run_agents([learner], handle_signals=False, until=stop), scenario())
    info = await bus.js.consumer_info(bus.stream, "learner")
    assert info.num_ack_pending == 0 and info.num_pending == 0  # the stop's checkpoint made them durable
    ckpt = latest_checkpoint(cfg.run.runs_dir / bus.run_id / "checkpoints" / "policy")
    assert ckpt is not None and ckpt.name == "v000001"
    assert learner.counters["checkpoints.policy"] == 1


async def test_groups_held_up_to_half_of_max_ack_pending_force_a_checkpoint(
    bus: NatsBus, loop_cfg: CoevoConfig
) -> None:
    cfg = _learner_cfg(
        loop_cfg,
        **{"learner.checkpoint_every_steps": 1000, "learner.checkpoint_every_s": 1000.0, "bus.max_ack_pending": 4},
    )
    for g in ("p1", "p2", "p3"):
        await bus.publish_sync(_scored(bus.run_id, g, f"t-{g}", policy_samples=_samples(g)))
    learner = LearnerAgent(bus, cfg)
    stop = asyncio.Event()

    async def scenario() -> None:
        try:

            async def acked() -> bool:
                if not await _covered(bus, {"p1", "p2"}):
                    return False
                return (await bus.js.consumer_info(bus.stream, "learner")).ack_floor.stream_seq >= 2

            await until(acked, timeout_s=90.0)
        finally:
            stop.set()

    await asyncio.gather(run_agents([learner], handle_signals=False, until=stop), scenario())
    assert learner.counters["checkpoints.policy"] >= 1


async def _covered(bus: NatsBus, groups: set[str]) -> bool:
    return groups <= {g for s in await _steps(bus) for g in s.group_ids}


class _Client:
    def __init__(self) -> None:
        self.version = 0
        self.loaded: list[tuple[str, int]] = []
        self.gate: asyncio.Event | None = None  # set: a load waits for it (a slow follower)
        self.loading = asyncio.Event()

    async def swap_weights(self, path: Path, version: int) -> float:
        self.loading.set()
        if self.gate is not None:
            await self.gate.wait()
        self.loaded.append((Path(path).name, version))
        self.version = version
        return 1.0


class _Follower:
    """A follower as an agent owns one, over a client that loads from disk; records what it reports."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.client = _Client()
        self.counters: Counter[str] = Counter()
        assert cfg.publication_root is not None
        transport = DiskReload(self.client, cfg.publication_root, full_verify=cfg.verify == "full")
        self.follower = WeightsFollower("policy", transport, lambda: self.client.version, self.counters)
        self.applied: list[tuple[int, bool, str | None]] = []
        self.model_version: int | None = None

    async def on_weights(self, event: WeightsPublished, delivery: SimpleNamespace) -> None:
        applied = await self.follower.follow(event, delivery)  # type: ignore[arg-type]
        if applied is not None:
            self.applied.append((applied.version, applied.ok, applied.error))
            self.model_version = applied.version if applied.ok else self.model_version


async def test_followers_apply_in_stream_order_verified_and_follow_a_restored_learner(
    tmp_path: Path, model_cache: Path
) -> None:
    from coevo.inference.models import ensure_default_model
    from coevo.weights.manifest import HELD

    lane = Lane("policy", ensure_default_model("policy", model_cache), tmp_path, LearnerConfig(), device="cpu")
    src = Source(agent_id="learner", role="learner")
    published = {}
    for version in (1, 2):
        lane.version = version
        with torch.no_grad():
            next(lane.model.parameters()).add_(1.0)  # other weights (the same weights have the same digest)
        path, digest, size = lane.publish()
        published[version] = WeightsPublished(
            run_id="r", source=src, role="policy", version=version, path=str(path), sha256=digest, bytes=size
        )
    HELD.clear()  # a follower in another process: from disk, verified
    follower = _Follower(LearnerConfig(verify="full", publication_root=tmp_path))

    async def deliver(event: WeightsPublished, seq: int) -> None:
        await follower.on_weights(event, SimpleNamespace(stream_seq=seq))

    await deliver(published[2], 10)
    await deliver(published[1], 5)  # an older event redelivered behind a newer one: ignored
    await deliver(published[2], 11)  # the same weights again: ignored
    assert [v for v, _, _ in follower.applied] == [2]
    await deliver(published[1], 12)  # a restored learner announces its older weights later: followed
    assert [v for v, ok, _ in follower.applied] == [2, 1] and follower.model_version == 1
    lane.version = 3
    path, digest, size = lane.publish()
    (path / "model.safetensors").write_bytes(b"garbage")
    await deliver(published[1].model_copy(update={"version": 3, "path": str(path), "sha256": digest}), 13)
    assert follower.applied[-1][:2] == (1, False) and "manifest says" in follower.applied[-1][2]
    assert follower.client.loaded == [(Path(published[2].path).name, 2), (Path(published[1].path).name, 1)]
    # weights announced from elsewhere, with a digest that matches them (as anyone who may publish
    # could announce): refused before anything is read, whether outside the root or escaping it
    forged = tmp_path.parent / f"{tmp_path.name}-forged"
    shutil.copytree(published[2].path, forged)
    for path in (forged, tmp_path / ".." / forged.name):
        await deliver(published[2].model_copy(update={"version": 9, "path": str(path)}), 14)
        assert follower.applied[-1][:2] == (1, False) and "not under the publication root" in follower.applied[-1][2]
    assert len(follower.client.loaded) == 2


async def test_a_follower_behind_the_learner_loads_the_newest_announcement_not_each_one(
    tmp_path: Path, model_cache: Path
) -> None:
    """#24 chaos: followers loading 20 s late worked through every announcement in turn, each older
    than the learner's newest, several already pruned ("no weights at ..."). While one load runs,
    the announcements that arrive are held and only the newest is loaded next."""
    from coevo.inference.models import ensure_default_model
    from coevo.weights.manifest import HELD

    lane = Lane("policy", ensure_default_model("policy", model_cache), tmp_path, LearnerConfig(), device="cpu")
    src = Source(agent_id="learner", role="learner")
    published = []
    for version in (1, 2, 3, 4):
        lane.version = version
        with torch.no_grad():
            next(lane.model.parameters()).add_(1.0)
        path, digest, size = lane.publish()
        published.append(
            WeightsPublished(
                run_id="r", source=src, role="policy", version=version, path=str(path), sha256=digest, bytes=size
            )
        )
    HELD.clear()
    follower = _Follower(LearnerConfig(publication_root=tmp_path))
    follower.client.gate = asyncio.Event()
    first = asyncio.create_task(follower.on_weights(published[0], SimpleNamespace(stream_seq=1)))
    await asyncio.wait_for(follower.client.loading.wait(), 10)  # v1 is loading, slowly
    later = [
        asyncio.create_task(follower.on_weights(e, SimpleNamespace(stream_seq=i + 2)))
        for i, e in enumerate(published[1:])
    ]
    await asyncio.sleep(0)  # one turn of the loop: each hands its announcement over, then waits for the load
    follower.client.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *later), 30)  # every announcement answered
    assert [v for _, v in follower.client.loaded] == [1, 4]  # 2 and 3 were never loaded
    assert [v for v, ok, _ in follower.applied] == [1, 4] and follower.model_version == 4
    assert follower.counters["weights.skipped_to_newest"] == 1


async def test_publication_pruning_never_removes_a_version_a_follower_is_loading(
    tmp_path: Path, model_cache: Path
) -> None:
    """#23: a follower loads a version slowly while the learner publishes twice KEEP_PUBLISHED newer
    ones. The version being loaded stays whole until the load ends (its lease), and the next
    publication after that removes it."""
    from coevo.inference.models import ensure_default_model
    from coevo.weights.manifest import HELD
    from coevo.weights.publish import KEEP_PUBLISHED

    lane = Lane("policy", ensure_default_model("policy", model_cache), tmp_path, LearnerConfig(), device="cpu")
    src = Source(agent_id="learner", role="learner")

    def publish(version: int) -> WeightsPublished:
        lane.version = version
        with torch.no_grad():
            next(lane.model.parameters()).add_(1.0)
        path, digest, size = lane.publish()
        return WeightsPublished(
            run_id="r", source=src, role="policy", version=version, path=str(path), sha256=digest, bytes=size
        )

    first = publish(1)
    HELD.clear()
    follower = _Follower(LearnerConfig(verify="full", publication_root=tmp_path))
    follower.client.gate = asyncio.Event()
    loading = asyncio.create_task(follower.on_weights(first, SimpleNamespace(stream_seq=1)))
    await asyncio.wait_for(follower.client.loading.wait(), 10)  # verified, now loading under its lease
    for version in range(2, 2 + 2 * KEEP_PUBLISHED):
        await asyncio.to_thread(publish, version)
    kept = sorted(p.name for p in Path(first.path).parent.glob("v*"))
    assert Path(first.path).name in kept and len(kept) == KEEP_PUBLISHED + 1
    assert (Path(first.path) / "model.safetensors").is_file()
    follower.client.gate.set()
    await asyncio.wait_for(loading, 10)
    assert follower.applied == [(1, True, None)]
    await asyncio.to_thread(publish, 2 + 2 * KEEP_PUBLISHED)
    assert not Path(first.path).exists()
    assert len(list(Path(first.path).parent.glob("v*"))) == KEEP_PUBLISHED


async def test_a_step_the_bus_refuses_at_first_is_named_once_it_is_stored(
    bus: NatsBus, loop_cfg: CoevoConfig, monkeypatch
) -> None:
    """A ``LearnerStepped`` refused more often than one confirmed publish tries (a NATS node down for
    seconds, as in ``bench chaos``) is retried until stored: the step's groups are named, and the
    learner's main task does not crash (it did, and its groups were then never named: the backlog gate
    waited for them, and the chaos check read their retraining after a restart as training twice)."""
    cfg = _learner_cfg(loop_cfg, **{"agent.heartbeat_s": 3600.0})
    for g in ("r1", "r2"):
        await bus.publish_sync(_scored(bus.run_id, g, f"t-{g}", policy_samples=_samples(g)))
    # the learner's publishes: its version-0 weights, its first status, then the step's event: refused
    # on every try of a confirmed publish (the bus's publish_retries + 1) and on the first of the next round
    refused = bus.cfg.publish_retries + 2
    monkeypatch.setenv(faults.ENV, json.dumps({"publish": {"p": 1.0, "after": 2, "times": refused}}))
    faults.reset()
    learner = LearnerAgent(bus, cfg)
    stop = asyncio.Event()

    async def scenario() -> None:
        try:
            await until(lambda: _covered(bus, {"r1", "r2"}), timeout_s=90.0)
        finally:
            stop.set()

    try:
        await asyncio.gather(run_agents([learner], handle_signals=False, until=stop), scenario())
        assert faults.fired("publish") == refused
    finally:
        monkeypatch.delenv(faults.ENV)
        faults.reset()
    assert learner.counters["restarts.main"] == 0
    assert learner.counters["republished.learner.stepped"] >= 1
    (step,) = [s for s in await _steps(bus) if s.is_step]
    assert sorted(step.group_ids) == ["r1", "r2"] and step.version == 1
