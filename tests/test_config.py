"""The config tree: precedence, errors that name the field, every shipped config loads."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from coevo.config import load_config
from coevo.errors import ConfigError
from tests.conftest import PYTHON, REPO, subprocess_env


def test_precedence_defaults_file_env_flags(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[bus]\nmax_ack_pending = 10\nfetch_batch = 7\n[agent]\nheartbeat_s = 2.0\n")
    monkeypatch.setenv("COEVO_BUS__MAX_ACK_PENDING", "20")
    cfg = load_config(f, {"agent.heartbeat_s": "3.5"})
    assert cfg.bus.max_ack_pending == 20  # env beats file
    assert cfg.bus.fetch_batch == 7  # file beats default
    assert cfg.agent.heartbeat_s == 3.5  # flag beats file
    assert cfg.bus.max_deliver == 5  # default


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[bus]\nmax_inflgiht = 3\n", "bus.max_inflgiht"),
        ("[bus]\nmax_ack_pending = 'lots'\n", "bus.max_ack_pending"),
        ("[nope]\nx = 1\n", "nope"),
        ("[bus]\nack_wait_s = 1.0\nin_progress_every_s = 2.0\n", "bus"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert info.value.field == field
    assert field in str(info.value)


def test_yaml_and_unparseable_files(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("log:\n  level: debug\n")
    assert load_config(y).log.level == "debug"
    broken = tmp_path / "broken.toml"
    broken.write_text("[bus\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(broken)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.*")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    load_config(path)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "coevo", *args], capture_output=True, text=True, env=subprocess_env(), timeout=60
    )


def test_cli_dry_run_prints_resolved_config_and_errors_name_fields(tmp_path: Path) -> None:
    out = run_cli("agent", "x:Y", "--dry-run", "--bus.max_ack_pending", "9", "--set", "agent.heartbeat_s=1.5")
    assert out.returncode == 0, out.stderr
    assert '"max_ack_pending": 9' in out.stdout and '"heartbeat_s": 1.5' in out.stdout
    bad = run_cli("agent", "x:Y", "--dry-run", "--set", "bus.max_ack_pendng=3")
    assert bad.returncode == 2 and "bus.max_ack_pendng" in bad.stderr


def test_help_everywhere_and_fast() -> None:
    t0 = time.perf_counter()
    top = run_cli("--help")
    elapsed = time.perf_counter() - t0
    assert top.returncode == 0
    for cmd in ("run", "agent", "server", "schemas", "bench"):
        assert cmd in top.stdout
        assert run_cli(cmd, "--help").returncode == 0
    assert run_cli("bench", "bus", "--help").returncode == 0
    assert run_cli("schemas", "export", "--help").returncode == 0
    assert elapsed < 5.0  # generous bound for a loaded CI machine; typically ~0.3 s
    probe = subprocess.run(
        [PYTHON, "-X", "importtime", "-m", "coevo", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    heavy = {"torch", "transformers", "nats", "vllm", "litellm"}
    imported = {line.split("|")[-1].strip().split(".")[0] for line in probe.stderr.splitlines() if "|" in line}
    assert not heavy & imported


def test_which_judges_the_learner_trains(tmp_path) -> None:
    def trains(**o: object) -> bool:
        return load_config(overrides={k.replace("__", "."): v for k, v in o.items()}).trains_judge

    assert trains() and not trains(loop="policy-only")  # the ablation fixes the judge
    assert trains(judge__backend="vllm", judge__url="http://h:1/v1", judge__model=str(tmp_path))  # a dir we serve
    assert not trains(judge__backend="vllm", judge__url="http://h:1/v1", judge__model="served-name")
    assert not trains(judge__backend="litellm", judge__model="openai/gpt-4.1-mini")


def test_a_tool_pointed_at_a_run_that_is_not_there_says_so_in_one_line(tmp_path: Path) -> None:
    for args in (
        ("trace", "--run", "nosuchrun", "x"),
        ("events", "export", "out.jsonl", "--run", "nosuchrun"),
        ("report", "--run", "nosuchrun"),
    ):
        out = run_cli(*args, "--runs-dir", str(tmp_path / "runs"))
        assert out.returncode == 2, (args, out.stderr[-2000:])
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "--runs-dir" in lines[0] and "nosuchrun" in lines[0], (args, out.stderr)
    assert not (tmp_path / "runs").exists()  # nothing was created for it


def test_weight_sync_is_tagged_by_its_transport(tmp_path: Path) -> None:
    """#23: only the chosen transport's fields exist; a bare name is that transport with its defaults;
    the command line's --weight-sync changes the transport and keeps the file's fields."""
    from coevo.config import DiskSync, PushSync

    assert load_config().learner.weight_sync == DiskSync()
    assert load_config(overrides={"learner.weight_sync": "gloo"}).learner.weight_sync == PushSync(transport="gloo")
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"learner.weight_sync": {"transport": "disk", "host": "10.0.0.5"}})
    assert err.value.field == "learner.weight_sync.disk.host"
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"learner.weight_sync": "tcp"})
    assert err.value.field == "learner.weight_sync" and "'disk', 'gloo', 'nccl'" in str(err.value)
    f = tmp_path / "c.toml"
    f.write_text('[learner.weight_sync]\ntransport = "gloo"\nhost = "10.0.0.5"\ntimeout_s = 30\n')
    cfg = load_config(f, {"learner.weight_sync.transport": "nccl"})
    assert cfg.learner.weight_sync == PushSync(transport="nccl", host="10.0.0.5", timeout_s=30.0)


def test_the_judge_is_tagged_by_its_backend(tmp_path: Path, model_cache: Path) -> None:
    """#26: only the chosen backend's fields exist; the default backend is local; the client follows the tag."""
    from coevo.config import LitellmJudge, LocalJudge, VllmJudge
    from coevo.inference.clients import make_client
    from coevo.inference.litellm_client import LiteLLMClient
    from coevo.inference.models import ensure_default_model
    from coevo.inference.vllm_client import VLLMClient

    assert isinstance(load_config().judge, LocalJudge)
    assert load_config(overrides={"judge.m": 5}).judge == LocalJudge(m=5)
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"judge.url": "http://h:8000/v1"})  # a URL means nothing to a local judge
    assert err.value.field == "judge.local.url"
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"judge.backend": "vllm"})
    assert err.value.field == "judge.vllm.url" and "required" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"judge.backend": "litellm", "judge.model": "openai/x", "judge.mode": "verdict"})
    assert "needs a local model" in str(err.value)
    served = str(ensure_default_model("judge", model_cache))  # a directory served as is (its tokenizer is read)
    vllm = load_config(overrides={"judge.backend": "vllm", "judge.url": "http://h:8000/v1", "judge.model": served})
    assert isinstance(vllm.judge, VllmJudge) and vllm.judge.effective_mode == "reasoned" and vllm.trains_judge
    client = make_client(vllm, "judge")
    assert isinstance(client, VLLMClient) and (client.model, client.base) == (served, "http://h:8000/v1")
    f = tmp_path / "j.toml"
    f.write_text('[judge]\nbackend = "litellm"\nmodel = "openai/gpt-4.1-mini"\n[judge.api]\nmax_usd = 2.5\n')
    api = load_config(f, {"judge.api.rpm": 30}).judge
    assert isinstance(api, LitellmJudge) and (api.api.max_usd, api.api.rpm) == (2.5, 30)
    assert isinstance(make_client(load_config(f), "judge"), LiteLLMClient)


