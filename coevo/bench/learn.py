"""Learning benchmarks: ``coevo bench learn`` and ``coevo bench ladder``.

``learn`` and ``ladder`` run the whole loop in process (embedded NATS, tiny local models) for a
wall-clock budget per configuration, and measure the policy with an evaluator that plays tasks with
the newest policy checkpoint every ``eval_every_s`` seconds, acting as the policy agent does (same
prompt, same mode, same temperature, the family's own environments).

Evidence over seeds: every configuration runs once per seed ``s`` (``0..K-1``, or ``S..S+K-1`` with
``--first-seed S``: ``coevo.bench.merge`` joins the parts of one seed range), with ``run.seed = s``
(the tiny models' initial weights and tokenizer, policy and judge sampling) and ``env.seed = s``
(the initial training pool). The held-out tasks are the same for every seed and configuration
(``HELDOUT_SEED``), so held-out success is comparable across runs. Runs go seed by seed, every
configuration of a seed before the next seed, so a drift in the machine's load hits every
configuration alike. Per configuration the result gives each metric's mean over seeds with a 95 %
Student-t interval (``seed_stats``), paired differences between configurations (the runs of one seed
share initial weights and pools), and every run's raw numbers.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import tempfile
import time
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from coevo.bench.heldout import EVAL_SEEDS, HELDOUT_TASKS, Matrix, bootstrap, greedy, habit_table, model_matrix, verdict
from coevo.bench.steps import (
    Paths,
    agreement_fields,
    agreement_table,
    ceiling_paths,
    habit_by_verb,
    habit_rows,
    model_agreement,
)
from coevo.config import CoevoConfig, ComputeDtype, EnvConfig, PolicyConfig, load_config, registered_families
from coevo.errors import ConfigError
from coevo.observe.progress import progress_bar, tracked
from coevo.schemas import TaskSpec

Result = dict[str, Any]
"""a JSON result (what the bench writes)"""
Overrides = dict[str, Any]
"""dotted config field -> value (``load_config``'s overrides)"""

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from coevo.agents.tasks import Slot
    from coevo.envs.base import Environment, Family
    from coevo.inference.engine import LocalEngine
    from coevo.observe.progress import Bar
    from coevo.training.lane import StepMetrics

HELDOUT_SEED = 7919
"""Seed of the held-out task set every run is evaluated on (``initial_tasks(0, n_heldout, HELDOUT_SEED)``)."""
TARGET = 0.8
"""The success rate whose first crossing on the training tasks is reported as ``seconds_to_0.8``."""
TRAIN_CURVE_SEED = 0
"""The sampling seed of every point of a run's train-success curve: each point plays the same episodes
with the same random draws, so a change between two points is the model's, not the draw's (with a
seed per point, the base itself scored 0.125 and 0.375 on one pool)."""
PRESETS = ("default", "hard")

# ---- budgets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """What every run of a benchmark gets: wall-clock seconds, or policy learner steps (``steps``).

    A step budget compares configurations per learner step, as the paper does: the run ends when the
    policy lane publishes version ``amount``, and that exact version is evaluated (copied when
    published, whatever the loop does after). ``cap_s`` bounds a step budget's wall clock (a
    configuration whose learner never steps, e.g. outcome-only reward on all-lost groups); a run
    stopped by it reports ``budget_reached = False``."""

    kind: Literal["seconds", "steps"]
    amount: float
    cap_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.amount <= 0 or (self.kind == "steps" and self.amount != int(self.amount)):
            raise ValueError(
                f"a {self.kind} budget must be a positive {'integer' if self.kind == 'steps' else 'number'}, "
                f"got {self.amount}"
            )

    @classmethod
    def parse(cls, text: str, *, cap_s: float = 1800.0) -> Budget:
        """``steps:N``, ``minutes:M`` or ``seconds:S`` (a bare number is minutes)."""
        kind, _, value = text.partition(":") if ":" in text else ("minutes", "", text)
        try:
            amount = float(value)
        except ValueError:
            raise ValueError(f"budget {text!r}: expected steps:N, minutes:M or seconds:S") from None
        if kind == "minutes":
            return cls("seconds", amount * 60, cap_s)
        if kind == "steps":
            return cls("steps", amount, cap_s)
        if kind == "seconds":
            return cls("seconds", amount, cap_s)
        raise ValueError(f"budget {text!r}: unknown unit {kind!r} (steps, minutes or seconds)")

    @property
    def steps(self) -> int | None:
        return int(self.amount) if self.kind == "steps" else None

    @property
    def seconds(self) -> float:
        """The wall clock the run may take: the budget itself, or a step budget's cap."""
        return self.amount if self.kind == "seconds" else self.cap_s

    def milestones(self, every: float) -> list[int]:
        """A step budget's evaluation points: every ``every`` steps, and the budget itself (pure)."""
        n, k = int(self.amount), max(1, int(every))
        return sorted({*range(k, n, k), n})

    def describe(self) -> str:
        return f"{int(self.amount)} policy steps" if self.kind == "steps" else f"{self.amount / 60:g} min"


# ---- statistics over seeds ---------------------------------------------------------------------

