"""Offline tools over a run's durable event log. They read events and reuse agents and the learner;
nothing but the CLI imports them.

- ``events``: open a recorded run, load its events, export/import them, the config it ran with;
- ``trace``: the causal timeline around a trajectory, step, task or weights version (``trace_view``
  renders it);
- ``replay``: feed recorded events into the scorer, judge, rewriter or learner; the first divergence;
- ``rejudge``: another judge over the recorded steps;
- ``topology``: who publishes and who consumes each event kind.
"""
