"""``coevo run``: the closed loop in one process tree, with the dashboard and the report."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from collections.abc import Callable

from coevo.cli._checks import check_api_keys, check_endpoints, check_models, check_nats, check_resume
from coevo.cli._config import dry_run, resolve_config
from coevo.cli._leftovers import removed_on_failure
from coevo.cli._table import Command, arg
from coevo.config import registered_families


def cmd_run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    check_resume(cfg.run.runs_dir, args.resume)  # before anything is created: never a new run by that name
    check_models(cfg, args)
    check_api_keys(cfg)
    if dry_run(args, cfg):
        return 0
    check_endpoints(cfg)
    check_nats(cfg.nats.url)
    from coevo.bench.heldout import run_baselines
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
    with removed_on_failure(cfg.run.runs_dir):  # failed before it ran: no run directory of logs alone
        return asyncio.run(run_main(cfg, opts, baselines=run_baselines, resume=resume_command(sys.argv[1:])))


RUN_ID_FLAGS = ("--resume", "--run-id", "--run.run_id")


def resume_command(argv: list[str]) -> Callable[[str], str]:
    """run id -> this command line (``argv`` after the program) continuing that run: ``--resume RUN``
    in place of any run id it named."""
    kept: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word in RUN_ID_FLAGS:
            skip = True
        elif not word.startswith(tuple(f"{f}=" for f in RUN_ID_FLAGS)):
            kept.append(word)
    return lambda run_id: shlex.join(["coevo", *kept, "--resume", run_id])


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
                help=" | ".join([*registered_families(), "external", "gym:MODULE:ENV"])
                + " (every registered family, a plugin's included) [env.family]",
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
)
