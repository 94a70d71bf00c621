"""``coevo bench NAME``: the benchmarks, each writing JSON.

A bench is registered by one row of ``BENCHES`` below (its words, help, function and flags); the
function imports its ``coevo.bench`` module inside, so that ``coevo --help`` stays light."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from coevo.cli._config import parse_value
from coevo.cli._table import JSON_ARG, Arg, Command, arg
from coevo.config import registered_families
from coevo.runtime.proc import run_stoppable


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
    if args.seeds < 1 or args.first_seed < 0:
        raise SystemExit("coevo bench: --seeds must be >= 1 and --first-seed >= 0")
    overrides = _run_overrides(args)
    if args.judge_from is not None:
        if not (args.judge_from / "config.json").is_file():
            raise SystemExit(f"coevo bench: --judge-from {args.judge_from}: not a model directory (no config.json)")
        overrides["judge.model"] = str(args.judge_from.resolve())
    from coevo.bench.learn import Protocol

    _check_heldout(args)
    return {
        "seeds": range(args.first_seed, args.first_seed + args.seeds),
        "preset": args.preset,
        "family": args.family,
        "cache_dir": args.cache_dir,
        "overrides": overrides,
        "protocol": Protocol(args.heldout_tasks, args.eval_seeds, args.heldout_measure, args.heldout_states),
        # every finished run beside the final JSON, as it finishes: a long bench killed keeps its runs
        "progress": args.json.with_name(args.json.stem + ".partial.json") if args.json else None,
    }


def _run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of a bench learn / ladder takes from the command line, as ``coevo run`` would:
    a ``--config`` file, then ``--set KEY=VALUE``, then ``--lora`` and ``--base`` (policy and judge from
    one base: a model directory, a GGUF file or a shipped model's short name)."""
    from coevo.cli._config import one_base, parse_value
    from coevo.config import load_config, read_config_file
    from coevo.errors import ConfigError
    from coevo.inference.models import resolve_model_path

    overrides: dict[str, Any] = {}
    if args.config is not None:
        try:
            overrides.update(_dotted(read_config_file(args.config)))
        except ConfigError as exc:
            raise SystemExit(f"coevo bench: {exc}") from None
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"coevo bench: --set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = parse_value(value)
    one_base(argparse.Namespace(lora=args.lora_lanes, base=args.base), overrides)
    try:
        if args.base is not None:
            resolve_model_path(args.base, "--base", "policy.model")
        load_config(overrides=overrides)  # a wrong field is one line now, not after the first run started
    except ConfigError as exc:
        raise SystemExit(f"coevo bench: {exc}") from None
    return overrides


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config file's tree as dotted overrides (an empty section stays one: ``learner.lora = {}``)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_heldout(args: argparse.Namespace) -> None:
    from coevo.bench.heldout import EVAL_SEEDS

    if args.heldout_tasks < 1 or not 1 <= args.eval_seeds <= len(EVAL_SEEDS):
        raise SystemExit(f"coevo bench: --heldout-tasks must be >= 1 and --eval-seeds 1..{len(EVAL_SEEDS)}")
    if args.heldout_states is not None and args.heldout_states < 1:
        raise SystemExit("coevo bench: --heldout-states must be >= 1")


def _heldout_args() -> tuple[Arg, ...]:
    return (
        arg("--heldout-tasks", type=int, default=64, help="held-out tasks evaluated (from the held-out region)"),
        arg("--eval-seeds", type=int, default=5, help="evaluation seeds: each held-out task is played once per seed"),
        arg(
            "--heldout-measure",
            choices=("both", "success", "steps"),
            default="both",
            help="what a model's held-out evaluation measures: success (episodes the model plays), step "
            "agreement with the ceiling on its path (one forward pass a state: the cheaper), or both",
        ),
        arg(
            "--heldout-states",
            type=int,
            metavar="N",
            help="step agreement on at most N states of each path, drawn from the task and seed alone (the "
            "same for every model and habit; default: every state): long quests at a fraction of the passes",
        ),
    )


