"""Every event of the closed loop (see docs/algorithm.md). Facts are named in the past tense.

Invariant: these models are the only contract between agents; each has a unique ``kind`` literal,
which the registry maps to a subject. Adding a field needs a default (old events stay decodable) and
bumps ``SCHEMA_VERSION``'s minor; removing, retyping or changing a field's meaning bumps its major and
adds an upcaster in the registry (``coevo.schemas.versions``; ``python -m coevo.schemas.snapshot``
checks the bump against the committed snapshot).
Token ids and log-probs are ``TokenIds`` / ``Floats``: ``IntArray`` / ``FloatArray`` in Python (built
from lists, equal to lists), raw arrays in a frame on the wire (``coevo.schemas.packed``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from coevo.schemas.base import Event, Frozen, Identifier
from coevo.schemas.packed import FloatArray, Floats, IntArray, TokenIds

Role = Literal["policy", "judge"]
WeightsFormat = Literal["full", "lora"]
Outcome = Literal["won", "lost", "truncated", "aborted"]
Direction = Literal["harder", "easier"]
Purpose = Literal["train", "candidate", "eval"]
Split = Literal["train", "heldout"]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class TaskSpec(Frozen):
    """A task as the environments, the rewriter and the events see it.

    ``params`` holds the family's own parameters (validated by the family); ``knobs`` the integer
    difficulty knobs the rewriter may move within the family's bounds.
    """

    task_id: Identifier
    family: Identifier
    params: dict[str, Any] = Field(default_factory=dict)
    knobs: dict[str, int] = Field(default_factory=dict)
    parent_id: Identifier | None = None
    version: int = Field(default=0, ge=0)
    split: Split = "train"


# ---- tasks -------------------------------------------------------------------------------------


class TaskScheduled(Event):
    """A group of ``n_rollouts`` trajectories was requested for a task."""

    kind: Literal["task.scheduled"] = "task.scheduled"
    task: TaskSpec
    slot_id: Identifier | None = None
    group_id: Identifier
    n_rollouts: int = Field(ge=1, le=4096)
    purpose: Purpose = "train"
    round_size: int | None = Field(
        default=None,
        ge=1,
        description="an evaluation group: how many groups its round has (one per held-out task), so a reader "
        "knows a round complete before its last group is even scheduled",
    )


class TaskRewritten(Event):
    """The rewriter proposed a harder or easier version of a slot's active task."""

    kind: Literal["task.rewritten"] = "task.rewritten"
    slot_id: Identifier
    parent: TaskSpec
    candidate: TaskSpec | None
    direction: Direction
    summaries: list[str] = Field(default_factory=list)
    rewriter: str
    moves: int = Field(
        default=1,
        ge=1,
        description="knob steps asked for (more than 1 for a saturated slot; fewer than a candidate of the "
        "same task that went too far in this direction)",
    )
    moves_wanted: int | None = Field(
        default=None,
        ge=1,
        description="knob steps the slot's saturation asked for before an overshoot capped them to ``moves`` "
        "(None: written by a release before this field)",
    )
    precheck_ok: bool
    precheck_error: str | None = None


class TaskDecided(Event):
    """The acceptance gate's verdict on a rolled-out candidate (docs/algorithm.md §4.4)."""

    kind: Literal["task.decided"] = "task.decided"
    slot_id: Identifier
    parent_id: Identifier
    candidate_id: Identifier
    group_id: Identifier | None = Field(
        default=None,
        description="the candidate's rolled-out group this verdict is about (none: rejected "
        "before any rollout); a re-proposed candidate has a new group, so verdicts are per proposal",
    )
    direction: Direction
    accepted: bool
    reason: str
    parent_accuracy: Probability
    candidate_accuracy: Probability | None
    rewriter: str


# ---- rollouts ----------------------------------------------------------------------------------


