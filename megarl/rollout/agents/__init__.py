"""Agent loops: multi-turn, tool-calling rollouts (docs/agents.md).

- driver.py        AgentRollout: the default generate function (megarl/rollout/generate.py); the driver (rounds, tools concurrent)
- loops.py         the loops (single_turn, tool_agent, your own): generators of Generate / CallTools
- chat.py          the ids appended between turns, from the model's chat template
- tool_calls.py    finding calls in a turn: parsers by name (hermes, your own)
- tool_base.py     the Tool base class and the built-in tools by name
- tools.py         verl-format tool files, one call with a deadline
- builtin_tools.py calculator, python (the code sandbox), retrieval (BM25)
- interactions.py  verl-format interaction files: a simulated user between turns
- checks.py        what the preflight checks in the data (agent_name, interaction and tool names)
- errors.py        AgentError, the one-line user error
"""
