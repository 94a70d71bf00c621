"""The policy as a service: an OpenAI-compatible endpoint in front of the policy's inference client,
for agents that already exist as programs (``coevo run --family external`` or ``--serve-policy``).

``endpoint`` serves the routes and turns an agent's calls into episodes and steps; ``episodes``
keeps which group and rollout each episode fills; ``openai_api`` is the wire format. The policy
agent (``coevo.agents.policy``) owns the endpoint and publishes what it records: this package knows
no bus.
"""

from __future__ import annotations

from coevo.serve.endpoint import Endpoint, Sink

__all__ = ["Endpoint", "Sink"]
