"""The closing summary of ``coevo run``: what a person reads at the end (pure: a summary and the config
in, lines out). A change is called improved or fell only when its interval clears 0; a held-out number
stands beside what habits and the base score on the same tasks; a run that did not learn, starved or
collapsed says which, and what it measured.
"""

from __future__ import annotations

from typing import Any

from coevo.config import CoevoConfig


def _change(label: str, start: float | None, end: float | None, how: str, missing: str, interval: Any = None) -> str:
    """One line of the closing summary: a change is called improved (or fell) only when its 95 %
    interval says so (``coevo.observe.claims``); else no clear change, or too few groups to say."""
    if start is None or end is None:
        return f"  {label}: not measured ({missing})"
    if interval is None:
        return f"  {label}: {start:.2f} -> {end:.2f} ({end - start:+.2f}, one window: nothing to compare; {how})"
    from coevo.observe.claims import Change

    bounds = None if interval["low"] is None else (interval["low"], interval["high"])
    change = Change(start, end, interval["groups"][0], interval["groups"][1], bounds)
    return f"  {label}: {start:.2f} -> {end:.2f} ({change.words()}; {how})"


def _beside(s: dict[str, Any], cfg: CoevoConfig, baselines: dict[str, Any] | None) -> list[str]:
    """The held-out line's baselines: habits and the base greedy on the same tasks, and whether the last
    round clears them (none: not measured, or no round); then the step agreement of the base and the
    last policy beside the habits' (none: not measured)."""
    from coevo.observe.claims import run_verdict, steps_verdict

    baselines = baselines or {}
    bars = {k: v for k, v in baselines.items() if isinstance(v, float | int)}
    out = []
    if bars and s["heldout_success_end"] is not None:
        out.append(f"    {run_verdict(s['heldout_success_end'], cfg.env.n_heldout * cfg.policy.n, bars)}")
    if steps := baselines.get("step_agreement"):
        out.append(f"  {steps_verdict(steps)}")
    if why := baselines.get("skipped"):
        out.append(
            f"  baselines: not measured ({why}); `coevo bench heldout` measures the habits and the base on "
            "the same tasks"
        )
    return out


def _no_heldout(s: dict[str, Any], cfg: CoevoConfig) -> str:
    """Why held-out success was not measured: a family without held-out tasks, or no round yet (and
    what to change)."""
    if cfg.env.family == "external" and cfg.env.tasks_from is None:
        return "agents outside coevo bring their own tasks, so there are no held-out tasks; --env.tasks_from FAMILY has some"
    tc = cfg.tasks
    clock = f" or {tc.eval_every_s:g} s" if tc.eval_every_s is not None else ""
    return (
        f"no evaluation round was scored: one runs after every {tc.eval_every} train groups{clock} and this run "
        f"scored {s['groups_scored']}; --set tasks.eval_every=N or tasks.eval_every_s=S for rounds sooner"
    )


def _rounds(rounds: list[float]) -> str:
    """``; rounds 0.12 0.87 0.48``: the held-out curve between its first and last round (with one
    round only, how to get more)."""
    if len(rounds) == 1:
        return (
            "; one round only: --set tasks.eval_every=N (train groups between rounds) or tasks.eval_every_s=S for more"
        )
    if len(rounds) < 3:
        return ""
    shown = rounds if len(rounds) <= 8 else [*rounds[:4], *rounds[-4:]]
    text = " ".join(f"{r:.2f}" for r in shown)
    if len(rounds) <= 8:
        return f"; rounds {text}"
    return f"; {len(rounds)} rounds, first and last four {text}, lowest {min(rounds):.2f}, highest {max(rounds):.2f}"


def no_learning_reason(summary: dict[str, Any], cfg: CoevoConfig) -> str | None:
    """Why a run ended before its first policy learner step (None when it took one)."""
    if summary["learner_steps"]:
        return None
    groups, with_samples = summary["groups_scored"], summary["train_groups_with_samples"]
    samples, batch = summary["policy_samples"], cfg.learner.batch_samples
    errors, calls = summary.get("judge_errors", 0), summary.get("judge_calls", 0)
    if not groups and errors:
        return (
            f"no policy learner step in this run: no train group was scored, and {errors} of the judge's "
            f"{errors + calls} votes failed (the log file names each error: an API key, an endpoint, a model "
            "name). Fix the judge, or run without --judge (the local judge model)."
        )
    if not groups:
        why = "no train group was scored (models still loading, or the run was too short to finish a group)"
    elif not with_samples:
        why = (
            f"none of the {groups} train groups carried a learning signal: in each, every rollout won or "
            "every one lost (the policy band keeps such groups out of training)"
        )
    elif cfg.learner.batch_groups is not None:
        why = (
            f"{groups} train groups scored, {with_samples} with samples; a lane steps once "
            f"learner.batch_groups = {cfg.learner.batch_groups} groups were scored since its last step"
        )
    else:
        why = (
            f"{samples} policy samples from {with_samples} of {groups} train groups, fewer than "
            f"learner.batch_samples = {batch} (a lane steps once it holds a batch, or after "
            f"learner.flush_after_s without a new group)"
        )
    return f"no policy learner step in this run: {why}. Run longer (--minutes) or lower learner.batch_samples."


