"""``coevo agent ROLE``: one agent against a server (a role, or ``module:Class``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

from coevo.cli._checks import (
    API_ROLES,
    check_api_keys,
    check_credentials_run,
    check_endpoints,
    check_models,
    check_nats,
)
from coevo.cli._config import dry_run, resolve_config
from coevo.cli._leftovers import removed_on_failure
from coevo.cli._table import Command, arg


def _exit_on_stop(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def cmd_agent(args: argparse.Namespace) -> int:
    import signal

    # a stop while the config, modules and models load exits at once; go() swaps in the loop's graceful drain
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_on_stop)
    cfg = resolve_config(args)
    check_credentials_run(cfg)
    check_models(cfg, args)
    check_api_keys(cfg, external := API_ROLES.get(args.role, ()))
    if dry_run(args, cfg):
        return 0
    check_endpoints(cfg, external)
    from coevo.agents import resolve_role

    cls = resolve_role(args.role)
    check_nats(cfg.nats.url)
    if args.role == "learner":
        from coevo.training.distributed import init_distributed

        rank, _world = init_distributed()
        if rank > 0:  # torchrun: ranks > 0 follow rank 0, which alone talks to NATS
            return _learner_follower(cfg)

    async def go() -> int:
        import structlog

        from coevo.runtime.agent import run_agents
        from coevo.runtime.aio import off_the_loop
        from coevo.runtime.app import open_runtime
        from coevo.runtime.proc import StopSignals, exit_now

        stop = asyncio.Event()
        signals = StopSignals(stop)
        try:
            async with open_runtime(cfg, name=f"coevo-agent-{cls.role}") as rt:
                signals.started()
                agent = await off_the_loop(
                    lambda: cls(rt.bus, cfg, agent_id=args.agent_id),
                    lambda s: structlog.get_logger("coevo.cli").info(
                        "agent.loading_models", role=cls.role, seconds=round(s)
                    ),
                )
                async with _agent_metrics(agent, args) as url:
                    if url:
                        print(f"{agent.agent_id}: Prometheus metrics at {url}", flush=True)
                    await _with_status(agent, run_agents([agent], handle_signals=False, until=stop))
        except asyncio.CancelledError:
            if not signals.cancelled:
                raise
            structlog.get_logger("coevo.cli").info("agent.stopped_before_start", role=cls.role)
        if stop.is_set():  # stopped by a signal: within seconds, whatever a worker thread still computes
            exit_now(0)
        return 0

    try:
        with removed_on_failure(cfg.run.runs_dir):  # a failed agent leaves no run directory of its log alone
            return asyncio.run(go())
    except Exception as exc:
        raise _hinted(exc, cfg) from exc


def _hinted(exc: Exception, cfg: Any) -> Exception:
    """A NATS timeout under a role's credentials is most often a run the server does not serve."""
    from coevo.cli._failure import one_line
    from coevo.errors import BusError

    line = one_line(exc)
    if cfg.nats.credentials_file is None or line is None or "timeout" not in line.lower():
        return exc
    return BusError(
        f"{line}: with --nats.credentials_file the server answers only for the runs it was started for "
        f"(coevo server --run-id RUN); is {cfg.run.run_id} one of them?"
    )


async def _with_status(agent: Any, running: Any) -> None:
    """``running`` (the agent until it stops) with the agent's status line: what it has done so far,
    redrawn on a terminal, logged every 10 s elsewhere (a separate process otherwise says nothing)."""
    from coevo.observe.status import agent_line, show_status

    done = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(show_status(lambda: agent_line(agent), done), name="agent-status")
        try:
            await running
        finally:
            done.set()


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


COMMANDS: tuple[Command, ...] = (
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
)
