"""The ``coevo`` command. Parses flags and config first; heavy modules are imported per command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coevo.runtime.proc import run_stoppable


def _config_flags(parser: argparse.ArgumentParser) -> None:
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
    _one_base(args, overrides)
    for key, dotted in getattr(args, "_extra_overrides", {}).items():
        value = getattr(args, key, None)
        if value is not None:
            overrides[dotted] = value
    return load_config(args.config, overrides)


def _one_base(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    """The parser, built from ``COMMANDS`` (one row per command; a row without ``run`` is a group)."""
    parser = argparse.ArgumentParser(
        prog="coevo", description="Online RL of LLM agents: policy, judge and environment rewriter co-evolve over NATS."
    )
    groups = {"": parser.add_subparsers(dest="command", required=True, metavar="COMMAND")}
    for command in COMMANDS:
        parent, _, name = command.path.rpartition(" ")
        p = groups[parent].add_parser(name, help=command.help)
        if command.run is None:
            groups[command.path] = p.add_subparsers(
                dest=command.path.replace(" ", "_") + "_command", required=True, metavar=command.metavar
            )
            continue
        for a in command.args:
            p.add_argument(*a.flags, **a.options)
        if command.overrides:
            p.set_defaults(_extra_overrides=dict(command.overrides))
        if command.config:
            _config_flags(p)
        if command.source:
            _run_source(p)
        p.set_defaults(func=command.run)
    return parser


def _run_source(parser: argparse.ArgumentParser) -> None:
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


def main(argv: list[str] | None = None) -> int:
    from coevo.runtime.memory import bound_malloc_arenas

    bound_malloc_arenas()  # before any thread starts
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
    except BaseExceptionGroup as group:  # an agent of a task group refused its config (a learner's probe)
        refused = group.subgroup(ConfigError)
        if refused is None:
            raise
        print(f"coevo: {_leaves(refused)[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _leaves(group: BaseExceptionGroup[Any]) -> list[BaseException]:
    return [leaf for e in group.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


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
    from coevo.observe.live import ObserveOptions
    from coevo.tools.trace import trace

    opts = ObserveOptions(
        dashboard=not args.no_dashboard,
        dashboard_port=args.dashboard_port,
        metrics_port=args.metrics_port,
        report=not args.no_report,
        trace=trace,
    )
    return asyncio.run(run_main(cfg, opts))


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
        from coevo.runtime.proc import StopSignals, exit_now

        stop = asyncio.Event()
        signals = StopSignals(stop)
        try:
            async with open_runtime(cfg, name=f"coevo-agent-{cls.role}") as rt:
                signals.started()
                agent = cls(rt.bus, cfg, agent_id=args.agent_id)
                async with _agent_metrics(agent, args) as url:
                    if url:
                        print(f"{agent.agent_id}: Prometheus metrics at {url}", flush=True)
                    await run_agents([agent], handle_signals=False, until=stop)
        except asyncio.CancelledError:
            if not signals.cancelled:
                raise
            import structlog  # nothing was consumed yet: nothing to drain

            structlog.get_logger("coevo.cli").info("agent.stopped_before_start", role=cls.role)
        if stop.is_set():  # stopped by a signal: within seconds, whatever a worker thread still computes
            exit_now(0)
        return 0

    return asyncio.run(go())


def _agent_metrics(agent: Any, args: argparse.Namespace) -> Any:
    """The agent's ``/metrics`` endpoint when ``--metrics-port`` is given. Without one the observe
    package (aiohttp's web server, the dashboard) is not imported: every restart pays for it."""
    if args.metrics_port is None:
        return contextlib.nullcontext(None)
    from coevo.observe.live import agent_metrics

    return agent_metrics([agent], args.metrics_port, args.metrics_host)


def _learner_follower(cfg: Any) -> int:
    from coevo.config import checkpoint_root
    from coevo.training.distributed import follow
    from coevo.training.learner import build_lanes, trained_roles

    if not cfg.run.run_id:
        raise SystemExit("under torchrun, pass --run-id so that every rank writes the same checkpoints")
    follow({lane.role: lane for lane in build_lanes(cfg, trained_roles(cfg), checkpoint_root(cfg, cfg.run.run_id))})
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    import signal
    import socket
    import threading

    from coevo.runtime.server import EmbeddedCluster, EmbeddedServer, server_security

    security = server_security(  # ConfigError (exit 2) for a non-loopback bind without authentication
        args.host,
        args.store,
        token_env=args.token_env,
        generate_token=args.generate_token,
        user=args.user,
        password_env=args.password_env,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        run_ids=tuple(args.run_id or ()),
        insecure_loopback=args.insecure_loopback,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    opts: dict[str, Any] = {"port": args.port, "host": args.host, "auth": security.auth, "tls": security.tls}
    server = (
        EmbeddedCluster(args.store, nodes=args.cluster, **opts) if args.cluster else EmbeddedServer(args.store, **opts)
    )
    with server:
        url = server.url or ""
        print(f"nats-server ready at {url} (JetStream in {server.store_dir}); Ctrl-C stops it", flush=True)
        if security.token_file is not None:
            print(f"the token is in {security.token_file} (mode 0600)", flush=True)
        if security.credentials is not None:
            from coevo.runtime.app import provision_runs
            from coevo.runtime.credentials import ADMIN, credential_path

            asyncio.run(
                provision_runs(
                    url,
                    credential_path(security.credentials, ADMIN),
                    tuple(args.run_id),
                    replicas=min(3, args.cluster or 1),
                )
            )
            print(
                f"each role's credentials are in {security.credentials}/ROLE.json (mode 0600; admin.json for the "
                f"process that starts the run and tools); the stream and buckets of {', '.join(args.run_id)} "
                "exist",
                flush=True,
            )
        public = url.replace("0.0.0.0", socket.gethostname())
        print(f"agents connect with: {security.agent_command(public)}", flush=True)
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
    from coevo.tools.events import export_events, open_run

    async def go() -> int:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            return await export_events(bus, args.out, args.format)

    n = asyncio.run(go())
    print(f"exported {n} events of run {args.run} to {args.out}")
    return 0


def cmd_events_import(args: argparse.Namespace) -> int:
    from coevo.runtime.app import make_run_id, open_bus, run_reader_config
    from coevo.tools.events import import_events, read_export

    run_id = args.run_id or make_run_id()

    async def go() -> int:
        rows = read_export(args.file)
        cfg = run_reader_config(args.runs_dir / run_id / "nats", args.nats_url, args.nats_credentials)
        async with open_bus(run_id, url=args.nats_url, store=args.runs_dir / run_id / "nats", cfg=cfg) as bus:
            return await import_events(bus, rows)

    n = asyncio.run(go())
    print(f"imported {n} events as run {run_id}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from coevo.tools.events import open_run
    from coevo.tools.trace import trace

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
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
    from coevo.tools.events import load_events, open_run, run_config

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key.strip()] = _parse_value(value)
    cfg = run_config(args.runs_dir, args.run, overrides)

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            events = await load_events(bus, args.start, args.end)
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
    from coevo.tools.events import open_run, run_config
    from coevo.tools.rejudge import rejudge

    recorded_cfg = run_config(args.runs_dir, args.run, {})
    use_recorded = args.judge == "recorded"
    cfg = recorded_cfg if use_recorded else load_config(Path(args.judge))

    async def go() -> dict[str, Any]:
        async with open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus:
            return await rejudge(bus, cfg, use_recorded)

    print(json.dumps(asyncio.run(go()), indent=2))
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from coevo.observe.live import ObserveOptions, observe_run
    from coevo.tools.events import open_run
    from coevo.tools.trace import trace

    opts = ObserveOptions(dashboard_port=args.port, host=args.host, trace=trace)

    async def go() -> int:
        import signal

        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with (
            open_run(args.run, args.runs_dir, args.nats_url, args.nats_credentials) as bus,
            observe_run(bus, opts, title=f"coevo run {args.run}") as live,
        ):
            print(f"dashboard of run {args.run} at {live.dashboard_url} (Ctrl-C stops it)", flush=True)
            await stop.wait()
        return 0

    return asyncio.run(go())


def cmd_report(args: argparse.Namespace) -> int:
    if (args.run is None) == (args.bench is None):
        raise SystemExit("coevo report: give --run RUN or --bench FILE.json")
    if args.bench is not None:
        from coevo.observe.report import write_bench_report

        out = args.out or args.bench.with_suffix("")
        path = write_bench_report(json.loads(args.bench.read_text()), out, name=args.bench.stem)
    else:
        from coevo.observe.offline import run_report

        out = args.out or args.runs_dir / args.run / "report"
        path = asyncio.run(run_report(args.run, args.runs_dir, args.nats_url, out, args.nats_credentials))
    print(f"wrote {path}")
    return 0


def cmd_bench_bus(args: argparse.Namespace) -> int:
    from coevo.bench.bus import bench_bus

    result = run_stoppable(bench_bus(count=args.count, repeats=args.repeats, url=args.nats_url))
    return _emit(result, args.json)


def cmd_bench_envs(args: argparse.Namespace) -> int:
    from coevo.bench.envs import bench_envs

    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    return _emit(run_stoppable(bench_envs(args.seconds, families)), args.json)


def cmd_bench_learn(args: argparse.Namespace) -> int:
    from coevo.bench.learn import bench_learn, bench_learn_lora

    if args.lora:
        return _emit(
            run_stoppable(
                bench_learn_lora(
                    _bench_budget(args),
                    args.eval_every,
                    args.episodes,
                    rank=args.lora,
                    lr=args.lora_lr,
                    **_over_seeds(args),
                )
            ),
            args.json,
        )
    return _emit(
        run_stoppable(bench_learn(_bench_budget(args), args.eval_every, args.episodes, **_over_seeds(args))), args.json
    )


def cmd_bench_ladder(args: argparse.Namespace) -> int:
    from coevo.bench.learn import bench_ladder, rungs_named

    try:
        rungs = rungs_named(args.rungs)
    except ValueError as exc:
        raise SystemExit(f"coevo bench: {exc}") from None
    return _emit(
        run_stoppable(
            bench_ladder(_bench_budget(args), args.eval_every, args.episodes, rungs=rungs, **_over_seeds(args))
        ),
        args.json,
    )


def _bench_budget(args: argparse.Namespace) -> Any:
    """``--budget steps:N|minutes:M|seconds:S`` (default: ``--minutes``)."""
    from coevo.bench.learn import Budget

    if args.budget is None:
        return Budget("seconds", args.minutes * 60)
    try:
        return Budget.parse(args.budget, cap_s=args.max_minutes * 60)
    except ValueError as exc:
        raise SystemExit(f"coevo bench: --budget: {exc}") from None


def _over_seeds(args: argparse.Namespace) -> dict[str, Any]:
    """bench learn / ladder: seeds, preset, family, cache and the judge to start from, checked before
    anything runs."""
    from coevo.bench.learn import family_of

    try:
        family_of(args.family, args.preset)
    except ValueError as exc:
        raise SystemExit(f"coevo bench: {exc}") from None
    if args.seeds < 1:
        raise SystemExit("coevo bench: --seeds must be >= 1")
    overrides: dict[str, Any] = {}
    if args.judge_from is not None:
        if not (args.judge_from / "config.json").is_file():
            raise SystemExit(f"coevo bench: --judge-from {args.judge_from}: not a model directory (no config.json)")
        overrides["judge.model"] = str(args.judge_from.resolve())
    return {
        "seeds": args.seeds,
        "preset": args.preset,
        "family": args.family,
        "cache_dir": args.cache_dir,
        "overrides": overrides,
    }


def _seeds_args() -> tuple[Arg, ...]:
    return (
        arg(
            "--seeds",
            type=int,
            default=1,
            help="runs per configuration (run.seed = env.seed = 0..K-1); means and 95%% t intervals over them",
        ),
        arg(
            "--preset",
            default="default",
            choices=("default", "hard"),
            help="initial task pool; hard: the quick game's sparse-reward pool (family quickgame-hard)",
        ),
        arg("--family", default="quickgame", help="quickgame or textworld"),
        arg("--cache-dir", type=Path, help="models and compiled games (default: a temporary directory)"),
        arg(
            "--budget",
            help="per run: steps:N (equal policy learner steps; --eval-every counts steps), "
            "minutes:M or seconds:S (default: --minutes)",
        ),
        arg("--max-minutes", type=float, default=30.0, help="wall-clock cap of a steps:N run"),
        arg(
            "--judge-from",
            type=Path,
            metavar="DIR",
            help="the judge starts from this model directory (a "
            "judge trained beforehand, e.g. runs/<id>/checkpoints/judge/published/v…): frozen in the "
            "policy-only rung and with outcome-only reward, trained on elsewhere",
        ),
    )


def cmd_bench_weights(args: argparse.Namespace) -> int:
    from coevo.bench.weights import bench_weights

    sizes = tuple(s.strip() for s in args.sizes.split(",") if s.strip())
    return _emit(run_stoppable(bench_weights(args.vllm_python, sizes)), args.json)


def cmd_bench_table(args: argparse.Namespace) -> int:
    from coevo.bench.tables import tables

    try:
        result = json.loads(args.result.read_text())
        print(tables(result), end="")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"coevo bench table: {args.result}: not a bench learn/ladder result ({exc!r})") from None
    return 0


def cmd_bench_parity(args: argparse.Namespace) -> int:
    from coevo.bench.parity import bench_parity

    return _emit(run_stoppable(bench_parity(args.vllm_python, rollouts=args.rollouts)), args.json)


def cmd_bench_learner(args: argparse.Namespace) -> int:
    from coevo.bench.learner import bench_learner

    return _emit(
        bench_learner(
            args.size,
            args.device,
            steps=args.steps,
            samples=args.samples,
            tokens=args.tokens,
            checkpoint_every=args.checkpoint_every,
            lora_rank=args.lora,
        ),
        args.json,
    )


def cmd_bench_chaos(args: argparse.Namespace) -> int:
    from coevo.bench.chaos import KINDS, ChaosPlan, bench_chaos

    kinds = (
        tuple(k.strip() for k in args.faults.split(",") if k.strip())
        if args.faults
        else tuple(k for k in KINDS if args.hosts or k not in ("link_cut", "sigterm_cut"))
    )
    try:
        plan = ChaosPlan(
            minutes=args.minutes,
            kill_every_s=args.kill_every,
            node_every_s=args.node_every,
            seed=args.seed,
            faults=kinds,
            hosts=args.hosts,
            cut_every_s=args.cut_every,
            cut_s=args.cut_s,
        )
    except ValueError as exc:
        raise SystemExit(f"coevo bench chaos: {exc}") from None
    result = run_stoppable(bench_chaos(plan, baseline=not args.no_baseline, workdir=args.workdir))
    _emit(result, args.json)
    return 0 if result["ok"] else 1


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from coevo.bench.soak import bench_soak

    extra = [a for kv in args.set for a in ("--set", kv)]
    return _emit(run_stoppable(bench_soak(args.minutes, args.every, extra)), args.json)


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from coevo.bench.bus import bench_codec

    return _emit(bench_codec(), args.json)


def cmd_bench_async(args: argparse.Namespace) -> int:
    from coevo.bench.asynchrony import AsyncPlan, bench_async

    overrides = {k.strip(): _parse_value(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    plan = AsyncPlan(minutes=args.minutes, seeds=args.seeds, loop=args.loop, overrides=overrides)
    return _emit(run_stoppable(bench_async(plan, workdir=args.workdir)), args.json)


def _emit(result: dict[str, Any], path: Path | None) -> int:
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0


# ---- the command table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Arg:
    flags: tuple[str, ...]
    options: dict[str, Any]


def arg(*flags: str, **options: Any) -> Arg:
    return Arg(flags, options)


@dataclass(frozen=True)
class Command:
    """One row of the CLI: ``path`` is the words typed ("bench learn"); no ``run`` makes it a group."""

    path: str
    help: str
    run: Callable[[argparse.Namespace], int] | None = None
    args: tuple[Arg, ...] = ()
    config: bool = False
    """every field of the config tree as a flag, plus --config, --set, --nats, --run-id, --dry-run"""
    source: bool = False
    """--nats / --runs-dir: where a recorded run's events are"""
    overrides: dict[str, str] = field(default_factory=dict)
    """flag dest -> config field it sets"""
    metavar: str = "ACTION"


_JSON = arg("--json", type=Path, help="write results here")

COMMANDS: tuple[Command, ...] = (
    Command(
        "run",
        "run the closed loop (policy, judge, rewriter, learner)",
        cmd_run,
        config=True,
        args=(
            arg("--minutes", type=float, help="wall-clock budget (0: until stopped) [run.minutes]"),
            arg("--steps", type=int, help="stop after this many policy learner steps [run.steps]"),
            arg(
                "--family",
                help="quickgame | textworld | coding | external | gym:MODULE:ENV | a plugin's name [env.family]",
            ),
            arg(
                "--serve-policy",
                type=int,
                metavar="PORT",
                help="serve the OpenAI-compatible policy endpoint on this "
                "port (0: any free port; --family external serves on 8000 by default) [policy.serve_port]",
            ),
            arg("--reward", help="integrated | outcome-only | steps-only [scorer.reward]"),
            arg("--policy-model", help="local transformers model dir [policy.model]"),
            arg("--policy-url", help="vLLM server serving the policy, http://host:port/v1 [policy.url]"),
            arg(
                "--weight-sync",
                choices=("disk", "gloo", "nccl"),
                help="how vLLM servers get new weights: reload the checkpoint (disk) or pushed by the learner "
                "(gloo on CPU, nccl on GPU) [learner.weight_sync.transport]",
            ),
            arg("--lora", action="store_true", help="train LoRA adapters instead of full models [learner.lora]"),
            arg(
                "--base",
                metavar="DIR",
                help="policy and judge from one base model directory (with --lora: two adapters "
                "of one base, held once; with --policy-url: both served by that server) [policy.model, judge.model]",
            ),
            arg("--resume", metavar="RUN", help="continue run RUN (same run id and run directory)"),
            arg(
                "--judge",
                metavar="BACKEND:MODEL",
                help="e.g. litellm:openai/gpt-4.1-mini, vllm:NAME, local:DIR [judge.backend, judge.model]",
            ),
            arg("--judge-api-base", help="api_base of the judge's API (LiteLLM) or vLLM URL [judge.url]"),
            arg(
                "--dashboard-port",
                type=int,
                default=8765,
                help="port of the live dashboard on 127.0.0.1 (0: any free port; 8765 falls back to a free one)",
            ),
            arg("--no-dashboard", action="store_true", help="do not serve the live dashboard"),
            arg("--metrics-port", type=int, help="also serve Prometheus /metrics and /healthz on this port"),
            arg("--no-report", action="store_true", help="do not write runs/<id>/report/ at the end"),
        ),
        overrides={
            "minutes": "run.minutes",
            "steps": "run.steps",
            "family": "env.family",
            "serve_policy": "policy.serve_port",
            "reward": "scorer.reward",
            "policy_model": "policy.model",
            "policy_url": "policy.url",
            "weight_sync": "learner.weight_sync.transport",
            "resume": "run.run_id",
        },
    ),
    Command(
        "agent",
        "run one agent (a role, or module:Class) against a server",
        cmd_agent,
        config=True,
        args=(
            arg("role", help="agent role or module:Class"),
            arg("--agent-id", help="agent id (default: role + random suffix)"),
            arg("--family", help="environment family (same as --env.family)"),
            arg("--metrics-port", type=int, help="serve Prometheus /metrics and /healthz on this port"),
            arg("--metrics-host", default="127.0.0.1", help="address of --metrics-port (0.0.0.0: every interface)"),
        ),
        overrides={"family": "env.family"},
    ),
    Command(
        "server",
        "run an embedded nats-server with JetStream in the foreground",
        cmd_server,
        args=(
            arg("--port", type=int, default=4222, help="port (-1: any free port)"),
            arg("--host", default="127.0.0.1", help="address to listen on; beyond loopback it needs auth"),
            arg("--store", type=Path, default=Path("runs/nats"), help="JetStream storage directory"),
            arg(
                "--cluster",
                type=int,
                choices=(3, 5),
                help="start N nodes on this host joined by routes "
                "(ports PORT..PORT+N-1; stores STORE/n<i>); prints the comma-separated URLs",
            ),
            arg(
                "--run-id",
                action="append",
                metavar="RUN",
                help="require a user per role with run RUN's permissions (repeatable), credentials in "
                "STORE/credentials/ROLE.json (mode 0600; docs/security.md)",
            ),
            arg(
                "--generate-token",
                action="store_true",
                help="require a random token, kept in STORE/nats-token (mode 0600)",
            ),
            arg(
                "--insecure-loopback",
                action="store_true",
                help="serve on loopback without authentication: any local user or program can publish",
            ),
            arg("--token-env", metavar="NAME", help="require the token held by environment variable NAME"),
            arg("--user", help="require this user (with --password-env)"),
            arg("--password-env", metavar="NAME", help="environment variable holding --user's password"),
            arg("--tls-cert", type=Path, help="server certificate (PEM): clients connect over TLS"),
            arg("--tls-key", type=Path, help="key of --tls-cert"),
            arg("--tls-ca", type=Path, help="require client certificates signed by this CA (mutual TLS)"),
        ),
    ),
    Command("schemas", "event schemas"),
    Command(
        "schemas export",
        "write the JSON Schema of every event into DIR",
        cmd_schemas_export,
        args=(arg("dir", type=Path),),
    ),
    Command("events", "export a run's events, or import an export under a new run id"),
    Command(
        "events export",
        "write every event of a run, in order, with sequence numbers",
        cmd_events_export,
        source=True,
        args=(
            arg("out", type=Path),
            arg("--run", required=True, help="run id"),
            arg("--format", choices=["jsonl", "parquet"], default="jsonl"),
        ),
    ),
    Command(
        "events import",
        "load an export into a server under a new run id",
        cmd_events_import,
        source=True,
        args=(arg("file", type=Path), arg("--run-id", help="new run id (default: generated)")),
    ),
    Command(
        "trace",
        "causal timeline of a trajectory, task, step or weights version",
        cmd_trace,
        source=True,
        args=(
            arg("ident", help="trajectory id, task id, step event id, or a weights version (policy:12)"),
            arg("--run", required=True),
            arg("--json", action="store_true", help="JSON instead of a tree"),
        ),
    ),
    Command(
        "replay",
        "feed recorded events into a fresh agent; report the first divergence",
        cmd_replay,
        source=True,
        args=(
            arg("--run", required=True),
            arg("--into", required=True, choices=["scorer", "judge", "rewriter", "learner"]),
            arg("--from", dest="start", type=int, help="first stream sequence"),
            arg("--to", dest="end", type=int, help="last stream sequence"),
            arg("--set", action="append", default=[], metavar="KEY=VALUE", help="change the config for the replay"),
        ),
    ),
    Command(
        "rejudge",
        "run another judge over a run's steps; agreement and accuracies",
        cmd_rejudge,
        source=True,
        args=(
            arg("--run", required=True),
            arg("--judge", default="recorded", help="'recorded' (the original responses) or a config file"),
        ),
    ),
    Command(
        "dashboard",
        "serve the dashboard of a running or finished run",
        cmd_dashboard,
        source=True,
        args=(
            arg("--run", required=True, help="run id"),
            arg("--port", type=int, default=8765, help="port (0: any free port)"),
            arg("--host", default="127.0.0.1", help="address to listen on"),
        ),
    ),
    Command(
        "report",
        "HTML report with plots of a run (--run) or of a bench result (--bench)",
        cmd_report,
        source=True,
        args=(
            arg("--run", help="run id"),
            arg("--bench", type=Path, help="a `coevo bench ... --json` file"),
            arg("--out", type=Path, help="output directory (default: runs/<run>/report, or next to FILE)"),
        ),
    ),
    Command("bench", "benchmarks (write JSON)", metavar="BENCH"),
    Command(
        "bench bus",
        "typed bus vs plain nats-py: throughput and publish-to-ack latency",
        cmd_bench_bus,
        args=(
            _JSON,
            arg("--count", type=int, default=20000, help="events per size and mode"),
            arg("--repeats", type=int, default=5, help="pairs (plain, typed) per size: the ratio is their median"),
            arg("--nats", dest="nats_url", help="use this server instead of an embedded one"),
        ),
    ),
    Command(
        "bench envs",
        "environment steps/s in process vs as services; sandbox runs/s",
        cmd_bench_envs,
        args=(
            _JSON,
            arg("--seconds", type=float, default=5.0, help="per measurement"),
            arg("--families", default="quickgame,textworld,coding"),
        ),
    ),
    Command(
        "bench learn",
        "policy success over time, integrated vs outcome-only, over seeds",
        cmd_bench_learn,
        args=(
            _JSON,
            arg("--minutes", type=float, default=10.0, help="budget per configuration"),
            arg(
                "--eval-every",
                type=float,
                default=30.0,
                help="seconds (steps under --budget steps:N) between evaluations",
            ),
            arg("--episodes", type=int, default=64, help="episodes per evaluation"),
            arg(
                "--lora",
                type=int,
                metavar="RANK",
                help="LoRA lanes of this rank against full fine-tuning "
                "(both integrated) instead of integrated against outcome-only",
            ),
            arg("--lora-lr", type=float, default=5e-3, help="the LoRA runs' learner.lr (full: the default)"),
            *_seeds_args(),
        ),
    ),
    Command(
        "bench ladder",
        "the paper's ablation ladder at equal wall-clock budget",
        cmd_bench_ladder,
        args=(
            _JSON,
            arg("--minutes", type=float, default=5.0, help="budget per rung"),
            arg("--eval-every", type=float, default=30.0),
            arg("--episodes", type=int, default=64),
            arg(
                "--rungs",
                default="policy-only,policy+judge,full",
                help="comma-separated, bottom first, of "
                "policy-only, policy+judge, full, full-unsaturated (the full loop without the saturated-slot rules)",
            ),
            *_seeds_args(),
        ),
    ),
    Command(
        "bench table",
        "markdown tables (mean ± 95 %% interval over seeds, paired differences, per step) of a bench learn or "
        "ladder result",
        cmd_bench_table,
        args=(arg("result", type=Path, help="the JSON bench learn or bench ladder wrote"),),
    ),
    Command(
        "bench weights",
        "pause of a weight swap (local engine; vLLM with --vllm-python)",
        cmd_bench_weights,
        args=(
            _JSON,
            arg("--vllm-python", help="python of a venv with vllm (starts a server per size)"),
            arg("--sizes", default="tiny,small,medium"),
        ),
    ),
    Command(
        "bench parity",
        "sampling parity with vLLM on a model with instruct-style sampling defaults: KL from "
        "the server's sampling to the learner's log-probs",
        cmd_bench_parity,
        args=(
            _JSON,
            arg("--vllm-python", required=True, help="python of a venv with vllm"),
            arg("--rollouts", type=int, default=40, help="fresh completions per setting"),
        ),
    ),
    Command(
        "bench learner",
        "one learner step by model size: step, publish and checkpoint costs, memory, MFU",
        cmd_bench_learner,
        args=(
            _JSON,
            arg("--size", default="large", choices=("tiny", "small", "medium", "large", "0.5B", "1.5B")),
            arg("--device", default="cpu", help="cpu or cuda"),
            arg("--steps", type=int, help="measured steps (default 3 on CPU, 5 on GPU)"),
            arg("--samples", type=int, help="samples per step (default 16 on CPU, 64 on GPU)"),
            arg("--tokens", type=int, help="tokens per sample, a quarter response (default 128 / 512)"),
            arg("--checkpoint-every", type=int, default=1, help="a resume checkpoint every N steps"),
            arg("--lora", type=int, metavar="RANK", help="a LoRA lane of this rank, compared with full weights"),
        ),
    ),
    Command(
        "bench chaos",
        "the loop as processes on a 3-node cluster under kill -9, node loss, garbage, failing "
        "stores, slow handlers, lagging followers, failing ranks, a full disk and (--hosts) link cuts",
        cmd_bench_chaos,
        args=(
            _JSON,
            arg("--minutes", type=float, default=10.0, help="with faults (and again without)"),
            arg("--faults", help="comma-separated fault kinds (default: every kind; see coevo.bench.chaos.KINDS)"),
            arg(
                "--hosts",
                type=int,
                default=0,
                help="N >= 3: each NATS node and a share of the agents on a "
                "host of its own (a network namespace; needs root and iproute2); link cuts become faults",
            ),
            arg("--cut-every", type=float, default=90.0, help="seconds between link cuts (--hosts)"),
            arg("--cut-s", type=float, default=30.0, help="how long a host stays cut off"),
            arg("--kill-every", type=float, default=5.0, help="seconds between kill -9 of a random agent"),
            arg("--node-every", type=float, default=60.0, help="seconds between NATS node kills"),
            arg("--seed", type=int, default=0),
            arg("--no-baseline", action="store_true", help="skip the fault-free run"),
            arg("--workdir", type=Path, help="keep stores, runs and agent logs here (default: removed)"),
        ),
    ),
    Command(
        "bench soak",
        "a long coevo run: RSS slope of every process and growth on disk, per hour",
        cmd_bench_soak,
        args=(
            _JSON,
            arg("--minutes", type=float, default=30.0),
            arg("--every", type=float, default=10.0, help="seconds between samples"),
            arg(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="config override for the run (repeatable), e.g. stream.retain_bytes=200000000",
            ),
        ),
    ),
    Command("bench codec", "wire encodings of the event models: speed and size", cmd_bench_codec, args=(_JSON,)),
    Command(
        "bench async",
        "sync (max_staleness 0) vs async loop, rollouts and learner pinned to separate cores",
        cmd_bench_async,
        args=(
            _JSON,
            arg("--minutes", type=float, default=3.0, help="measured per run"),
            arg("--seeds", type=int, default=2, help="a sync and an async run per seed"),
            arg("--loop", default="policy+judge", choices=("policy-only", "policy+judge", "full")),
            arg(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="config override for both modes (repeatable), e.g. learner.batch_samples=32",
            ),
            arg("--workdir", type=Path, help="keep the store, runs and agent logs here (default: removed)"),
        ),
    ),
)


if __name__ == "__main__":
    sys.exit(main())
