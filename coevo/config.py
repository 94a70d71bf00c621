"""One typed config tree for every coevo process.

Precedence (lowest to highest): defaults -> config file (TOML or YAML) -> environment
(``COEVO_SECTION__FIELD``) -> command-line flags. Unknown keys and wrong types fail at load time
with a ``ConfigError`` that names the dotted field. Secrets are never fields of this tree: they
come from the environment at the point of use.
"""

from __future__ import annotations

import contextvars
import difflib
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from coevo.errors import ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class RunConfig(Section):
    run_id: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9_\-]{1,64}$", description="run id (default: generated)"
    )
    runs_dir: Path = Field(default=Path("runs"), description="parent directory of run directories")
    minutes: float = Field(default=3.0, ge=0.0, description="wall-clock budget; 0 = until stopped")
    steps: int | None = Field(default=None, ge=1, description="stop after this many policy learner steps")
    seed: int = Field(default=0, description="global seed")


class NatsConfig(Section):
    url: str | None = Field(
        default=None,
        description="NATS URL, or a cluster's URLs comma-separated "
        "(nats://h1:4222,nats://h2:4222); none = start an embedded server",
    )
    user: str | None = Field(default=None, description="NATS user name (its password from password_env)")
    password_env: str | None = Field(default=None, description="name of the environment variable holding the password")
    token_env: str | None = Field(default=None, description="environment variable holding a token")
    creds_file: Path | None = Field(default=None, description="NATS .creds file")
    credentials_file: Path | None = Field(
        default=None,
        description="a coevo credentials file ({user, password}, mode 0600): a run's embedded server "
        "writes one per role under runs/<run>/nats/credentials/ (docs/security.md)",
    )
    tls_ca: Path | None = Field(default=None, description="CA bundle that signed the server's certificate")
    tls_cert: Path | None = Field(default=None, description="client certificate (mutual TLS)")
    tls_key: Path | None = Field(default=None, description="the client certificate's key")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="per connection attempt")
    server_binary: str = Field(default="nats-server", description="binary for the embedded server")


class StreamConfig(Section):
    max_age_s: float = Field(default=7 * 24 * 3600.0, gt=0, description="drop events older than this")
    max_bytes: int = Field(
        default=-1, ge=-1, description="stream size limit in bytes (-1: none; JetStream reserves it up front)"
    )
    max_msg_size: int = Field(
        default=8 * 1024**2,
        ge=1024,
        description="largest stored message (larger events travel as claims on the object store, bus.inline_max_bytes)",
    )
    retain_bytes: int = Field(
        default=16 * 1024**3,
        ge=0,
        description="coevo purges the oldest events, once every consumer has "
        "acknowledged them, to keep the stream under this (0: keep everything until max_age_s)",
    )
    retain_min_age_s: float = Field(
        default=7200.0,
        gt=0,
        description="never purge events younger than this (longer than "
        "tasks.inflight_timeout_s and scorer.group_timeout_s)",
    )
    retain_check_s: float = Field(default=60.0, gt=0, description="how often the retention keeper looks")
    retain_headroom: float = Field(default=0.8, gt=0, le=1, description="a purge leaves this share of retain_bytes")
    duplicate_window_s: float = Field(default=120.0, gt=0, description="Nats-Msg-Id dedupe window")
    storage: Literal["file", "memory"] = Field(default="file", description="where the server keeps the stream")
    replicas: int = Field(default=1, ge=1, le=5, description="copies of the stream across a cluster's nodes")


class BusConfig(Section):
    max_inflight_publishes: int = Field(default=512, ge=1, description="bound on unacked publishes")
    publish_ack_timeout_s: float = Field(
        default=10.0, gt=0, description="a publish unacknowledged this long is sent again under its id"
    )
    publish_retries: int = Field(default=5, ge=0, description="tries of a confirmed publish before PublishError")
    fetch_batch: int = Field(default=64, ge=1, description="messages one pull asks for")
    fetch_timeout_s: float = Field(default=1.0, gt=0, description="how long one pull waits for messages")
    max_ack_pending: int = Field(default=256, ge=1, description="server-side backpressure per consumer")
    ack_wait_s: float = Field(default=30.0, gt=0, description="redelivery after this without ack")
    max_deliver: int = Field(default=5, ge=1, description="then the message is dead-lettered")
    nak_backoff_s: list[float] = Field(
        default_factory=lambda: [0.2, 1.0, 5.0],
        min_length=1,
        description="redelivery delays after a crash, by attempt (the last repeats)",
    )
    handler_concurrency: int = Field(default=8, ge=1, description="handlers of one subscription at once")
    unshared_inactive_s: float = Field(
        default=300.0,
        gt=0,
        description="the server deletes an unshared consumer (one agent instance's own: weight followers, "
        "learner-decisions) after this long without a pull: a partition longer than this deletes it, and the "
        "agent creates it again where it left off when it reconnects",
    )
    in_progress_every_s: float = Field(default=10.0, gt=0, description="heartbeat for long handlers")
    payload_wait_s: float = Field(
        default=300.0,
        gt=0,
        description="on its last delivery, a message whose claimed payload cannot be read "
        "now is held and read again for this long before it is dead-lettered (an object store unreachable for "
        "longer than the redeliveries take)",
    )
    inline_max_bytes: int = Field(
        default=256 * 1024,
        ge=1024,
        description="an event encoded larger than this is stored in the run's object "
        "store and the stream holds a claim (key + sha256); always kept below stream.max_msg_size",
    )

    @model_validator(mode="after")
    def _in_progress_before_ack_wait(self) -> BusConfig:
        if self.in_progress_every_s >= self.ack_wait_s:
            raise ValueError("bus.in_progress_every_s must be shorter than bus.ack_wait_s")
        return self


