"""Generate functions (``rollout.generate_function``): a step's prompts -> a Batch of responses.

``GENERATE_FUNCTIONS`` names them; a user's own is named by import path (package.module:function,
docs/extending.md). ``default`` is the agent rollout (megarl/rollout/agents/driver.py): each
sample's agent loop, chosen by its ``agent_name``, and for a step whose samples are all
single-turn one engine request (megarl/rollout/single_turn.py). :func:`make_generate` gives the
run its function; a function that needs the run's settings (the agent loops' tools and chat
template) implements :class:`RunBound`, whichever name it is registered under.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from megarl.algos.registry import Registry
from megarl.config.rollout_sections import AgentConfig
from megarl.config.section_base import IMPORT_PATH
from megarl.data.batch import Batch
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import Engines, SamplingParams
from megarl.engines.routing import routing_replay
from megarl.rollout.agents.driver import AgentRollout, agent_names, build_env
from megarl.rollout.agents.errors import AgentError

GenerateFn = Callable[[Engines, PromptBatch, SamplingParams], Batch]
"""``generate(engines, prompts, params) -> Batch``: a step's prompts to responses (rollout.generate_function)."""

GENERATE_FUNCTIONS: Registry[GenerateFn] = Registry("generate function")


@runtime_checkable
class RunBound(Protocol):
    """A generate function that takes the run's settings before its first call."""

    def for_run(self, cfg: Any, tokenizer: Any, eos_token_ids: Sequence[int]) -> GenerateFn: ...


class DefaultGenerate:
    """``default``: the agent rollout. Unbound (called as it is) it has the default agent
    settings and no chat template (single-turn samples only); ``for_run`` binds the run's."""

    def __call__(self, engines: Engines, prompts: PromptBatch, params: SamplingParams) -> Batch:
        loops = sorted(set(agent_names(prompts, AgentConfig().default_agent)) - {"single_turn"})
        if loops:
            raise AgentError(f"the default generate function was called without its run's settings, and agent loop "
                             f"{loops[0]!r} needs them (tools, chat template); get the run's function from "
                             "megarl.rollout.generate.make_generate(cfg, tokenizer, eos_token_ids)")  # fmt: skip
        return AgentRollout(AgentConfig(), None, overlap_tools=False)(engines, prompts, params)

    def for_run(self, cfg: Any, tokenizer: Any, eos_token_ids: Sequence[int]) -> GenerateFn:
        agent = cfg.rollout.agent
        overlap = agent.overlap_tools
        if overlap is None:  # rounds that wait for their tools keep a deterministic engine's runs reproducible
            overlap = cfg.rollout.engine == "sglang" and not cfg.rollout.deterministic
        return AgentRollout(agent, build_env(agent, tokenizer, eos_token_ids, cfg.data.apply_chat_template_kwargs), overlap, routing_replay(cfg))


GENERATE_FUNCTIONS.register("default")(DefaultGenerate())


def make_generate(cfg: Any, tokenizer: Any, eos_token_ids: Sequence[int]) -> GenerateFn:
    """The run's generate function (``rollout.generate_function``), bound to the run if it asks."""
    name = cfg.rollout.generate_function
    fn = GENERATE_FUNCTIONS.get(name)
    fn = fn.for_run(cfg, tokenizer, eos_token_ids) if isinstance(fn, RunBound) else fn
    if IMPORT_PATH.match(name):  # the user's own: its exits and exceptions named as the user's code
        from megarl.user_code import named_generate_function

        return named_generate_function(fn, name, returns=Batch)
    return fn
