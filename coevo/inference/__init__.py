"""Inference: the clients that turn prompts into tokens and log-probs (local engine, vLLM, LiteLLM),
the one factory that picks a client from config, tiny default models built locally, and checkpoint
integrity. Knows no bus: agents and the learner hold clients, clients hold nothing of theirs."""