class AgentConfig(Section):
    heartbeat_s: float = Field(default=5.0, gt=0, description="between an agent's agent.status events")
    heap_trim_s: float = Field(
        default=30.0,
        ge=0,
        description="seconds between handing freed heap memory back to the OS (glibc's malloc_trim) in a "
        "process that runs agents: otherwise what a learner step's activations held stays resident, and "
        "grows with fragmentation; 0 = never",
    )
    drain_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="once stopped (SIGTERM), how long work in "
        "flight may go on before it is cancelled and handed back (redelivered): a "
        "stop ends the process within about this plus a second",
    )
    restart_backoff_s: list[float] = Field(
        default_factory=lambda: [0.1, 0.5, 2.0, 5.0],
        min_length=1,
        description="delays before restarting a crashed agent, by attempt",
    )
    max_restarts: int = Field(
        default=20,
        ge=0,
        description="crashes of one task within agent.restart_window_s it survives; one more and the agent fails",
    )
    restart_window_s: float = Field(
        default=3600.0,
        gt=0,
        description="crashes older than this no longer "
        "count against agent.max_restarts (rare transient crashes never add up)",
    )


FAMILY_ENTRY_POINTS = "coevo.families"
"""The entry-point group of every task family, coevo's own included (``coevo.envs.make_family``)."""
_GYM_SPEC = re.compile(r"^gym:[A-Za-z_][\w.]*:[A-Za-z_][\w.\-]*$")


def registered_families() -> list[str]:
    """Names of the families registered under ``coevo.families`` (metadata only): coevo's own
    (quickgame, quickgame-hard, textworld, coding) and installed plugins'."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=FAMILY_ENTRY_POINTS)})


def family_problem(name: str, *, external: bool = True) -> str | None:
    """Why ``name`` is not a family coevo can build (None when it is): ``external``, a
    ``gym:<module>:<EnvClass or id>`` spec, or a family registered under ``coevo.families``."""
    if (external and name == "external") or _GYM_SPEC.match(name):
        return None
    if name.startswith("gym:"):
        return f"{name!r} is not gym:<module>:<EnvClass or registered id> (no '/' and no spaces)"
    registered = registered_families()
    if name in registered:
        return None
    if "quickgame" not in registered:
        return (
            f"unknown family {name!r}: no family is registered, not even coevo's own (they are entry points "
            f"of the group {FAMILY_ENTRY_POINTS!r}, registered when coevo is installed: pip install -e .)"
        )
    known = [*registered, *(["external"] if external else []), "gym:<module>:<EnvClass or id>"]
    return (
        f"unknown family {name!r} (known: {', '.join(known)}; plugins register under the entry-point "
        f"group {FAMILY_ENTRY_POINTS!r})"
    )


class EnvConfig(Section):
    family: str = Field(
        default="quickgame",
        description="task family: quickgame | quickgame-hard (its hard preset) | "
        "textworld | tw-coin_collector | tw-treasure_hunter | tw-cooking (TextWorld's challenge games) | "
        "arithmetic | coding | external "
        "(the environment is an outside program talking to the policy endpoint) | "
        "gym:<module>:<EnvClass or id> (a Gymnasium env with text observations and actions) | "
        "a plugin's name (entry-point group coevo.families)",
    )
    tasks_from: str | None = Field(
        default=None,
        description="family external: the family whose tasks make the pool handed out by POST "
        "/coevo/v1/episodes (then rewritten like any pool); none: agents bring their own tasks",
    )
    gym_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="gym: keyword arguments of the env constructor or gymnasium.make"
    )
    gym_observation: str | None = Field(
        default=None,
        description="gym: module:function (observation, info) -> text, for envs whose observations are not text",
    )
    gym_action: str | None = Field(
        default=None,
        description="gym: module:function (text, env) -> action, for "
        "envs whose actions are not text or indices of the candidates",
    )
    max_steps: int = Field(
        default=50,
        ge=1,
        le=1000,
        description="gym and external: step cap of an episode (a gym env's own max_episode_steps wins when smaller)",
    )
    win_threshold: float = Field(
        default=0.0,
        description="gym, and external episodes finished with a reward: an episode is won when its return exceeds this",
    )
    start_knobs: dict[str, tuple[int, int]] = Field(
        default_factory=dict,
        description="where the initial train tasks are drawn: knob -> [low, high], within the family's "
        "train bounds (the rewriter then moves tasks anywhere within those); a knob not named keeps the "
        'family\'s own range. E.g. tw-coin_collector {"length": [1, 3]}: short chains a small model '
        "sometimes wins (quickgame and TextWorld's challenge games)",
    )
    n_train: int = Field(default=8, ge=1, description="training task slots")
    n_heldout: int = Field(default=8, ge=0, description="held-out tasks (never rewritten)")
    seed: int = Field(default=0, description="seed of the initial task set")
    cache_dir: Path | None = Field(default=None, description="compiled games cache (default ~/.cache/coevo)")
    jsonl: Path | None = Field(default=None, description="coding: a JSONL problem file instead of HumanEval")
    remote: bool = Field(default=False, description="use environment workers over NATS (coevo agent env)")
    step_timeout_s: float = Field(default=30.0, gt=0, description="a remote step slower than this fails")
    max_sessions: int = Field(default=64, ge=1, description="episodes one env worker hosts at once")
    session_idle_s: float = Field(default=600.0, gt=0, description="an idle remote episode is closed")
    sandbox: Literal["bwrap", "process"] = Field(
        default="bwrap",
        description="coding: how programs are isolated. bwrap: bubblewrap namespaces (no network, "
        "no host files, read-only interpreter, unprivileged uid, seccomp); process: an audit hook and rlimits "
        "only, NOT safe for untrusted (RL-trained) policies, opt in for trusted code (docs/security.md)",
    )

    @field_validator("family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        if (problem := family_problem(name)) is not None:
            raise ValueError(problem)
        return name

    @field_validator("start_knobs")
    @classmethod
    def _ranges(cls, ranges: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        for name, (low, high) in ranges.items():
            if low > high:
                raise ValueError(f"{name}: [{low}, {high}] has its low end above its high end")
        return ranges

    @model_validator(mode="after")
    def _tasks_from_a_family(self) -> EnvConfig:
        if self.tasks_from is not None:
            if self.family != "external":
                raise ValueError("env.tasks_from is for env.family = 'external' (other families make their own pool)")
            if (problem := family_problem(self.tasks_from, external=False)) is not None:
                raise ValueError(f"env.tasks_from: {problem}")
        return self

    @model_validator(mode="after")
    def _coding_needs_isolation(self) -> EnvConfig:
        import shutil

        if self.family == "coding" and self.sandbox == "bwrap" and shutil.which("bwrap") is None:
            raise ValueError(
                "env.sandbox = 'bwrap' needs bubblewrap (bwrap), which is not on PATH: install it with "
                "apt-get install bubblewrap; or set env.sandbox = 'process' to run programs without "
                "isolation (trusted programs only)"
            )
        return self


Band = tuple[float, float]
PromptFormat = Literal["auto", "chat", "raw"]
ComputeDtype = Literal["auto", "bfloat16", "float32"]


def _check_band(band: Band, name: str) -> Band:
    low, high = band
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"{name} must satisfy 0 <= low <= high <= 1, got {band}")
    return band


class SamplingConfig(Section):
    """How a role's tokens are sampled beside the temperature: stated on every request (a model's
    ``generation_config.json`` defaults never apply) and applied by the learner to its log-probs,
    so what is trained is what was sampled. Penalties are always neutral."""

    top_k: int = Field(default=0, ge=0, description="sample among the k most likely tokens (0: off)")
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="nucleus: the most likely tokens holding this probability (1: off)"
    )
    min_p: float = Field(
        default=0.0, ge=0, lt=1, description="drop tokens less likely than min_p times the most likely one (0: off)"
    )

    @property
    def is_neutral(self) -> bool:
        return self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0.0


class GrammarConfig(Section):
    """Budgets of structured outputs (``coevo.inference.grammar``): a client's schema is checked against
    them before anything compiles it, and a compile runs on a worker thread, never on an event loop or
    the engine's batch thread; over a budget the request is refused with a 400 naming the field."""

    max_schema_bytes: int = Field(
        default=64 << 10, ge=256, description="largest JSON schema (or tools' parameter schemas) of a request, in bytes"
    )
    max_enum_values: int = Field(
        default=1024, ge=1, description="most enum and const values in one request's schemas, all counted together"
    )
    max_schema_depth: int = Field(default=32, ge=1, description="deepest nesting of subschemas in one schema")
    max_grammar_bytes: int = Field(
        default=256 << 10, ge=1024, description="largest grammar (EBNF text) compiled, the learner's replay included"
    )
    compile_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="a grammar's compile that takes longer is refused (the request freed at once; the compile ends "
        "on its worker and is discarded, and the same grammar is refused again without compiling)",
    )
    cache_bytes: int = Field(
        default=256 << 20, ge=1 << 20, description="compiled grammars kept per process, by their size in memory"
    )


