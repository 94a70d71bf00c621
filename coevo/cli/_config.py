"""The flags every config-taking command shares, and the one resolution of them into a config:
defaults, then the ``--config`` file, then ``--set`` and the per-field flags (the CLI is generated from
the config tree)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def config_flags(parser: argparse.ArgumentParser) -> None:
    from coevo.config import leaf_fields

    parser.add_argument("--config", type=Path, help="TOML or YAML config file")
    parser.add_argument(
        "--nats", dest="nats_url", metavar="URL", help="NATS server URL (default: start an embedded server)"
    )
    parser.add_argument("--run-id", help="run id (default: generated)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field by dotted name (repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    group = parser.add_argument_group("config fields (any field of the tree, by dotted name)")
    for name, info in leaf_fields().items():
        group.add_argument(
            f"--{name}",
            dest=f"cfg:{name}",
            default=None,
            metavar="V",
            help=(info.description or "") + f" [default: {_default(info)}]",
        )


def _default(info: Any) -> str:
    if info.default_factory is not None:
        return repr(info.default_factory())
    return repr(info.default)


def parse_value(raw: str) -> Any:
    text = raw.strip()
    if text[:1] in "[{":
        return json.loads(text)
    return raw


def resolve_config(args: argparse.Namespace) -> Any:
    from coevo.config import load_config

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
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
            raise SystemExit(f"--judge expects litellm:MODEL, vllm:NAME or local:DIR, got {args.judge!r}")
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
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))


def dry_run(args: argparse.Namespace, cfg: Any) -> bool:
    if args.dry_run:
        print(cfg.model_dump_json(indent=2))
        return True
    return False
