"""The flags every config-taking command shares, and the one resolution of them into a config:
defaults, then the ``--config`` file, then ``--set`` and the per-field flags (the CLI is generated from
the config tree)."""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

CONFIG_EPILOG = (
    "The flags in 'options' are the ones most runs need. Every field of the config tree is a flag too "
    "(--SECTION.FIELD V, listed under 'config fields'); a --config file sets many at once (configs/ has "
    "examples), and --dry-run prints what a command line resolves to."
)


def config_flags(parser: argparse.ArgumentParser) -> None:
    """--config, --nats, --run-id, --set, --dry-run and a flag per field of the config tree (its
    description, choices and default as plain values)."""
    usage = parser.format_usage().removeprefix("usage: ").rstrip()
    parser.usage = usage + " [--config FILE] [--set KEY=VALUE] [--dry-run] [--SECTION.FIELD V ...]"
    parser.epilog = CONFIG_EPILOG
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML or YAML config file")
    parser.add_argument(
        "--nats", dest="nats_url", metavar="URL", help="NATS server URL (default: start an embedded server)"
    )
    parser.add_argument("--run-id", metavar="RUN", help="run id (default: generated)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field by dotted name (repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    group = parser.add_argument_group("config fields (any field of the tree, by dotted name)")
    for name, flag in field_flags().items():
        group.add_argument(
            f"--{name}",
            dest=f"cfg:{name}",
            default=None,
            metavar="{" + ",".join(flag.choices) + "}" if flag.choices else "V",
            help=flag.help().replace("%", "%%"),
        )


@dataclass(frozen=True)
class FieldFlag:
    """What a config field's flag says of it."""

    info: Any
    choices: tuple[str, ...] = ()
    """a Literal's values; a tagged section's tag: every variant's"""
    only: str = ""
    """for a field of some variants of a tagged section: ``judge.backend vllm|litellm``"""

    def help(self) -> str:
        text = self.info.description or ""
        if self.only:
            text += f" (with {self.only})"
        if self.info.is_required():
            return text + " [required]"
        default = self.info.get_default(call_default_factory=True)
        return text + f" [default: {plain(default)}]"


def plain(value: Any) -> str:
    """A default as a user would type it: ``runs``, not ``PosixPath('runs')``; ``none`` for None."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Path | str | int | float):
        return str(value)
    if isinstance(value, BaseModel):
        return json.dumps(value.model_dump(mode="json"))
    return json.dumps(value, default=str)


def field_flags(model: type[BaseModel] | None = None, prefix: str = "") -> dict[str, FieldFlag]:
    """Dotted name -> its flag's description, for every leaf of the config tree (the fields of a
    tagged section's every variant, each saying which variants have it)."""
    from coevo.config import CoevoConfig

    out: dict[str, FieldFlag] = {}
    for name, info in (model or CoevoConfig).model_fields.items():
        sections = _sections(info.annotation)
        if not sections:
            out[prefix + name] = FieldFlag(info, _literal(info.annotation))
            continue
        if len(sections) == 1:
            out.update(field_flags(sections[0], f"{prefix}{name}."))
            continue
        tag = str(info.discriminator)
        holders: dict[str, list[str]] = {}
        for section in sections:
            for key, flag in field_flags(section, f"{prefix}{name}.").items():
                holders.setdefault(key, []).extend(_literal(section.model_fields[tag].annotation))
                out.setdefault(key, flag)
        tags = [t for section in sections for t in _literal(section.model_fields[tag].annotation)]
        for key, held in holders.items():
            if key == f"{prefix}{name}.{tag}":
                out[key] = FieldFlag(out[key].info, tuple(tags))
            elif len(held) < len(tags):
                out[key] = FieldFlag(out[key].info, out[key].choices, f"{prefix}{name}.{tag} " + "|".join(held))
    return out


def _sections(ann: Any) -> list[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    members = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union else ()
    return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]


def _literal(ann: Any) -> tuple[str, ...]:
    """The values of a Literal annotation (of ``Literal[...] | None`` too), as strings; () otherwise."""
    if typing.get_origin(ann) is typing.Literal:
        return tuple(str(v) for v in typing.get_args(ann))
    if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union:
        return tuple(v for member in typing.get_args(ann) for v in _literal(member))
    return ()


def parse_value(raw: str) -> Any:
    text = raw.strip()
    if text[:1] in "[{":
        return json.loads(text)
    return raw


def resolve_config(args: argparse.Namespace) -> Any:
    from coevo.config import load_config
    from coevo.errors import ConfigError

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}", field=None)
        overrides[key.strip()] = parse_value(value)
    for key, value in vars(args).items():
        if key.startswith("cfg:") and value is not None:
            overrides[key[4:]] = parse_value(value)
    if getattr(args, "nats_url", None):
        overrides["nats.url"] = args.nats_url
    if getattr(args, "run_id", None):
        overrides["run.run_id"] = args.run_id
    if getattr(args, "judge", None):
        backend, sep, model = args.judge.partition(":")
        if not sep or backend not in ("litellm", "vllm", "local"):
            raise ConfigError(
                f"--judge expects litellm:MODEL, vllm:NAME or local:DIR, got {args.judge!r}", field="judge.backend"
            )
        overrides["judge.backend"], overrides["judge.model"] = backend, model
    if getattr(args, "judge_api_base", None):
        overrides["judge.url"] = args.judge_api_base
    one_base(args, overrides)
    for key, dotted in getattr(args, "_extra_overrides", {}).items():
        value = getattr(args, key, None)
        if value is not None:
            overrides[dotted] = value
    return load_config(args.config, overrides)


def one_base(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    """``--lora``: LoRA lanes (``learner.lora`` defaults); ``--base DIR``: policy and judge from one base
    directory, and with ``--policy-url`` (and no ``--judge``) both served by that one server."""
    if getattr(args, "lora", False):
        overrides.setdefault("learner.lora", {})
    base = getattr(args, "base", None)
    if base is None:
        return
    overrides["policy.model"] = overrides["judge.model"] = base
    if getattr(args, "policy_url", None) and not getattr(args, "judge", None):
        overrides["judge.backend"], overrides["judge.url"] = "vllm", args.judge_api_base or args.policy_url


def run_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        dest="nats_url",
        metavar="URL",
        help="server holding the run (default: the run's own store under --runs-dir)",
    )
    parser.add_argument(
        "--nats-credentials",
        type=Path,
        metavar="FILE",
        help="credentials for --nats (a run's admin.json, docs/security.md); default: the run's "
        "own RUNS_DIR/RUN/nats/credentials/admin.json when it exists",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=Path("runs"),
        metavar="DIR",
        help="where run directories are (default: runs, as run.runs_dir)",
    )


def dry_run(args: argparse.Namespace, cfg: Any) -> bool:
    if args.dry_run:
        print(cfg.model_dump_json(indent=2))
        return True
    return False