def _seeds_args() -> tuple[Arg, ...]:
    return (
        *_heldout_args(),
        arg(
            "--seeds",
            type=int,
            default=1,
            help="runs per configuration (run.seed = env.seed = 0..K-1); means and 95%% t intervals over them",
        ),
        arg(
            "--first-seed",
            type=int,
            default=0,
            metavar="S",
            help="run seeds S..S+K-1 instead (a later part of a seed range: coevo bench merge joins the parts)",
        ),
        arg(
            "--preset",
            default="default",
            choices=("default", "hard"),
            help="initial task pool; hard: the quick game's sparse-reward pool (family quickgame-hard)",
        ),
        arg(
            "--family",
            default="quickgame",
            help="a registered environment family: " + ", ".join(registered_families()) + " (tw-*: TextWorld's "
            "challenge games; arithmetic: word problems; a plugin's too)",
        ),
        arg(
            "--cache-dir",
            type=Path,
            help="models and compiled games (default: env.cache_dir, else ~/.cache/coevo or $COEVO_CACHE_DIR, "
            "as coevo run: a model converted or a game compiled once serves every later bench)",
        ),
        arg(
            "--budget",
            help="per run: steps:N (equal policy learner steps; --eval-every counts steps), "
            "minutes:M or seconds:S (default: --minutes)",
        ),
        arg("--max-minutes", type=float, default=30.0, help="wall-clock cap of a steps:N run"),
        *_model_args(),
        arg(
            "--judge-from",
            type=Path,
            metavar="DIR",
            help="the judge starts from this model directory (a "
            "judge trained beforehand, e.g. runs/<id>/checkpoints/judge/published/v…): frozen in the "
            "policy-only rung and with outcome-only reward, trained on elsewhere",
        ),
    )


def _model_args() -> tuple[Arg, ...]:
    """What every run of a bench takes as ``coevo run`` would (``_run_overrides`` reads them)."""
    return (
        arg("--config", type=Path, metavar="FILE", help="a config file every run starts from (as coevo run's)"),
        arg(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a config field of every run, by dotted name (repeatable; after --config; each run's seed and "
            "configuration are set over it)",
        ),
        arg(
            "--base",
            metavar="MODEL",
            help="policy and judge from one base: a model directory, a GGUF file or a shipped short name "
            "(smollm2-135m-instruct) [policy.model, judge.model]",
        ),
        arg(
            "--lora-lanes",
            action="store_true",
            help="every run trains LoRA adapters of the base [learner.lora] (bench learn --lora compares them with full)",
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


def cmd_bench_merge(args: argparse.Namespace) -> int:
    from coevo.bench.merge import merge_results

    parts = []
    for path in args.parts:
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"coevo bench merge: {path}: {exc}") from None
    try:
        merged = merge_results(parts)
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"coevo bench merge: {exc}") from None
    return _emit(merged, args.json, here=False)


def cmd_bench_parity(args: argparse.Namespace) -> int:
    from coevo.bench.parity import bench_parity

    return _emit(run_stoppable(bench_parity(args.vllm_python, rollouts=args.rollouts)), args.json)


def cmd_bench_precision(args: argparse.Namespace) -> int:
    from coevo.bench.precision import bench_precision
    from coevo.config import load_config
    from coevo.inference.clients import model_dir

    cfg = load_config(overrides=_run_overrides(args))
    base = model_dir(cfg, "policy")
    dtypes = tuple(dict.fromkeys(args.dtype or ("float32", "bfloat16")))
    bench = bench_precision(
        base, dtypes=dtypes, rollouts=args.rollouts, max_tokens=args.max_tokens, vllm_python=args.vllm_python
    )
    return _emit(run_stoppable(bench), args.json)


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
            delete_every_s=args.delete_every,
            partition_s=args.partition_s,
            inactive_s=args.inactive_s,
        )
    except ValueError as exc:
        raise SystemExit(f"coevo bench chaos: {exc}") from None
    result = run_stoppable(bench_chaos(plan, baseline=not args.no_baseline, workdir=args.workdir))
    _emit(result, args.json)
    return 0 if result["ok"] else 1


def cmd_bench_heldout(args: argparse.Namespace) -> int:
    from coevo.bench.heldout import EVAL_SEEDS, bench_heldout, heldout_table
    from coevo.config import load_config

    _check_heldout(args)
    overrides = {**_run_overrides(args), "env.family": args.family}
    if args.cache_dir is not None:
        overrides["env.cache_dir"] = str(args.cache_dir)
    cfg = load_config(overrides=overrides)
    result = run_stoppable(
        bench_heldout(
            cfg,
            EVAL_SEEDS[: args.eval_seeds],
            args.heldout_tasks,
            both_forms=not args.used_form_only,
            judge=args.judge_probe,
            measure=args.heldout_measure,
            states=args.heldout_states,
        )
    )
    _emit(result, args.json)
    print(heldout_table(result), end="", file=sys.stderr)
    return 0


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from coevo.bench.soak import bench_soak

    extra = [*(a for kv in args.set for a in ("--set", kv)), *args.run_args]
    return _emit(run_stoppable(bench_soak(args.minutes, args.every, extra)), args.json)


