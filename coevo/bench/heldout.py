"""The held-out protocol: what every habit scores beside what a model scores, on the same tasks and seeds.

A score is a matrix ``won[task][seed]``: one episode of each held-out task per evaluation seed, the
candidates shown in the order the episode's key ``"<task>/<seed>/<i>"`` draws (``shown_order``), played
by a model acting as the policy agent does (``coevo.bench.learn.play_episodes``) or by a habit: uniform
random, each constant label, the best of those (the best position rule), and the family's scripted
reader (the ceiling: a few lines that parse the observation, ``Family.reader``). Intervals come from a
bootstrap over tasks and seeds together (and runs, given several), paired where two arms met the same
tasks and seeds. ``verdict`` names a change a gain only where its interval clears the base's greedy
score and every habit's.

``coevo bench heldout`` measures the table for a base model: the habits, the base greedy and sampled,
and the probability mass the base puts on the answer labels with raw prompts and through its chat
template.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coevo.acting.ceiling import Habit, habit_episode
from coevo.config import ComputeDtype
from coevo.inference.precision import model_dtype

if TYPE_CHECKING:
    from coevo.config import CoevoConfig, PolicyConfig
    from coevo.envs.base import Family
    from coevo.schemas import TaskSpec

EVAL_SEEDS = (999, 1000, 1001, 1002, 1003)
"""The evaluation seeds: each held-out task is played once per seed (its shuffles, the model's draws)."""
HELDOUT_TASKS = 64
"""Held-out tasks every bench evaluates on (the loop's own rounds play ``env.n_heldout``)."""
GREEDY = 1e-5
"""The temperature of greedy decoding (engines divide by at least this: the argmax)."""
CONSTANTS = 4
"""Constant-label habits measured: always 0, 1, 2, 3 (a label past the last candidate: the last one)."""
RESAMPLES = 2000

VERBS = ("take", "unlock", "open")
"""The verb rule's order: it reads the action words, never the observation. The first of these verbs
that some shown action starts with wins, uniformly among its actions (take the coin or a key, then
unlock, then open; else any action): the best habit of the old quick game, which needs no reading."""

Matrix = list[list[int]]
"""won[task][seed] (1 won, 0 not)."""


def greedy(policy: PolicyConfig) -> PolicyConfig:
    """``policy`` decoding greedily."""
    return policy.model_copy(update={"temperature": GREEDY})


def episode_key(task_id: str, seed: int, i: int) -> str:
    return f"{task_id}/{seed}/{i}"


def constant(label: int) -> Habit:
    return lambda _obs, shown, _rng: min(label, len(shown) - 1)


def uniform(_obs: str, shown: list[str], rng: random.Random) -> int:
    return rng.randrange(len(shown))


async def play_habit(
    family: Family, tasks: Sequence[TaskSpec], seeds: Sequence[int], habit: Habit, policy: PolicyConfig
) -> Matrix:
    """``habit``'s matrix on ``tasks`` × ``seeds``, each episode shown as the policy agent would show it."""
    return [
        [
            int(await habit_episode(family, task, episode_key(task.task_id, seed, i), habit, policy) == "won")
            for seed in seeds
        ]
        for i, task in enumerate(tasks)
    ]


def bootstrap(
    arms: Sequence[Sequence[float]] | Sequence[Sequence[Sequence[float]]] | np.ndarray,
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """Mean and 95 % percentile interval of ``arms`` (runs × tasks × seeds; a single matrix is one run),
    resampling runs, tasks and seeds together (pure). Pass the difference of two arms met on the same
    runs, tasks and seeds for a paired interval."""
    a = np.asarray(arms, dtype=float)
    if a.ndim == 2:
        a = a[None]
    runs, tasks, seeds = a.shape
    rng = np.random.default_rng(seed)
    r = rng.integers(0, runs, (resamples, runs))
    t = rng.integers(0, tasks, (resamples, tasks))
    s = rng.integers(0, seeds, (resamples, seeds))
    means = np.array([a[r[b]][:, t[b]][:, :, s[b]].mean() for b in range(resamples)])
    low, high = np.percentile(means, [2.5, 97.5])
    return {
        "mean": round(float(a.mean()), 4),
        "low": round(float(low), 4),
        "high": round(float(high), 4),
        "runs": runs,
        "tasks": tasks,
        "seeds": seeds,
    }


def verb_choices(shown: list[str]) -> list[int]:
    """The indices the verb rule picks among (pure): the actions of the first verb in ``VERBS`` that a
    shown action starts with, else all."""
    first = [a.split()[0] if a.split() else "" for a in shown]
    verb = next((v for v in VERBS if v in first), None)
    return [j for j, f in enumerate(first) if verb is None or f == verb]


def verb_rule(_obs: str, shown: list[str], rng: random.Random) -> int:
    return rng.choice(verb_choices(shown))


def habits_of(family: Family) -> dict[str, Habit]:
    out: dict[str, Habit] = {"random": uniform}
    out |= {f"always {j}": constant(j) for j in range(CONSTANTS)}
    out["verb rule"] = verb_rule
    if family.readable:
        out["reader"] = lambda obs, shown, _rng: family.read(obs, shown)
    return out


async def habit_table(
    family: Family, tasks: Sequence[TaskSpec], seeds: Sequence[int], policy: PolicyConfig
) -> dict[str, Any]:
    """Every habit's score (mean, interval), and ``best position rule``: the best constant label."""
    rows = {name: bootstrap(await play_habit(family, tasks, seeds, h, policy)) for name, h in habits_of(family).items()}
    best = max((f"always {j}" for j in range(CONSTANTS)), key=lambda n: rows[n]["mean"])
    rows["best position rule"] = {**rows[best], "rule": best}
    return rows


HABITS = ("random", "best position rule", "verb rule")
"""The rows a gain must clear besides the base's greedy score (the best position rule is the best constant)."""


def verdict(interval: dict[str, Any], rows: dict[str, dict[str, Any]]) -> str:
    """``gain`` where ``interval``'s low end clears the base's greedy score and every habit's (pure); else
    what it does not clear."""
    bars = {name: rows[name]["mean"] for name in ("base greedy", *HABITS) if name in rows}
    under = [f"{name} {value:.2f}" for name, value in bars.items() if interval["low"] <= value]
    return "gain" if not under else "no gain: interval does not clear " + ", ".join(under)


_MEASURED: dict[tuple[str, ...], Matrix] = {}
"""Matrices already measured in this process, by model directory, policy, family, tasks and seeds: a model
directory is never rewritten (each checkpoint is its own), so the base of every run of a bench is
measured once."""


async def model_matrix(
    model: Path,
    family: Family,
    tasks: Sequence[TaskSpec],
    seeds: Sequence[int],
    policy: PolicyConfig,
    dtype: ComputeDtype = "auto",
) -> Matrix:
    """The model's matrix: per seed, one episode of each task (``play_episodes``: the same keys as
    habits), the model served in ``dtype``."""
    from coevo.bench.learn import play_episodes

    key = (
        str(Path(model).resolve()),
        policy.model_dump_json(),
        family.name,
        *(t.model_dump_json() for t in tasks),
        repr(seeds),
        dtype,
    )
    if key not in _MEASURED:
        by_seed = [
            await play_episodes(model, list(tasks), len(tasks), s, family=family, policy=policy, dtype=dtype)
            for s in seeds
        ]
        _MEASURED[key] = [[int(by_seed[j][i]) for j in range(len(seeds))] for i in range(len(tasks))]
    return [list(row) for row in _MEASURED[key]]


async def label_mass(model: Path, family: Family, tasks: Sequence[TaskSpec], policy: PolicyConfig) -> dict[str, float]:
    """The base's next-token probability on the answer labels at each task's first step, averaged over
    the tasks, with the raw prompt and through the chat template (pure inference, no sampling)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from coevo.acting import step_order
    from coevo.algorithm.prompts import CHAT_LABELS, INDEX_LABELS, policy_messages, policy_prompt
    from coevo.inference.chat import PromptForm
    from coevo.inference.engine import choice_token_ids, encode_prompt

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    chat, cache = PromptForm(tok, "chat"), dict[tuple[str, ...], list[int]]()
    out: dict[str, list[float]] = {"raw": [], "chat": []}
    for i, task in enumerate(tasks):
        env = family.make_env()
        try:
            obs = await env.reset(task)
        finally:
            await env.close()
        key = episode_key(task.task_id, EVAL_SEEDS[0], i)
        shown = [obs.candidates[j] for j in step_order(policy, key, 0, len(obs.candidates))]
        prompts = {
            "raw": (encode_prompt(tok, policy_prompt(obs.text, shown)), INDEX_LABELS),
            "chat": (chat.ids(policy_messages(obs.text, shown)) or [], CHAT_LABELS),
        }
        for form, (ids, names) in prompts.items():
            labels = choice_token_ids(tok, list(names[: len(shown)]), cache)
            with torch.no_grad():
                logits = lm(torch.tensor([ids])).logits[0, -1].float()
            out[form].append(float(torch.softmax(logits, -1)[labels].sum()))
    return {form: round(sum(v) / len(v), 4) for form, v in out.items() if v}


async def bench_heldout(
    cfg: CoevoConfig,
    seeds: Sequence[int] = EVAL_SEEDS,
    n_tasks: int = HELDOUT_TASKS,
    *,
    both_forms: bool = True,
    judge: bool = False,
    measure: str = "both",
    states: int | None = None,
) -> dict[str, Any]:
    """The held-out table of ``cfg``'s family and policy base: habits, the scripted reader, the base
    greedy and at the policy's temperature, each prompt form's label mass and sampled score
    (``both_forms=False``: the form the policy uses only, for families whose episodes are long), and the
    base's step agreement (``base_agreement``, on at most ``states`` states of each path); ``measure``:
    ``success`` or ``steps`` alone, else both; ``judge``: the judge's votes too (``bench.judge_probe``)."""
    from transformers import AutoTokenizer

    from coevo.bench.learn import HELDOUT_SEED
    from coevo.envs import make_family
    from coevo.inference.chat import PromptForm
    from coevo.inference.clients import model_dir

    family = make_family(cfg.env)
    tasks = [t for t in family.initial_tasks(0, n_tasks, HELDOUT_SEED) if (await family.precheck(t)).ok]
    base, policy, dtype = model_dir(cfg, "policy"), cfg.policy, cfg.learner.dtype
    rows = await habit_table(family, tasks, seeds, policy)
    used = "chat" if PromptForm(AutoTokenizer.from_pretrained(base), policy.prompt_format).chat else "raw"
    forms = {}
    for form in (("raw", "chat") if both_forms else (used,)) if measure != "steps" else ():
        p = policy.model_copy(update={"prompt_format": form})
        forms[form] = {
            "greedy": bootstrap(await model_matrix(base, family, tasks, seeds, greedy(p), dtype)),
            "sampled": bootstrap(await model_matrix(base, family, tasks, seeds, p, dtype)),
        }
    if used in forms:
        rows["base greedy"], rows["base sampled"] = forms[used]["greedy"], forms[used]["sampled"]
    steps = await base_agreement(base, family, tasks, seeds, policy, dtype, states) if measure != "success" else {}
    probe = {}
    if judge:
        from coevo.bench.judge_probe import judge_probe

        probe = await judge_probe(
            model_dir(cfg, "judge"), family, tasks, policy, cfg.judge.temperature, seeds[0], dtype
        )
    return {
        "family": family.name,
        "base": str(cfg.policy.model or "tiny"),
        "tasks": len(tasks),
        "seeds": list(seeds),
        "temperature": policy.temperature,
        "prompt_format": f"{policy.prompt_format} ({used})",
        "dtype": str(model_dtype(dtype, None, base)).removeprefix("torch."),  # as play_episodes serves
        "shuffle_choices": policy.shuffle_choices,
        "rows": rows,
        "prompt_forms": forms,
        "label_mass": await label_mass(base, family, tasks, policy),
        **({"step_agreement": steps} if steps else {}),
        **({"judge_probe": probe} if judge else {}),
        "interval": "95 % bootstrap percentile over tasks and seeds together",
    }


async def base_agreement(
    base: Path,
    family: Family,
    tasks: Sequence[TaskSpec],
    seeds: Sequence[int],
    policy: PolicyConfig,
    dtype: ComputeDtype,
    states: int | None = None,
) -> dict[str, Any]:
    """The step-agreement rows of ``bench heldout`` (``coevo.bench.steps``): the habits, the ceiling, the base
    greedy and at the policy's temperature, and the states measured; {} where the family has no ceiling
    or the policy does not choose among candidates."""
    from coevo.bench.steps import ceiling_paths, habit_by_verb, habit_rows, model_agreement, path_states

    if not tasks or not family.has_ceiling or policy.mode != "choice":
        return {}
    paths = await ceiling_paths(family, tasks, seeds, policy, states)
    agreed = await model_agreement(base, paths, policy, dtype)
    rows = habit_rows(paths) | {"base greedy": bootstrap(agreed.greedy), "base sampled": bootstrap(agreed.sampled)}
    verbs = habit_by_verb(paths) | {"base sampled": agreed.by_verb}
    return {"states": path_states(paths), "rows": rows, "by_verb": verbs}


def _rows(rows: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for name, row in rows.items():
        named = name + (f" ({row['rule']})" if "rule" in row else "")
        out.append(f"  {named:<32} {row['mean']:.2f}  [{row['low']:.2f}, {row['high']:.2f}]")
    return out


def verb_lines(by_verb: dict[str, dict[str, float] | None]) -> list[str]:
    """The step agreement by the ceiling's verb, a line per row (``states``: how many of each)."""
    out = []
    if counts := by_verb.get("states"):
        out.append("  by the ceiling's verb: " + ", ".join(f"{v} {int(n)} states" for v, n in counts.items()))
    for name, verbs in by_verb.items():
        if name != "states" and verbs:
            out.append(f"    {name:<30} " + "  ".join(f"{v} {x:.2f}" for v, x in verbs.items()))
    return out


def heldout_table(result: dict[str, Any]) -> str:
    """``bench heldout``'s result as a text table."""
    lines = [
        f"held-out success, {result['family']}: {result['tasks']} tasks x {len(result['seeds'])} seeds "
        f"(base {result['base']}, temperature {result['temperature']})",
        *_rows(result["rows"]),
    ]
    if steps := result.get("step_agreement"):
        lines += [
            f"held-out step agreement with the ceiling, on its path ({steps['states']} states):",
            *_rows(steps["rows"]),
        ]
        lines += verb_lines(steps.get("by_verb", {}))
    for form, r in result.get("prompt_forms", {}).items():
        mass = result.get("label_mass", {}).get(form)
        lines.append(
            f"  base, {form} prompts: greedy {r['greedy']['mean']:.2f}, sampled {r['sampled']['mean']:.2f}, "
            f"label mass {mass if mass is not None else '-'}"
        )
    if probe := result.get("judge_probe"):
        lines.append(
            f"  judge on {probe['steps']} labelled steps of random play ({probe['labelled_good']:.2f} good), "
            f"votes at temperature {probe['temperature']}:"
        )
        for name, r in probe.items():
            if isinstance(r, str):
                lines.append(f"    {name:<20} not measured: {r}")
            elif isinstance(r, dict):
                auc = "-" if r["auc"] is None else f"{r['auc']:.2f}"
                lines.append(
                    f"    {name:<20} + votes {r['plus_share']:.2f}  accuracy {r['accuracy']:.2f}  AUC {auc}  "
                    f"balanced accuracy {r['balanced_accuracy']:.2f}"
                )
    return "\n".join(lines) + "\n"


async def run_baselines(
    cfg: CoevoConfig, run_dir: Path | None = None, success: bool = True, seeds: Sequence[int] = EVAL_SEEDS[:2]
) -> dict[str, Any]:
    """What the habits and the base greedy score on the held-out tasks of ``cfg``'s loop (its own rounds'
    tasks), for ``coevo run``'s closing summary, and (``step_agreement``, ``run_steps``) the step
    agreement of the base and of the run's last policy checkpoint under ``run_dir``. Base greedy only for
    a local policy model (a vLLM-served policy is measured with ``coevo bench heldout``); empty for a
    family without held-out tasks. ``success=False`` (no evaluation round to set them beside): the step
    agreement only."""
    from coevo.envs import make_family
    from coevo.inference.clients import model_dir

    if cfg.env.family == "external" or cfg.env.n_heldout == 0:
        return {}
    family = make_family(cfg.env)
    tasks = [t for t in family.initial_tasks(cfg.env.n_train, cfg.env.n_heldout, cfg.env.seed) if t.split == "heldout"]
    out: dict[str, Any] = {}
    if success:
        rows = await habit_table(family, tasks, seeds, cfg.policy)
        out = {name: rows[name]["mean"] for name in (*HABITS, "reader") if name in rows}
    if cfg.policy.url is None:
        if success:
            won = await model_matrix(
                model_dir(cfg, "policy"), family, tasks, seeds, greedy(cfg.policy), cfg.learner.dtype
            )
            out["base greedy"] = round(float(np.mean(won)), 4)
        if run_dir is not None and (steps := await run_steps(cfg, family, tasks, seeds, run_dir)):
            out["step_agreement"] = steps
    return out


async def run_steps(
    cfg: CoevoConfig, family: Family, tasks: Sequence[TaskSpec], seeds: Sequence[int], run_dir: Path
) -> dict[str, Any]:
    """The base's and the run's last policy checkpoint's step agreement on the reader's path through the
    run's held-out tasks (``coevo.bench.steps``), with the habits' and the paired change; {} without a
    checkpoint, a ceiling or a choosing policy."""
    from coevo.bench.steps import ceiling_paths, habit_rows, mean_cell, model_agreement, path_states
    from coevo.inference.clients import model_dir
    from coevo.training.lane import latest_checkpoint

    final = latest_checkpoint(Path(run_dir) / "checkpoints" / "policy")
    if final is None or not family.has_ceiling or cfg.policy.mode != "choice":
        return {}
    paths = await ceiling_paths(family, tasks, seeds, cfg.policy)
    base = await model_agreement(model_dir(cfg, "policy"), paths, cfg.policy, cfg.learner.dtype)
    trained = await model_agreement(final, paths, cfg.policy, cfg.learner.dtype)
    rows = habit_rows(paths)
    interval = bootstrap(trained.sampled)
    return {
        "states": path_states(paths),
        "habits": {name: rows[name]["mean"] for name in HABITS},
        "base greedy": mean_cell(base.greedy),
        "base": mean_cell(base.sampled),
        "trained": mean_cell(trained.sampled),
        "low": interval["low"],
        "high": interval["high"],
        "change": bootstrap(np.asarray(trained.sampled) - np.asarray(base.sampled)),
    }
