"""The user-facing error of agent rollouts (a tool or interaction file, a chat template, the data's
agent_name or interaction_kwargs): `megarl` reports it as one `error:` line with exit code 2."""


class AgentError(ValueError):
    """A user mistake in an agent rollout's setup or data; the message names it and the fix."""