class PolicyConfig(Section):
    model: Path | None = Field(default=None, description="transformers model dir (default: tiny built locally)")
    url: str | None = Field(default=None, description="vLLM server (http://host:port/v1) serving the policy")
    served_name: str | None = Field(default=None, description="model name on the vLLM server")
    n: int = Field(default=8, ge=2, le=256, description="trajectories per task (group size)")
    mode: Literal["choice", "generate", "chat"] = Field(
        default="choice",
        description="constrained index, free text, or a multi-turn conversation rendered with "
        "the model's chat template (token-in/token-out across turns)",
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        description="sampling temperature (the learner computes log-probs at it: what is trained is what was sampled)",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grammar: GrammarConfig = Field(default_factory=GrammarConfig)
    prompt_format: PromptFormat = Field(
        default="auto",
        description="how the built-in families' prompts reach the model: chat (its chat template: an "
        "instruction, then the observation and the labelled actions as the user turn), raw (the text after "
        "BOS, for base models), auto (chat when the tokenizer ships a chat template of its own)",
    )
    shuffle_choices: bool = Field(
        default=True,
        description="show the candidates in an order drawn per step from the episode's seed, so an "
        "answer's label carries no information (the trajectory records the action itself)",
    )
    max_tokens: int = Field(default=64, ge=1, description="most tokens of one action")
    max_concurrent_trajectories: int = Field(default=64, ge=1, description="rollouts played at once")
    serve_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="serve the OpenAI-compatible policy endpoint (/v1/chat/completions, "
        "/v1/completions, /coevo/v1/episodes) on this port (0: any free port); env.family = 'external' serves on "
        "8000 when unset",
    )
    serve_host: str = Field(
        default="127.0.0.1",
        description="address of the policy endpoint; beyond loopback "
        "every request needs the key of policy.serve_api_key_env",
    )
    serve_api_key_env: str = Field(
        default="COEVO_POLICY_API_KEY",
        description="environment variable holding the "
        "endpoint's API key; when unset, a key is generated for the run and written "
        "to runs/<run>/policy-endpoint.key (mode 0600). Every request must carry it",
    )
    serve_insecure_loopback: bool = Field(
        default=False,
        description="serve the policy endpoint without a key, "
        "on loopback only: any local user or program can then sample from the "
        "policy and open, reward and finish episodes (docs/security.md)",
    )
    serve_max_tokens: int = Field(default=512, ge=1, description="cap on a request's max_tokens at the endpoint")
    serve_strict: bool = Field(
        default=False,
        description="refuse (400, naming it) a request's sampling parameter the policy does not sample "
        "with (temperature, top_p, top_k, min_p other than policy's; penalties, logit_bias); "
        "off: served at the policy's own, and counted (endpoint.knobs_ignored.<name>)",
    )
    serve_max_unrecorded: int = Field(
        default=4,
        ge=1,
        description="calls outside episodes served at once by the "
        "endpoint (more answer 429): the policy's engine is for the episodes",
    )
    serve_retry_after_s: float = Field(
        default=2.0,
        gt=0,
        description="Retry-After of the endpoint's 429 and 503 "
        "answers (the OpenAI and Anthropic SDKs wait that long before retrying)",
    )
    serve_backlog_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="a finished group of the endpoint's "
        "that no policy learner step names stops holding new episodes back after "
        "this long (its samples were rejected)",
    )
    episode_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="an endpoint episode idle this long is reported aborted (its group completes without it)",
    )


