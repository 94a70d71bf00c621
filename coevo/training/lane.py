"""One trainable model (the policy or the judge): optimiser, version counter, published weights and
resume checkpoints.

Two artefacts, two cadences:
- *published weights* (``publish``): the model's tensors in the serving dtype, every step or every
  ``learner.publish_every`` steps, on the critical path (step end → ``WeightsPublished``), written
  once and held in memory for in-process engines and pushed transfers (``coevo.weights.publish``);
- *resume checkpoints* (``begin_checkpoint``): fp32 weights, optimizer state, counters and the
  consumed groups, every ``learner.checkpoint_every_steps`` / ``checkpoint_every_s``, written off
  the critical path (``coevo.training.checkpoint``): the next optimiser step waits only for the
  snapshot's copy into CPU memory.

A step trains one batch (``Lane.step``): samples older than ``learner.max_staleness`` versions are
dropped or kept with truncated IS (``learner.stale``), the proximal log-probs (and, with
``learner.kl_reference = "initial"``, those of the starting weights: a frozen copy, or a LoRA lane's base
with its adapters off) are taken once,
then ``learner.epochs`` passes over ``learner.minibatches`` minibatches take one optimiser step each.

Invariants:
- ``version`` counts trained batches since the initial weights (version 0) along the lineage of
  the checkpoint it resumed from, and survives restarts: one version per batch however many
  optimiser steps it took (``steps_total`` counts those), so published weights, ``LearnerStepped.version``
  and what followers load agree;
- a batch is trained whole or not at all: a step that fails leaves the weights and optimiser state
  of before it (``_UndoPoint`` when it takes several optimiser steps or the KL guard measures it:
  the guard's forward pass is inside the undo scope), so a retried group is never trained once and
  a part, nor twice;
- no inf or NaN reaches the weights: an optimiser step whose loss or gradient norm is not finite
  raises ``NonFiniteStep`` before ``optimizer.step`` (the batch fails whole, as above), and the KL
  guard undoes a batch whose step KL is not a number (``kl_rejects``);
- every rank plans the same minibatches and, per minibatch, the same number of micro-batches
  (``rank_plan``): the same number of optimiser steps and collectives on every rank;
- only complete checkpoints are ever loaded; a checkpoint records the groups whose samples it has
  trained, and ``is_durable`` answers from the newest *durable* one: a group is acknowledged only
  once it is durable, so a resumed learner never trains an acknowledged group twice and trains
  again exactly the groups it lost;
- under torchrun (world > 1) publishing and checkpoints are collective and synchronous;
- a LoRA lane (``learner.lora``, ``coevo.training.lora``) trains, checkpoints and publishes its
  adapter only, named after its role; lanes on one base (``SharedBase``) share the model and the
  lock, and each activates its own adapter before it computes anything.
"""

from __future__ import annotations

import functools
import json
import math
import threading
import time
from collections import Counter, OrderedDict, defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch

from coevo.algorithm.recent import put_newest
from coevo.config import GrammarConfig, LearnerConfig, SamplingConfig
from coevo.errors import ConfigError, NonFiniteStep
from coevo.inference import adapters
from coevo.inference.grammar import GrammarError, Grammars
from coevo.inference.precision import default_device, model_dtype
from coevo.runtime import faults
from coevo.schemas import TrainingSample
from coevo.schemas.events import WeightsFormat
from coevo.training import lora
from coevo.training.batch import Tensors, minibatches, rank_plan, sample_problem, split_stale, staleness, to_tensors
from coevo.training.checkpoint import MARKER, Checkpoint, CheckpointJob, CheckpointWriter, latest_checkpoint
from coevo.training.entropy import EntropyControl
from coevo.training.loss import DECOUPLED_CAP, mismatch_kl, ppo_loss, token_logprobs_and_entropy
from coevo.weights.manifest import HELD, manifest_of
from coevo.weights.publish import (
    clear_partial,
    serving_dtype,
    serving_tensors,
    write_published,
    write_published_adapter,
)

__all__ = ["MARKER", "Lane", "StepMetrics", "kl_rejects", "latest_checkpoint"]


REPLAYED_KEPT = 256
"""grammar samples whose replayed masks a lane keeps (packed: under 2 MB for 256 tokens of a 49k vocabulary)"""