class StepTaken(Event):
    """One policy call and the environment's answer to the action it chose."""

    kind: Literal["step.taken"] = "step.taken"
    trajectory_id: Identifier
    task_id: Identifier
    group_id: Identifier
    step_index: int = Field(ge=0)
    objective: str = ""
    observation: str
    candidates: list[str] = Field(default_factory=list)
    prompt_token_ids: TokenIds = Field(default_factory=IntArray)
    response_token_ids: TokenIds = Field(default_factory=IntArray)
    logprobs: Floats = Field(default_factory=FloatArray, description="sampling log-prob per response token")
    allowed_token_ids: TokenIds | None = Field(
        default=None, description="choice mode: the tokens sampling was restricted to (log-probs are of that)"
    )
    grammar: str | None = Field(
        default=None,
        description="structured output: the grammar (xgrammar EBNF) each response token was drawn under; "
        "the learner replays it for the masks",
    )
    response_text: str = ""
    action_index: int | None = None
    """the chosen candidate's index in ``candidates`` (the environment's order)"""
    shown_order: list[int] | None = None
    """the order the prompt showed the candidates in (position j showed ``candidates[order[j]]``;
    None: as listed): shuffled per step from the episode's seed, so a label carries no information"""
    action_text: str = ""
    parse_ok: bool = True
    next_observation: str = ""
    artifact: str | None = Field(default=None, description="the environment's full form of the action (a program)")
    done: bool = False
    reference_label: Literal[1, -1] | None = Field(
        default=None, description="environment's own label of this step (e.g. from a walkthrough)"
    )
    env_reward: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="the environment's own reward for this step (an outside agent's, through the endpoint); "
        "the scorer adds scorer.env_reward_weight times it to the step's reward",
    )
    policy_version: int = Field(ge=0)


class TrajectoryCompleted(Event):
    """A trajectory ended; ``aborted`` ones are never counted as failures nor trained on."""

    kind: Literal["trajectory.completed"] = "trajectory.completed"
    trajectory_id: Identifier
    task_id: Identifier
    group_id: Identifier
    rollout_index: int = Field(default=0, ge=0, description="which of the group's n rollouts this is")
    outcome: Outcome
    num_steps: int = Field(ge=0)
    step_event_ids: list[str] = Field(default_factory=list)
    policy_versions: list[int] = Field(default_factory=list)
    error: str | None = None


class StepAgreementMeasured(Event):
    """The policy's step agreement on an evaluation group's task: on every state of the ceiling's path
    (the family's scripted reader, else its walkthrough) through the episode of the group's first
    rollout key, the policy's probability of the ceiling's action at its temperature (``agreement``,
    the mean over the states) and whether that action is its most probable one (``greedy``). Empty
    path: ``states`` 0, both None."""

    kind: Literal["step.agreement"] = "step.agreement"
    group_id: Identifier
    task_id: Identifier
    policy_version: int = Field(ge=0, description="the weights that answered (the oldest, if they changed on the way)")
    states: int = Field(ge=0)
    agreement: float | None = Field(default=None, ge=0.0, le=1.0)
    greedy: float | None = Field(default=None, ge=0.0, le=1.0)


class Vote(Frozen):
    """One of the judge's ``m`` votes on a step. ``value`` is None unless ``status == 'ok'``."""

    index: int = Field(ge=0)
    value: Literal[1, -1] | None
    status: Literal["ok", "unparseable", "error"]
    rationale: str = ""
    prompt_token_ids: TokenIds = Field(default_factory=IntArray)
    response_token_ids: TokenIds = Field(default_factory=IntArray)
    logprobs: Floats = Field(default_factory=FloatArray)
    allowed_token_ids: TokenIds | None = None
    model_version: int | None = None
    cost_usd: float = Field(default=0.0, ge=0.0)
    prompt_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    latency_ms: float = Field(default=0.0, ge=0.0)
    cached: bool = False


class StepJudged(Event):
    """The judge's votes on one step."""

    kind: Literal["step.judged"] = "step.judged"
    step_event_id: str
    trajectory_id: Identifier
    task_id: Identifier
    group_id: Identifier
    step_index: int = Field(ge=0)
    votes: list[Vote]
    judge_version: int | None = None


class TrainingSample(Frozen):
    """One (prompt, response, advantage) sample for a trainable model."""

    sample_id: str
    role: Role
    prompt_token_ids: TokenIds
    response_token_ids: TokenIds
    logprobs: Floats
    allowed_token_ids: TokenIds | None = None
    grammar: str | None = None
    advantage: float
    model_version: int = Field(ge=0)
    step_event_id: str


class FailureDigest(Frozen):
    """What the rewriter's critic sees of one failed trajectory (docs/algorithm.md §4.2)."""

    trajectory_id: str
    outcome: Outcome
    steps: list[str] = Field(default_factory=list, description="numbered 'action -> feedback' lines")
    all_negative_steps: list[int] = Field(default_factory=list, description="steps every vote called bad")
    rationales: list[str] = Field(default_factory=list)