def cmd_bench_codec(args: argparse.Namespace) -> int:
    from coevo.bench.bus import bench_codec

    return _emit(bench_codec(), args.json)


def cmd_bench_async(args: argparse.Namespace) -> int:
    from coevo.bench.asynchrony import AsyncPlan, bench_async

    plan = AsyncPlan(minutes=args.minutes, seeds=args.seeds, loop=args.loop, overrides=_run_overrides(args))
    return _emit(run_stoppable(bench_async(plan, cache=args.cache_dir, workdir=args.workdir)), args.json)


def cmd_bench_hostile(args: argparse.Namespace) -> int:
    from coevo.bench.hostile import HostilePlan, bench_hostile

    overrides = {k.strip(): parse_value(v) for k, _, v in (kv.partition("=") for kv in args.set)}
    plan = HostilePlan(
        seconds=args.seconds,
        honest=args.honest,
        repeat=args.repeat,
        flood=args.flood,
        finishes=args.finishes,
        attack_limit_s=args.attack_limit,
        overrides=overrides,
    )
    result = run_stoppable(bench_hostile(plan, workdir=args.workdir))
    _emit(result, args.json)
    return 0 if result["ok"] else 1


def _emit(result: dict[str, Any], path: Path | None, *, here: bool = True) -> int:
    """Print ``result`` and write it to ``path``; ``here``: with the machine and commit it ran on
    (``coevo.bench.machine``; a merge keeps its parts' instead)."""
    if here:
        from coevo.bench.machine import machine

        result = {**result, "machine": machine()}
    text = json.dumps(result, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 0


BENCHES: tuple[Command, ...] = (
    Command(
        "bench heldout",
        "the held-out table of a base model: habits (random, constant labels, best position rule, verb rule), "
        "the scripted reader, the base greedy and sampled, raw and chat prompts, label mass; its success, "
        "and its step agreement with the ceiling on the ceiling's path",
        cmd_bench_heldout,
        args=(
            JSON_ARG,
            arg("--family", default="quickgame", help="a family with held-out tasks"),
            arg("--cache-dir", type=Path, help="models and compiled games (default: ~/.cache/coevo)"),
            arg(
                "--used-form-only",
                action="store_true",
                help="measure the base in the prompt form the policy uses only, not raw and chat both",
            ),
            arg(
                "--judge-probe",
                action="store_true",
                help="also the judge model's votes against the environment's step labels on random play of "
                "the held-out tasks, per way of asking: share of + votes, accuracy, AUC",
            ),
            *_heldout_args(),
            *_model_args(),
        ),
    ),
    Command(
        "bench bus",
        "typed bus vs plain nats-py: throughput and publish-to-ack latency",
        cmd_bench_bus,
        args=(
            JSON_ARG,
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
            JSON_ARG,
            arg("--seconds", type=float, default=5.0, help="per measurement"),
            arg("--families", default="quickgame,textworld,coding"),
        ),
    ),
    Command(
        "bench learn",
        "policy success over time, integrated vs outcome-only, over seeds",
        cmd_bench_learn,
        args=(
            JSON_ARG,
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
            JSON_ARG,
            arg("--minutes", type=float, default=5.0, help="budget per rung"),
            arg("--eval-every", type=float, default=30.0),
            arg("--episodes", type=int, default=64),
            arg(
                "--rungs",
                default="policy-only,policy+judge,full",
                help="comma-separated, bottom first (one rung: against its own base), of policy-only, policy+judge, "
                "full, full-unsaturated (the full loop without the saturated-slot rules), policy+judge-balanced "
                "(scorer.judge_balance), policy+judge-group (scorer.judge_baseline=group), policy+judge-balanced-group "
                "(both), policy-only-fresh and full-fresh (tasks.train_worlds=fresh: every train group in a world of its own)",
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
        "bench merge",
        "one bench learn or ladder result from parts that ran disjoint seeds (--first-seed) of one setting",
        cmd_bench_merge,
        args=(
            JSON_ARG,
            arg(
                "parts", type=Path, nargs="+", help="the parts' JSON results, the same command but --seeds/--first-seed"
            ),
        ),
    ),
    Command(
        "bench weights",
        "pause of a weight swap (local engine; vLLM with --vllm-python)",
        cmd_bench_weights,
        args=(
            JSON_ARG,
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
            JSON_ARG,
            arg("--vllm-python", required=True, help="python of a venv with vllm"),
            arg("--rollouts", type=int, default=40, help="fresh completions per setting"),
        ),
    ),
    Command(
        "bench precision",
        "fp32 against bf16 on one model: matmul peak, engine prefill and sampling, a LoRA learner step, an "
        "adapter version applied, and the mismatch KL of every sampler and learner dtype pair",
        cmd_bench_precision,
        args=(
            JSON_ARG,
            arg("--rollouts", type=int, default=32, help="free completions sampled per measurement"),
            arg("--max-tokens", type=int, default=16, help="tokens per completion"),
            arg("--vllm-python", help="python of a venv with vllm: measure vLLM's CPU build in each dtype too"),
            arg(
                "--dtype",
                action="append",
                choices=("float32", "bfloat16"),
                help="a compute dtype measured (repeat for several; default both): bf16 alone is slow where the "
                "CPU only emulates it (no AMX or AVX512-BF16)",
            ),
            *_model_args(),
        ),
    ),
    Command(
        "bench learner",
        "one learner step by model size: step, publish and checkpoint costs, memory, MFU",
        cmd_bench_learner,
        args=(
            JSON_ARG,
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
            JSON_ARG,
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
            arg("--delete-every", type=float, default=20.0, help="seconds between consumer deletions"),
            arg("--partition-s", type=float, default=25.0, help="how long a long partition cuts an agent off"),
            arg(
                "--inactive-s",
                type=float,
                default=10.0,
                help="bus.unshared_inactive_s under long_partition (shorter than --partition-s)",
            ),
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
            JSON_ARG,
            arg("--minutes", type=float, default=30.0),
            arg("--every", type=float, default=10.0, help="seconds between samples"),
            arg(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="config override for the run (repeatable), e.g. stream.retain_bytes=200000000",
            ),
            arg(
                "run_args",
                nargs="*",
                metavar="RUN_FLAG",
                help="after --, flags of the coevo run itself, e.g. -- --family tw-coin_collector --lora --base "
                "smollm2-135m-instruct",
            ),
        ),
    ),
    Command(
        "bench hostile",
        "an episode-key and an agent-key holder attack the policy endpoint of a real run while honest agents "
        "play: status codes per attack, whether the run stayed up, non-finite weights, steps lost, groups "
        "trained twice",
        cmd_bench_hostile,
        args=(
            JSON_ARG,
            arg("--seconds", type=float, default=45.0, help="honest play from the first attack on"),
            arg("--honest", type=int, default=2, help="honest agents playing at once"),
            arg("--repeat", type=int, default=1, help="each attack, per key holder"),
            arg("--flood", type=int, default=40, help="concurrent opens in a flood"),
            arg("--finishes", type=int, default=8, help="concurrent finishes of one episode"),
            arg("--attack-limit", type=float, default=150.0, help="seconds after which the attacks stop"),
            arg(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="config override for the run (repeatable), e.g. policy.max_concurrent_trajectories=64",
            ),
            arg("--workdir", type=Path, help="keep the run and its NATS store here (default: removed)"),
        ),
    ),
    Command("bench codec", "wire encodings of the event models: speed and size", cmd_bench_codec, args=(JSON_ARG,)),
    Command(
        "bench async",
        "sync (max_staleness 0) vs async loop, rollouts and learner pinned to separate cores",
        cmd_bench_async,
        args=(
            JSON_ARG,
            arg("--minutes", type=float, default=3.0, help="measured per run"),
            arg("--seeds", type=int, default=2, help="a sync and an async run per seed"),
            arg("--loop", default="policy+judge", choices=("policy-only", "policy+judge", "full")),
            *_model_args(),
            arg("--cache-dir", type=Path, help="models (default: one under the work directory, removed after)"),
            arg("--workdir", type=Path, help="keep the store, runs and agent logs here (default: removed)"),
        ),
    ),
)

COMMANDS: tuple[Command, ...] = (Command("bench", "benchmarks (write JSON)", metavar="BENCH"), *BENCHES)