ENTROPY_FLOOR = 0.05
"""nats per response token under which the closing summary calls the policy collapsed: at 0.05 a policy
choosing between two actions puts 0.99 on one, and a group of 8 rollouts agrees on that step 93 % of the
time, so a group rarely carries an outcome signal"""

STEP_GAP_LIMIT_S = 120.0
"""the longest the policy lane may go without a step before the closing summary says so"""


def health_warnings(summary: dict[str, Any]) -> list[str]:
    """What broke in a run that learned (pure): the policy's entropy under ``ENTROPY_FLOOR`` at the end, and
    the policy lane waiting longer than ``STEP_GAP_LIMIT_S`` for a batch; each names what it measured."""
    if not summary["learner_steps"]:
        return []  # no_learning_reason says why
    out = []
    end, low = summary.get("policy_entropy"), summary.get("policy_entropy_min")
    if end is not None and end < ENTROPY_FLOOR:
        out.append(
            f"the policy collapsed: its entropy ended at {end:.3f} nats a token (last quarter of its steps; lowest "
            f"batch {low:.3f}), under the floor of {ENTROPY_FLOOR}, where a group of 8 agrees on a two-way step 93 % "
            "of the time and carries no outcome signal"
        )
    gap, where = summary.get("policy_step_gap_max_s"), summary.get("policy_step_gap_where")
    if gap is not None and gap > STEP_GAP_LIMIT_S:
        out.append(
            f"the policy lane went {gap:.0f} s without a step ({where}), over {STEP_GAP_LIMIT_S:.0f} s: no batch of "
            "samples came (train groups all won or all lost, or the samplers slower than the learner)"
        )
    return out


JUDGE_ONE_WAY = 0.02
"""share of +1 votes (or of -1 votes) in the last quarter at or under which the closing summary calls a
trained judge collapsed onto the other vote"""
JUDGE_SILENT = 0.9
"""share of silent steps (votes that all earned the same reward: no sample) in the last quarter above
which a one-way judge has stopped hearing its training signal"""


def judge_warning(summary: dict[str, Any]) -> str | None:
    """A trained judge that ended voting one way on nearly every step, with nearly every step silent (pure):
    its step rewards are then a constant, which the policy's group advantage removes."""
    pos, silent = summary.get("judge_vote_positive"), summary.get("judge_steps_silent")
    if not summary.get("judge_learner_steps") or pos is None or silent is None or silent <= JUDGE_SILENT:
        return None
    if min(pos, 1.0 - pos) > JUDGE_ONE_WAY:
        return None
    start = summary.get("judge_vote_positive_start")
    was = f" ({start:.0%} in the first quarter)" if start is not None else ""
    return (
        f"the judge collapsed: it voted +1 on {pos:.1%} of the steps in the last quarter{was} and {silent:.0%} of "
        "its steps were silent (their votes all earned the same reward: no sample), so it has stopped learning and "
        "its step rewards are a constant the policy's advantage removes: the policy trained on the outcome alone. "
        "Trained for consistency with outcomes, a judge whose policy mostly loses is pushed to -1 (mostly wins: "
        "+1); scorer.judge_balance with scorer.judge_baseline = 'group' removes that push (docs/benchmarks.md, "
        "'Why a judge collapses')"
    )


UNVOTED = 0.25
"""the share of steps scored without the judge's votes above which the closing summary warns"""


def unvoted_warning(summary: dict[str, Any], cfg: CoevoConfig) -> str | None:
    """The judge lagged the policy: a share of the scored steps over ``UNVOTED`` had no votes in time (pure)."""
    share = summary.get("steps_without_votes")
    if share is None or share <= UNVOTED or summary["events"].get("step.taken", 0) < 100:
        return None
    return (
        f"the judge lagged the policy: {share:.0%} of the steps of scored groups were scored without its votes "
        f"(none had come scorer.vote_timeout_s = {cfg.scorer.vote_timeout_s:g} s after their trajectory ended), "
        "so those steps carried the outcome only. Give the judge its own compute (a vLLM server, an API), or "
        "wait longer for it (configs/smollm2.toml waits 300 s on 2 CPU cores)"
    )


STARVING = 0.95
"""the share of unanimous train groups at the end of a run above which the closing summary warns"""


