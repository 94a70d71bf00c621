"""The metric catalogue and bounded time series.

Invariants:
- every series has a name in ``SPECS`` (its meaning, unit, chart and label names are stated once,
  here, and read by every sink: TensorBoard tags, Prometheus families, the dashboard and the report);
- a ``Series`` holds at most ``cap`` points however long the run: when full it halves its
  resolution (keeps every other point, then takes one new point in two), and always knows its
  latest point.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Spec:
    """What a series means. ``counter``: a running total (Prometheus counter, never decreases)."""

    help: str
    chart: str
    unit: str = ""
    counter: bool = False
    labels: tuple[str, ...] = ()


MIXED_WINDOW = 16
"""train groups ``train_groups_mixed`` looks back over"""

SPECS: dict[str, Spec] = {
    "success_train": Spec(
        "policy success on one train group: the fraction of its rollouts won", "success", "fraction won"
    ),
    "train_groups_mixed": Spec(
        f"share of the last {MIXED_WINDOW} train groups with mixed outcomes (some rollouts won, some lost): the "
        "groups whose outcome gives the policy a signal; under half, the pool is saturating",
        "signal",
        "fraction of groups",
    ),
    "success_heldout": Spec(
        "held-out success: mean over one evaluation round (the same tasks every round)", "success", "fraction won"
    ),
    "heldout_agreement": Spec(
        "held-out step agreement: the policy's mean probability, at its temperature, of the ceiling's action on "
        "the ceiling's path through each task of one evaluation round (the scripted reader, else the walkthrough)",
        "agreement",
        "probability",
    ),
    "reward_mean": Spec("mean integrated step reward of one train group", "reward", "reward"),
    "reward_std": Spec("standard deviation of the mean rewards of the last 16 train groups", "reward", "reward"),
    "judge_process_accuracy": Spec(
        "judge's step votes agreeing with the environment's step labels (per group)", "judge", "accuracy"
    ),
    "judge_outcome_accuracy": Spec(
        "judge's votes agreeing with the trajectory outcome (per group)", "judge", "accuracy"
    ),
    "judge_consistency": Spec(
        "mean consistency reward R·S of the judge's votes (per group; its agreement with the integrated rewards)",
        "consistency",
        "R·S",
    ),
    "learner_loss": Spec("loss of one learner step", "loss", "loss", labels=("role",)),
    "learner_kl": Spec(
        "KL between the trained and the sampling policy, one learner step", "kl", "nats", labels=("role",)
    ),
    "learner_mismatch_kl": Spec(
        "KL between the learner's and the inference engine's log-probs of the sampled "
        "tokens (trainer/inference mismatch, with the weights' drift since a stale sample was drawn)",
        "mismatch_kl",
        "nats",
        labels=("role",),
    ),
    "learner_mismatch_kl_current": Spec(
        "the mismatch KL on a step's samples drawn by the weights the learner held (staleness 0): the sampler's "
        "own mismatch, without the drift of the weights since a stale sample was drawn",
        "mismatch_kl",
        "nats",
        labels=("role",),
    ),
    "learner_entropy": Spec(
        "entropy of the distributions a step's batch was drawn from, under the weights before the step "
        "(per response token; a policy collapsing to one answer goes to 0)",
        "entropy",
        "nats",
        labels=("role",),
    ),
    "learner_entropy_coef": Spec(
        "the entropy bonus's coefficient a step was trained with (learner.entropy_coef, or the adaptive one "
        "under learner.entropy_target)",
        "entropy_coef",
        "coefficient",
        labels=("role",),
    ),
    "learner_clip_fraction": Spec(
        "fraction of tokens whose ratio was clipped, one learner step", "clip", "fraction", labels=("role",)
    ),
    "learner_tokens_per_second": Spec(
        "training tokens per second of one learner step", "tokens", "tokens/s", labels=("role",)
    ),
    "learner_staleness_mean": Spec(
        "mean staleness (learner version - sampling version) of a step's samples",
        "staleness",
        "versions",
        labels=("role",),
    ),
    "learner_staleness_samples_total": Spec(
        "samples trained at each staleness, since the start",
        "staleness_hist",
        "samples",
        counter=True,
        labels=("role", "staleness"),
    ),
    "trajectories_per_second": Spec("completed trajectories per second (30 s window)", "rates", "1/s"),
    "env_steps_per_second": Spec("environment steps per second (30 s window)", "rates", "1/s"),
    "weights_pause_ms": Spec(
        "pause of a weight swap on one inference server", "weights", "ms", labels=("role", "server", "transport")
    ),
    "weights_apply_failures_total": Spec(
        "weight swaps that failed (the server kept its old weights)",
        "weights_failed",
        "swaps",
        counter=True,
        labels=("role", "server"),
    ),
    "rewrites_proposed_total": Spec("task rewrites proposed by the rewriter", "rewrites", "rewrites", counter=True),
    "rewrites_accepted_total": Spec(
        "rewrites accepted by the gate (measured accuracy in band)", "rewrites", "rewrites", counter=True
    ),
    "rewrites_rejected_total": Spec(
        "rewrites rejected by the gate or the precheck", "rewrites", "rewrites", counter=True
    ),
    "task_difficulty": Spec(
        "difficulty of a slot's active task (knob positions, higher = harder)",
        "difficulty",
        "difficulty",
        labels=("slot",),
    ),
    "judge_errors_total": Spec(
        "judge votes that failed (API errors: never a -1)", "judge_calls", "votes", counter=True
    ),
    "judge_calls_total": Spec("judge model calls (not from the cache)", "judge_calls", "calls", counter=True),
    "judge_cost_usd_total": Spec("cost of the judge's API calls", "judge_cost", "USD", counter=True),
    "dead_letters_total": Spec(
        "messages a consumer gave up on (kept as DeadLettered)",
        "dead_letters",
        "messages",
        counter=True,
        labels=("consumer",),
    ),
    "consumer_pending": Spec(
        "messages not yet delivered to a durable consumer (JetStream consumer info)",
        "consumers",
        "messages",
        labels=("consumer",),
    ),
    "consumer_ack_pending": Spec(
        "messages delivered to a durable consumer and not acknowledged yet",
        "consumers",
        "messages",
        labels=("consumer",),
    ),
    "endpoint_prompts_total": Spec(
        "prompts the policy endpoint built, by how: fresh, reused or mismatch (the "
        "sampled tokens kept), diverged (a prefix break: the conversation did not extend "
        "the tokens sampled, so it was tokenised afresh), tokens (ids given)",
        "endpoint",
        "calls",
        counter=True,
        labels=("tokens",),
    ),
    "agent_restarts_total": Spec(
        "crashed tasks an agent restarted (its supervision)", "restarts", "restarts", counter=True, labels=("agent",)
    ),
}

CHARTS: dict[str, tuple[str, str]] = {
    "success": ("Policy success (train groups, held-out rounds)", "fraction won"),
    "signal": ("Train groups with an outcome signal (mixed outcomes)", "fraction of groups"),
    "agreement": ("Held-out step agreement (the ceiling's action on its path, per round)", "probability"),
    "reward": ("Integrated reward", "reward"),
    "judge": ("Judge process and outcome accuracy", "accuracy"),
    "consistency": ("Judge consistency (R·S)", "R·S"),
    "loss": ("Learner loss", "loss"),
    "kl": ("KL (trained vs sampling policy)", "nats"),
    "mismatch_kl": ("Mismatch KL (learner vs inference log-probs)", "nats"),
    "clip": ("Clip fraction", "fraction"),
    "entropy": ("Entropy of the sampled distributions (per response token)", "nats"),
    "entropy_coef": ("Entropy bonus coefficient", "coefficient"),
    "tokens": ("Train tokens/s", "tokens/s"),
    "staleness": ("Staleness of trained samples (mean)", "versions"),
    "staleness_hist": ("Staleness histogram (samples, cumulative)", "samples"),
    "rates": ("Trajectories/s and environment steps/s", "1/s"),
    "weights": ("Weight-sync pause per server and transport", "ms"),
    "weights_failed": ("Failed weight swaps", "swaps"),
    "rewrites": ("Rewrites proposed / accepted / rejected", "rewrites"),
    "difficulty": ("Task difficulty per slot", "difficulty"),
    "judge_calls": ("Judge calls and errors", "calls"),
    "judge_cost": ("Judge cost", "USD"),
    "dead_letters": ("Dead letters per consumer", "messages"),
    "consumers": ("Consumer pending / ack pending", "messages"),
    "restarts": ("Agent restarts", "restarts"),
    "endpoint": ("Policy endpoint prompts (diverged: prefix breaks)", "calls"),
}
"""Dashboard and report charts: id -> (title, y axis). Every ``Spec.chart`` is a key here."""


def series_key(name: str, labels: tuple[tuple[str, str], ...] = ()) -> str:
    """``name{a="x",b="y"}`` (Prometheus' notation): one key per name and label values."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"


def tb_tag(name: str, labels: tuple[tuple[str, str], ...] = ()) -> str:
    """The TensorBoard tag of a series: ``chart/name/label-values`` (grouped by chart in TensorBoard)."""
    parts = [SPECS[name].chart, name, *(v for _, v in labels)]
    return "/".join(p.replace("/", "_") for p in parts)


@dataclass(frozen=True)
class Point:
    """One value of one series. ``t``: seconds since the run's first event; ``step``: the learner version
    for learner series, else the point's ordinal in its series; ``wall``: Unix time."""

    name: str
    labels: tuple[tuple[str, str], ...]
    t: float
    value: float
    step: int
    wall: float

    @property
    def key(self) -> str:
        return series_key(self.name, self.labels)


@dataclass
class Series:
    """The points of one key, at most ``cap`` of them (see the module's invariant)."""

    name: str
    labels: tuple[tuple[str, str], ...]
    cap: int = 2000
    points: list[tuple[float, float]] = field(default_factory=list)
    last: tuple[float, float] | None = None
    count: int = 0
    stride: int = 1

    def append(self, t: float, value: float) -> None:
        self.last = (t, value)
        if self.count % self.stride == 0:
            self.points.append((t, value))
            if len(self.points) >= self.cap:
                self.points = self.points[::2]
                self.stride *= 2
        self.count += 1

    def visible(self) -> list[tuple[float, float]]:
        """The kept points plus the latest one (always shown, even between strides)."""
        if self.last is not None and (not self.points or self.points[-1] != self.last):
            return [*self.points, self.last]
        return list(self.points)