_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
"""Student t quantiles t_{0.975, df} for df = 1..30."""


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (a table to 30, then the
    Cornish-Fisher expansion around the normal quantile, within 1e-3 of the exact value)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def seed_stats(values: list[float | None]) -> Result:
    """Mean and 95 % Student-t interval of one metric over seeds; ``None`` values (a metric a run does not
    have, e.g. judge accuracy without a judge) are left out and ``n`` counts the rest. The half-width
    is ``t_{0.975, n-1} · sd / √n`` with the sample sd (n - 1); one value gives no interval (None)."""
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "half_width": None, "low": None, "high": None}
    mean = statistics.fmean(xs)
    if n == 1:
        return {"n": 1, "mean": round(mean, 6), "sd": None, "half_width": None, "low": None, "high": None}
    sd = statistics.stdev(xs)
    half = t975(n - 1) * sd / math.sqrt(n)
    return {
        "n": n,
        "mean": round(mean, 6),
        "sd": round(sd, 6),
        "half_width": round(half, 6),
        "low": round(mean - half, 6),
        "high": round(mean + half, 6),
    }


def paired_stats(a: list[float | None], b: list[float | None]) -> Result:
    """``seed_stats`` of the per-seed differences a - b (seeds where either is None are left out)."""
    return seed_stats([x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None])


# ---- the evaluator -----------------------------------------------------------------------------


async def _play(
    engine: LocalEngine, family: Family, env: Environment, task: TaskSpec, policy: PolicyConfig, key: str
) -> bool:
    """One episode of ``task``, acting as the policy agent does (its prompt form, the candidates shown in
    the order episode ``key`` draws); True iff it is won."""
    from coevo.acting import choose, step_order
    from coevo.inference.chat import ChatTokens, Conversation, PromptForm

    conversation = Conversation(ChatTokens(engine.tokenizer)) if policy.mode == "chat" else None
    form = PromptForm.of(engine, policy.prompt_format)
    obs = await env.reset(task)
    for k in range(family.max_steps_cap):
        cands = list(obs.candidates)
        order = step_order(policy, key, k, len(cands))
        c, index, _ = await choose(engine, policy, obs, cands, conversation, order=order, form=form)
        action = str(c.text) if not cands else (cands[index] if index is not None else "")
        r = await env.step(action)
        if r.done:
            return r.outcome == "won"
        obs = r.observation
    return False


async def play_episodes(
    model_dir: Path,
    tasks: list[TaskSpec],
    episodes: int,
    seed: int = 0,
    *,
    family: Family | None = None,
    policy: PolicyConfig | None = None,
    concurrency: int = 32,
    dtype: ComputeDtype = "auto",
) -> list[bool]:
    """Whether each of ``episodes`` episodes of the policy at ``model_dir`` was won, sampling as the
    policy agent does (``policy``: its mode and temperature; default config when None), served in
    ``dtype`` (``learner.dtype``). Episode ``i`` plays ``tasks[i % len(tasks)]``, so every task gets its
    share; ``family`` (default: built from the tasks' family name) makes the environments."""
    from coevo.envs import make_family
    from coevo.inference.engine import LocalEngine

    family = family or make_family(EnvConfig(family=tasks[0].family))
    policy = policy or PolicyConfig()
    permits = asyncio.Semaphore(concurrency)  # environments open at once (TextWorld: one emulator each)
    async with LocalEngine(model_dir, seed=seed, dtype=dtype) as engine:

        async def one(i: int) -> bool:
            task = tasks[i % len(tasks)]
            async with permits:
                env = family.make_env()
                try:
                    return await _play(engine, family, env, task, policy, f"{task.task_id}/{seed}/{i}")
                finally:
                    await env.close()

        return list(await asyncio.gather(*(one(i) for i in range(episodes))))


@dataclass
class EvalSet:
    """What the evaluator plays: the run's initial training tasks and the fixed held-out tasks, these
    once per evaluation seed (``coevo.bench.heldout``: the same tasks and shuffles every habit plays)."""

    family: Family
    train: list[TaskSpec]
    heldout: list[TaskSpec]
    policy: PolicyConfig
    episodes: int
    seeds: tuple[int, ...] = EVAL_SEEDS
    dtype: ComputeDtype = "auto"
    """what the evaluated models are served in (the run's ``learner.dtype``)"""
    paths: Paths | None = None
    """the ceiling's states on each held-out task × seed (``coevo.bench.steps``); None where the family has
    no ceiling or the policy does not choose among candidates"""

    async def _won(self, model: Path, tasks: list[TaskSpec], seed: int) -> list[bool]:
        return await play_episodes(
            model, tasks, self.episodes, seed, family=self.family, policy=self.policy, dtype=self.dtype
        )

    async def success(self, model: Path, split: Literal["train", "heldout"], seed: int) -> float | None:
        tasks = self.train if split == "train" else self.heldout
        if not tasks:
            return None
        won = await self._won(model, tasks, seed)
        return sum(won) / len(won)

    async def heldout_wins(self, model: Path, policy: PolicyConfig | None = None) -> Matrix:
        """``model``'s held-out matrix (task × evaluation seed), acting as ``policy`` (default: the run's)."""
        return await model_matrix(model, self.family, self.heldout, self.seeds, policy or self.policy, self.dtype)

    async def heldout_eval(self, final: Path, base: Path, success: bool = True) -> tuple[Matrix, Matrix, Result]:
        """A run's held-out measures, trained (``final``) against ``base``: the success matrices (trained,
        base sampled; none without ``success``) and the run's fields (``heldout_fields``, ``step_fields``)."""
        fields = await self.step_fields(final, base)
        if not success:
            return [], [], fields
        won, won0 = await self.heldout_wins(final), await self.heldout_wins(base)
        greedy0 = await self.heldout_wins(base, greedy(self.policy))
        return won, won0, heldout_fields(self, won, won0, greedy0) | fields

    async def step_fields(self, final: Path, base: Path) -> Result:
        """The run's held-out step agreement, trained against its base (``coevo.bench.steps``); {} without paths."""
        if self.paths is None:
            return {}
        trained = await model_agreement(final, self.paths, self.policy, self.dtype)
        return agreement_fields(self.paths, trained, await model_agreement(base, self.paths, self.policy, self.dtype))