class ApiConfig(Section):
    """An external LLM API through LiteLLM. Keys are read from the environment, never from config."""

    api_key_env: str | None = Field(default=None, description="env var with the key (default: the provider's)")
    fallbacks: list[str] = Field(default_factory=list, description="provider/name models tried in order")
    rpm: int | None = Field(default=None, ge=1, description="requests per minute limit")
    tpm: int | None = Field(default=None, ge=1, description="tokens per minute limit")
    max_concurrency: int = Field(default=16, ge=1, description="calls in flight at once")
    retries: int = Field(default=4, ge=0, description="retries with jittered backoff (rate limits, timeouts)")
    backoff_s: float = Field(default=1.0, gt=0, description="first backoff; doubles, with jitter")
    timeout_s: float = Field(default=60.0, gt=0, description="per call")
    max_usd: float | None = Field(default=None, gt=0, description="stop calling once this much was spent")
    cache: bool = Field(default=True, description="cache responses in JetStream KV (re-runs don't pay twice)")
    mock_response: str | list[str] | None = Field(
        default=None, description="offline testing: LiteLLM mock_response per attempt (text or error name)"
    )
    mock_delay_s: float | None = Field(
        default=None, gt=0, description="offline testing: LiteLLM's mock_delay, seconds before each mocked answer"
    )


class LocalEndpoint(Section):
    """A model directory loaded in this process (transformers), trained by the learner where it is a lane."""

    backend: Literal["local"] = Field(default="local", description="the tag: a local model")


class VllmEndpoint(Section):
    """A vLLM server (OpenAI-compatible API)."""

    backend: Literal["vllm"]
    url: str = Field(description="the server's base URL, e.g. http://127.0.0.1:8000/v1")
    model: str | None = Field(default=None, description="the served model name (default: the role's name)")


class LitellmEndpoint(Section):
    """An external LLM API through LiteLLM: never trained; keys, limits and costs in ``api``."""

    backend: Literal["litellm"]
    model: str = Field(description="provider/name, e.g. openai/gpt-4.1-mini")
    url: str | None = Field(
        default=None, description="api_base: a proxy or self-hosted endpoint (default: the provider's)"
    )
    api: ApiConfig = Field(default_factory=ApiConfig)


def _tagged(tag: str, default: str) -> Any:
    """A tagged section's input: a bare string names the tag; a table without the tag gets ``default``."""

    def before(value: Any) -> Any:
        if isinstance(value, str):
            return {tag: value}
        if isinstance(value, dict) and tag not in value:
            return {**value, tag: default}
        return value

    return BeforeValidator(before)