@dataclass(frozen=True)
class StepMetrics:
    version: int
    samples: int
    tokens: int
    loss: float
    kl: float
    clip_fraction: float
    mismatch_kl: float
    staleness_histogram: dict[str, int]
    tokens_per_second: float
    grad_norm: float
    checkpoint_wait_s: float = 0.0
    """how long this step's optimiser update waited for a checkpoint's snapshot"""
    stale_dropped: int = 0
    """samples of the batch dropped as older than ``max_staleness`` (``learner.stale = "drop"``)"""
    optimizer_steps: int = 1
    """optimiser steps this batch took (``minibatches`` × ``epochs``; 0 when nothing was left to train)"""
    step_kl: float | None = None
    """KL per token from the weights before the batch to those after (under ``learner.max_step_kl``)"""
    kl_rejected: bool = False
    """the batch was undone: its step KL exceeded ``learner.max_step_kl`` (``samples`` 0, version unchanged)"""
    entropy: float | None = None
    """nats per response token of the distributions the batch was drawn from, under the weights before the step"""
    entropy_coef: float | None = None
    """the entropy bonus's coefficient this batch was trained with (``coevo.training.entropy``); None when
    the lane has no bonus (``entropy_coef`` 0, no target)"""
    mismatch_kl_current: float | None = None
    """``mismatch_kl`` on the batch's samples drawn by the weights the lane holds (staleness 0): the
    sampler's mismatch alone, without the drift of the weights since a stale sample was drawn; None when
    the batch has no such sample"""

    @classmethod
    def trained(
        cls,
        version: int,
        samples: int,
        tokens: int,
        sums: dict[str, float],
        steps: int,
        hist: dict[str, int],
        seconds: float,
        *,
        dropped: int,
        step_kl: float | None,
        entropy: float | None = None,
        entropy_coef: float | None = None,
        mismatch_kl_current: float | None = None,
    ) -> StepMetrics:
        """A batch trained in ``steps`` optimiser steps: ``sums`` of their metrics become means."""
        loss, kl, clip, mismatch, grad_norm = (
            sums[k] / steps for k in ("loss", "kl", "clip_fraction", "mismatch_kl", "grad_norm")
        )
        return cls(
            version,
            samples,
            tokens,
            loss,
            kl,
            clip,
            mismatch,
            grad_norm=grad_norm,
            staleness_histogram=hist,
            checkpoint_wait_s=sums["waited"],
            tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
            stale_dropped=dropped,
            optimizer_steps=steps,
            step_kl=step_kl,
            entropy=entropy,
            entropy_coef=entropy_coef,
            mismatch_kl_current=mismatch_kl_current,
        )

    @classmethod
    def untrained(cls, version: int, dropped: int, step_kl: float | None = None) -> StepMetrics:
        """A batch that took no step: left empty by the staleness bound, or undone by the KL guard."""
        return cls(
            version,
            0,
            0,
            0.0,
            0.0,
            0.0,
            0.0,
            {},
            0.0,
            0.0,
            stale_dropped=dropped,
            optimizer_steps=0,
            step_kl=step_kl,
            kl_rejected=step_kl is not None,
        )


Published = tuple[Path, str, int]
"""(directory, manifest digest, bytes written)"""


