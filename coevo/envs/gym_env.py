"""Gymnasium environments as a family: ``env.family = "gym:<module>:<EnvClass or id>"``.

``<module>`` is imported (so it may register ids); ``<EnvClass or id>`` is a ``gymnasium.Env``
subclass of that module, built with ``env.gym_kwargs``, or an id known to ``gymnasium.make``.

Mapping (an env keeps full control through its ``info`` and a few optional attributes):
- observation: text as it is, or ``env.gym_observation`` (``module:function (obs, info) -> str``);
- candidates: ``info["candidates"]`` (or ``admissible_commands`` / ``valid_actions``); for a
  ``Discrete`` action space without them, the env's ``action_labels`` or ``"0".."n-1"``;
- action: ``env.gym_action`` (``module:function (text, env) -> action``), else the index of the chosen
  candidate for a ``Discrete`` space, else the text itself; an action a ``Discrete`` space cannot
  take wastes the step (the env is not stepped);
- outcome: ``terminated`` is ``won`` when ``info["won"]`` says so, else when the episode's return
  exceeds ``env.win_threshold``, and ``lost`` otherwise; ``truncated`` (or the step cap
  ``min(env.max_steps, spec.max_episode_steps)``) is ``truncated``; an exception is ``aborted``;
- step labels: ``info["reference_label"]`` (+1 / -1) when the env knows the right move;
- tasks: one per seed (``reset(seed=...)``); knobs from the env class's ``coevo_knobs``
  (``(name, low, high, harder[, initial])`` tuples), passed to ``reset`` as ``options``, so the
  rewriter rewrites them; the precheck proves the task resets.

Invariant: every env call runs in a worker thread (a slow env never blocks the event loop), one
env instance per episode.
"""

from __future__ import annotations

import asyncio
import importlib
import random
from collections.abc import Callable
from typing import Any, Literal

from coevo.config import EnvConfig
from coevo.envs.base import Environment, Family, Knob, Observation, PrecheckResult, StepResult
from coevo.errors import EnvError
from coevo.schemas import TaskSpec

CANDIDATE_KEYS = ("candidates", "admissible_commands", "valid_actions")


def load_function(path: str | None) -> Callable[..., Any] | None:
    """``module:function`` -> the function (None for None)."""
    if not path:
        return None
    module, sep, name = path.partition(":")
    if not sep:
        raise ValueError(f"{path!r} is not module:function")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"{path!r} is not a function")
    return fn