def starving_warning(summary: dict[str, Any]) -> str | None:
    """Why the learner got (almost) no samples at the end of a run that did learn (None when it did not starve)."""
    share, groups = summary.get("train_groups_unanimous_end"), summary["groups_scored"]
    if share is None or share < STARVING or groups < 50 or not summary["learner_steps"]:
        return None
    text = (
        f"the learner was starving at the end: {share:.0%} of the last {max(1, groups // 5)} train groups "
        "were all won or all lost, which gives it no sample"
    )
    start, end = summary.get("policy_entropy_start"), summary.get("policy_entropy")
    if start is not None and end is not None and end < start / 2:
        text += (
            f". The policy's entropy fell from {start:.2f} to {end:.2f} nats a token (first and last quarter "
            "of its steps): it is collapsing onto one line per task, which wins a task always or never, so no "
            "rewrite lands in the band and no batch comes for a remedy to act on. Act before it: a smaller "
            "learner.lr, learner.entropy_coef or learner.entropy_target (docs/benchmarks.md, 'An entropy bonus "
            "against the collapse', says what each did on SmolLM2)"
        )
    return text + "."


def warnings(s: dict[str, Any], cfg: CoevoConfig) -> list[str]:
    """Every warning of the closing summary, in the order it prints them."""
    found = (no_learning_reason(s, cfg), starving_warning(s), *health_warnings(s), judge_warning(s))
    return [w for w in (*found, unvoted_warning(s, cfg)) if w]


def _landed(decided: dict[str, dict[str, int]]) -> str:
    """`` (harder: 2 accepted, 3 unsolved; easier: 4 accepted, 1 not easier)``: the gate's verdicts by
    direction, most common first (empty when nothing was decided)."""
    parts = [
        f"{d}: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(c.items(), key=lambda kv: -kv[1]))
        for d, c in decided.items()
        if c
    ]
    return f" ({'; '.join(parts)})" if parts else ""


def compute_line(summary: dict[str, Any]) -> str | None:
    """``  busy: judge engine 38% (1,230 tokens/s, 12% padding), ..., learner 30% of the run (...)``: what
    ``busy_share`` says, each engine with its rate and padding (None when nothing was counted: remote
    servers only and no learner step)."""
    busy = summary.get("busy_share") or {}
    if not busy:
        return None
    parts = []
    for name, share in busy.items():
        role = name.removesuffix(" engine")
        rate, pad = summary.get("engine_tokens_per_s", {}).get(role), summary.get("engine_padding_share", {}).get(role)
        extra = f" ({rate:,.0f} tokens/s, {pad:.0%} padding)" if rate is not None and pad is not None else ""
        parts.append(f"{name} {share:.0%}{extra}")
    return "  busy: " + ", ".join(parts) + " of the run (overlapping on shared cores)"


def describe(
    summary: dict[str, Any],
    cfg: CoevoConfig,
    links: dict[str, str],
    baselines: dict[str, Any] | None = None,
    interrupted: str | None = None,
) -> str:
    """A short human summary of a finished run: what improved, by how much, and where to look;
    ``baselines``: what habits and the base greedy score on the held-out tasks (``run_baselines``);
    ``interrupted``: the signal that stopped the run before its budget (``links`` then says how to resume)."""
    s = summary
    how = f"was interrupted ({interrupted}) before its budget" if interrupted else "finished"
    lines = [
        f"Run {s['run_id']} {how}: {s['learner_steps']} policy and {s['judge_learner_steps']} judge learner "
        f"steps, {s['events'].get('trajectory.completed', 0)} trajectories, {s['groups_scored']} train groups "
        f"scored in all (this process ran {s['seconds'] / 60:.1f} min of it)."
    ]
    lines += [
        _change(
            "policy success on train groups",
            s["policy_success_start"],
            s["policy_success_end"],
            "first vs last fifth of the groups",
            "no train group was scored",
            s.get("policy_success_change"),
        ),
        _change(
            "held-out success",
            s["heldout_success_start"],
            s["heldout_success_end"],
            "first vs last evaluation round, fixed tasks" + _rounds(s.get("heldout_success_rounds") or []),
            _no_heldout(s, cfg),
            s.get("heldout_success_change"),
        ),
        *_beside(s, cfg, baselines),
        _change(
            "judge process accuracy",
            s["judge_process_accuracy_start"],
            s["judge_process_accuracy"],
            "first vs last quarter of the groups",
            "no group had both judge votes and the environment's "
            "step labels: outcome-only reward, or a family without reference labels",
            s.get("judge_process_accuracy_change"),
        ),
    ]
    lines.append(
        f"  rewrites: {s['rewrites_accepted']} accepted of {s['rewrites_proposed']} proposed"
        + _landed(s.get("rewrites_decided") or {})
        + (
            f"; judge errors: {s['judge_errors']}, cost ${s['judge_cost_usd']:.4f}"
            if s["judge_errors"] or s["judge_cost_usd"]
            else ""
        )
    )
    lines += [busy for busy in (compute_line(s),) if busy]
    lines += [f"  warning: {reason}" for reason in warnings(s, cfg)]
    lines += [f"  {name + ':':<12} {where}" for name, where in links.items()]
    return "\n".join(lines)