class JudgeBase(Section):
    """What every judge backend shares: votes per step, how a vote is asked for, sampling."""

    m: int = Field(default=3, ge=1, le=32, description="votes per step")
    mode: Literal["auto", "verdict", "reasoned"] = Field(
        default="auto", description="auto: one constrained token for local models, reasoning + \\boxed otherwise"
    )
    temperature: float = Field(
        default=0.8, gt=0, description="sampling temperature of a vote (a trained judge's log-probs are computed at it)"
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    max_tokens: int = Field(default=256, ge=1, description="most tokens of a reasoned vote")
    prompt_format: PromptFormat = Field(
        default="auto",
        description="how a vote's prompt reaches a local or vLLM judge: chat (the model's chat template: an "
        "instruction, then the step as the user turn), raw (the text after BOS, for base models), auto (chat "
        "when the tokenizer ships a chat template of its own, as instruct models do)",
    )
    max_concurrent_steps: int = Field(default=32, ge=1, description="steps judged at once")

    @property
    def effective_mode(self) -> Literal["verdict", "reasoned"]:
        if self.mode == "auto":
            return "verdict" if isinstance(self, LocalJudge) else "reasoned"
        return self.mode


class LocalJudge(JudgeBase, LocalEndpoint):
    """``judge.backend = "local"`` (the default): the judge is a local model, trained on its consistency
    rewards by the learner's judge lane."""

    model: str | None = Field(
        default=None, description="model directory (default: the tiny judge built for the run from run.seed)"
    )


class VllmJudge(JudgeBase, VllmEndpoint):
    """``judge.backend = "vllm"``: a vLLM server votes; it is trained (weights pushed or reloaded) when
    ``model`` is the local directory the server serves as is."""

    model: str | None = Field(
        default=None, description="the served model name (a local directory served as is is trained)"
    )


class LitellmJudge(JudgeBase, LitellmEndpoint):
    """``judge.backend = "litellm"``: an external API votes (reasoning, then a boxed verdict); never trained."""

    @model_validator(mode="after")
    def _reasons(self) -> LitellmJudge:
        if self.mode == "verdict":
            raise ValueError("judge.mode 'verdict' needs a local model; use 'reasoned' with an API")
        return self


JudgeConfig = Annotated[
    LocalJudge | VllmJudge | LitellmJudge, _tagged("backend", "local"), Field(discriminator="backend")
]
"""``judge``: tagged by ``backend``; only the chosen backend's fields exist (``judge.url`` with the local
backend is an error naming ``judge.local.url``)."""


class ScorerConfig(Section):
    reward: Literal["integrated", "outcome-only", "steps-only"] = Field(
        default="integrated",
        description="R = outcome + λ·mean(step votes) (docs/algorithm.md §1), the outcome alone, or the votes alone",
    )
    lam: float = Field(default=1.0, ge=0, description="weight of the step votes (λ)")
    env_reward_weight: float = Field(
        default=1.0,
        ge=0,
        description="weight of an environment's own step rewards "
        "(StepTaken.env_reward, e.g. POST /coevo/v1/episodes/{id}/reward), added to R_i",
    )
    policy_band: Band = Field(default=(0.125, 0.875), description="accuracy band of tasks the policy trains on")
    judge_band: Band = Field(default=(0.2, 0.8), description="accuracy band of tasks the judge trains on")
    judge_balance: bool = Field(
        default=False,
        description="weigh the judge's consistency advantages so that the steps of a group's won and of its lost "
        "trajectories count alike (S/(2·S_won), S/(2·S_lost)): the judge then learns which steps raise the odds "
        "of winning above the task's own, not the base rate of failure that makes it vote -1 everywhere. "
        "Measured on the tiny judge, it stops the -1 collapse, but 3 judges of 5 saturate at +1 instead "
        "(docs/benchmarks.md 'Why a judge collapses'); off is the paper's reward",
    )
    judge_baseline: Literal["step", "group"] = Field(
        default="step",
        description="what the judge's consistency rewards are standardised over: 'step', the paper's, over the "
        "step's own m votes (a step whose votes agree is skipped, so a judge that votes alike everywhere hears "
        "nothing more); 'group', over every vote of the group, so such a step still tells the judge whether "
        "its votes agreed with the outcome more or less than the group's average vote (with judge_balance, the balanced "
        "average). Measured alone on the tiny judge it sends every judge to -1 (docs/benchmarks.md 'Why a judge "
        "collapses'): off",
    )
    max_abs_env_reward: float = Field(
        default=100.0,
        gt=0,
        le=1e6,
        description="the bound of an environment's reward: the policy endpoint refuses (400, param reward) a step "
        "reward or a finish reward that is not a finite number within ±this, or that would take a step's total "
        "beyond it; the scorer clips StepTaken.env_reward to ±this (a NaN counts 0) whatever path it came by",
    )
    vote_timeout_s: float = Field(default=60.0, gt=0, description="score without missing votes after this")
    group_timeout_s: float = Field(default=600.0, gt=0, description="score a group with missing trajectories")

    @model_validator(mode="after")
    def _bands(self) -> ScorerConfig:
        _check_band(self.policy_band, "scorer.policy_band")
        _check_band(self.judge_band, "scorer.judge_band")
        return self


class BuiltinRewriterConfig(Section):
    """``tasks.rewriter = "builtin"`` (the default): the family's knob operators, ordered by the critic's
    summaries; no model."""

    backend: Literal["builtin"] = Field(default="builtin", description="the tag: the built-in rewriter")


class NoRewriter(Section):
    """``tasks.rewriter = "off"``: the pool is never rewritten, even in the full loop."""

    backend: Literal["off"]


class LLMRewriterBase(Section):
    """An LLM proposes the rewritten task's knobs as JSON, validated against the family's bounds."""

    retries: int = Field(
        default=2,
        ge=0,
        description="new tries after an invalid proposal (the prompt then "
        "says what was wrong); then the proposal is rejected with the error",
    )


class LitellmRewriter(LLMRewriterBase, LitellmEndpoint):
    """``tasks.rewriter.backend = "litellm"``: an external API rewrites."""


class VllmRewriter(LLMRewriterBase, VllmEndpoint):
    """``tasks.rewriter.backend = "vllm"``: a model on a vLLM server rewrites."""

    model: str = Field(description="the served model name")


class LocalRewriter(LLMRewriterBase, LocalEndpoint):
    """``tasks.rewriter.backend = "local"``: a local model directory rewrites."""

    model: str = Field(description="model directory")


RewriterConfig = Annotated[
    BuiltinRewriterConfig | NoRewriter | LitellmRewriter | VllmRewriter | LocalRewriter,
    _tagged("backend", "builtin"),
    Field(discriminator="backend"),
]
"""``tasks.rewriter``: tagged by ``backend``; a bare string names it (``tasks.rewriter = "off"``)."""
LLMRewriterConfig = LitellmRewriter | VllmRewriter | LocalRewriter


class TasksConfig(Section):
    rewriter: RewriterConfig = Field(default_factory=BuiltinRewriterConfig)
    band: Band = Field(default=(0.2, 0.8), description="(α_low, α_high) of the rewrite trigger and gate")
    min_groups_between_rewrites: int = Field(default=2, ge=0, description="per slot, against oscillation")
    train_worlds: Literal["slot", "fresh"] = Field(
        default="slot",
        description="what a train group of a slot plays: the slot's active task (slot: the same world every time, "
        "which a policy can win by memorising it) or its knobs in a world drawn for that group and never a "
        "held-out one (fresh: winning needs reading the observation; families whose tasks have a seed param, "
        "the others play the slot's task). Rewrites, candidates and held-out rounds are the same either way",
    )
    max_groups_in_flight: int = Field(default=4, ge=1, description="scheduled but not yet scored")
    eval_every: int = Field(default=16, ge=1, description="train groups between held-out evaluations")
    eval_every_s: float | None = Field(
        default=None,
        gt=0,
        description="seconds from the end of a held-out evaluation to the next, as well (whichever comes first "
        "with eval_every); unset: by train groups only. Not given with a model you name (policy.model) and no "
        "tasks.eval_every either: PRETRAINED_EVAL_EVERY_S, so that a run of a few minutes on a slow machine "
        "has a round to compare",
    )
    saturated_after: int = Field(
        default=3,
        ge=0,
        description="a train slot whose last this many scored groups were all won or all lost "
        "is saturated (no outcome signal): scheduled less, rewritten with larger moves; 0 = off",
    )
    saturated_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="how often a saturated slot is scheduled relative to the others (stride scheduling)",
    )
    saturated_moves: int = Field(
        default=3,
        ge=1,
        description="most knob steps one rewrite of a saturated slot moves (1 + streak // saturated_after; "
        "below the moves of a candidate of the same task that went too far in that direction)",
    )
    inflight_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="a scheduled group never scored after this (its TaskScheduled or "
        "GroupScored was lost) stops counting against max_groups_in_flight; a candidate is scheduled again",
    )

    @model_validator(mode="after")
    def _band(self) -> TasksConfig:
        _check_band(self.band, "tasks.band")
        return self


class DiskSync(Section):
    """Servers reload each version from the published weights' directory: every server must see the
    learner's files (one host, or ``learner.publication_root`` on shared storage)."""

    transport: Literal["disk"] = Field(default="disk", description="the tag: servers reload from disk")


class PushSync(Section):
    """The learner pushes each version into the servers over a collective: gloo on CPU (the server runs
    with ``--weight-transfer-config '{"backend": "coevo_gloo"}'``), nccl on GPU (``'{"backend": "nccl"}'``).
    A server whose transfer fails reloads from disk, and connects again on the next version."""

    transport: Literal["gloo", "nccl"] = Field(description="the tag: the collective weights are pushed over")
    host: str = Field(default="127.0.0.1", description="address the vLLM servers reach the learner at")
    timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="limit of one pushed transfer, from the offer to "
        "the last tensor, including the pause's wait for requests in flight",
    )
    servers: tuple[str, ...] = Field(
        default=(),
        description="the servers (their followers' agent ids) allowed to connect for pushed weights; "
        "empty: any name not already connected",
    )
    max_links: int = Field(
        default=8,
        ge=1,
        le=256,
        description="transfer groups the learner holds at once (each takes a thread of its own transfer pool "
        "while it forms or sends); a new server's connect past it is refused unless it replaces a broken link",
    )
    max_workers: int = Field(
        default=8, ge=1, le=1024, description="the most workers (ranks) one server's connect may ask the group for"
    )