def _factory(spec: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    import gymnasium

    _, module, target = spec.split(":", 2)
    obj = getattr(importlib.import_module(module), target, None)
    if obj is not None:
        if not (isinstance(obj, type) and issubclass(obj, gymnasium.Env)):
            raise ValueError(f"{spec}: {module}.{target} is not a gymnasium.Env subclass")
        return lambda: obj(**kwargs)
    try:
        gymnasium.spec(target)
    except gymnasium.error.Error as exc:
        raise ValueError(
            f"{spec}: {module} has no class {target} and gymnasium knows no id {target!r} ({exc})"
        ) from None
    return lambda: gymnasium.make(target, disable_env_checker=True, **kwargs)


def _knob(entry: Any) -> tuple[Knob, int]:
    name, low, high, harder, *rest = entry
    return Knob(str(name), int(low), int(high), 1 if harder >= 0 else -1), int(rest[0] if rest else low)


class GymFamily(Family):
    """Tasks of one Gymnasium env: a seed and the env's knobs."""

    def __init__(self, spec: str, cfg: EnvConfig) -> None:
        try:
            import gymnasium  # noqa: F401
        except ImportError as exc:
            raise ImportError("env.family gym:... needs gymnasium: pip install 'coevo[gym]'") from exc
        self.name = spec  # type: ignore[misc]  # one family per env: task specs carry the spec
        self.factory = _factory(spec, dict(cfg.gym_kwargs))
        self.observe = load_function(cfg.gym_observation)
        self.act = load_function(cfg.gym_action)
        self.win_threshold = cfg.win_threshold
        probe = self.factory()
        try:
            entries = getattr(probe.unwrapped, "coevo_knobs", ())
            pairs = [_knob(e) for e in entries]
            limit = getattr(probe.spec, "max_episode_steps", None) if probe.spec is not None else None
        finally:
            probe.close()
        self.knobs = tuple(k for k, _ in pairs)  # type: ignore[misc]
        self.initial_knobs = {k.name: k.clamp(v) for k, v in pairs}
        self.max_steps_cap = min(cfg.max_steps, limit or cfg.max_steps)  # type: ignore[misc]

    def make_env(self) -> GymEnvironment:
        return GymEnvironment(self)

    def initial_tasks(self, n_train: int, n_heldout: int, seed: int) -> list[TaskSpec]:
        rng = random.Random(seed)
        tasks = []
        for i in range(n_train + n_heldout):
            split: Literal["train", "heldout"] = "train" if i < n_train else "heldout"
            tasks.append(
                TaskSpec(
                    task_id=f"gym-{split[0]}{i}",
                    family=self.name,
                    params={"seed": rng.randrange(1_000_000)},
                    knobs=dict(self.initial_knobs),
                    split=split,
                )
            )
        return tasks

    async def precheck(self, task: TaskSpec) -> PrecheckResult:
        env = self.make_env()
        try:
            await env.reset(task)
        except Exception as exc:  # any failure of the user's env is a reason, not a crash
            return PrecheckResult(False, f"does not reset: {exc!r}"[:500])
        finally:
            await env.close()
        return PrecheckResult(True)


class GymEnvironment(Environment):
    """One episode of a Gymnasium env, in text."""

    def __init__(self, family: GymFamily) -> None:
        self.family = family
        self.env: Any = None
        self.candidates: list[str] = []
        self.last = Observation("")
        self.steps = 0
        self.total = 0.0
        self.done = True

    async def reset(self, task: TaskSpec) -> Observation:
        self.env = self.env or await asyncio.to_thread(self.family.factory)
        options = {**task.params.get("options", {}), **self.family.knobs_of(task)}
        seed = int(task.params.get("seed", 0))
        try:
            obs, info = await asyncio.to_thread(self.env.reset, seed=seed, options=options or None)
        except Exception as exc:
            raise EnvError(f"{self.family.name}: reset failed: {exc!r}") from exc
        self.steps, self.total, self.done = 0, 0.0, False
        self.last = self._observation(obs, info)
        return self.last

    def _observation(self, obs: Any, info: dict[str, Any]) -> Observation:
        if self.family.observe is not None:
            text = str(self.family.observe(obs, info))
        elif isinstance(obs, str):
            text = obs
        else:
            raise EnvError(
                f"{self.family.name}: observation of type {type(obs).__name__} is not text; set "
                "env.gym_observation = 'module:function' ((obs, info) -> str)"
            )
        cands = next((list(map(str, info[k])) for k in CANDIDATE_KEYS if info.get(k)), None)
        if cands is None:
            cands = self._discrete_labels()
        self.candidates = cands
        objective = str(info.get("objective") or info.get("goal") or getattr(self.env.unwrapped, "objective", ""))
        return Observation(text=text, candidates=cands, objective=objective)

    def _discrete_labels(self) -> list[str]:
        from gymnasium.spaces import Discrete

        space = self.env.action_space
        if not isinstance(space, Discrete):
            return []
        labels = getattr(self.env.unwrapped, "action_labels", None)
        return list(map(str, labels)) if labels else [str(i) for i in range(int(space.n))]

    def _action(self, text: str) -> Any:
        """The env's action for ``text``; None when a Discrete space cannot take it."""
        if self.family.act is not None:
            return self.family.act(text, self.env)
        from gymnasium.spaces import Discrete

        space = self.env.action_space
        if not isinstance(space, Discrete):
            return text
        if text in self.candidates and len(self.candidates) == int(space.n):
            return int(space.start) + self.candidates.index(text)
        return int(text) if text.strip().lstrip("-").isdigit() and space.contains(int(text)) else None

    async def step(self, action: str) -> StepResult:
        if self.done or self.env is None:
            raise EnvError("step after the episode ended (call reset)")
        self.steps += 1
        act = self._action(action)
        if act is None:  # nothing this env can take: the step is wasted
            over = self.steps >= self.family.max_steps_cap
            self.done = over
            return StepResult(self.last, over, "truncated" if over else None, -1, {"feedback": "invalid action"})
        try:
            obs, reward, terminated, truncated, info = await asyncio.to_thread(self.env.step, act)
        except Exception as exc:
            self.done = True
            return StepResult(self.last, True, "aborted", None, {"error": f"step failed: {exc!r}"[:500]})
        self.total += float(reward)
        self.last = self._observation(obs, info)
        outcome = self._outcome(bool(terminated), bool(truncated), info)
        self.done = outcome is not None
        label = info.get("reference_label")
        return StepResult(
            self.last,
            self.done,
            outcome,
            label if label in (1, -1) else None,
            {"reward": float(reward), "return": self.total},
        )

    def _outcome(
        self, terminated: bool, truncated: bool, info: dict[str, Any]
    ) -> Literal["won", "lost", "truncated"] | None:
        if terminated:
            won = info["won"] if "won" in info else self.total > self.family.win_threshold
            return "won" if won else "lost"
        if truncated or self.steps >= self.family.max_steps_cap:
            return "truncated"
        return None

    async def close(self) -> None:
        if self.env is not None:
            env, self.env = self.env, None
            await asyncio.to_thread(env.close)
