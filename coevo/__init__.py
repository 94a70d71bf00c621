"""coevo: an asynchronous, event-driven runtime for online RL of LLM agents (RLAnything's loop)."""

__version__ = "0.1.0"