WeightSync = Annotated[DiskSync | PushSync, _tagged("transport", "disk"), Field(discriminator="transport")]
"""``learner.weight_sync``: only the fields of the chosen transport exist (a ``host`` with disk is an error)."""


class LoraConfig(Section):
    """A LoRA lane: only an adapter on ``target_modules`` trains; checkpoints and published weights are
    the adapter (PEFT's format, a few MB), loaded by vLLM servers started with ``--enable-lora``
    (``--max-lora-rank`` at least ``rank``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) and applied beside their
    base layers by local engines."""

    rank: int = Field(default=16, ge=1, le=512, description="the adapter's rank r")
    alpha: float = Field(default=32.0, gt=0, description="LoRA alpha: the update is scaled by alpha / rank")
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="dropout on the adapter's input while training "
        "(> 0 makes the learner's log-probs differ from the sampler's by the dropout noise)",
    )
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        min_length=1,
        description="names of the linear layers that get an adapter (every one of them, in every layer)",
    )


PRETRAINED_EVAL_EVERY_S = 120.0
"""``tasks.eval_every_s`` with a model you name when no evaluation cadence is given: on 2 CPU cores
SmolLM2-135M scores a few train groups a minute, and 16 of them (``tasks.eval_every``) take longer than
the runs a person starts first"""

PRETRAINED_MAX_BATCH_TOKENS = 4096
"""``learner.max_batch_tokens`` with a model you name when none is given. A pretrained model keeps tens of
KB of activations per token and layer for the backward pass (SmolLM2-135M: about 40 KB × 30 layers in
fp32), so the tiny models' 32,768 tokens a micro-batch would hold over 30 GB: a 10-minute run of
SmolLM2 with reasoned judge votes (batches of up to 64 × 600 tokens) grew to 24 GB and was killed.
4,096 holds about 5 GB; the gradient is the same (micro-batches accumulate into one optimiser step)."""

LORA_PRETRAINED_LR = 1e-4
"""``learner.lr`` of LoRA lanes on a pretrained model when none is given (chosen by the sweep in
docs/benchmarks.md, "Learning rate of LoRA lanes on a pretrained model")"""


