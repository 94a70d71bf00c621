"""Offline tools over a run's durable event log: export/import, trace, replay into agents, rejudge,
and the subject topology. They read events and reuse agents and the learner; nothing imports them."""
