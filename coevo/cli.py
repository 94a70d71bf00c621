"""The ``coevo`` command. Parses flags and config first; heavy modules are imported per command."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def _config_flags(parser: argparse.ArgumentParser) -> None:
    from coevo.config import leaf_fields

    parser.add_argument("--config", type=Path, help="TOML or YAML config file")
    parser.add_argument("--nats", dest="nats_url", metavar="URL",
                        help="NATS server URL (default: start an embedded server)")
    parser.add_argument("--run-id", help="run id (default: generated)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config field by dotted name (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    group = parser.add_argument_group("config fields (any field of the tree, by dotted name)")
    for name, info in leaf_fields().items():
        group.add_argument(f"--{name}", dest=f"cfg:{name}", default=None, metavar="V",
                           help=(info.description or "") + f" [default: {_default(info)}]")


def _default(info: Any) -> str:
    if info.default_factory is not None:
        return repr(info.default_factory())
    return repr(info.default)


def _parse_value(raw: str) -> Any:
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
        overrides[key.strip()] = _parse_value(value)
    for key, value in vars(args).items():
        if key.startswith("cfg:") and value is not None:
            overrides[key[4:]] = _parse_value(value)
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
    for key, dotted in getattr(args, "_extra_overrides", {}).items():
        value = getattr(args, key, None)
        if value is not None:
            overrides[dotted] = value
    return load_config(args.config, overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coevo",
        description="Online RL of LLM agents: policy, judge and environment rewriter co-evolve over NATS.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="run the closed loop (policy, judge, rewriter, learner)")
    p.add_argument("--minutes", type=float, help="wall-clock budget (0: until stopped) [run.minutes]")
    p.add_argument("--steps", type=int, help="stop after this many policy learner steps [run.steps]")
    p.add_argument("--family", help="quickgame | textworld | coding [env.family]")
    p.add_argument("--reward", help="integrated | outcome-only | steps-only [scorer.reward]")
    p.add_argument("--policy-model", help="local transformers model dir [policy.model]")
    p.add_argument("--policy-url", help="vLLM server serving the policy, http://host:port/v1 [policy.url]")
    p.add_argument("--weight-sync", choices=("disk", "gloo", "nccl"),
                   help="how vLLM servers get new weights: reload the checkpoint (disk) or pushed by the learner "
                   "(gloo on CPU, nccl on GPU) [learner.weight_sync]")
    p.add_argument("--resume", metavar="RUN", help="continue run RUN (same run id and run directory)")
    p.add_argument("--judge", metavar="BACKEND:MODEL",
                   help="e.g. litellm:openai/gpt-4.1-mini, vllm:NAME, local:DIR [judge.backend, judge.model]")
    p.add_argument("--judge-api-base", help="api_base of the judge's API (LiteLLM) or vLLM URL [judge.url]")
    p.set_defaults(_extra_overrides={"minutes": "run.minutes", "steps": "run.steps", "family": "env.family",
                                     "reward": "scorer.reward", "policy_model": "policy.model",
                                     "policy_url": "policy.url", "weight_sync": "learner.weight_sync",
                                     "resume": "run.run_id"})
    _config_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("agent", help="run one agent (a role, or module:Class) against a server")
    p.add_argument("role", help="agent role or module:Class")
    p.add_argument("--agent-id", help="agent id (default: role + random suffix)")
    p.add_argument("--family", help="environment family (same as --env.family)")
    p.set_defaults(_extra_overrides={"family": "env.family"})
    _config_flags(p)
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("server", help="run an embedded nats-server with JetStream in the foreground")
    p.add_argument("--port", type=int, default=4222, help="port (-1: any free port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--store", type=Path, default=Path("runs/nats"), help="JetStream storage directory")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("schemas", help="event schemas")
    ssub = p.add_subparsers(dest="schemas_command", required=True, metavar="ACTION")
    e = ssub.add_parser("export", help="write the JSON Schema of every event into DIR")
    e.add_argument("dir", type=Path)
    e.set_defaults(func=cmd_schemas_export)

    p = sub.add_parser("events", help="export a run's events, or import an export under a new run id")
    esub = p.add_subparsers(dest="events_command", required=True, metavar="ACTION")
    e = esub.add_parser("export", help="write every event of a run, in order, with sequence numbers")
    e.add_argument("out", type=Path)
    e.add_argument("--run", required=True, help="run id")
    e.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    _run_source(e)
    e.set_defaults(func=cmd_events_export)
    e = esub.add_parser("import", help="load an export into a server under a new run id")
    e.add_argument("file", type=Path)
    e.add_argument("--run-id", help="new run id (default: generated)")
    _run_source(e)
    e.set_defaults(func=cmd_events_import)

    p = sub.add_parser("trace", help="causal timeline of a trajectory, task, step or weights version")
    p.add_argument("ident", help="trajectory id, task id, step event id, or a weights version (policy:12)")
    p.add_argument("--run", required=True)
    p.add_argument("--json", action="store_true", help="JSON instead of a tree")
    _run_source(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("replay", help="feed recorded events into a fresh agent; report the first divergence")
    p.add_argument("--run", required=True)
    p.add_argument("--into", required=True, choices=["scorer", "judge", "rewriter", "learner"])
    p.add_argument("--from", dest="start", type=int, help="first stream sequence")
    p.add_argument("--to", dest="end", type=int, help="last stream sequence")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change the config for the replay")
    _run_source(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("rejudge", help="run another judge over a run's steps; agreement and accuracies")
    p.add_argument("--run", required=True)
    p.add_argument("--judge", default="recorded", help="'recorded' (the original responses) or a config file")
    _run_source(p)
    p.set_defaults(func=cmd_rejudge)

    p = sub.add_parser("bench", help="benchmarks (write JSON)")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    b = bsub.add_parser("bus", help="typed bus vs plain nats-py: throughput and publish-to-ack latency")
    b.add_argument("--json", type=Path, help="write results here")
    b.add_argument("--count", type=int, default=20000, help="events per size and mode")
    b.add_argument("--repeats", type=int, default=3, help="best of N runs per measurement")
    b.add_argument("--nats", dest="nats_url", help="use this server instead of an embedded one")
    b.set_defaults(func=cmd_bench_bus)
    b = bsub.add_parser("envs", help="environment steps/s in process vs as services; sandbox runs/s")
    b.add_argument("--json", type=Path)
    b.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    b.add_argument("--families", default="quickgame,textworld,coding")
    b.set_defaults(func=cmd_bench_envs)
    b = bsub.add_parser("learn", help="policy success over time on the quick game, integrated vs outcome-only")
    b.add_argument("--json", type=Path)
    b.add_argument("--minutes", type=float, default=10.0, help="budget per configuration")
    b.add_argument("--eval-every", type=float, default=30.0, help="seconds between evaluations")
    b.add_argument("--episodes", type=int, default=64, help="episodes per evaluation")
    b.set_defaults(func=cmd_bench_learn)
    b = bsub.add_parser("ladder", help="the paper's ablation ladder at equal wall-clock budget")
    b.add_argument("--json", type=Path)
    b.add_argument("--minutes", type=float, default=5.0, help="budget per rung")
    b.add_argument("--eval-every", type=float, default=30.0)
    b.add_argument("--episodes", type=int, default=64)
    b.set_defaults(func=cmd_bench_ladder)
    b = bsub.add_parser("weights", help="pause of a weight swap (local engine; vLLM with --vllm-python)")
    b.add_argument("--json", type=Path)
    b.add_argument("--vllm-python", help="python of a venv with vllm (starts a server per size)")
    b.add_argument("--sizes", default="tiny,small,medium")
    b.set_defaults(func=cmd_bench_weights)
    b = bsub.add_parser("codec", help="wire encodings of the event models: speed and size")
    b.add_argument("--json", type=Path)
    b.set_defaults(func=cmd_bench_codec)
    return parser


def _run_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", dest="nats_url", metavar="URL",
                        help="server holding the run (default: the run's own store under --runs-dir)")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from coevo.errors import ConfigError

    if args.command not in ("run", "agent", "server"):  # tools: quiet logs, results on stdout
        from coevo.runtime.logging import configure_logging

        configure_logging(None, level="warning", console="pretty")
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"coevo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


# ---- commands ----------------------------------------------------------------------------------


def _dry_run(args: argparse.Namespace, cfg: Any) -> bool:
    if args.dry_run:
        print(cfg.model_dump_json(indent=2))
        return True
    return False


def cmd_run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if _dry_run(args, cfg):
        return 0
    from coevo.loop import run_main

    return asyncio.run(run_main(cfg))


def _exit_on_stop(signum: int, _frame: object) -> None:
    raise SystemExit(0)  # stopped while starting up: nothing consumed yet, nothing to drain


def cmd_agent(args: argparse.Namespace) -> int:
    import signal

    # a stop while the config, the modules and the models load exits cleanly; go() replaces these
    # handlers with the event loop's (graceful drain) as soon as the loop runs
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_on_stop)
    cfg = resolve_config(args)
    if _dry_run(args, cfg):
        return 0
    from coevo.agents import resolve_role

    cls = resolve_role(args.role)
    if args.role == "learner":
        from coevo.training.distributed import init_distributed

        rank, _world = init_distributed()
        if rank > 0:  # torchrun: ranks > 0 follow rank 0, which alone talks to NATS
            return _learner_follower(cfg)

    async def go() -> int:
        from coevo.runtime.agent import run_agents
        from coevo.runtime.app import open_runtime

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with open_runtime(cfg, name=f"coevo-agent-{cls.role}") as rt:
            agent = cls(rt.bus, cfg, agent_id=args.agent_id)
            await run_agents([agent], handle_signals=False, until=stop)
        return 0

    return asyncio.run(go())


def _learner_follower(cfg: Any) -> int:
    from coevo.training.distributed import follow
    from coevo.training.learner import build_lane, checkpoint_root, trained_roles

    if not cfg.run.run_id:
        raise SystemExit("under torchrun, pass --run-id so that every rank writes the same checkpoints")
    root = checkpoint_root(cfg, cfg.run.run_id)
    follow({role: build_lane(cfg, role, root) for role in trained_roles(cfg)})
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    import signal
    import threading

    from coevo.runtime.server import EmbeddedServer

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with EmbeddedServer(args.store, port=args.port, host=args.host) as server:
        print(f"nats-server ready at {server.url} (JetStream in {server.store_dir}); Ctrl-C stops it",
              flush=True)
        done.wait()
    return 0


def cmd_schemas_export(args: argparse.Namespace) -> int:
    from coevo.schemas import json_schemas

    args.dir.mkdir(parents=True, exist_ok=True)
    schemas = json_schemas()
    for kind, schema in schemas.items():
        (args.dir / f"{kind}.json").write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(schemas)} schemas to {args.dir}")
    return 0


def cmd_events_export(args: argparse.Namespace) -> int:
    from coevo.tools.replay import export_events, open_run

    async def go() -> int:
        async with open_run(args.run, args.runs_dir, args.nats_url) as bus:
            return await export_events(bus, args.out, args.format)

    n = asyncio.run(go())
    print(f"exported {n} events of run {args.run} to {args.out}")
    return 0


def cmd_events_import(args: argparse.Namespace) -> int:
    from coevo.runtime.app import make_run_id, open_bus
    from coevo.tools.replay import import_events, read_export

    run_id = args.run_id or make_run_id()

    async def go() -> int:
        rows = read_export(args.file)
        async with open_bus(run_id, url=args.nats_url, store=args.runs_dir / run_id / "nats") as bus:
            return await import_events(bus, rows)

    n = asyncio.run(go())
    print(f"imported {n} events as run {run_id}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from coevo.tools.replay import open_run, trace

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url) as bus:
            return await trace(bus, args.ident)

    try:
        result = asyncio.run(go())
    except KeyError as exc:
        print(f"coevo: {exc.args[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        from rich import print as rprint

        from coevo.tools.trace_view import tree

        rprint(tree(result))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from coevo.tools import replay as rp

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key.strip()] = _parse_value(value)
    cfg = rp.run_config(args.runs_dir, args.run, overrides)

    async def go() -> dict[str, Any]:
        async with rp.open_run(args.run, args.runs_dir, args.nats_url) as bus:
            events = await rp.load_events(bus, args.start, args.end)
        if args.into == "scorer":
            report = rp.replay_scorer(events, cfg)
        elif args.into == "judge":
            report = await rp.replay_judge(events, cfg)
        elif args.into == "rewriter":
            report = await rp.replay_rewriter(events, cfg)
        else:
            report = await asyncio.to_thread(rp.replay_learner, events, cfg)
        return report.as_dict()

    result = asyncio.run(go())
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["identical"] else 1


def cmd_rejudge(args: argparse.Namespace) -> int:
    from coevo.config import load_config
    from coevo.tools import replay as rp

    recorded_cfg = rp.run_config(args.runs_dir, args.run, {})
    use_recorded = args.judge == "recorded"
    cfg = recorded_cfg if use_recorded else load_config(Path(args.judge))

    async def go() -> dict[str, Any]:
        async with rp.open_run(args.run, args.runs_dir, args.nats_url) as bus:
            return await rp.rejudge(bus, cfg, use_recorded)

    print(json.dumps(asyncio.run(go()), indent=2))
    return 0


def cmd_bench_bus(args: argparse.Namespace) -> int:
    from coevo.bench.bus import bench_bus

    result = asyncio.run(bench_bus(count=args.count, repeats=args.repeats, url=args.nats_url))
    return _emit(result, args.json)


def cmd_bench_envs(args: argparse.Namespace) -> int:
    from coevo.bench.envs import bench_envs

    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    return _emit(asyncio.run(bench_envs(args.seconds, families)), args.json)


def cmd_bench_learn(args: argparse.Namespace) -> int:
    from coevo.bench.learn import bench_learn

    return _emit(asyncio.run(bench_learn(args.minutes, args.eval_every, args.episodes)), args.json)


def cmd_bench_ladder(args: argparse.Namespace) -> int:
    from coevo.bench.learn import bench_ladder

    return _emit(asyncio.run(bench_ladder(args.minutes, args.eval_every, args.episodes)), args.json)


def cmd_bench_weights(args: argparse.Namespace) -> int:
    from coevo.bench.learn import bench_weights

    sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
    return _emit(asyncio.run(bench_weights(args.vllm_python, sizes)), args.json)


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from coevo.bench.bus import bench_codec

    return _emit(bench_codec(), args.json)


def _emit(result: dict[str, Any], path: Path | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