class LearnerConfig(Section):
    lr: float = Field(
        default=1e-3,
        gt=0,
        description="AdamW lr. Not given: 1e-3 for the built-in tiny models (random weights), "
        "LORA_PRETRAINED_LR for LoRA lanes of a model you name (policy.model), where 1e-3 collapses the policy "
        "within minutes (docs/benchmarks.md, the learning-rate sweep); ~1e-6 for full fine-tuning of a 7B",
    )
    judge_lr: float | None = Field(default=None, description="judge lane lr (default: lr)")
    batch_samples: int = Field(
        default=64, ge=1, description="samples per batch: one model version, minibatches × epochs optimiser steps"
    )
    batch_groups: int | None = Field(
        default=None,
        ge=1,
        description="count batches in groups instead of samples: a lane steps once this many "
        "groups were scored since its last step (those that gave it no sample count too, as in trainers that batch "
        "rollouts), on at most this many; unset: batch_samples. Lock-step (max_staleness = 0) steps per wave",
    )
    max_batch_tokens: int = Field(
        default=32768,
        ge=64,
        description="tokens of one micro-batch (padded); not given with a model you name (policy.model): "
        "PRETRAINED_MAX_BATCH_TOKENS",
    )
    clip_eps: float = Field(default=0.2, gt=0, description="PPO clip range ε of the ratio")
    clip_eps_high: float | None = Field(
        default=None,
        gt=0,
        description="upper clip of the ratio, 1 + this (clip-higher, DAPO: 0.28 lets unlikely tokens of a good "
        "answer gain more than likely ones lose, against entropy collapse); None: clip_eps on both sides. The "
        "clip acts only when a batch takes more than one optimiser step (epochs or minibatches > 1)",
    )
    kl_beta: float = Field(default=0.01, ge=0, description="weight of the k3 KL penalty against kl_reference")
    entropy_coef: float = Field(
        default=0.0,
        ge=0,
        description="entropy bonus: the loss subtracts this times the entropy (nats per response token) of the "
        "distributions the batch's tokens were drawn from, under the weights being trained (both lanes). Pushes "
        "against a policy collapsing onto one answer (every group unanimous: no signal left, "
        "LearnerStepped.entropy falling to 0). 0: none, no extra cost; > 0: the head's softmax is kept per token "
        "through the backward pass (recomputed, chunked). With entropy_target: the coefficient's start",
    )
    entropy_target: float | None = Field(
        default=None,
        gt=0,
        description="adaptive entropy bonus (coevo.training.entropy): a batch whose entropy before its step is below "
        "this (nats per response token) is trained with the bonus, whose coefficient grows by entropy_coef_step "
        "for every such batch and shrinks by as much for every batch at or above it (then trained without one); "
        "per lane. None: entropy_coef on every batch",
    )
    entropy_coef_step: float = Field(
        default=0.05, gt=0, description="how far one batch moves the adaptive coefficient (entropy_target)"
    )
    entropy_coef_max: float = Field(default=1.0, gt=0, description="the adaptive coefficient's bound (entropy_target)")
    grad_clip: float = Field(default=1.0, gt=0, description="gradient norm clip")
    max_staleness: int = Field(
        default=2,
        ge=0,
        description="versions data may lag (0 = synchronous): gates "
        "scheduling, and at the learner a sample older than this (lane version at step time "
        "- sample.model_version; the judge lane counts judge versions) is handled per `stale`",
    )
    stale: Literal["drop", "correct"] = Field(
        default="correct",
        description="samples beyond max_staleness at the learner: keep them with truncated "
        "importance sampling (weight capped at tis_cap whatever `correction` says, masked above it under 'mis'; "
        "the default: a fast learner "
        "ahead of its samplers loses no data) or drop them (counted, LearnerStepped.stale_dropped)",
    )
    kl_reference: Literal["behavior", "initial"] = Field(
        default="behavior",
        description="the KL penalty's reference: the sampling log-probs recorded in the "
        "samples (behavior), or the starting weights (initial: for full fine-tuning one more model in memory, in "
        "learner.dtype; for LoRA lanes the base with the adapters off, no extra memory)",
    )
    minibatches: int = Field(
        default=1,
        ge=1,
        description="optimiser steps per epoch: the batch is split into this "
        "many minibatches (one optimiser step each); 1 = one step per batch",
    )
    epochs: int = Field(
        default=1,
        ge=1,
        description="passes over the batch; proximal log-probs are taken once per "
        "batch (decoupled PPO), so with epochs or minibatches > 1 the PPO clip acts. The model "
        "version advances once per batch, whatever the number of optimiser steps",
    )
    verdict_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="how long a candidate group waits for its "
        "TaskDecided before it is redelivered (dropped untrained on its last delivery)",
    )
    parity_max_kl: float | None = Field(
        default=0.05,
        gt=0,
        description="at start, sample a probe batch from each "
        "vLLM server the learner trains for and refuse one whose behaviour "
        "log-probs are further than this (KL per token, nats) from the learner's "
        "own (a server applying sampling defaults coevo does not compute); None: "
        "no probe",
    )
    max_step_kl: float | None = Field(
        default=None,
        gt=0,
        description="step rejection: after a batch's optimiser steps, the KL per response token "
        "from the weights before it to those after (k3 on the batch's sampled tokens); above this, or not a number, "
        "the batch is undone (weights and optimiser state restored, version unchanged, its groups acknowledged "
        "untrained, named in LearnerStepped.kl_rejected_group_ids and counted in LearnerStepped.kl_rejected). "
        "None: no guard. When set, every batch costs one more forward pass and a full copy of the trainable weights "
        "and of the optimiser state (Adam: two more tensors per weight) on the learner's device while it trains",
    )
    correction: Literal["tis", "mis", "decoupled"] = Field(
        default="tis",
        description="off-policy correction, per token, of the sampler's log-probs against the learner's: tis "
        "(the importance weight truncated at tis_cap), mis (masked: a token whose weight exceeds tis_cap counts "
        "0, the rest their weight; for samplers whose numerics differ, e.g. bf16 kernels), decoupled (PPO with "
        "the proximal policy, weight capped far out)",
    )
    tis_cap: float = Field(default=2.0, ge=1.0, description="truncated importance sampling cap c")
    device: str | None = Field(default=None, description="torch device (default: cuda if available)")
    parallel: Literal["fsdp", "ddp"] = Field(
        default="fsdp", description="under torchrun: FSDP2 sharding or replicated data parallel"
    )
    dtype: ComputeDtype = Field(
        default="auto",
        description="compute dtype of the local models, engines and lanes alike: the engines serve their "
        "weights in it, a LoRA lane holds its frozen base in it (the adapter and its optimiser state stay float32), "
        "full fine-tuning runs its passes under autocast to it (master weights float32); log-softmax is float32 "
        "everywhere. auto: bfloat16 on GPUs of compute capability 8 or more and on CPUs with AMX or AVX512-BF16, for "
        "models of hidden size 512 or more, "
        "float32 elsewhere (the built-in tiny models: latency-bound, exact in float32)",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in the backward pass (less memory, more time)"
    )
    weight_sync: WeightSync = Field(
        default_factory=lambda: DiskSync(),
        description="how vLLM servers get new weights, tagged by "
        "`transport`: disk (reload from the published weights' path), gloo or nccl (pushed by the learner; see "
        'PushSync). A bare name ("gloo") stands for that transport with its defaults. Local engines take the '
        "published weights from memory in the learner's process, from disk elsewhere",
    )
    lora: LoraConfig | None = Field(
        default=None, description="train LoRA adapters instead of the full models (both lanes); unset: full fine-tuning"
    )
    publish_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="dtype of the published weights (what servers load, pushes send and "
        "WeightsPublished points at): auto = the lane's compute dtype (learner.dtype)",
    )
    publish_every: int = Field(default=1, ge=1, description="publish weights every N optimiser steps")
    checkpoint_every_steps: int = Field(
        default=10,
        ge=1,
        description="write a resume checkpoint (fp32 weights, optimizer state, consumed groups) "
        "every N steps, off the critical path. A GroupScored is acknowledged only once a checkpoint that includes "
        "it is durable, so the learner holds about N steps of groups unacknowledged: bus.max_ack_pending (the "
        "learner's subscription concurrency) must exceed twice that; a checkpoint is forced when half of it waits",
    )
    checkpoint_every_s: float = Field(
        default=30.0, gt=0, description="... or this long after the previous one, when trained groups wait for one"
    )
    verify: Literal["manifest", "full"] = Field(
        default="manifest",
        description="what followers check before loading published weights: the manifest "
        "(per-file sizes and sha256 written by the learner) against the announced digest and the files' sizes, "
        "or full: also re-hash every file",
    )
    publication_root: Path | None = Field(
        default=None,
        description="followers load announced weights only from under this directory (default: the "
        "run's checkpoints, runs/<run>/checkpoints, where the learner publishes); a WeightsPublished naming another "
        "path is refused and reported (docs/security.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _bf16_is_dtype(cls, data: Any) -> Any:
        """``learner.bf16`` (before ``learner.dtype``): false is float32, true is auto; a ``dtype`` given
        beside it wins."""
        if isinstance(data, dict) and "bf16" in data:
            data = dict(data)
            try:
                bf16 = TypeAdapter(bool).validate_python(data.pop("bf16"))  # "false" from --set or the environment
            except ValidationError as exc:
                raise ValueError(
                    f"learner.bf16: {exc.errors()[0]['msg']} (learner.dtype replaces it: auto, bfloat16 or float32)"
                ) from None
            data.setdefault("dtype", "auto" if bf16 else "float32")
        return data

    @model_validator(mode="after")
    def _entropy_start_within_bound(self) -> LearnerConfig:
        if self.entropy_target is not None and self.entropy_coef > self.entropy_coef_max:
            raise ValueError(
                f"learner.entropy_coef ({self.entropy_coef:g}) is the adaptive coefficient's start: it must not "
                f"exceed learner.entropy_coef_max ({self.entropy_coef_max:g})"
            )
        return self


class LogConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="lowest level logged")
    console: Literal["pretty", "json", "off"] = Field(default="pretty", description="how the console shows logs")
    tensorboard: bool = Field(default=True, description="write metrics as TensorBoard event files in runs/<id>/tb")
    wandb: bool = Field(
        default=False,
        description="also log metrics to Weights & Biases, offline (needs wandb "
        "installed; `wandb sync runs/<id>/wandb/offline-run-*` uploads later)",
    )
    wandb_project: str = Field(default="coevo", min_length=1, description="W&B project name")


