"""Single-turn generation: one engine request for a whole step, ``n`` responses per prompt,
grouped by prompt. The default generate function (megarl/rollout/generate.py) takes it when every
sample of a step is single-turn; a user's generate function may call it too."""

from __future__ import annotations

from megarl.data.batch import Batch
from megarl.data.prompt_batch import PromptBatch
from megarl.engines.base import Engines, SamplingParams
from megarl.rollout.batching import batch_from_generations


def generate_batch(engines: Engines, prompts: PromptBatch, params: SamplingParams) -> Batch:
    """One single-turn response per sample: ``params.n`` samples of each prompt, grouped by prompt."""
    results = engines.generate(prompts.prompt_ids, params)
    return batch_from_generations(
        prompts.prompt_ids, results, params.n, data_source=prompts.data_source,
        ground_truth=prompts.ground_truth, extra_info=prompts.extra_info, prompt_text=prompts.prompt_text,
        raw_prompt=prompts.raw_prompt,
    )