class GroupScore(Frozen):
    """What the scorer computes of a ready group (``coevo.agents.scorer.score_group``, pure): rewards,
    advantages, accuracy, bands and the training samples; ``GroupScored`` is this in an envelope."""

    task_id: Identifier
    group_id: Identifier
    slot_id: Identifier | None = None
    purpose: Purpose = "train"
    accuracy: Probability
    n_trajectories: int = Field(ge=0)
    n_aborted: int = Field(ge=0, default=0)
    policy_band_ok: bool
    judge_band_ok: bool
    trajectory_ids: list[str] = Field(default_factory=list)
    step_event_ids: list[str] = Field(default_factory=list)
    stragglers: list[str] = Field(
        default_factory=list,
        description="steps scored without the judge's votes (none had come scorer.vote_timeout_s after their "
        "trajectory completed): ids of step_event_ids",
    )
    policy_samples: list[TrainingSample] = Field(default_factory=list)
    judge_samples: list[TrainingSample] = Field(default_factory=list)
    judge_process_accuracy: Probability | None = None
    judge_outcome_accuracy: Probability | None = None
    judge_vote_positive: Probability | None = Field(
        default=None, description="share of the parseable votes that are +1"
    )
    judge_steps_silent: Probability | None = Field(
        default=None,
        description="share of the judged steps whose votes all earned one consistency reward (no judge sample)",
    )
    steps_labelled_good: Probability | None = Field(
        default=None, description="share of the steps with a reference label that are labelled +1"
    )
    flagged: str | None = Field(default=None, description="why this group is kept out of training")
    failures: list[FailureDigest] = Field(default_factory=list)
    mean_reward: float = 0.0
    judge_consistency: float | None = Field(
        default=None, description="mean consistency reward R·S of the judge's votes (its agreement with outcomes)"
    )


class GroupScored(GroupScore, Event):
    """A task's group was scored: a ``GroupScore`` in the event envelope."""

    kind: Literal["group.scored"] = "group.scored"

    @classmethod
    def of(cls, score: GroupScore, **envelope: Any) -> GroupScored:
        """The event of ``score`` (its fields as they are: nested samples are not copied or re-validated)."""
        return cls(**dict(score), **envelope)


# ---- learner and weights -----------------------------------------------------------------------


class LearnerStepped(Event):
    """One step of a lane (policy or judge): a batch trained (``samples`` > 0, ``version`` new), or
    (``samples`` 0, ``version`` unchanged) a report of groups the lane disposed of without training
    them. Every group the learner is done with is named once, in one of the ``*group_ids`` fields
    (``disposed_group_ids``: all of them), so what waits for the learner (``coevo.algorithm.admission``)
    is released by it, trained or not."""

    kind: Literal["learner.stepped"] = "learner.stepped"
    role: Role
    version: int = Field(ge=0, description="model version produced by this step")
    samples: int = Field(ge=0)
    tokens: int = Field(ge=0)
    loss: float
    kl: float
    clip_fraction: float
    mismatch_kl: float = Field(
        description="KL per response token from the sampler's distributions to the learner's weights before this "
        "step, on the batch's sampled tokens: the sampler's mismatch, plus the drift of the weights since a stale "
        "sample was drawn"
    )
    mismatch_kl_current: float | None = Field(
        default=None,
        ge=0,
        description="mismatch_kl on the batch's samples drawn by the weights the learner held (staleness 0): the "
        "sampler's mismatch alone (precision, kernels, a server's defaults); null when the batch had none",
    )
    staleness_histogram: dict[str, int] = Field(default_factory=dict)
    tokens_per_second: float
    group_ids: list[str] = Field(default_factory=list, description="groups this step trained")
    kl_rejected_group_ids: list[str] = Field(
        default_factory=list, description="groups of batches undone by learner.max_step_kl, acknowledged untrained"
    )
    stale_group_ids: list[str] = Field(
        default_factory=list,
        description="groups whose samples were all older than learner.max_staleness, acknowledged untrained",
    )
    no_signal_group_ids: list[str] = Field(
        default_factory=list,
        description="train groups that gave this lane no sample to train (no learning signal: all won or all lost, "
        "all advantages zero, outside the band, or every sample refused), acknowledged untrained",
    )
    dead_lettered_group_ids: list[str] = Field(
        default_factory=list,
        description="groups this lane could not train even alone (e.g. a loss or gradient that is not finite): "
        "rejected and dead-lettered with the reason",
    )
    not_finite: int = Field(
        default=0,
        ge=0,
        description="batches refused since this lane's previous LearnerStepped because a loss or gradient norm "
        "was not finite (weights and optimiser state left untouched; their groups retried alone)",
    )
    stale_dropped: int = Field(
        default=0,
        ge=0,
        description="samples dropped as older than learner.max_staleness since this lane's previous LearnerStepped",
    )
    kl_rejected: int = Field(
        default=0, ge=0, description="batches undone by learner.max_step_kl since this lane's previous LearnerStepped"
    )
    step_kl: float | None = Field(
        default=None,
        ge=0,
        description="KL per token from the weights before this step "
        "to those after, on its batch (measured under learner.max_step_kl)",
    )
    entropy: float | None = Field(
        default=None,
        ge=0,
        description="nats per response token of the distributions this step's batch was drawn from (temperature, "
        "allowed tokens, grammar, truncation), under the weights before the step: a policy collapsing to one "
        "answer goes to 0",
    )
    entropy_coef: float | None = Field(
        default=None,
        ge=0,
        description="the entropy bonus's coefficient this step was trained with: learner.entropy_coef, or the "
        "adaptive one under learner.entropy_target (0 while the entropy is at or above the target)",
    )

    @property
    def is_step(self) -> bool:
        """A trained batch (a new version), not a report of groups disposed of untrained."""
        return self.samples > 0

    @property
    def disposed_group_ids(self) -> list[str]:
        """Every group this event names: trained, undone by the KL guard, stale, without signal, dead-lettered."""
        return [
            *self.group_ids,
            *self.kl_rejected_group_ids,
            *self.stale_group_ids,
            *self.no_signal_group_ids,
            *self.dead_lettered_group_ids,
        ]