_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("coevo_config_file", default=None)


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _CONFIG_FILE.get()
        return read_config_file(path) if path is not None else {}


class CoevoConfig(BaseSettings):
    """The root of the config tree."""

    model_config = SettingsConfigDict(env_prefix="COEVO_", env_nested_delimiter="__", extra="forbid", frozen=True)

    run: RunConfig = Field(default_factory=RunConfig)
    nats: NatsConfig = Field(default_factory=NatsConfig)
    stream: StreamConfig = Field(default_factory=StreamConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    judge: JudgeConfig = Field(default_factory=LocalJudge)
    scorer: ScorerConfig = Field(default_factory=ScorerConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    loop: Literal["policy-only", "policy+judge", "full"] = Field(
        default="full", description="ablation: fixed judge and tasks / + judge training / + rewriting"
    )
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _pretrained_defaults(self) -> CoevoConfig:
        """A model you name (``policy.model``) gets, for each setting not given anywhere (a file, the
        environment, a flag), what a pretrained model needs rather than the tiny models' default:
        LORA_PRETRAINED_LR for LoRA lanes (not 1e-3), PRETRAINED_MAX_BATCH_TOKENS a micro-batch, and held-out
        rounds every PRETRAINED_EVAL_EVERY_S seconds as well when neither cadence is given (a real model
        scores few groups a minute on CPU)."""
        if self.policy.model is None:
            return self
        lc, tc = self.learner, self.tasks
        learner: dict[str, Any] = {}
        if "lr" not in lc.model_fields_set and lc.lora is not None:
            learner["lr"] = LORA_PRETRAINED_LR
        if "max_batch_tokens" not in lc.model_fields_set:
            learner["max_batch_tokens"] = PRETRAINED_MAX_BATCH_TOKENS
        if learner:
            object.__setattr__(self, "learner", lc.model_copy(update=learner))
        if not {"eval_every", "eval_every_s"} & tc.model_fields_set:
            object.__setattr__(self, "tasks", tc.model_copy(update={"eval_every_s": PRETRAINED_EVAL_EVERY_S}))
        return self

    @model_validator(mode="after")
    def _retention_outlives_timeouts(self) -> CoevoConfig:
        needed = max(self.tasks.inflight_timeout_s, self.scorer.group_timeout_s)
        if self.stream.retain_bytes and self.stream.retain_min_age_s < needed:
            raise ValueError(
                f"stream.retain_min_age_s ({self.stream.retain_min_age_s:g}) must be at least "
                f"tasks.inflight_timeout_s and scorer.group_timeout_s ({needed:g}): an unfinished "
                "group's events must outlive its timeouts"
            )
        return self

    @property
    def trains_judge(self) -> bool:
        """The judge lane learns unless the ablation fixes it or the judge is not ours to train: a local
        model is trained, and so is a vLLM server whose ``judge.model`` is the local directory it serves
        (its weights follow the learner's like the policy's); an API, or a vLLM model known only by its
        served name, is not."""
        j = self.judge
        ours = j.backend == "local" or (j.backend == "vllm" and j.model is not None and Path(j.model).is_dir())
        return self.loop != "policy-only" and ours

    @property
    def endpoint_port(self) -> int | None:
        """The port of the policy endpoint, None when it is off (``policy.serve_port``; 8000 for external)."""
        if self.policy.serve_port is None and self.env.family == "external":
            return 8000
        return self.policy.serve_port

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSource(settings_cls))


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist", field=None)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory: give a .toml, .yaml or .yml file", field=None)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}", field=None) from None
    try:
        if path.suffix in {".yaml", ".yml"}:
            import yaml

            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as exc:  # its message spans lines, with a drawing of the spot
                mark = getattr(exc, "problem_mark", None)
                at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
                problem = getattr(exc, "problem", None) or type(exc).__name__
                raise ConfigError(f"config file {path} does not parse: {problem}{at}", field=None) from None
        elif path.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path}: use .toml, .yaml or .yml", field=None)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"config file {path} does not parse: {exc}", field=None) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping", field=None)
    return data


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section", field=dotted)
    node[parts[-1]] = value


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> CoevoConfig:
    """Load the tree from defaults, ``path``, the environment and dotted ``overrides``."""
    nested: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        set_dotted(nested, key, value)
    token = _CONFIG_FILE.set(path)
    try:
        return CoevoConfig(**nested)
    except ValidationError as exc:
        raise ConfigError.from_validation(exc, known=closest_field) from None
    finally:
        _CONFIG_FILE.reset(token)


def closest_field(name: str) -> str | None:
    """The config field or section whose dotted name is closest to ``name`` (a typo's likely meaning)."""
    names = {".".join(leaf.split(".")[: i + 1]) for leaf in leaf_fields() for i in range(leaf.count(".") + 1)}
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.75)
    return close[0] if close else None


def leaf_fields(model: type[BaseModel] = CoevoConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted name -> FieldInfo for every leaf of the tree (used to generate CLI flags)."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        sections = _sections(info.annotation)
        if sections and not name.startswith("_"):
            for section in sections:  # a tagged section: the fields of every variant, the first one's description
                for key, leaf in leaf_fields(section, f"{prefix}{name}.").items():
                    out.setdefault(key, leaf)
        else:
            out[f"{prefix}{name}"] = info
    return out


def _sections(ann: Any) -> list[type[BaseModel]]:
    """The section types a field holds: one, the variants of a tagged union, or none (a leaf)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    members = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) is typing.Union else ()
    return [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]


def checkpoint_root(cfg: CoevoConfig, run_id: str) -> Path:
    """Where the learner of run ``run_id`` checkpoints and publishes (``<role>/published/...``)."""
    return cfg.run.runs_dir / run_id / "checkpoints"
