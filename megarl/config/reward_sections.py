"""The reward's model sections: the reward model (``reward.model``) and the LLM judge (``reward.judge``).

Part of the key tree of megarl/config/sections.py (MegaRLConfig.reward); torch-free. What the
names in ``reward.combine`` may be is checked by the planner (megarl/plan/reward_checks.py),
which knows the rule scorers' names.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megarl.config.section_base import Section, UserPath

# The components of reward.combine that are not rule scorers.
MODEL_COMPONENT, JUDGE_COMPONENT, CUSTOM_COMPONENT = "model", "judge", "custom"
JudgeParser = Literal["number", "verdict", "boxed"]
RewardModelPlacement = Literal["workers", "disaggregated", "colocated"]
# reward.judge.mem_fraction when unset: on its own GPUs most of the memory (as rollout.mem_fraction); on
# cpu a share of the host's memory, where its KV cache is sized in tokens anyway.
JUDGE_MEM_FRACTION = {"cuda": 0.8, "cpu": 0.05}


class RewardModelConfig(Section):
    path: UserPath = Field(
        description="HF sequence-classification model directory (num_labels 1); its config.json and tokenizer files are checked before launch."
    )
    batch_size: int = Field(8, ge=1, description="Samples per forward (padded to the longest, at most max_length tokens each).")
    device: str | None = Field("cpu", description="Device of the reward model in the reward workers (placement workers "
                               "only; null: cpu there, and unset for a role, which runs on cluster.device).")
    placement: RewardModelPlacement = Field(
        "workers", description="Where the model is held: workers = a copy in each reward worker process on "
        "reward.model.device, outside the plan; disaggregated = a role on reward.model.gpus devices of its own taken "
        "out of the cluster, one Ray actor per device holding the model once, counted in the plan's placement and "
        "memory; colocated = one Ray actor on each training device (beside its policy rank), the model in host memory "
        "and on the device only for the step's reward phase, counted in the plan's memory per phase.",
    )
    gpus: int = Field(1, ge=1, description="placement disaggregated: devices the reward model takes out of the cluster "
                      "(the last ones; on cpu, processes), one Ray actor each; a step's batches are shared among them.")
    chat_template: bool = Field(
        True, description="Re-render each sample in the reward model's own chat template (the prompt as the data file "
        "holds it, then the response as the assistant's turn; verl's input_tokenizer); false, or a tokenizer without "
        "one: the prompt as the policy's engine saw it followed by the response.",
    )
    max_length: int | None = Field(
        None, ge=1, description="Tokens the reward model reads per sample; a longer sample is cut from the left, so "
        "the response's end is always read. None = the model's max_position_embeddings.",
    )


class RewardJudgeConfig(Section):
    model: UserPath = Field(description="HF causal-LM directory of the judge (config.json, weights, tokenizer); checked before launch.")
    engine: Literal["torch", "sglang"] = Field(
        "torch", description="What generates the verdicts: torch = the torch engine on CPU (in the controller's "
        "process for an in-process run, else a Ray actor of its own, log judge_engine.log); sglang = SGLang servers "
        "of its own, run by rollout.server_python: on cluster.device cuda reward.judge.gpus / reward.judge.tp of them "
        "on devices taken out of the cluster (logs judge_sglang<k>.log), on cpu one, a child process of the controller "
        "on its node (log judge_sglang.log).",
    )
    gpus: int = Field(1, ge=1, description="engine sglang on cluster.device cuda: devices the judge takes out of the "
                      "cluster (the last ones, after the reward model's role's), one SGLang server per reward.judge.tp "
                      "of them, held in every phase of the step; a call's samples are shared among the servers.")
    tp: int = Field(1, ge=1, description="engine sglang on cluster.device cuda: tensor-parallel size of one judge "
                    "server (its devices on one node); it divides reward.judge.gpus.")
    prompt_template: str = Field(
        description="The judge's instruction: a file path, or the text itself, with the placeholders {prompt}, "
        "{response} and {ground_truth} (literal braces doubled, as in Python's str.format); rendered in the judge "
        "model's own chat template as a user turn. Rendered on a data row before launch.",
    )
    parser: JudgeParser = Field(
        "verdict", description="How a score is read from the judge's output: number = the last number; verdict = the "
        "last of the verdicts' words (whole words, any case); boxed = the number in the last \\boxed{...}.",
    )
    verdicts: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0, "incorrect": 0.0},
        description="parser verdict: each word and the score it gives.",
    )
    score_range: tuple[float, float] | None = Field(
        None, description="parser number or boxed: [low, high], the scores the instruction asks for (e.g. [0, 10]); "
        "a number outside counts as an output without a score (called again, then counted as a failure). None = any "
        "finite number is a score.",
    )
    max_new_tokens: int = Field(64, ge=1, description="Longest judge output; the prompt is cut from the left to fit the judge's context.")
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature (0 = greedy).")
    timeout_s: float = Field(300.0, gt=0, description="Deadline of one judge call (all of a step's samples in one batch); a call past it counts every sample it held as a timeout.")
    retries: int = Field(1, ge=0, description="Calls again for the samples whose call failed (an engine error, a timeout) or whose output did not parse.")
    max_running_requests: int = Field(64, ge=1, description="Samples the judge's engine decodes at once (sglang: "
                                      "also the requests in flight at once).")
    context_length: int | None = Field(
        None, ge=2, description="Tokens of the judge's context, its prompt and output together (sglang: "
        "--context-length); None = the judge model's max_position_embeddings.",
    )
    mem_fraction: float | None = Field(
        None, gt=0, lt=1, description="sglang: --mem-fraction-static of each judge server: on cuda the share of the "
        "GPU memory it sees free at launch that it takes for weights and KV cache (None = 0.8); on cpu a share of the "
        "host's memory, its KV cache the larger of 4096 tokens and one full context (None = 0.05).",
    )

    @model_validator(mode="after")
    def _range(self) -> RewardJudgeConfig:
        if self.score_range is None:
            return self
        low, high = self.score_range
        if self.parser == "verdict":
            raise ValueError(f"reward.judge.score_range {list(self.score_range)} is for parser number or boxed (the "
                             "verdicts' scores are reward.judge.verdicts); remove it or set the parser")
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(f"reward.judge.score_range {list(self.score_range)}: give [low, high], finite, low < high")
        return self

    def server_mem_fraction(self, device: str) -> float:
        """mem_fraction as the server on ``device`` (cluster.device) takes it: the default when unset."""
        if self.mem_fraction is not None:
            return self.mem_fraction
        return JUDGE_MEM_FRACTION[device]

    @field_validator("verdicts")
    @classmethod
    def _verdict_words(cls, value: dict[str, float]) -> dict[str, float]:
        bad = [w for w in value if not w.strip() or any(c.isspace() for c in w.strip())]
        if not value or bad:
            raise ValueError(f"give one or more single words with their scores, e.g. {{correct: 1.0, incorrect: 0.0}} (got {bad or value})")
        return {w.strip(): s for w, s in value.items()}


def combine_numbers(value: Any) -> Any:
    """reward.combine's weights as the YAML gave them: numbers, not text that reads as one ("0.5",
    which pydantic would turn into 0.5, hiding a quoting mistake) nor booleans."""
    if not isinstance(value, dict):
        return value  # pydantic's own message names the type
    for source, parts in value.items():
        for name, weight in (parts.items() if isinstance(parts, dict) else ()):
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValueError(f"reward.combine[{source!r}][{name!r}] = {weight!r} is {type(weight).__name__}, not a "
                                 "number; write the weight unquoted (0.5; 1.0e-3, as YAML reads 1e-3 as text)")
    return value


def combine_weights(value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """reward.combine's shape: every data source has components, every weight is finite."""
    for source, parts in value.items():
        if not parts:
            raise ValueError(f"reward.combine[{source!r}] is empty; give its components and weights, e.g. {{gsm8k: 1.0, judge: 0.5}}")
        for name, weight in parts.items():
            if not math.isfinite(weight):
                raise ValueError(f"reward.combine[{source!r}][{name!r}] = {weight}; give a finite weight")
    return value


def combine_problem(combine: dict[str, dict[str, float]], model: bool, judge: bool) -> str | None:
    """reward.combine against reward.model and reward.judge: a component whose section is unset, or
    a judge no entry uses; one line with the fix, or None."""
    used = {name for parts in combine.values() for name in parts}
    for name, is_set in ((MODEL_COMPONENT, model), (JUDGE_COMPONENT, judge)):
        if name in used and not is_set:
            return f"reward.combine uses {name!r} but reward.{name} is not set; set reward.{name} or drop {name!r} from reward.combine"
    if judge and JUDGE_COMPONENT not in used:
        return "reward.judge is set but no reward.combine entry uses it; add it, e.g. reward.combine: {<data_source>: {judge: 1.0}}"
    return None
