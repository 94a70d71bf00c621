"""docs/algorithm.md's numbers, checked against values computed by hand (no I/O, no torch)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coevo.algorithm.prompts import last_boxed, parse_action, parse_vote
from coevo.algorithm.scoring import (
    StepRec,
    TrajRec,
    VoteRec,
    accept_rewrite,
    accuracy,
    consistency_advantages,
    group_consistency_advantages,
    integrated_rewards,
    judge_accuracies,
    outcome_weights,
    rewrite_direction,
    step_advantages,
    vote_profile,
)

P, M, U, E = VoteRec(1), VoteRec(-1), VoteRec(None, "unparseable"), VoteRec(None, "error")


def group() -> list[TrajRec]:
    return [
        TrajRec("t1", "won", (StepRec("s10", 0, (P, P, P), 1), StepRec("s11", 1, (P, M, U), 1))),
        TrajRec(
            "t2",
            "lost",
            (StepRec("s20", 0, (M, M, M), -1), StepRec("s21", 1, (M, M, P), -1), StepRec("s22", 2, (P, P, P), 1)),
        ),
        TrajRec("t3", "truncated", (StepRec("s30", 0, (P, M, M), -1),)),
        TrajRec("t4", "aborted", (StepRec("s40", 0, (P, P, P)),)),
    ]


def test_integrated_rewards() -> None:
    r = integrated_rewards(group())
    assert r == pytest.approx({"s10": 2.0, "s11": 1.0, "s20": -2.0, "s21": -4 / 3, "s22": 0.0, "s30": -4 / 3})
    assert "s40" not in r  # aborted: never trained on
    assert integrated_rewards(group(), mode="outcome-only")["s11"] == 1.0
    assert integrated_rewards(group(), mode="steps-only")["s21"] == pytest.approx(-1 / 3)
    assert integrated_rewards(group(), lam=0.5)["s20"] == pytest.approx(-1.5)


def test_step_index_standardisation() -> None:
    a = step_advantages(group(), integrated_rewards(group()))
    # index 0: R = [2, -2, -4/3]; mean -4/9; population std sqrt(248/81)
    std0 = math.sqrt(((2 + 4 / 9) ** 2 + (-2 + 4 / 9) ** 2 + (-4 / 3 + 4 / 9) ** 2) / 3)
    assert std0 == pytest.approx(1.749779)
    assert a["s10"] == pytest.approx((2 + 4 / 9) / std0) == pytest.approx(1.397001, abs=1e-6)
    assert a["s20"] == pytest.approx(-0.889, abs=1e-3)
    assert a["s30"] == pytest.approx(-0.508, abs=1e-3)
    # index 1: R = [1, -4/3]: z = ±1
    assert a["s11"] == pytest.approx(1.0) and a["s21"] == pytest.approx(-1.0)
    # index 2 is reached by one trajectory only: raw R (here 0, so it will be dropped)
    assert a["s22"] == 0.0


def test_zero_std_gives_zero_advantage() -> None:
    same = [TrajRec(f"t{i}", "lost", (StepRec(f"s{i}", 0, (M, M)),)) for i in range(4)]
    assert set(step_advantages(same, integrated_rewards(same)).values()) == {0.0}
    lone = [TrajRec("t", "won", (StepRec("s", 0, (P,)),))]
    assert step_advantages(lone, integrated_rewards(lone)) == {"s": 2.0}


def test_consistency_rewards_with_an_unparseable_vote() -> None:
    # R = 1, votes (+1, -1, unparseable) -> rewards (1, -1, -2): mean -2/3, std sqrt(14/9)
    z = consistency_advantages(1.0, [P, M, U])
    std = math.sqrt(14 / 9)
    assert z == pytest.approx([(1 + 2 / 3) / std, (-1 + 2 / 3) / std, (-2 + 2 / 3) / std])
    assert z == pytest.approx([1.336306, -0.267261, -1.069045], abs=1e-6)
    assert consistency_advantages(2.0, [P, P, P]) == [None, None, None]  # all the same reward: skipped
    # an error vote is not a vote: excluded, and the rest standardised among themselves
    assert consistency_advantages(-1.0, [P, E, M]) == pytest.approx([-1.0, None, 1.0])
    assert consistency_advantages(-1.0, [E, E, P]) == [None, None, None]


def test_error_votes_do_not_count_as_minus_one() -> None:
    t = [TrajRec("t", "won", (StepRec("s", 0, (P, E, E)),))]
    assert integrated_rewards(t)["s"] == 2.0  # mean over the one real vote
    u = [TrajRec("t", "won", (StepRec("s", 0, (P, U)),))]
    assert integrated_rewards(u)["s"] == 1.5  # unparseable counts 0


def test_accuracy_and_judge_accuracies() -> None:
    assert accuracy(group()) == pytest.approx(1 / 3)  # aborted excluded
    proc, outc = judge_accuracies(group())
    # majorities: s10 +1 ok, s11 tie (wrong), s20 -1 ok, s21 -1 ok, s22 +1 ok, s30 -1 ok -> 5/6
    assert proc == pytest.approx(5 / 6)
    # mean votes: t1 4/6 > 0 and won (hit); t2 -1/9... (-3-1+3)/9 < 0 and lost (hit); t3 -1/3 (hit)
    assert outc == 1.0


def test_vote_profile_by_hand() -> None:
    p = vote_profile(group(), integrated_rewards(group()))
    # parseable votes of the non-aborted steps: 9 of 17 are +1
    assert p.positive == pytest.approx(9 / 17)
    # s10 (R 2, +++), s20 (R -2, ---) and s22 (R 0, +++) give every vote one reward: 3 of 6 steps silent
    assert p.silent == pytest.approx(0.5)
    assert p.labelled_good == pytest.approx(0.5)
    assert vote_profile([], {}) == type(p)(None, None, None)


@given(
    won=st.booleans(),
    votes=st.lists(st.sampled_from([1, -1]), min_size=2, max_size=8).filter(lambda v: len(set(v)) == 2),
    lam=st.floats(0.0, 1.0),
)
def test_the_judge_learns_the_outcome_whatever_lambda(won: bool, votes: list[int], lam: float) -> None:
    """On a step whose votes split, the consistency advantages are those of R = O: the vote mean that
    the integrated reward adds (lambda <= 1) only scales R, and the step's z-score removes the scale. What
    the judge is trained to say of a step is its trajectory's outcome, not the step's quality."""
    recs = tuple(VoteRec(v) for v in votes)  # type: ignore[arg-type]
    t = [TrajRec("t", "won" if won else "lost", (StepRec("s", 0, recs),))]
    r = integrated_rewards(t, lam=lam)["s"]
    assert consistency_advantages(r, recs) == pytest.approx(consistency_advantages(1.0 if won else -1.0, recs))
    plus = [a for a, v in zip(consistency_advantages(r, recs), votes, strict=True) if v == 1]
    assert all((a > 0) == won for a in plus)  # a +1 vote is rewarded iff the trajectory was won


@pytest.mark.parametrize(
    ("direction", "parent", "cand", "ok"),
    [
        ("harder", 0.875, 0.5, True),
        ("harder", 0.875, 0.0, False),  # unsolved
        ("harder", 0.875, 0.875, False),  # not harder (boundary)
        ("harder", 0.875, 0.2, True),  # exactly at alpha_low: accepted
        ("harder", 0.875, 0.125, False),  # below alpha_low
        ("easier", 0.125, 0.5, True),
        ("easier", 0.125, 0.125, False),  # not easier (boundary)
        ("easier", 0.125, 0.8, True),  # exactly at alpha_high: accepted
        ("easier", 0.125, 0.875, False),  # above alpha_high
        ("easier", 0.0, 0.0, False),
    ],
)
def test_acceptance_gate_on_both_sides_of_each_boundary(direction, parent, cand, ok) -> None:
    accepted, reason = accept_rewrite(direction, parent, cand)
    assert accepted is ok, reason


def test_rewrite_direction_band() -> None:
    assert rewrite_direction(0.8) == "harder" and rewrite_direction(0.2) == "easier"
    assert rewrite_direction(0.5) is None and rewrite_direction(0.79) is None


@pytest.mark.parametrize(
    ("text", "vote"),
    [
        (r"good step. \boxed{1}", 1),
        (r"\boxed{+1}", 1),
        (r"\boxed{-1}", -1),
        (r"first \boxed{1} then I changed my mind \boxed{-1}", -1),  # the last box counts
        (r"\boxed{ -1 }", -1),
        (r"\boxed{\text{-1}}", -1),
        (r"\boxed{0}", None),
        (r"\boxed{1/2}", None),
        (r"\boxed{good}", None),
        (r"no box at all: 1", None),
        (r"\boxed{1", None),  # unbalanced
        (r"\boxed{{1}}", None),
        (r"\boxed{-1} and an unfinished \boxed{", -1),
        ("", None),
    ],
)
def test_vote_parser_on_tricky_outputs(text: str, vote) -> None:
    assert parse_vote(text) == vote


def test_action_parser() -> None:
    assert parse_action(r"I go north \boxed{2}", 3) == 2
    assert parse_action(r"\boxed{3}", 3) is None
    assert parse_action(r"\boxed{b}", 12) == 11
    assert parse_action("2", 3) is None
    assert last_boxed(r"\boxed{a{b}c}") == "a{b}c"


@given(st.lists(st.floats(-2, 2, allow_nan=False), min_size=2, max_size=16))
def test_step_advantages_are_standardised(rs: list[float]) -> None:
    trajs = [TrajRec(f"t{i}", "won", (StepRec(f"s{i}", 0),)) for i in range(len(rs))]
    a = step_advantages(trajs, {f"s{i}": r for i, r in enumerate(rs)})
    vals = list(a.values())
    assert abs(sum(vals) / len(vals)) < 1e-6
    if max(rs) - min(rs) > 1e-6:
        assert sum(v * v for v in vals) / len(vals) == pytest.approx(1.0, abs=1e-6)


def test_coding_test_rewards_by_hand() -> None:
    from coevo.algorithm.scoring import coding_test_advantages

    # programs: A, B correct; C, D, E incorrect.  (correct, passed)
    t0 = [(True, True), (True, True), (False, False), (False, False), (False, True)]  # all correct pass: +2
    t1 = [(True, True), (True, False), (False, True), (False, False), (False, False)]  # a correct fails: -1
    t2 = [(True, False), (True, False), (False, False), (False, False), (False, False)]  # garbage: -0
    z = coding_test_advantages([t0, t1, t2])
    mean, std = 1 / 3, math.sqrt(((2 - 1 / 3) ** 2 + (-1 - 1 / 3) ** 2 + (0 - 1 / 3) ** 2) / 3)
    assert z == pytest.approx([(2 - mean) / std, (-1 - mean) / std, (0 - mean) / std])
    only_correct = [[(True, True), (True, True)], [(True, True), (True, False)]]  # +1 and -1
    assert coding_test_advantages(only_correct) == pytest.approx([1.0, -1.0])


async def test_scorer_memory_of_scored_groups_is_bounded_and_orphans_are_dropped(bus, cfg) -> None:
    import time

    from coevo.agents.scorer import ScorerAgent
    from coevo.schemas import StepJudged
    from tests.samples import sample_events

    scorer = ScorerAgent(bus, cfg)
    scorer.REMEMBER = 3
    for gid in ("g1", "g2", "g3", "g4", "g5"):
        scorer.remember(gid)
    assert list(scorer.scored) == ["g3", "g4", "g5"]  # the oldest are forgotten first
    vote = next(e for e in sample_events(bus.run_id) if isinstance(e, StepJudged))
    await scorer.on_event(vote.model_copy(update={"group_id": "g4"}), None)  # late vote of a scored group
    assert "g4" not in scorer.groups
    await scorer.on_event(vote.model_copy(update={"group_id": "g1"}), None)  # late vote of a forgotten group
    assert scorer.groups["g1"].scheduled is None
    scorer.drop_orphans(time.monotonic())
    assert "g1" in scorer.groups  # not before group_timeout_s
    scorer.drop_orphans(time.monotonic() + cfg.scorer.group_timeout_s + 1)
    assert "g1" not in scorer.groups and scorer.counters["groups.orphans_dropped"] == 1


async def test_scorer_restart_reloads_what_a_full_replay_would_from_the_oldest_open_group(
    bus, cfg, monkeypatch
) -> None:
    """A restarted scorer reads steps and votes only from the ``TaskScheduled`` of the oldest group
    still open at the last event its consumer was delivered, and ends with the state a replay of the
    whole stream up to there gives (but for orphans older than that, which it would only drop) and
    every group scored so far remembered (a ``GroupScored`` can be stored after that event)."""
    from coevo.agents.scorer import Group, ScorerAgent, scored_id
    from coevo.schemas import GroupScored, StepJudged, StepTaken, TaskScheduled, TrajectoryCompleted, new_id
    from tests.samples import sample_events

    proto = {type(e): e for e in sample_events(bus.run_id)}

    def ev(cls: type, gid: str, **fields: object) -> object:
        event_id = scored_id(gid) if cls is GroupScored else new_id()  # as the scorer derives it
        return proto[cls].model_copy(update={"event_id": event_id, "group_id": gid, **fields})

    stream = [
        ev(TaskScheduled, "g1"),
        ev(StepTaken, "g1"),
        ev(StepJudged, "g1"),
        ev(TrajectoryCompleted, "g1", rollout_index=0),
        ev(StepJudged, "old-orphan"),
        ev(GroupScored, "g1"),
        ev(TaskScheduled, "g2"),
        ev(StepTaken, "g2"),
        ev(StepJudged, "g1"),  # a late vote of a scored group
        ev(StepJudged, "orphan"),
        ev(TaskScheduled, "g3"),
        ev(StepTaken, "g3"),
        ev(TrajectoryCompleted, "g2", rollout_index=1),
        ev(TrajectoryCompleted, "g2", rollout_index=1),
        ev(StepJudged, "g3"),
    ]
    seqs = [(await bus.publish_sync(e)).seq for e in stream]
    delivered = seqs[-1]
    for e in (ev(GroupScored, "g3"), ev(StepTaken, "g2"), ev(TaskScheduled, "g4")):  # past what was delivered
        await bus.publish_sync(e)

    full = ScorerAgent(bus, cfg)  # the reference: every event up to ``delivered``, in stream order
    kinds = ["task.scheduled", "step.taken", "trajectory.completed", "step.judged", "group.scored"]
    async for _, e, _m in bus.history(kinds, end_seq=delivered):
        if isinstance(e, GroupScored):
            full.remember(e.group_id)
            full.groups.pop(e.group_id, None)
        elif e.group_id not in full.scored:
            full.groups.setdefault(e.group_id, Group()).add(e)

    reads, history = [], bus.history

    def recording(kinds, start_seq=1, end_seq=None, **kw):
        reads.append((tuple(kinds), start_seq, end_seq))
        return history(kinds, start_seq, end_seq, **kw)

    monkeypatch.setattr(bus, "history", recording)
    scorer = ScorerAgent(bus, cfg)
    await scorer.replay(delivered)

    def state(agent: ScorerAgent) -> dict[str, object]:
        return {
            gid: (
                g.scheduled and g.scheduled.event_id,
                sorted(g.steps),
                sorted((k, v.event_id) for k, v in g.judged.items()),
                sorted((k, v.event_id) for k, v in g.trajectories.items()),
            )
            for gid, g in agent.groups.items()
        }

    assert list(full.scored) == ["g1"] and list(scorer.scored) == ["g1", "g3"]  # g3's GroupScored came later
    assert set(full.groups) == {"g2", "g3", "orphan", "old-orphan"}
    assert state(scorer) == {gid: v for gid, v in state(full).items() if gid not in ("old-orphan", "g3")}
    assert "g4" not in scorer.groups  # scheduled after ``delivered``: the consumer delivers it
    assert scorer.groups["g2"].trajectories[1].event_id == stream[12].event_id  # the first completion wins
    assert reads[1][1:] == (seqs[6], delivered)  # steps and votes from g2's TaskScheduled on


async def test_scorer_restart_keeps_an_event_acknowledged_above_a_lost_delivery(bus, cfg) -> None:
    """The CI chaos failure: a delivery (or its ack) lost when a NATS node died leaves the consumer's
    ack floor below events acknowledged after it, which the server never delivers again. A scorer
    killed then must still hold them after its restart: here the group's ``TaskScheduled``,
    acknowledged above a step whose delivery was lost; without it the group is an orphan, dropped
    unscored."""
    import asyncio

    from coevo.agents.scorer import ScorerAgent
    from coevo.schemas import StepTaken, TaskScheduled, new_id
    from tests.samples import sample_events

    proto = {type(e): e for e in sample_events(bus.run_id)}
    lost = proto[StepTaken].model_copy(update={"event_id": new_id(), "group_id": "g-old"})
    scheduled = proto[TaskScheduled].model_copy(update={"event_id": new_id(), "group_id": "g-gap"})
    step = proto[StepTaken].model_copy(update={"event_id": new_id(), "group_id": "g-gap"})
    for e in (lost, scheduled, step):
        await bus.publish_sync(e)

    (sub,) = ScorerAgent(bus, cfg).subscriptions()  # the consumer the agent itself reads
    puller = await bus.puller(sub.durable, sub.kinds)
    try:
        first = await puller.fetch(1, 2.0)  # delivered, never acknowledged (lost)
        second = await puller.fetch(1, 2.0)
        await second[0].ack_sync()  # acknowledged above the gap
        assert [m.metadata.sequence.stream for m in first + second] == [1, 2]
    finally:
        await puller.unsubscribe()
    info = await bus.js.consumer_info(bus.stream, "scorer")
    assert (info.ack_floor.stream_seq, info.delivered.stream_seq, info.num_ack_pending) == (0, 2, 1)

    scorer = ScorerAgent(bus, cfg)
    await asyncio.wait_for(scorer.rebuild(), 20)
    assert scorer.groups["g-gap"].scheduled is not None
    assert scorer.groups["g-gap"].scheduled.event_id == scheduled.event_id
    assert "g-old" not in scorer.groups  # before the oldest open group (not reloaded); redelivered anyway
    assert not scorer.groups["g-gap"].steps  # stored after the last delivery: the consumer delivers it


# ---- the critic (docs/algorithm.md §4.2) ---------------------------------------------------------------------


def test_critic_reads_the_judges_reasoning_and_an_unparseable_vote_is_not_a_minus_one() -> None:
    from coevo.agents.scorer import Group, failure_digest
    from coevo.algorithm import scoring
    from coevo.algorithm.rewriter import LLMRewriter, critic_summary
    from coevo.envs.quickgame import QuickGame
    from coevo.schemas import Source, StepJudged, StepTaken, TaskSpec, Vote

    src = Source(agent_id="t", role="t")
    g = Group()
    steps = []
    for k, (action, votes) in enumerate(
        [
            ("go north", [(1, "ok"), (-1, "ok")]),
            ("jump into pit", [(-1, "ok"), (-1, "ok")]),
            ("wait", [(-1, "ok"), (None, "unparseable")]),
        ]
    ):
        st = StepTaken(
            run_id="r",
            source=src,
            trajectory_id="tr",
            task_id="q",
            group_id="g",
            step_index=k,
            observation="o",
            candidates=[action],
            prompt_token_ids=[1],
            response_token_ids=[2],
            logprobs=[-0.1],
            action_text=action,
            next_observation=f"You {action}. Then more.",
            policy_version=0,
        )
        g.add(st)
        g.add(
            StepJudged(
                run_id="r",
                source=src,
                step_event_id=st.event_id,
                trajectory_id="tr",
                task_id="q",
                group_id="g",
                step_index=k,
                votes=[
                    Vote(index=i, value=v, status=s, rationale="the pit kills you" if v == -1 else "")
                    for i, (v, s) in enumerate(votes)
                ],
            )
        )
        steps.append(scoring.StepRec(st.event_id, k, tuple(scoring.VoteRec(v, s) for v, s in votes), None))
    digest = failure_digest(scoring.TrajRec("tr", "lost", tuple(steps)), g)
    assert digest.steps[1] == "2. jump into pit -> You jump into pit"
    assert digest.all_negative_steps == [2]  # step 3 had an unparseable vote: not "every vote -1"
    assert digest.rationales == ["step 2: the pit kills you"]
    summary = critic_summary(digest)
    assert summary == (
        "Went wrong at step 2 (jump into pit -> You jump into pit), which every judge vote called bad."
        " The judge: the pit kills you."
    )
    prompt = LLMRewriter(client=None).prompt(
        QuickGame(), TaskSpec(task_id="q", family="quickgame", knobs={"steps": 3}), "easier", [summary], [digest]
    )
    assert "2. jump into pit -> You jump into pit" in prompt and "judge on step 2: the pit kills you" in prompt


def quarter_won_group(run_id: str = "r", voted: tuple[int, ...] = (1, 1, -1)) -> object:
    """A scorable group of 4 trajectories, 1 won in one step and 3 lost in two steps each (accuracy 0.25,
    in the judge's band; 1 won step against 6 lost ones), every step voted ``voted`` by a local judge:
    votes that do not depend on the outcome."""
    from coevo.agents.scorer import Group
    from coevo.schemas import Source, StepJudged, StepTaken, TaskScheduled, TaskSpec, TrajectoryCompleted, Vote

    src = Source(agent_id="test", role="test")
    ids = {"run_id": run_id, "source": src, "task_id": "t", "group_id": "g"}
    g = Group(
        scheduled=TaskScheduled(
            run_id=run_id, source=src, group_id="g", task=TaskSpec(task_id="t", family="quickgame"), n_rollouts=4
        )
    )
    for i, (outcome, n) in enumerate((("won", 1), ("lost", 2), ("lost", 2), ("lost", 2))):
        tid = f"g-t{i}"
        steps = [
            StepTaken(
                **ids,
                trajectory_id=tid,
                step_index=k,
                observation=f"room {i}.{k}",
                action_text="go",
                done=k == n - 1,
                policy_version=0,
                prompt_token_ids=[1, 2],
                response_token_ids=[3],
                logprobs=[-0.5],
            )
            for k in range(n)
        ]
        for s in steps:
            g.add(s)
        done = TrajectoryCompleted(
            **ids,
            trajectory_id=tid,
            rollout_index=i,
            outcome=outcome,
            num_steps=n,
            step_event_ids=[s.event_id for s in steps],
        )
        g.add(done)
        for s in steps:
            votes = [
                Vote(index=j, value=v, status="ok", prompt_token_ids=[5], response_token_ids=[7], logprobs=[-0.7])
                for j, v in enumerate(voted)
            ]
            g.add(StepJudged(**ids, step_event_id=s.event_id, trajectory_id=tid, step_index=s.step_index, votes=votes))
    return g


@pytest.mark.parametrize("balance", [False, True])
def test_a_judge_blind_to_the_outcome_is_pushed_to_minus_one_unless_the_outcomes_are_balanced(balance: bool) -> None:
    """The cause of the judge's collapse (docs/benchmarks.md 'Why a judge collapses'), on one group: at
    accuracy 0.25 the consistency reward pushes outcome-blind votes towards -1 (six lost steps outvote one
    won step); scorer.judge_balance weighs the won and the lost steps alike, and the push is zero."""
    from coevo.agents.scorer import score_group
    from coevo.config import load_config

    cfg = load_config(overrides={"scorer.judge_balance": balance})
    score = score_group(quarter_won_group(), cfg, train_judge=True)  # type: ignore[arg-type]
    assert score.accuracy == 0.25 and score.judge_band_ok
    assert len(score.judge_samples) == 7 * 3
    plus = sum(s.advantage for s in score.judge_samples if s.sample_id.endswith(("-0", "-1")))
    # per step (+, +, -): z = (.7071, .7071, -1.4142) on the won step, the negatives on each lost one
    won_w, lost_w = (7 / 2, 7 / 12) if balance else (1.0, 1.0)
    assert plus == pytest.approx(2 * math.sqrt(0.5) * (won_w - 6 * lost_w))
    assert plus == pytest.approx(0.0 if balance else -5 * math.sqrt(2))
    assert score.judge_vote_positive == pytest.approx(2 / 3) and score.judge_steps_silent == 0.0


@pytest.mark.parametrize("vote", [1, -1])
def test_a_judge_that_votes_alike_everywhere_is_silent_per_step_and_told_where_it_is_wrong_per_group(vote: int) -> None:
    """The absorbing state (docs/benchmarks.md 'Why a judge collapses', point 3): a judge whose m votes
    agree on every step gets no sample under the paper's per-step baseline. Standardised over the group
    (scorer.judge_baseline = "group"), each step's votes are told whether they agreed with the outcome:
    a -1 vote earns R·S = 0 on the won step (R = 1 - 1) and +2 on each lost one (R = -1 - 1), so its
    votes on the won step lose and on the lost steps gain; a constant +1 the other way round. The
    advantages of the group still sum to zero: a constant vote gets no net push either way."""
    from coevo.agents.scorer import score_group
    from coevo.config import load_config

    g = quarter_won_group(voted=(vote, vote, vote))
    step = score_group(g, load_config(), train_judge=True)  # type: ignore[arg-type]
    assert step.judge_band_ok and step.judge_samples == [] and step.judge_steps_silent == 1.0
    group = score_group(g, load_config(overrides={"scorer.judge_baseline": "group"}), train_judge=True)  # type: ignore[arg-type]
    assert len(group.judge_samples) == 7 * 3
    assert group.trajectory_ids[0] == "g-t0"  # the won trajectory, one step
    won_step = group.step_event_ids[0]
    on_won = [s.advantage for s in group.judge_samples if s.step_event_id == won_step]
    # +1: 3 votes scoring 2 on the won step, 18 scoring 0: z = +sqrt(18/3) there, -sqrt(3/18) elsewhere;
    # -1: 0 on the won step, 2 elsewhere, the signs flipped
    assert on_won == pytest.approx([vote * math.sqrt(6)] * 3)
    on_lost = [s.advantage for s in group.judge_samples if s.step_event_id != won_step]
    assert on_lost == pytest.approx([-vote * math.sqrt(1 / 6)] * 18)
    assert sum(s.advantage for s in group.judge_samples) == pytest.approx(0.0)


@pytest.mark.parametrize("vote", [1, -1])
def test_balanced_and_group_baseline_together_push_a_constant_vote_neither_way(vote: int) -> None:
    """With both ``scorer.judge_balance`` and the group baseline, the baseline is the weighted mean: the
    won step's 3 votes weigh 7/2 each, the lost steps' 18 votes 7/12 each (half the group each), and
    the weighted advantages of a judge that votes alike everywhere sum to zero. (With the plain mean
    they would not: 6 lost steps against 1 won one pushed the constant vote on, towards +1.)"""
    from coevo.agents.scorer import score_group
    from coevo.config import load_config

    cfg = load_config(overrides={"scorer.judge_balance": True, "scorer.judge_baseline": "group"})
    group = score_group(quarter_won_group(voted=(vote, vote, vote)), cfg, train_judge=True)  # type: ignore[arg-type]
    assert len(group.judge_samples) == 7 * 3
    won_step = group.step_event_ids[0]
    # R·S: +1 votes score 2 on the won step and 0 on the lost ones (-1 votes: 0 and 2); weighted mean 1,
    # weighted spread 1: z = ±1, times the step's weight
    on_won = [s.advantage for s in group.judge_samples if s.step_event_id == won_step]
    on_lost = [s.advantage for s in group.judge_samples if s.step_event_id != won_step]
    assert on_won == pytest.approx([vote * 7 / 2] * 3)
    assert on_lost == pytest.approx([-vote * 7 / 12] * 18)
    assert sum(on_won) + sum(on_lost) == pytest.approx(0.0)


def test_the_group_baseline_standardises_every_vote_of_the_group_together() -> None:
    # R = 2 (won, votes +1 +1), R = 0 (lost, + -), an error vote and an unparseable one (-2)
    z = group_consistency_advantages([(2.0, [P, P]), (0.0, [P, M]), (-1.0, [E, U])])
    rewards = [2.0, 2.0, 0.0, 0.0, -2.0]
    mu = sum(rewards) / 5
    sd = math.sqrt(sum((r - mu) ** 2 for r in rewards) / 5)
    assert z == [
        pytest.approx([(2 - mu) / sd] * 2),
        pytest.approx([-mu / sd] * 2),
        [None, pytest.approx((-2 - mu) / sd)],
    ]
    assert group_consistency_advantages([(1.0, [P, P]), (-1.0, [M, M])]) == [[None, None], [None, None]]
    assert group_consistency_advantages([(1.0, [E])]) == [[None]]


@given(lengths=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), min_size=1, max_size=12))
def test_balanced_weights_give_each_outcome_half_of_the_groups_steps(lengths: list[tuple[bool, int]]) -> None:
    trajs = [
        TrajRec(f"t{i}", "won" if won else "lost", tuple(StepRec(f"s{i}-{k}", k) for k in range(n)))
        for i, (won, n) in enumerate(lengths)
    ]
    won_w, lost_w = outcome_weights(trajs)
    won_steps = sum(n for won, n in lengths if won)
    lost_steps = sum(n for won, n in lengths if not won)
    if not won_steps or not lost_steps:
        assert (won_w, lost_w) == (1.0, 1.0)
        return
    assert won_w * won_steps == pytest.approx(lost_w * lost_steps)  # both outcomes weigh half
    assert won_w * won_steps + lost_w * lost_steps == pytest.approx(won_steps + lost_steps)  # the same total