def test_the_rewriter_is_tagged_by_its_backend() -> None:
    from coevo.config import BuiltinRewriterConfig, LitellmRewriter, NoRewriter

    assert load_config().tasks.rewriter == BuiltinRewriterConfig()
    assert load_config(overrides={"tasks.rewriter": "off"}).tasks.rewriter == NoRewriter(backend="off")
    llm = load_config(
        overrides={"tasks.rewriter.backend": "litellm", "tasks.rewriter.model": "openai/x", "tasks.rewriter.retries": 1}
    ).tasks.rewriter
    assert llm == LitellmRewriter(backend="litellm", model="openai/x", retries=1)
    for bad, field in (
        ({"tasks.rewriter.backend": "builtin", "tasks.rewriter.model": "x"}, "tasks.rewriter.builtin.model"),
        ({"tasks.rewriter.backend": "vllm", "tasks.rewriter.model": "x"}, "tasks.rewriter.vllm.url"),
        ({"tasks.rewriter.backend": "local"}, "tasks.rewriter.local.model"),
        ({"tasks.rewriter": "llm"}, "tasks.rewriter"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(overrides=bad)
        assert err.value.field == field, (bad, str(err.value))


def test_every_field_of_the_tree_says_what_it_means() -> None:
    """#26: every leaf (of every tagged variant) has a description: `coevo run --help` shows them all."""
    from coevo.config import leaf_fields

    assert [name for name, info in leaf_fields().items() if not info.description] == []


def test_a_misspelt_field_or_section_names_the_one_meant() -> None:
    cases = (
        ("polcy.n", "polcy", "policy"),  # an unknown section is the error's field
        ("policy.nn", "policy.nn", "policy.n"),
        ("learner.clip_eps_hihg", "learner.clip_eps_hihg", "learner.clip_eps_high"),
    )
    for given, field, meant in cases:
        with pytest.raises(ConfigError) as err:
            load_config(overrides={given: 4})
        assert f"{field}: Extra inputs are not permitted (did you mean {meant}?)" in str(err.value)
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"zzz": 1})
    assert "did you mean" not in str(err.value) and err.value.field == "zzz"