def mean_of(won: Matrix) -> float | None:
    return round(sum(map(sum, won)) / (len(won) * len(won[0])), 6) if won and won[0] else None


def by_task(tasks: list[TaskSpec], won: Matrix) -> dict[str, float]:
    """Each task's success over the evaluation seeds (the mean alone hides whether a gain is many tasks a
    little better or a few flipping from never to always won)."""
    return {t.task_id: round(sum(row) / len(row), 6) for t, row in zip(tasks, won, strict=True)}


Measure = Literal["both", "success", "steps"]


@dataclass(frozen=True)
class Protocol:
    """How many held-out tasks a bench evaluates on, each once per how many evaluation seeds, and what it
    measures there: success (episodes played by the model), step agreement (``coevo.bench.steps``: one
    forward pass per state of the ceiling's path; ``states``: at most that many states of each path) or
    both."""

    tasks: int = HELDOUT_TASKS
    seeds: int = len(EVAL_SEEDS)
    measure: Measure = "both"
    states: int | None = None


async def eval_set(
    cfg: CoevoConfig,
    episodes: int,
    heldout: int = HELDOUT_TASKS,
    seeds: int = len(EVAL_SEEDS),
    measure: Measure = "both",
    states: int | None = None,
) -> EvalSet:
    """The evaluation tasks of a run: its initial train tasks, and ``heldout`` held-out tasks played once per
    each of ``seeds`` evaluation seeds (their step agreement on at most ``states`` states of each path).
    Prechecks them first, which compiles TextWorld games before the clock starts; a task that fails its
    precheck is not evaluated."""
    from coevo.envs import make_family

    family = make_family(cfg.env)
    pool = [(t, (await family.precheck(t)).ok) for t in family.initial_tasks(cfg.env.n_train, 0, cfg.env.seed)]
    held = [
        t for t in (family.initial_tasks(0, heldout, HELDOUT_SEED) if heldout else []) if (await family.precheck(t)).ok
    ]
    with_paths = bool(held) and measure != "success" and family.has_ceiling and cfg.policy.mode == "choice"
    if measure == "steps" and held and not with_paths:
        why = "policy.mode is not choice" if family.has_ceiling else f"{family.name} has no reader or walkthrough"
        raise ConfigError(f"held-out step agreement cannot be measured: {why}", field="policy.mode")
    return EvalSet(
        family,
        [t for t, ok in pool if ok and t.split == "train"],
        held,
        cfg.policy,
        episodes,
        EVAL_SEEDS[:seeds],
        cfg.learner.dtype,
        await ceiling_paths(family, held, EVAL_SEEDS[:seeds], cfg.policy, states) if with_paths else None,
    )


# ---- one run -------------------------------------------------------------------------------------


def pool_snapshot(slots: Iterable[Slot]) -> Result:
    """What the loop trains on at this moment, beside what the evaluator measures (pure).

    The evaluator plays the run's *initial* train tasks; the rewriter replaces a slot's active task
    with a harder or easier version, so a falling success on the initial tasks can mean the policy
    got worse, or that it now trains on other tasks. ``pool_accuracy``: the mean accuracy of the
    newest scored group of each train slot's active task (None before any); ``slots_rewritten``:
    train slots whose active task is no longer the initial one."""
    train = [s for s in slots if s.split == "train"]
    measured = [s.last_accuracy for s in train if s.last_accuracy is not None]
    return {
        "pool_accuracy": round(sum(measured) / len(measured), 4) if measured else None,
        "slots_rewritten": sum(bool(s.history) for s in train),
    }


