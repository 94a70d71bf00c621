"""LoRA lanes (#23 item 3) on CPU: the merge a local engine computes is PEFT's; a LoRA lane trains,
checkpoints and publishes its adapter only; a follower's local engine serves each adapter version
exactly as the learner computes it. Against a real vLLM server: tests/test_vllm.py."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coevo.config import LearnerConfig, LoraConfig
from coevo.errors import ConfigError
from coevo.inference import adapters
from coevo.inference.engine import LocalEngine
from coevo.schemas import Source, WeightsPublished
from coevo.training import lora
from coevo.training.lane import Lane
from coevo.weights.follower import WeightsFollower
from coevo.weights.manifest import HELD, manifest_of
from coevo.weights.transports import DiskReload
from tests.test_delivery import _samples

LORA = LearnerConfig(lora=LoraConfig(rank=4, alpha=8.0), lr=0.05)
IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from coevo.inference.models import ensure_default_model

    return ensure_default_model("policy", tmp_path_factory.mktemp("models"))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS).logits.float()


def test_an_adapter_merged_into_the_base_computes_what_peft_computes(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny), LORA.lora)
    base = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny).state_dict().items()}
    assert torch.equal(_logits(model), _logits(AutoModelForCausalLM.from_pretrained(tiny)))  # fresh: the base
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    state = lora.adapter_state(model)
    config = json.loads(lora.adapter_config_json(model, tiny))
    merged = adapters.merged(base, state, config)
    assert len(merged) == 7 * model.config.num_hidden_layers  # every target module of every layer
    served = AutoModelForCausalLM.from_pretrained(tiny)
    served.load_state_dict(merged, strict=False)
    assert (_logits(served) - _logits(model)).abs().max() < 1e-4
    assert (_logits(served) - _logits(AutoModelForCausalLM.from_pretrained(tiny))).abs().max() > 1e-2
    with pytest.raises(ValueError, match="not in the base model"):
        adapters.merged({k: v for k, v in base.items() if "layers.0.self_attn.q_proj" not in k}, state, config)


def test_a_lora_lane_trains_checkpoints_and_publishes_only_its_adapter(tiny: Path, tmp_path: Path) -> None:
    full = Lane("policy", tiny, tmp_path / "full", LearnerConfig(), device="cpu")
    full_bytes = full.publish()[2]
    lane = Lane("policy", tiny, tmp_path / "lora", LORA, device="cpu")
    frozen = {k: v.clone() for k, v in lane.model.named_parameters() if "lora_" not in k}
    assert {id(p) for g in lane.optimizer.param_groups for p in g["params"]} == {id(p) for p in lane.trainable()}
    for i in range(3):
        lane.step(_samples(f"g{i}"), [f"g{i}"])
    after = dict(lane.model.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # the base never moves
    assert any(p.abs().sum() > 0 for k, p in after.items() if "lora_B" in k)  # the adapter did
    path, digest, size = lane.publish()
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]
    assert manifest_of(path)["digest"] == digest and size < 0.12 * full_bytes
    ckpt, _, _ = lane.checkpoint()
    adapter = {k: v.clone() for k, v in lora.adapter_state(lane.model, "policy").items()}
    served = LocalEngine(ckpt, device="cpu")  # a LoRA checkpoint loads as a model: its base, adapter merged
    assert (_logits(served.model) - _logits(lane.model)).abs().max() < 1e-4
    lane.close()
    resumed = Lane("policy", tiny, tmp_path / "lora", LORA, device="cpu")
    assert resumed.resumed_from == ckpt and resumed.version == 3
    assert all(torch.equal(adapter[k], v) for k, v in lora.adapter_state(resumed.model, "policy").items())
    assert resumed.optimizer.state_dict()["state"].keys() == lane.optimizer.state_dict()["state"].keys()
    resumed.close()
    with pytest.raises(ConfigError) as err:  # a full lane cannot resume from an adapter, nor the reverse
        Lane("policy", tiny, tmp_path / "lora", LearnerConfig(), device="cpu")
    assert err.value.field == "learner.lora"
    full.step(_samples("f"), ["f"])
    full.checkpoint()
    full.close()
    with pytest.raises(ConfigError, match="full weights"):
        Lane("policy", tiny, tmp_path / "full", LORA, device="cpu")


def test_a_lora_config_the_model_cannot_take_names_the_field(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        Lane("policy", tiny, tmp_path, LearnerConfig(lora=LoraConfig(target_modules=("q_proj", "qkv"))), device="cpu")
    assert err.value.field == "learner.lora.target_modules" and "['qkv']" in str(err.value)


def test_policy_and_judge_as_two_adapters_of_one_base_held_once(tiny: Path, tmp_path: Path) -> None:
    """#23 item 4: one base model, two adapters, two optimizers: each lane's step moves its own adapter
    only, publishes its own, and computes with its own; the base is held once."""
    shared = lora.SharedBase(tiny, LORA.lora)
    policy = Lane("policy", tiny, tmp_path, LORA, device="cpu", shared=shared)
    judge = Lane("judge", tiny, tmp_path, LORA, device="cpu", shared=shared)
    assert policy.model is judge.model and policy._lock is judge._lock
    assert not {id(p) for p in policy.trainable()} & {id(p) for p in judge.trainable()}
    assert len(policy.trainable()) == len(judge.trainable()) > 0
    before_judge = {k: v.clone() for k, v in lora.adapter_state(judge.model, "judge").items()}
    policy.step(_samples("p1"), ["p1"])
    policy.step(_samples("p2"), ["p2"])
    assert all(torch.equal(before_judge[k], v) for k, v in lora.adapter_state(judge.model, "judge").items())
    before_policy = {k: v.clone() for k, v in lora.adapter_state(policy.model, "policy").items()}
    judge.step(_samples("j1"), ["j1"])
    assert all(torch.equal(before_policy[k], v) for k, v in lora.adapter_state(policy.model, "policy").items())
    assert any(not torch.equal(before_judge[k], v) for k, v in lora.adapter_state(judge.model, "judge").items())
    p_path, _, _ = policy.publish()
    j_path, _, _ = judge.publish()
    p_tensors, _ = adapters.read(p_path)
    j_tensors, _ = adapters.read(j_path)
    assert p_tensors.keys() == j_tensors.keys() and any(not torch.equal(p_tensors[k], j_tensors[k]) for k in p_tensors)
    # each lane computes with its own adapter: a base merged with the policy's adapter is the policy lane
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny)
    config = json.loads((p_path / "adapter_config.json").read_text())
    base.load_state_dict(adapters.merged(base.state_dict(), p_tensors, config), strict=False)
    policy._activate()
    assert (_logits(base) - _logits(policy.model)).abs().max() < 1e-4
    judge._activate()
    assert (_logits(base) - _logits(judge.model)).abs().max() > 1e-3
    policy.close()
    judge.close()
    # resumed: both adapters back from their own checkpoints
    policy.checkpoint()
    judge.checkpoint()
    again = lora.SharedBase(tiny, LORA.lora)
    p2 = Lane("policy", tiny, tmp_path, LORA, device="cpu", shared=again)
    j2 = Lane("judge", tiny, tmp_path, LORA, device="cpu", shared=again)
    assert (p2.version, j2.version) == (2, 1)
    assert all(torch.equal(p_tensors[k], v.float()) for k, v in lora.adapter_state(p2.model, "policy").items())
    p2.close()
    j2.close()


@pytest.mark.parametrize("held", [True, False], ids=["in-memory", "from-disk"])
async def test_a_local_engine_follows_adapter_versions_as_the_learner_computes_them(
    tiny: Path, tmp_path: Path, held: bool
) -> None:
    """Each version is merged into the base, not into the previous merge: after v1 then v2 the engine
    serves v2 exactly as the lane computes it."""
    lane = Lane("policy", tiny, tmp_path, LORA, device="cpu")
    src = Source(agent_id="learner", role="learner")
    events = []
    for version in (1, 2):
        lane.step(_samples(f"g{version}"), [f"g{version}"])
        path, digest, size = lane.publish()
        events.append(
            WeightsPublished(
                run_id="r",
                source=src,
                role="policy",
                version=lane.version,
                path=str(path),
                sha256=digest,
                bytes=size,
                format="lora",
            )
        )
    if not held:
        HELD.clear()
    async with LocalEngine(tiny, name="policy", device="cpu") as engine:
        follower = WeightsFollower(
            "policy", DiskReload(engine, tmp_path, full_verify=True), lambda: engine.version, Counter()
        )
        for seq, event in enumerate(events, 1):
            applied = await follower.follow(event, SimpleNamespace(stream_seq=seq))  # type: ignore[arg-type]
            assert applied is not None and applied.ok and applied.transport == "adapter", applied
        assert engine.version == 2
        assert (_logits(engine.model) - _logits(lane.model)).abs().max() < 1e-4
        full = events[1].model_copy(update={"format": "full"})  # announced as full weights: refused whole
        failed = await follower.follow(full.model_copy(update={"version": 3}), SimpleNamespace(stream_seq=3))
        assert failed is not None and not failed.ok and engine.version == 2
    lane.close()


async def test_a_server_that_cannot_load_adapters_refuses_them_and_keeps_serving(tiny: Path, tmp_path: Path) -> None:
    class FullOnly:
        version = 0

        async def swap_weights(self, path: Path, version: int) -> float:
            raise AssertionError("an adapter must never be loaded as full weights")

    lane = Lane("policy", tiny, tmp_path, LORA, device="cpu")
    path, digest, size = lane.publish()
    event = WeightsPublished(
        run_id="r",
        source=Source(agent_id="l", role="learner"),
        role="policy",
        version=0,
        path=str(path),
        sha256=digest,
        bytes=size,
        format="lora",
    )
    follower = WeightsFollower("policy", DiskReload(FullOnly(), tmp_path), lambda: 0, Counter())
    applied = await follower.follow(event, None)
    assert applied is not None and not applied.ok and "cannot load LoRA adapters" in (applied.error or "")
    lane.close()


@pytest.mark.slow
@pytest.mark.parametrize("one_base", [False, True], ids=["two-bases", "one-base"])
async def test_the_loop_trains_lora_adapters_of_both_lanes_and_the_engines_follow(bus, loop_cfg, one_base) -> None:
    """The closed loop with ``learner.lora``: both lanes publish adapter versions, policy and judge
    engines apply them (transport ``adapter``), and rollouts come from trained adapters; with one
    base directory for both roles the learner holds that base once."""
    from coevo.config import load_config
    from coevo.inference.clients import model_dir
    from coevo.loop import build_agents
    from coevo.runtime.agent import run_agents
    from coevo.schemas import LearnerStepped, StepTaken, WeightsApplied
    from coevo.training.learner import LearnerAgent
    from tests.test_loop import wait_for
    from tests.test_vllm import _dump

    base = {"policy.model": str(model_dir(loop_cfg, "policy")), "judge.model": str(model_dir(loop_cfg, "policy"))}
    cfg = load_config(
        overrides={**_dump(loop_cfg), "learner.lora": {"rank": 4, "alpha": 8.0}, **(base if one_base else {})}
    )
    assert cfg.trains_judge
    agents = build_agents(bus, cfg)
    learner = next(a for a in agents if isinstance(a, LearnerAgent))
    stop = asyncio.Event()

    def applied(events: list, role: str) -> set[int]:
        return {e.version for e in events if isinstance(e, WeightsApplied) and e.role == role and e.ok}

    async def until() -> None:
        try:
            await wait_for(
                bus,
                lambda ev: (
                    max(applied(ev, "policy"), default=0) >= 2
                    and max(applied(ev, "judge"), default=0) >= 1
                    and any(isinstance(e, StepTaken) and e.policy_version >= 1 for e in ev)
                ),
                timeout=240,
            )
        finally:
            stop.set()

    await asyncio.gather(run_agents(agents, handle_signals=False, until=stop), until())
    policy, judge = learner.lanes["policy"].lane, learner.lanes["judge"].lane
    assert (policy.model is judge.model) == one_base
    events = await bus.events()
    published = [e for e in events if isinstance(e, WeightsPublished)]
    assert published and {e.format for e in published} == {"lora"}
    full_bytes = sum(f.stat().st_size for f in Path(cfg.policy.model or _default(cfg)).glob("*.safetensors"))
    assert max(e.bytes for e in published) < 0.12 * full_bytes
    weights = [e for e in events if isinstance(e, WeightsApplied)]
    assert weights and all(e.ok and e.transport == "adapter" for e in weights)
    for role in ("policy", "judge"):
        stepped = [e.version for e in events if isinstance(e, LearnerStepped) and e.role == role and e.is_step]
        assert stepped == list(range(1, len(stepped) + 1)) and stepped


def _default(cfg) -> Path:
    from coevo.inference.clients import model_dir

    return model_dir(cfg, "policy")


@pytest.mark.vllm
@pytest.mark.slow
async def test_vllm_serves_each_adapter_version_as_the_learner_computes_it_and_the_loop_advances(
    bus, loop_cfg, model_cache: Path, tmp_path: Path
) -> None:
    """A real vLLM (CPU build, ``--enable-lora``): an adapter loaded at runtime samples what the LoRA
    lane computes (the parity probe on fresh samples), not the base; then the closed loop with
    ``learner.lora``, policy and judge as two adapters of the one base that server serves, moves both
    through adapter versions."""
    from coevo.config import load_config
    from coevo.inference.models import ensure_default_model
    from coevo.inference.vllm_client import VLLMClient
    from coevo.loop import build_agents
    from coevo.runtime.agent import run_agents
    from coevo.schemas import StepTaken, WeightsApplied
    from coevo.training import parity
    from tests.conftest import serving
    from tests.test_loop import wait_for
    from tests.test_vllm import _dump

    model = ensure_default_model("policy", model_cache)
    trained = Lane("policy", model, tmp_path / "trained", LearnerConfig(lora=LORA.lora, lr=0.1), device="cpu")
    for i in range(5):
        trained.step(_samples(f"g{i}", n=4), [f"g{i}"])
    path, _, _ = trained.publish()
    base = Lane("policy", model, tmp_path / "base", LORA, device="cpu")  # version 0: the base
    with serving(model, tmp_path, lora_rank=LORA.lora.rank) as url:
        async with VLLMClient(url, str(model), name="probe", tokenizer_dir=model) as client:
            before, _ = await parity.probe(client, base)
            await client.load_adapter(path, trained.version)
            stated, tokens = await parity.probe(client, trained)
            against_base, _ = await parity.probe(client, base)
        assert before < 0.02 and stated < 0.02 and tokens > 100, (before, stated)
        assert against_base > 1e-3, against_base  # the adapter is served, not the base (about 0.05; equal: 1e-14)
        # one base, two roles: policy and judge are two adapters of the model this one server serves
        cfg = load_config(
            overrides={
                **_dump(loop_cfg),
                "policy.url": url,
                "policy.model": str(model),
                "judge.backend": "vllm",
                "judge.url": url,
                "judge.model": str(model),
                "judge.mode": "verdict",
                "learner.lora": LORA.lora.model_dump(mode="json"),
                "learner.batch_samples": 8,
            }
        )
        assert cfg.trains_judge
        stop = asyncio.Event()

        def served(events: list, role: str) -> list[WeightsApplied]:
            return [e for e in events if isinstance(e, WeightsApplied) and e.role == role and e.server.startswith(role)]

        def advanced(events: list, role: str) -> bool:
            return len({e.version for e in served(events, role) if e.ok}) >= 2

        async def until() -> None:
            try:
                await wait_for(
                    bus,
                    lambda ev: (
                        advanced(ev, "policy")
                        and advanced(ev, "judge")
                        and any(isinstance(e, StepTaken) and e.policy_version >= 1 for e in ev)
                    ),
                    timeout=300,
                )
            finally:
                stop.set()

        await asyncio.gather(run_agents(build_agents(bus, cfg), handle_signals=False, until=stop), until())
    for role in ("policy", "judge"):
        applied = served(await bus.events(["weights.applied"]), role)
        assert applied and all(e.ok and e.transport == "adapter" for e in applied), applied
        versions = [e.version for e in applied]
        assert versions == sorted(versions) and versions[-1] >= 1
    trained.close()
    base.close()


def test_bench_learner_lora_publishes_the_adapter_and_holds_one_base_for_two_roles() -> None:
    """``coevo bench learner --lora``: the adapter of the tiny shape (2 layers, hidden 128, MLP 512)
    has rank · (4 · 256 + 3 · 640) parameters per layer; it is what is published, a fraction of the
    full model's bytes, and two roles on one base hold less than two full models."""
    from coevo.bench.learner import bench_learner

    report = bench_learner("tiny", steps=1, samples=4, tokens=32, lora_rank=4)
    assert report["trainable_parameters"] == 2 * 4 * (4 * 256 + 3 * 640)
    cmp = report["lora"]
    assert cmp["adapter_publish_bytes"] == report["publish_bytes"]
    assert 4 * report["trainable_parameters"] < report["publish_bytes"] < 0.05 * cmp["full_publish_bytes"]
    assert cmp["publish_fraction"] == round(report["publish_bytes"] / cmp["full_publish_bytes"], 4)
    # two full models: 2 × (weights + two Adam moments); one base: its weights once, plus two adapters' states
    base = report["parameters"] - report["trainable_parameters"]
    assert cmp["two_roles_full_held_bytes"] == pytest.approx(2 * 3 * 4 * base, rel=1e-3)  # + Adam step counters
    assert cmp["two_roles_one_base_held_bytes"] < 0.4 * cmp["two_roles_full_held_bytes"]
    # utilisation against this machine's own measured peak, in the lane's compute dtype (tiny: float32)
    assert report["compute_dtype"] == "float32" and report["peak_source"] == "measured float32 matmul"
    assert report["peak_tflops"] > 0 and 0 < report["mfu"] < 1