def test_lora_lanes_of_a_named_model_get_the_pretrained_lr_unless_one_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coevo.config import LORA_PRETRAINED_LR

    named = {"learner.lora": {}, "policy.model": "m"}
    assert LORA_PRETRAINED_LR < 1e-3
    assert load_config(overrides=named).learner.lr == LORA_PRETRAINED_LR
    assert load_config(overrides={"learner.lora": {}}).learner.lr == 1e-3  # the tiny models: random weights
    assert load_config(overrides={"policy.model": "m"}).learner.lr == 1e-3  # full fine-tuning: as before
    assert load_config(overrides={**named, "learner.lr": 3e-4}).learner.lr == 3e-4  # a flag
    file = tmp_path / "c.toml"
    file.write_text("[learner]\nlr = 2e-4\n")
    assert load_config(file, overrides=named).learner.lr == 2e-4  # a file
    monkeypatch.setenv("COEVO_LEARNER__LR", "5e-5")
    assert load_config(overrides=named).learner.lr == 5e-5  # the environment


def test_a_named_model_trains_in_micro_batches_it_can_hold(tmp_path: Path) -> None:
    """The tiny models' 32,768 tokens a micro-batch would hold tens of GB of a pretrained model's
    activations: a model you name gets PRETRAINED_MAX_BATCH_TOKENS unless a size is given."""
    from coevo.config import PRETRAINED_MAX_BATCH_TOKENS

    assert load_config().learner.max_batch_tokens == 32768  # the tiny models
    assert load_config(overrides={"policy.model": "m"}).learner.max_batch_tokens == PRETRAINED_MAX_BATCH_TOKENS
    assert (
        load_config(overrides={"policy.model": "m", "learner.max_batch_tokens": 9000}).learner.max_batch_tokens == 9000
    )
    file = tmp_path / "c.toml"
    file.write_text("[learner]\nmax_batch_tokens = 16384\n")
    assert load_config(file, overrides={"policy.model": "m"}).learner.max_batch_tokens == 16384