class Lane:
    def __init__(
        self,
        role: Literal["policy", "judge"],
        base_model: Path,
        ckpt_root: Path,
        cfg: LearnerConfig,
        *,
        temperature: float = 1.0,
        sampling: SamplingConfig | None = None,
        lr: float | None = None,
        device: str | None = None,
        shared: lora.SharedBase | None = None,
        grammar: GrammarConfig | None = None,
    ) -> None:
        from coevo.inference.engine import quiet_transformers

        quiet_transformers()
        self.role = role
        self.cfg = cfg
        self.base_model = Path(base_model)
        self.root = Path(ckpt_root) / role
        self.published_root = self.root / "published"
        self.published_root.mkdir(parents=True, exist_ok=True)
        for root in (self.root, self.published_root):
            clear_partial(root)
        self.temperature = temperature
        self.sampling = sampling or SamplingConfig()
        self.grammar_cfg = grammar or GrammarConfig()
        self.device = device or default_device()
        self.dtype = model_dtype(cfg.dtype, self.device, self.base_model)  # a LoRA base's, every pass's
        self.publish_dtype = serving_dtype(cfg.publish_dtype, self.dtype)
        resume = latest_checkpoint(self.root)
        self.rank, self.world = _rank_world()
        self.fsdp = self.world > 1 and cfg.parallel == "fsdp"
        self.format: WeightsFormat = "lora" if cfg.lora is not None else "full"
        self.adapter = role if cfg.lora is not None else None  # its adapter's name in the model (LoRA)
        self.model = self._model(resume, shared)
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if self.fsdp:
            self._shard()
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=lr or cfg.lr)
        self.reference = self._reference_model() if cfg.kl_reference == "initial" and self.adapter is None else None
        self.version = self.steps_total = 0
        self.consumed: deque[str] = deque(maxlen=100_000)
        self.entropy_control = EntropyControl(cfg.entropy_target, cfg.entropy_coef_step, cfg.entropy_coef_max)
        self.entropy_coef = cfg.entropy_coef
        """the entropy bonus's coefficient now: fixed, or adapted per batch and kept in checkpoints"""
        if resume is not None:
            self._resume(resume)
        self.resumed_from = resume
        self.checkpointed_version = self.version
        self._consumed_set = set(self.consumed)
        self._durable = frozenset(self.consumed)
        self._writer = CheckpointWriter(self.root)
        self._lock = shared.lock if shared is not None else threading.RLock()
        """steps and publications of this lane (of every lane on a shared base) never overlap"""
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.vocab = int(self.model.config.vocab_size)
        self._replayed: OrderedDict[str, torch.Tensor] = OrderedDict()

    def _shard(self) -> None:
        """FSDP2: every decoder layer, then the root, sharded over the ranks."""
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)

    def _model(self, resume: Path | None, shared: lora.SharedBase | None) -> Any:
        """The model to train: the resume checkpoint's, else the base; under ``learner.lora`` the base
        with an adapter (the checkpoint's, or a fresh one), the base held once when ``shared``."""
        from transformers import AutoModelForCausalLM

        lc = self.cfg.lora
        saved_adapter = resume is not None and adapters.is_adapter(resume)
        if resume is not None and saved_adapter != (lc is not None):
            raise ConfigError(
                f"{resume} holds {'an adapter' if saved_adapter else 'full weights'}: this run's "
                f"checkpoints were written {'with' if saved_adapter else 'without'} learner.lora",
                field="learner.lora",
            )
        if lc is None:
            # transformers' @wraps(Module.to) is not a bound method to mypy: it wants the model as first argument
            # fp32 master weights whatever dtype the checkpoint was saved in (the passes autocast)
            loaded = AutoModelForCausalLM.from_pretrained(resume or self.base_model, dtype=torch.float32)
            return loaded.to(self.device)
        if self.fsdp:
            raise ConfigError(
                "learner.lora under torchrun needs learner.parallel = 'ddp' (adapters are not sharded)",
                field="learner.lora",
            )
        if shared is not None:
            return shared.attach(self.role, resume, self.device)
        base = AutoModelForCausalLM.from_pretrained(self.base_model, dtype=self.dtype)
        model = lora.wrap(base, lc, self.role)
        if resume is not None:
            lora.load_adapter(model, resume, self.role)
        return model.to(self.device)

    def trainable(self) -> list[torch.nn.Parameter]:
        """What the optimiser updates: every parameter, or a LoRA lane's adapter only."""
        return lora.trainable(self.model, self.adapter)

    def _activate(self) -> None:
        """Make this lane's adapter the one the model computes with (lanes on one base share the model)."""
        if self.adapter is not None:
            self.model.set_adapter(self.adapter)

    def _reference_model(self) -> torch.nn.Module:
        """The KL's frozen reference (``kl_reference = "initial"``): the starting weights (version 0,
        whatever checkpoint the lane resumed from) in the compute dtype, replicated on every rank."""
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(self.base_model, dtype=self.dtype)
        ref = loaded.to(self.device)
        ref.eval()
        ref.requires_grad_(False)
        return ref

    def _resume(self, resume: Path) -> None:
        state = json.loads((resume / "state.json").read_text())
        self.version = state["version"]
        self.steps_total = int(state.get("steps_total", 0))
        if self.entropy_control.adaptive and state.get("entropy_coef") is not None:
            # an adaptive coefficient goes on where it was, within today's bound
            self.entropy_coef = self.entropy_control.bounded(float(state["entropy_coef"]))
        self.consumed.extend(state["consumed_groups"])
        shard = resume / f"optimizer.rank{self.rank}.pt"
        self.optimizer.load_state_dict(
            torch.load(shard if shard.exists() else resume / "optimizer.pt", map_location=self.device)
        )

    def has_consumed(self, group_id: str) -> bool:
        """Trained into the weights in memory (durable or not)."""
        return group_id in self._consumed_set

    def is_durable(self, group_id: str) -> bool:
        """Trained into the weights of a complete resume checkpoint (safe to acknowledge)."""
        return group_id in self._durable

    async def sample_problems(self, samples: list[TrainingSample]) -> list[str | None]:
        """``sample_problem`` of each sample, for an event loop: a grammar sample's replay (and its
        grammar's compile) runs in a worker thread, so the loop goes on meanwhile.

        The learner compiles a sample's grammar itself (a compiled grammar lives in the process that
        compiled it: the engine's is not shared across processes), on ``Grammars``' worker within the
        same budget as the engine (``policy.grammar``: grammar bytes, compile seconds); a grammar
        over it is a problem of the sample, which is then not trained."""
        import asyncio

        if not any(s.grammar is not None for s in samples):
            return [self.sample_problem(s) for s in samples]
        return await asyncio.to_thread(lambda: [self.sample_problem(s) for s in samples])

    def sample_problem(self, s: TrainingSample) -> str | None:
        """Why ``s`` cannot be trained (None: it can). Replays a grammar sample's masks: call it off
        the event loop for those (``sample_problems``)."""
        problem = sample_problem(s, self.vocab, int(getattr(self.model.config, "max_position_embeddings", 1 << 30)))
        if problem is None and s.grammar is not None:
            try:
                self.grammar_masks(s)
            except GrammarError as exc:  # what the grammar refuses was not sampled under it
                return str(exc)
        return problem

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The grammar masks of this lane's tokenizer and vocabulary (built on the first grammar sample)."""
        from transformers import AutoTokenizer

        base = adapters.base_of(self.base_model) if adapters.is_adapter(self.base_model) else self.base_model
        return Grammars(AutoTokenizer.from_pretrained(base), self.vocab, self.grammar_cfg)

    def grammar_masks(self, s: TrainingSample) -> torch.Tensor:
        """A grammar sample's packed per-position masks, replayed over its response tokens (the last
        few kept: a sample is checked by ``sample_problem`` and then packed for the step)."""
        hit = self._replayed.get(s.sample_id)
        if hit is None:
            assert s.grammar is not None
            hit = self.grammars.replay(s.grammar, list(s.response_token_ids))
            put_newest(self._replayed, s.sample_id, hit, REPLAYED_KEPT)
        return hit

    def step(self, samples: list[TrainingSample], groups: list[str]) -> StepMetrics:
        """``_step`` under the lane's lock: one step at a time, whatever calls it (a restarted learner
        task can start a step while the thread of a cancelled one still runs)."""
        with self._lock:
            return self._step(samples, groups)

    def _step(self, samples: list[TrainingSample], groups: list[str]) -> StepMetrics:
        """One batch ``samples`` (all groups at once, the same list on every rank: each trains its rows
        of ``rank_plan``, minibatch by minibatch); returns this rank's metrics.

        Samples beyond ``max_staleness`` are dropped or kept with truncated IS (``learner.stale``);
        the proximal (and ``initial`` reference) log-probs are taken once, then ``epochs`` passes over
        ``minibatches`` minibatches take one optimiser step each; the version advances by one. A batch
        the staleness bound leaves empty takes no step: version unchanged, groups not consumed,
        ``samples`` 0. A batch of several optimiser steps whose later step fails leaves weights,
        optimiser state and counters as they were before it (``_UndoPoint``): retried, its groups
        are trained once, not once and a part."""
        t0 = time.perf_counter()
        fresh, stale = split_stale(samples, self.version, self.cfg.max_staleness)
        dropping = self.cfg.stale == "drop"
        kept = fresh if dropping else list(samples)
        dropped = len(stale) if dropping else 0
        if not kept:
            return StepMetrics.untrained(self.version, dropped)
        self._activate()
        self.model.train()
        parts = minibatches(kept, self.cfg.minibatches, self.version)
        plans = [self._rank_tensors(part) for part in parts]
        fixed, entropy, current = self._fixed_logprobs(plans)
        eta, coef_after = self.entropy_control.decide(self.entropy_coef, entropy)
        agg: defaultdict[str, float] = defaultdict(float)
        steps = 0
        guard = self.cfg.max_step_kl
        undo = _UndoPoint.of(self) if self.cfg.epochs * len(parts) > 1 or guard is not None else None
        try:
            for _epoch in range(self.cfg.epochs):
                for part, micro, fx in zip(parts, plans, fixed, strict=True):
                    for k, v in self._optimizer_step(micro, fx, len(part), eta).items():
                        agg[k] += v
                    steps += 1
            # inside the undo scope: a failure of the KL's forward pass undoes the steps taken
            step_kl = self._step_kl(plans, fixed) if guard is not None else None
        except BaseException:
            if undo is not None and steps:  # a batch is trained whole or not at all
                undo.restore(self)
            raise
        if guard is not None and step_kl is not None and kl_rejects(step_kl, guard) and undo is not None:
            undo.restore(self)  # rejected: as if the batch never came (its groups are acknowledged untrained)
            return StepMetrics.untrained(self.version, dropped, step_kl)
        tokens = sum(int(t.response_mask.sum()) + int(t.attention_mask.sum()) for micro in plans for t in micro)
        hist = Counter(str(staleness(s, self.version)) for s in kept)
        self._advance(groups, coef_after)
        return StepMetrics.trained(
            self.version,
            len(kept),
            tokens,
            agg,
            steps,
            dict(hist),
            time.perf_counter() - t0,
            dropped=dropped,
            step_kl=step_kl,
            entropy=entropy,
            entropy_coef=eta if self.cfg.entropy_coef > 0 or self.entropy_control.adaptive else None,
            mismatch_kl_current=current if "0" in hist else None,  # every rank holds the same batch
        )

    def _advance(self, groups: list[str], entropy_coef: float) -> None:
        """A batch of ``groups`` is trained: the next version, and the coefficient it left (a batch undone
        or failed never gets here, so it leaves the coefficient as it was too)."""
        self.version += 1
        self.entropy_coef = entropy_coef
        for g in groups:
            self.consumed.append(g)
            self._consumed_set.add(g)

    def _rank_tensors(self, part: list[TrainingSample]) -> list[Any]:
        """This rank's micro-batches of one minibatch, as tensors on the lane's device."""
        return [
            to_tensors(mb, self.vocab, self.pad_id, self.grammar_masks).to(self.device)
            for mb in rank_plan(part, self.rank, self.world, self.cfg.max_batch_tokens)
        ]

    def _step_kl(self, plans: list[list[Tensors]], fixed: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> float:
        """KL per response token from the weights before the batch (its proximal log-probs) to the
        weights now, on the batch's sampled tokens (k3); averaged over ranks, so every rank decides alike."""
        faults.hit("lane.step_kl")  # after the batch's optimiser steps: a failure here must undo them
        num = den = 0.0
        with torch.no_grad(), self._autocast():
            for micro, fx in zip(plans, fixed, strict=True):
                for t, (px, _ref) in zip(micro, fx, strict=True):
                    new = self._logprobs(t)[0]
                    n = float(t.response_mask.sum())
                    num += mismatch_kl(new, px, t.response_mask.float()) * n
                    den += n
        return self._mean_over_ranks(num, den)

    def mismatch_kl(self, samples: list[TrainingSample]) -> float:
        """KL(sampler || this lane's weights) per response token on ``samples``, computed as a step
        would compute it (temperature, truncation, precision) but without one: the parity probe's
        measure (``coevo.training.parity``). This rank alone: never under a sharded model."""
        with self._lock, torch.no_grad(), self._autocast():
            self._activate()
            t = to_tensors(samples, self.vocab, self.pad_id, self.grammar_masks).to(self.device)
            new = self._logprobs(t, self.model.eval())[0]
            return mismatch_kl(new, t.behav_logp, t.response_mask.float())

    def _logprobs(
        self, t: Tensors, model: torch.nn.Module | None = None, *, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``t``'s tokens under ``model`` (default: the lane's), as the sampler drew them
        (temperature, truncation, allowed tokens); with ``entropy``, those distributions' entropies."""
        return token_logprobs_and_entropy(
            model if model is not None else self.model,
            t.input_ids,
            t.attention_mask,
            t.response_mask,
            t.allowed,
            self.temperature,
            sampling=self.sampling,
            positions=t.positions,
            entropy=entropy,
        )

    def _autocast(self) -> Any:
        """Passes in the compute dtype: matmuls in bf16 where it is one (a LoRA adapter's too), every
        log-softmax in fp32 (``loss`` casts the head's logits). A local engine serves the published adapter
        beside its bf16 base (``adapters.Beside``): on the same tokens, bit for bit what this lane computes."""
        kind = "cuda" if str(self.device).startswith("cuda") else "cpu"
        return torch.autocast(kind, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _fixed_logprobs(
        self, plans: list[list[Tensors]]
    ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], float, float]:
        """Per minibatch, per micro-batch: (proximal log-probs, the KL's reference log-probs), taken
        once per batch before its first optimiser step; the policy's entropy on the batch: nats per
        response token of the distributions its tokens were drawn from, under the weights before the
        step; and the mismatch KL on its rows of the lane's version (``StepMetrics.mismatch_kl_current``;
        0 when it has none). Every rank's rows."""
        fixed: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        num = den = kl_num = kl_den = 0.0
        with torch.no_grad(), self._autocast():
            for micro in plans:
                fixed.append([])
                for t in micro:
                    prox, ent = self._logprobs(t, entropy=True)
                    assert ent is not None
                    num += float((ent * t.response_mask).sum())
                    den += float(t.response_mask.sum())
                    fixed[-1].append((prox, self._reference_logprobs(t)))
                    mask = t.response_mask.float() * self._current_rows(t).unsqueeze(-1)
                    kl_num += mismatch_kl(prox, t.behav_logp, mask) * float(mask.sum())
                    kl_den += float(mask.sum())
        return fixed, self._mean_over_ranks(num, den), self._mean_over_ranks(kl_num, kl_den)

    def _current_rows(self, t: Tensors) -> torch.Tensor:
        """1 for each row of ``t`` drawn by the weights of the lane's version, 0 for the others."""
        return torch.tensor([float(v == self.version) for v in t.versions], device=t.response_mask.device)

    def _reference_logprobs(self, t: Tensors) -> torch.Tensor:
        """The KL's reference log-probs of ``t``: the sampler's (``behavior``), or the starting weights'
        (``initial``): a frozen copy, or for a LoRA lane the shared base with every adapter off (the
        adapters start at zero, so that is version 0 of each, whatever checkpoint it resumed from)."""
        if self.cfg.kl_reference == "behavior":
            return t.behav_logp
        if self.reference is not None:
            return self._logprobs(t, self.reference)[0]
        with self.model.disable_adapter():
            return self._logprobs(t)[0]

    def _mean_over_ranks(self, num: float, den: float) -> float:
        """``num / den`` summed over ranks (every rank gets the same number: a collective on every rank)."""
        if self.world > 1:
            import torch.distributed as dist

            both = torch.tensor([num, den], dtype=torch.float64, device=self.device)
            dist.all_reduce(both, op=dist.ReduceOp.SUM)
            num, den = float(both[0]), float(both[1])
        return num / den if den else 0.0

    def _row_cap(self, t: Tensors) -> torch.Tensor | None:
        """Under ``stale = "correct"``: the truncated-IS cap for rows beyond ``max_staleness`` (the
        others keep ``correction``'s cap); None when no row is stale."""
        lc = self.cfg
        if lc.stale != "correct" or all(self.version - v <= lc.max_staleness for v in t.versions):
            return None
        usual = DECOUPLED_CAP if lc.correction == "decoupled" else lc.tis_cap
        return torch.tensor(
            [lc.tis_cap if self.version - v > lc.max_staleness else usual for v in t.versions],
            device=t.advantages.device,
        )

    def _optimizer_step(
        self, micro: list[Tensors], fixed: list[tuple[torch.Tensor, torch.Tensor]], total: int, eta: float
    ) -> dict[str, float]:
        """One optimiser step on one minibatch of ``total`` samples (this rank's micro-batches), with an
        entropy bonus of coefficient ``eta``."""
        lc = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        agg: defaultdict[str, float] = defaultdict(float)
        for t, (px, ref) in zip(micro, fixed, strict=True):
            with self._autocast():
                new, ent = self._logprobs(t, entropy=eta > 0)
            out = ppo_loss(
                new,
                px,
                t.behav_logp,
                t.advantages,
                t.response_mask,
                clip_eps=lc.clip_eps,
                clip_eps_high=lc.clip_eps_high,
                kl_beta=lc.kl_beta,
                correction=lc.correction,
                tis_cap=lc.tis_cap,
                ref_logp=ref,
                row_cap=self._row_cap(t),
                entropy=ent,
                entropy_coef=eta,
            )
            rows, real = t.input_ids.shape[0], int((t.response_mask.sum(-1) > 0).sum())
            # loss is the mean over rows (padding rows add 0): scaled to this rank's share of the global
            # mean, times world because gradients are averaged over ranks
            (out.loss * rows / total * self.world).backward()
            weight = real / total * self.world
            agg["loss"] += float(out.loss.detach()) * rows / max(real, 1) * weight
            agg["kl"] += out.kl * weight
            agg["clip_fraction"] += out.clip_fraction * weight
            agg["mismatch_kl"] += out.mismatch_kl * weight
        faults.hit("lane.optimizer_step")  # between this step's backward and its collectives
        self.all_reduce_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.trainable(), lc.grad_clip)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not self._all_finite(agg["loss"], grad_norm):  # before optimizer.step: weights and moments untouched
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteStep(agg["loss"], grad_norm)
        agg["grad_norm"] += grad_norm
        agg["waited"] += self._writer.wait_copied()  # a checkpoint's snapshot must hold the weights before a step
        self.optimizer.step()
        self.steps_total += 1
        return agg

    def _all_finite(self, loss: float, grad_norm: float) -> bool:
        """Whether this step's loss and gradient norm are finite on every rank (so every rank decides alike)."""
        bad = 0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0
        if self.world > 1:
            import torch.distributed as dist

            flag = torch.tensor([bad], dtype=torch.float32, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.SUM)
            bad = float(flag[0])
        return bad == 0.0

    def all_reduce_grads(self) -> None:
        """Data parallel (torchrun, gloo or nccl): average gradients over ranks."""
        import torch.distributed as dist

        if self.world == 1 or self.fsdp:  # FSDP reduce-scatters (averages) gradients itself
            return
        world = dist.get_world_size()
        for p in self.trainable():  # a lane on a shared base: its own adapter's gradients only
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world

    # ---- published weights ---------------------------------------------------------------------

    def publish(self) -> Published | None:
        with self._lock:
            return self._publish()

    def publish_alone(self) -> Published:
        """``publish`` in a process that is the whole learner (benchmarks, tools): rank 0 by construction."""
        published = self.publish()
        if published is None:
            raise RuntimeError(f"lane {self.role} is rank {self.rank} of {self.world}: only rank 0 publishes")
        return published

    def _publish(self) -> Published | None:
        """The current weights in the serving dtype: written once (hashed while written) and held in
        memory (``HELD``) for in-process engines and pushed transfers. Call between steps (every
        rank under torchrun); None on ranks other than 0."""
        full = self._full_state()  # collective under FSDP: every rank
        if self.rank != 0:
            return None
        tensors = serving_tensors(full, self.publish_dtype)
        if self.format == "lora":
            path, digest, size = write_published_adapter(
                self.published_root, self.version, tensors, self._adapter_config() or ""
            )
        else:
            path, digest, size = write_published(
                self.published_root, self.version, tensors, self.model.config.to_json_string(), self.base_model
            )
        HELD.put(self.role, path, digest, tensors)
        return path, digest, size

    def _full_state(self) -> dict[str, torch.Tensor]:
        """What is published and checkpointed: every tensor, or a LoRA lane's adapter."""
        if self.adapter is not None:
            return lora.adapter_state(self.model, self.adapter)
        if not self.fsdp:
            return self.model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], full)  # full_state_dict: plain tensors, no DTensor shards

    # ---- resume checkpoints --------------------------------------------------------------------

    @property
    def checkpoint_busy(self) -> bool:
        return self._writer.busy

    def wait_checkpoint(self) -> None:
        """Block until the checkpoint in flight (if any) is written (or failed)."""
        if self._writer.in_flight is not None:
            self._writer.in_flight.exception()

    def begin_checkpoint(self) -> Future[Checkpoint]:
        """Start a resume checkpoint of the current state (call between steps, none in flight): its
        snapshot is copied and written on the writer's thread; the future ends when it is durable.
        Under torchrun it is written at once, by every rank."""
        self.checkpointed_version = self.version
        if self.world > 1:
            done: Future[Checkpoint] = Future()
            t0 = time.perf_counter()
            path, digest, size = self._checkpoint_distributed()
            done.set_result(
                Checkpoint(path, digest, size, self.version, tuple(self.consumed), time.perf_counter() - t0)
            )
            self._durable_now(done)
            return done
        job = CheckpointJob(
            self.version,
            self.role,
            list(self.consumed),
            self.steps_total,
            self._full_state(),
            self.optimizer.state_dict(),
            self.model.config.to_json_string(),
            self.base_model,
            adapter_config_json=self._adapter_config(),
            entropy_coef=self._saved_entropy_coef(),
        )
        fut = self._writer.start(job)
        fut.add_done_callback(self._durable_now)
        return fut

    def _saved_entropy_coef(self) -> float | None:
        """What a checkpoint keeps of the entropy bonus: an adaptive coefficient (a fixed one is the config's)."""
        return self.entropy_coef if self.entropy_control.adaptive else None

    def _durable_now(self, fut: Future[Checkpoint]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._durable = frozenset(fut.result().consumed)  # checkpoints complete in order

    def checkpoint(self) -> Published:
        """A resume checkpoint of the current state, written now (waits for one in flight);
        (path, manifest digest, bytes). The directory also loads as a model (config, tokenizer)."""
        self.wait_checkpoint()
        final = self.root / f"v{self.version:06d}"
        if (final / MARKER).exists() and (manifest := manifest_of(final)) is not None:
            return final, manifest["digest"], sum(int(f["bytes"]) for f in manifest["files"].values())
        ckpt = self.begin_checkpoint().result()
        return ckpt.path, ckpt.digest, ckpt.bytes

    def _checkpoint_distributed(self) -> Published:
        """Every rank takes part: full weights gathered to rank 0, optimizer shards one file per rank."""
        import torch.distributed as dist

        from coevo.training.checkpoint import write_checkpoint

        full = self._full_state()
        shard = self.root / f".opt-v{self.version:06d}.rank{self.rank}.pt"
        torch.save(self.optimizer.state_dict(), shard)
        dist.barrier()
        out: list[Any] = [None]
        if self.rank == 0:
            job = CheckpointJob(
                self.version,
                self.role,
                list(self.consumed),
                self.steps_total,
                full,
                {},
                self.model.config.to_json_string(),
                self.base_model,
                adapter_config_json=self._adapter_config(),
                entropy_coef=self._saved_entropy_coef(),
            )
            out[0] = write_checkpoint(
                self.root,
                job,
                {k: v.detach().cpu() for k, v in full.items()},
                None,
                extra={
                    f"optimizer.rank{r}.pt": self.root / f".opt-v{self.version:06d}.rank{r}.pt"
                    for r in range(self.world)
                },
            )
        dist.broadcast_object_list(out, src=0)
        dist.barrier()  # every rank has it before any goes on (a broadcast alone does not wait for the receivers)
        return out[0]

    def _adapter_config(self) -> str | None:
        if self.adapter is None:
            return None
        return lora.adapter_config_json(self.model, self.base_model, self.adapter)

    def close(self) -> None:
        """Wait for a checkpoint in flight and stop the writer's thread (and the grammars' worker)."""
        self._writer.close()
        if "grammars" in self.__dict__:
            self.grammars.close()


@dataclass
class _UndoPoint:
    """The lane's trainable state before a batch of several optimiser steps: parameters and optimiser
    state copied on their device (one more copy of each while such a batch runs; a batch of one
    step, the default, needs none: its failure happens before ``optimizer.step``)."""

    params: list[torch.Tensor]
    optimizer: dict[Any, dict[str, Any]]
    steps_total: int

    @classmethod
    def of(cls, lane: Lane) -> _UndoPoint:
        with torch.no_grad():
            params = [p.detach().clone() for p in lane.trainable()]
            state = {
                p: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for p, s in lane.optimizer.state.items()
            }
        return cls(params, state, lane.steps_total)

    def restore(self, lane: Lane) -> None:
        with torch.no_grad():
            for p, saved in zip(lane.trainable(), self.params, strict=True):
                p.copy_(saved)
        lane.optimizer.state.clear()
        lane.optimizer.state.update(self.optimizer)
        lane.optimizer.zero_grad(set_to_none=True)
        lane.steps_total = self.steps_total


def kl_rejects(step_kl: float, bound: float) -> bool:
    """Whether the KL guard undoes a batch that moved the weights by ``step_kl``: beyond ``bound``,
    or not a number (``nan > bound`` is False; ``not nan <= bound`` is True)."""
    return not step_kl <= bound


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