async def _curve(
    ev: EvalSet,
    ckpts: Path,
    base: Path,
    seconds: float,
    eval_every_s: float,
    stop: asyncio.Event,
    bar: Bar,
    pool: Callable[[], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Train success of the newest checkpoint every ``eval_every_s`` until ``seconds`` (with the
    ``pool`` snapshot taken as the evaluation starts); then sets ``stop``."""
    from coevo.runtime.aio import wait_event
    from coevo.training.lane import latest_checkpoint

    curve: list[dict[str, Any]] = []
    t0 = time.monotonic()
    while not stop.is_set():
        ckpt = latest_checkpoint(ckpts) or base
        t = time.monotonic() - t0
        training_on = pool()
        success = await ev.success(ckpt, "train", seed=TRAIN_CURVE_SEED)
        version = int(ckpt.name[1:]) if ckpt != base else 0
        curve.append({"seconds": round(t, 1), "success": success or 0.0, "policy_version": version, **training_on})
        bar.update(completed=min(t, seconds))
        if t >= seconds:
            break
        # the last evaluation falls on the budget, not up to eval_every_s past it: equal budgets
        await wait_event(stop, min(eval_every_s, max(0.0, seconds - (time.monotonic() - t0))))
    stop.set()
    return curve


class StepWatch:
    """A step budget's milestones, taken as the learner reaches them (its ``on_step`` callback).

    When the policy lane steps to a milestone version, that version's publication is copied out of
    the run (published directories are pruned as newer ones arrive) and queued for evaluation; at the
    last milestone ``stop`` is set, so the loop ends at the budget while the copy is evaluated. A run
    the wall-clock cap ends first is evaluated at its newest version, not at its last milestone."""

    def __init__(self, published: Path, keep: Path, milestones: list[int], stop: asyncio.Event) -> None:
        self.published, self.keep, self.pending, self.stop = published, keep, list(milestones), stop
        self.ready: asyncio.Queue[tuple[int, Path, float]] = asyncio.Queue()
        self.t0 = time.monotonic()
        self.latest = self.queued = 0
        """the newest policy version stepped to; the newest queued for evaluation"""

    def on_step(self, role: str, metrics: StepMetrics) -> None:
        if role != "policy":
            return
        self.latest = max(self.latest, metrics.version)
        if not self.pending or metrics.version < self.pending[0]:
            return
        while self.pending and self.pending[0] <= metrics.version:
            self.pending.pop(0)
        self.queue(metrics.version)
        if not self.pending:
            self.stop.set()

    def queue(self, version: int) -> None:
        self.ready.put_nowait((version, self.copy(version), time.monotonic() - self.t0))
        self.queued = version

    def copy(self, version: int) -> Path:
        """The publication of ``version``, copied under ``keep`` (read under its lease: never half pruned)."""
        import shutil

        from coevo.weights import lease

        found = sorted(self.published.glob(f"v{version:06d}-*"))
        if not found:
            raise FileNotFoundError(f"no publication of policy version {version} under {self.published}")
        dst = self.keep / found[0].name
        with lease.reading(found[0]):
            shutil.copytree(found[0], dst, ignore=shutil.ignore_patterns(".lease*"))
        return dst

    async def next(self, cap_s: float) -> tuple[int, Path, float] | None:
        """The next milestone copied, or None once ``stop`` is set with none left (or ``cap_s`` passed)."""
        while True:
            if not self.ready.empty():
                return self.ready.get_nowait()
            if self.stop.is_set():
                return None
            getter = asyncio.ensure_future(self.ready.get())
            stopped = asyncio.ensure_future(self.stop.wait())
            left = max(0.0, cap_s - (time.monotonic() - self.t0))
            done, _ = await asyncio.wait({getter, stopped}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if getter in done:
                return getter.result()
            getter.cancel()
            if not done:  # the cap: the budget is not reached; the run's newest version is its last point
                self.stop.set()
                if self.latest > self.queued:
                    self.queue(self.latest)


async def _step_curve(
    ev: EvalSet,
    base: Path,
    watch: StepWatch,
    budget: Budget,
    eval_every: float,
    bar: Bar,
    pool: Callable[[], dict[str, Any]],
) -> tuple[list[dict[str, Any]], Path]:
    """Train success at step 0 (the base) and at each milestone of a step budget; the last model evaluated."""

    async def point(model: Path, version: int, t: float) -> Result:
        training_on = pool()
        success = await ev.success(model, "train", seed=TRAIN_CURVE_SEED)
        bar.update(completed=version)
        return {
            "step": version,
            "seconds": round(t, 1),
            "success": success or 0.0,
            "policy_version": version,
            **training_on,
        }

    curve: list[dict[str, Any]] = []
    curve.append(await point(base, 0, 0.0))
    last = base
    while (got := await watch.next(budget.cap_s)) is not None:
        version, last, t = got
        curve.append(await point(last, version, t))
    return curve, last


async def run_budget(
    cfg: CoevoConfig, budget: Budget, *, eval_every: float, episodes: int, protocol: Protocol | None = None
) -> Result:
    """Run the loop for ``budget``; evaluate on the run's initial train tasks during the run (every
    ``eval_every`` seconds, or steps under a step budget), and on the fixed held-out tasks before (base
    model, sampled and greedy) and after (the newest checkpoint; under a step budget the budget's own
    version), each held-out task once per evaluation seed."""
    from coevo.agents.tasks import TasksAgent
    from coevo.inference.clients import model_dir
    from coevo.loop import build_agents, summarize
    from coevo.runtime.agent import run_agents
    from coevo.runtime.app import open_runtime
    from coevo.training.lane import latest_checkpoint

    if budget.kind == "steps" and cfg.learner.publish_every != 1:
        raise ConfigError(
            "a step budget evaluates every milestone version: learner.publish_every must be 1",
            field="learner.publish_every",
        )
    protocol = protocol or Protocol()
    ev = await eval_set(cfg, episodes, *astuple(protocol))
    base = await asyncio.to_thread(model_dir, cfg, "policy")
    await asyncio.to_thread(model_dir, cfg, "judge")
    async with open_runtime(cfg, name="coevo-bench") as rt:
        ckpts = rt.run_dir / "checkpoints" / "policy"
        stop = asyncio.Event()
        watch = (
            StepWatch(ckpts / "published", rt.run_dir / "evaluated", budget.milestones(eval_every), stop)
            if budget.kind == "steps"
            else None
        )
        agents = build_agents(rt.bus, cfg, on_step=watch.on_step if watch else None)
        tasks = next((a for a in agents if isinstance(a, TasksAgent)), None)

        def pool() -> Result:
            return pool_snapshot(tasks.slots.values()) if tasks is not None else {}

        t0 = time.monotonic()
        label = f"{cfg.env.family}, {cfg.loop}, {cfg.scorer.reward} reward, seed {cfg.run.seed}"
        with progress_bar(label, budget.amount, unit="steps" if budget.kind == "steps" else "s") as bar:
            if watch is None:
                _, curve = await asyncio.gather(
                    run_agents(agents, handle_signals=False, until=stop),
                    _curve(ev, ckpts, base, budget.seconds, eval_every, stop, bar, pool),
                )
                final = latest_checkpoint(ckpts) or base
            else:
                _, (curve, final) = await asyncio.gather(
                    run_agents(agents, handle_signals=False, until=stop),
                    _step_curve(ev, base, watch, budget, eval_every, bar, pool),
                )
        elapsed = time.monotonic() - t0
        won, won0, fields = await ev.heldout_eval(final, base, protocol.measure != "steps")
        summary = await summarize(rt.bus, 0.0, elapsed)
    result = run_result(cfg, budget, curve, summary, ev, mean_of(won0), mean_of(won), elapsed)
    return result | pool() | fields


def heldout_fields(ev: EvalSet, won: Matrix, won0: Matrix, greedy0: Matrix) -> Result:
    """A run's held-out wins per task and evaluation seed: trained, base sampled, base greedy."""
    final, initial = by_task(ev.heldout, won), by_task(ev.heldout, won0)
    return {
        "heldout_by_task": {t: {"initial": initial[t], "final": final[t]} for t in final},
        "heldout_wins": won,
        "heldout_wins_initial": won0,
        "heldout_wins_base_greedy": greedy0,
    }


POLICY_HEALTH = (
    "policy_kl_rejected",
    "policy_mismatch_kl_max",
    "policy_mismatch_kl_current_max",
    "policy_step_kl_max",
    "policy_entropy_start",
    "policy_entropy",
    "policy_entropy_min",
    "policy_step_gap_max_s",
)
"""The policy lane's health in a run's summary: carried into each run's result and summarised per configuration."""

SUMMARY_KEYS = (
    "judge_process_accuracy_start",
    "judge_process_accuracy",
    "judge_outcome_accuracy",
    "judge_process_accuracy_heldout",
    "judge_outcome_accuracy_heldout",
    "judge_vote_positive_start",
    "judge_vote_positive",
    "judge_steps_silent_start",
    "judge_steps_silent",
    "steps_labelled_good",
    "steps_without_votes",
    "rewrites_accepted",
    "learner_steps",
    "judge_learner_steps",
    *POLICY_HEALTH,
    "heldout_agreement_rounds",  # the run's own evaluation rounds (tasks.eval_every), not the bench's
)
"""What a run's result carries over from its ``summary.json`` as it is."""


def run_result(
    cfg: CoevoConfig,
    budget: Budget,
    curve: list[dict[str, Any]],
    summary: dict[str, Any],
    ev: EvalSet,
    held0: float | None,
    held: float | None,
    elapsed: float,
) -> Result:
    """One run's numbers from its curve and summary (pure)."""
    hit = next((p for p in curve if p["success"] >= TARGET), None)
    reached = hit["seconds"] if hit else None
    steps = curve[-1]["policy_version"]
    return {
        "seed": cfg.run.seed,
        "budget": budget.describe(),
        "budget_reached": (steps >= budget.amount if budget.kind == "steps" else True),
        "policy_steps": steps,
        "train_success_initial": curve[0]["success"],
        "train_success": curve[-1]["success"],
        "best_train_success": max(p["success"] for p in curve),
        "heldout_success_initial": held0,
        "heldout_success": held,
        "heldout_gain": None if held is None or held0 is None else round(held - held0, 6),
        "seconds_to_0.8": reached,
        "steps_to_0.8": hit["policy_version"] if hit else None,
        "seconds_to_0.8_or_budget": reached if reached is not None else round(elapsed, 1),
        "seconds": round(elapsed, 1),
        "train_tasks": len(ev.train),
        "heldout_tasks": len(ev.heldout),
        **{k: summary[k] for k in SUMMARY_KEYS},
        "trajectories_per_second": round(summary["events"].get("trajectory.completed", 0) / max(elapsed, 1e-9), 2),
        "curve": curve,
    }


def bench_config(tmp: Path, overrides: Overrides) -> CoevoConfig:
    base = {"run.runs_dir": str(tmp / "runs"), "log.console": "off", "agent.heartbeat_s": 10.0, "run.minutes": 0}
    return load_config(overrides={**base, **overrides})


# ---- configurations × seeds ----------------------------------------------------------------------

METRICS = (
    "train_success",
    "heldout_success",
    "heldout_gain",
    "heldout_step_agreement",
    "heldout_step_agreement_initial",
    "judge_process_accuracy",
    "judge_outcome_accuracy",
    "seconds_to_0.8",
    "seconds_to_0.8_or_budget",
    "train_success_initial",
    "heldout_success_initial",
    "best_train_success",
    "judge_process_accuracy_heldout",
    "judge_outcome_accuracy_heldout",
    "learner_steps",
    "judge_learner_steps",
    "judge_process_accuracy_start",
    "judge_vote_positive",
    "judge_steps_silent",
    "steps_without_votes",
    "rewrites_accepted",
    "trajectories_per_second",
    "pool_accuracy",
    "slots_rewritten",
    "policy_steps",
    "seconds",
    "steps_to_0.8",
    *POLICY_HEALTH,
)
"""Summarised per configuration. ``seconds_to_0.8``: over the runs that reached 0.8 train success
(``reached_0.8`` counts them); ``seconds_to_0.8_or_budget``: every run, one that never reached it
counted as its whole run (the budget, a lower bound on its time); ``steps_to_0.8``: the policy version of
that evaluation. ``seconds``: the run's wall clock (under a step budget, what the steps took)."""
PAIRED = (
    "train_success",
    "heldout_success",
    "heldout_gain",
    "heldout_step_agreement",
    "best_train_success",
    "judge_process_accuracy",
    "judge_outcome_accuracy",
    "seconds_to_0.8_or_budget",
    "seconds",
)


def summarize_configs(runs: dict[str, list[dict[str, Any]]]) -> Result:
    """Per configuration: ``summarize_runs`` and the runs as given (a result's ``configs``)."""
    return {c: {**summarize_runs(rs), "runs": rs} for c, rs in runs.items()}


def summarize_runs(runs: list[dict[str, Any]]) -> Result:
    """Per-metric ``seed_stats`` of one configuration's runs (one per seed)."""
    reached = sum(r["seconds_to_0.8"] is not None for r in runs)
    return {
        "reached_0.8": f"{reached}/{len(runs)}",
        "summary": {m: seed_stats([r.get(m) for r in runs]) for m in METRICS},
    }


def family_of(family: str, preset: str) -> str:
    """The family a ``--family``/``--preset`` pair names (the hard preset is its own family)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    if preset == "default":
        return family
    if f"{family}-{preset}" not in registered_families():
        raise ValueError(f"family {family!r} has no {preset} preset (the quick game has: quickgame-hard)")
    return f"{family}-{preset}"


def seed_list(seeds: int | Sequence[int]) -> list[int]:
    """The seeds a bench runs: ``K`` means ``0..K-1``; a sequence is taken as given (``--first-seed``
    runs a later part of a seed range, which ``coevo bench merge`` joins to the earlier part)."""
    chosen = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not chosen:
        raise ValueError("seeds must be >= 1, got none")
    if len(set(chosen)) < len(chosen) or min(chosen) < 0:
        raise ValueError(f"seeds must be distinct and >= 0, got {chosen}")
    return chosen


def plan_runs(configs: dict[str, Overrides], seeds: int | Sequence[int]) -> list[tuple[int, str, dict[str, Any]]]:
    """The runs of ``configs`` × ``seeds`` in the order they run, as (seed, configuration, overrides):
    seed-major (every configuration of seed ``s`` before the next seed, in the order of ``configs``),
    each run's overrides its configuration's with ``run.seed = env.seed = s``."""
    return [(s, c, {**configs[c], "run.seed": s, "env.seed": s}) for s in seed_list(seeds) for c in configs]


def aggregate_seeds(
    runs: dict[str, list[dict[str, Any]]],
    *,
    seeds: int | Sequence[int],
    family: str,
    preset: str,
    budget: Budget,
    episodes: int,
    overrides: Overrides | None = None,
) -> Result:
    """``run_seeds``' result from its runs, with no I/O: ``runs[c][i]`` is configuration ``c``'s run with
    the ``i``-th of ``seeds``, so every configuration has exactly those seeds in that order (what
    ``paired`` pairs by position; a ValueError otherwise). Per configuration: ``summarize_runs`` and the
    runs as given; ``overrides``, the config fields every run had, are recorded as they were given."""
    chosen = seed_list(seeds)
    for c, rs in runs.items():
        if [r["seed"] for r in rs] != chosen:
            raise ValueError(f"configuration {c!r} has runs for seeds {[r['seed'] for r in rs]}, not {chosen} in order")
    return {
        "family": family,
        "preset": preset,
        "budget": budget.describe(),
        "budget_kind": budget.kind,
        "minutes_per_run": round(budget.amount / 60, 3) if budget.kind == "seconds" else None,
        "steps_per_run": budget.steps,
        "seeds": chosen,
        "episodes_per_evaluation": episodes,
        "overrides": dict(overrides or {}),
        "heldout_seed": HELDOUT_SEED,
        "interval": "95 % Student t over seeds: mean ± t(0.975, n-1)·sd/√n (sample sd); none for n = 1",
        "seconds_to_0.8": "first evaluation with train success >= 0.8; seconds_to_0.8 averages the runs that "
        "reached it (reached_0.8 counts them), seconds_to_0.8_or_budget counts the others "
        "as the budget",
        "configs": summarize_configs(runs),
    }


async def run_seeds(
    configs: dict[str, Overrides],
    *,
    seeds: int | Sequence[int],
    budget: Budget,
    eval_every: float,
    episodes: int,
    family: str,
    preset: str,
    cache_dir: Path | None,
    overrides: Overrides | None = None,
    protocol: Protocol | None = None,
    progress: Path | None = None,
) -> Result:
    """Every configuration once per seed (``plan_runs``' seed-major order) and the statistics over seeds
    (``aggregate_seeds``), with the held-out protocol's table (``heldout_protocol``: the habits on the
    same tasks and evaluation seeds, the base, each configuration's interval and verdict);
    ``overrides`` (config fields) apply to every run. ``progress``: a JSON file rewritten after every
    run with the runs finished so far (a long bench stopped or killed keeps them)."""
    plan = plan_runs(configs, seeds)
    name = family_of(family, preset)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        cache = {"env.cache_dir": str(cache_dir)} if cache_dir is not None else {}  # else the config's, as coevo run
        common = {**cache, "env.family": name, **(overrides or {})}
        for s, c, run in tracked(
            plan, f"{len(configs)} configurations × {len(plan) // len(configs)} seeds", unit="runs"
        ):
            cfg = bench_config(Path(tmp) / f"{c}-s{s}", {**common, **run})
            runs[c].append(await run_budget(cfg, budget, eval_every=eval_every, episodes=episodes, protocol=protocol))
            if progress is not None:
                _write_progress(progress, runs)
        protocol = protocol or Protocol()
        ev = await eval_set(cfg, 0, *astuple(protocol))
        success = protocol.measure != "steps"
        habits = await habit_table(ev.family, ev.heldout, ev.seeds, cfg.policy) if success else {}
    out = aggregate_seeds(
        runs, seeds=seeds, family=name, preset=preset, budget=budget, episodes=episodes, overrides=overrides
    )
    if success:
        out["heldout_protocol"] = heldout_protocol(runs, habits)
    if ev.paths is not None and all("heldout_steps" in r for rs in runs.values() for r in rs):
        out["heldout_steps"] = agreement_table(runs, habit_rows(ev.paths), habit_by_verb(ev.paths))
        out["heldout_states_per_path"] = protocol.states  # None: every state
    return out


def _write_progress(path: Path, runs: dict[str, list[dict[str, Any]]]) -> None:
    """``runs`` so far into ``path``, whole or not at all (written beside it, then renamed), with the
    machine they ran on."""
    from coevo.bench.machine import machine

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"finished_runs": runs, "machine": machine()}, indent=1, default=str) + "\n")
    tmp.replace(path)


def heldout_protocol(runs: dict[str, list[dict[str, Any]]], habits: dict[str, Any]) -> Result:
    """The held-out table of ``run_seeds``' runs (pure): every habit's row, the base sampled and greedy
    (over every run's base), each configuration's final success with its verdict (``verdict``: a gain
    only where the interval clears the base's greedy score and every habit's), and the paired
    differences of every configuration against the first, all by bootstrap over runs, tasks and seeds."""
    first, *rest = runs
    arms = {c: np.asarray([r["heldout_wins"] for r in rs]) for c, rs in runs.items()}
    rows = {
        **habits,
        "base greedy": bootstrap([r["heldout_wins_base_greedy"] for r in runs[first]]),
        "base sampled": bootstrap([r["heldout_wins_initial"] for r in runs[first]]),
    }
    trained = {c: bootstrap(a) for c, a in arms.items()}
    return {
        "rows": rows,
        "trained": {c: {**t, "verdict": verdict(t, rows)} for c, t in trained.items()},
        "paired": {f"{c} - {first}": bootstrap(arms[c] - arms[first]) for c in rest},
        "interval": "95 % bootstrap percentile over runs, tasks and evaluation seeds together (paired: same ones)",
    }


def paired(out: dict[str, Any], a: str, b: str) -> Result:
    """Per-seed differences ``a - b`` of the headline metrics (the runs of a seed share weights and pool)."""
    ra, rb = out["configs"][a]["runs"], out["configs"][b]["runs"]
    return {m: paired_stats([r.get(m) for r in ra], [r.get(m) for r in rb]) for m in PAIRED}


def _mean(out: dict[str, Any], config: str, metric: str) -> Any:
    return out["configs"][config]["summary"][metric]["mean"]


LEARN: dict[str, Overrides] = {"integrated": {}, "outcome_only": {"scorer.reward": "outcome-only"}}
"""``bench learn``'s configurations: integrated reward, then outcome-only reward."""
RUNGS: dict[str, Overrides] = {
    "policy-only": {"loop": "policy-only"},
    "policy+judge": {"loop": "policy+judge"},
    "full": {"loop": "full"},
    "full-unsaturated": {"loop": "full", "tasks.saturated_after": 0},
    "policy+judge-balanced": {"loop": "policy+judge", "scorer.judge_balance": True},
    "policy+judge-group": {"loop": "policy+judge", "scorer.judge_baseline": "group"},
    "policy+judge-balanced-group": {
        "loop": "policy+judge",
        "scorer.judge_balance": True,
        "scorer.judge_baseline": "group",
    },
    "policy-only-fresh": {"loop": "policy-only", "tasks.train_worlds": "fresh"},
    "full-fresh": {"loop": "full", "tasks.train_worlds": "fresh"},
}
"""The rungs ``bench ladder --rungs`` chooses from: ``full-unsaturated`` is the full loop without the saturated-slot
rules (``coevo.algorithm.saturation``), the ablation of that rule; ``policy+judge-balanced`` trains the judge with
won and lost trajectories weighed alike (``scorer.judge_balance``); ``policy+judge-group`` standardises the judge's
consistency rewards over the group's votes, so that steps whose votes agree are heard (``scorer.judge_baseline``);
``policy+judge-balanced-group`` both (an outcome-blind vote gets no net push, and a unanimous step is still heard);
``policy-only-fresh`` and ``full-fresh`` play every train group in a world of its own (``tasks.train_worlds``), so no
rung can win a slot by memorising its world."""
LADDER: dict[str, Overrides] = {k: RUNGS[k] for k in ("policy-only", "policy+judge", "full")}
"""``bench ladder``'s rungs, bottom first: policy-only, + judge training, + environment adaptation."""


def rungs_named(names: str) -> dict[str, Overrides]:
    """The rungs of a comma-separated list, in its order (the first is the one the others pair against;
    a single rung pairs only against its own base, ``heldout_gain``)."""
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in RUNGS]
    if unknown or not chosen or len(set(chosen)) < len(chosen):
        raise ValueError(f"--rungs {names!r}: one or more distinct rungs of {', '.join(RUNGS)}")
    return {n: RUNGS[n] for n in chosen}


RUNG_KEYS = (
    "train_success",
    "heldout_success",
    "heldout_gain",
    "heldout_step_agreement",
    "train_success_initial",
    "heldout_success_initial",
    "judge_process_accuracy",
    "judge_outcome_accuracy",
    "judge_process_accuracy_heldout",
    "judge_outcome_accuracy_heldout",
    "rewrites_accepted",
    "learner_steps",
)
"""The metrics whose means over seeds ``ladder_result`` gives per rung (``coevo report`` plots these)."""


def learn_result(out: dict[str, Any], configs: dict[str, Overrides] = LEARN) -> Result:
    """``bench learn``'s result from ``run_seeds``' ``out`` over ``configs`` (a new dict; ``out`` is left as
    it is): adds the paired differences first - second configuration, the headline means over seeds,
    every run's curve (``"<config> s<seed>"``) and the target."""
    a, b = configs
    return {
        **out,
        "paired": {f"{a} - {b}": paired(out, a, b)},
        "headline": {
            f"{c}.{m}": _mean(out, c, m)
            for c in configs
            for m in ("train_success", "heldout_success", "seconds_to_0.8")
        },
        "curves": {f"{c} s{r['seed']}": r["curve"] for c in configs for r in out["configs"][c]["runs"]},
        "target": "final train success >= 0.8 within 10 minutes",
    }


def ladder_result(out: dict[str, Any]) -> Result:
    """``bench ladder``'s result from ``run_seeds``' ``out``, its configurations the rungs bottom first (a new
    dict; ``out`` is left as it is): adds each higher rung's paired differences against the bottom one, then
    against the rung just below it (what that rung adds), and per rung, in ladder order, the means over seeds
    of ``RUNG_KEYS`` and the first seed's curve."""
    bottom, *higher = out["configs"]
    pairs = [(c, bottom) for c in higher] + [(c, below) for below, c in itertools.pairwise(higher)]
    return {
        **out,
        "paired": {f"{a} - {b}": paired(out, a, b) for a, b in pairs},
        "rungs": {
            c: {**{k: _mean(out, c, k) for k in RUNG_KEYS}, "curve": rung["runs"][0]["curve"]}
            for c, rung in out["configs"].items()
        },
    }


def _budget(budget: Budget | float) -> Budget:
    """A budget, or minutes as a number."""
    return budget if isinstance(budget, Budget) else Budget("seconds", float(budget) * 60)


async def bench_learn(
    budget: Budget | float = 10.0,
    eval_every: float = 30.0,
    episodes: int = 64,
    cache_dir: Path | None = None,
    *,
    seeds: int | Sequence[int] = 1,
    preset: str = "default",
    family: str = "quickgame",
    overrides: Overrides | None = None,
    protocol: Protocol | None = None,
    progress: Path | None = None,
) -> Result:
    """Integrated reward vs outcome-only, ``seeds`` runs each, ``budget`` each (minutes when a number)."""
    return learn_result(
        await run_seeds(
            LEARN,
            seeds=seeds,
            budget=_budget(budget),
            eval_every=eval_every,
            episodes=episodes,
            family=family,
            preset=preset,
            cache_dir=cache_dir,
            overrides=overrides,
            protocol=protocol,
            progress=progress,
        )
    )


def lora_configs(rank: int, lr: float) -> dict[str, Overrides]:
    """``bench learn --lora``'s configurations: a LoRA lane of ``rank`` at ``lr``, then full fine-tuning
    (both with the integrated reward)."""
    return {"lora": {"learner.lora": {"rank": rank, "alpha": 2.0 * rank}, "learner.lr": lr}, "full": {}}


async def bench_learn_lora(
    budget: Budget | float = 10.0,
    eval_every: float = 30.0,
    episodes: int = 64,
    cache_dir: Path | None = None,
    *,
    rank: int = 16,
    lr: float = 5e-3,
    seeds: int | Sequence[int] = 1,
    preset: str = "default",
    family: str = "quickgame",
    overrides: Overrides | None = None,
    protocol: Protocol | None = None,
    progress: Path | None = None,
) -> Result:
    """LoRA lanes against full fine-tuning at an equal budget, ``seeds`` runs each (paired by seed)."""
    configs = lora_configs(rank, lr)
    out = await run_seeds(
        configs,
        seeds=seeds,
        budget=_budget(budget),
        eval_every=eval_every,
        episodes=episodes,
        family=family,
        preset=preset,
        cache_dir=cache_dir,
        overrides=overrides,
        protocol=protocol,
        progress=progress,
    )
    return {**learn_result(out, configs), "lora": configs["lora"]}


async def bench_ladder(
    budget: Budget | float = 5.0,
    eval_every: float = 30.0,
    episodes: int = 64,
    cache_dir: Path | None = None,
    *,
    seeds: int | Sequence[int] = 1,
    preset: str = "default",
    family: str = "quickgame",
    overrides: Overrides | None = None,
    rungs: dict[str, Overrides] | None = None,
    protocol: Protocol | None = None,
    progress: Path | None = None,
) -> Result:
    """The paper's ladder (policy-only, + judge training, + environment adaptation), ``seeds`` runs each."""
    return ladder_result(
        await run_seeds(
            rungs or LADDER,
            seeds=seeds,
            budget=_budget(budget),
            eval_every=eval_every,
            episodes=episodes,
            family=family,
            preset=preset,
            cache_dir=cache_dir,
            overrides=overrides,
            protocol=protocol,
            progress=progress,
        )
    )