class WeightsPublished(Event):
    """New weights exist on disk; never the bytes themselves."""

    kind: Literal["weights.published"] = "weights.published"
    role: Role
    version: int = Field(ge=0)
    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)
    format: WeightsFormat = Field(
        default="full",
        description="full: a model directory (every tensor, what a "
        "server reloads); lora: a LoRA adapter directory (PEFT's format) of the base "
        "model the servers serve",
    )


class WeightsApplied(Event):
    """An inference server (vLLM or a local engine) now serves ``version`` (or failed to)."""

    kind: Literal["weights.applied"] = "weights.applied"
    role: Role
    server: str
    version: int = Field(ge=0)
    pause_ms: float = Field(ge=0.0)
    ok: bool = True
    error: str | None = None
    transport: Literal["disk", "gloo", "nccl", "adapter"] = Field(
        default="disk",
        description="how the weights got there: loaded from the published path, pushed "
        "by the learner over a collective, or a LoRA adapter loaded beside the base (vLLM's "
        "/v1/load_lora_adapter, or beside a local engine's base layers)",
    )


# ---- runtime -----------------------------------------------------------------------------------

AgentState = Literal["starting", "running", "paused", "draining", "stopped", "failed"]


class AgentStatus(Event):
    """Heartbeat and lifecycle transitions of an agent."""

    kind: Literal["agent.status"] = "agent.status"
    agent_id: Identifier
    role: Identifier
    state: AgentState
    uptime_s: float = Field(ge=0.0)
    counters: dict[str, int] = Field(default_factory=dict)
    detail: str | None = None


class DeadLettered(Event):
    """A message a consumer could not accept, kept with its raw bytes and the reason."""

    kind: Literal["dead.lettered"] = "dead.lettered"
    original_subject: str
    consumer: str
    reason: str
    raw: bytes
    delivery_count: int = Field(ge=0)
    headers: dict[str, str] = Field(default_factory=dict)


class BudgetExceeded(Event):
    """An external API reached its spending cap: no further calls are made to it."""

    kind: Literal["budget.exceeded"] = "budget.exceeded"
    backend: str
    model: str
    spent_usd: float = Field(ge=0.0)
    max_usd: float = Field(ge=0.0)


class RunFinished(Event):
    """The run stopped; carries the summary that ``summary.json`` also holds."""

    kind: Literal["run.finished"] = "run.finished"
    summary: dict[str, Any] = Field(default_factory=dict)
