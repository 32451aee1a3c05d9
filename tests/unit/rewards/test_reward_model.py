"""reward.model: a tiny random Qwen2 sequence classifier scored in the workers, compared with
a direct transformers forward of each text on its own (no padding) in this process."""

import pytest

from megarl.config.sections import RewardConfig, RewardModelConfig
from megarl.rewards import RewardScorer

pytestmark = pytest.mark.slow  # the workers import torch + transformers


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm")))


def _reference(path: str, texts: list[str]) -> list[float]:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_a_saved_sequence_classifier_passes_the_check(reward_model_dir):
    from megarl.rewards.reward_model import model_dir_problem

    assert model_dir_problem(reward_model_dir) is None


def test_reward_model_scores_prompt_plus_response(reward_model_dir):
    prompts = ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"] * 2 + [
        "<|im_start|>user\nlonger question?<|im_end|>\n<|im_start|>assistant\n"
    ]
    responses = ["hello", "a much longer answer with more tokens", "ok"]
    cfg = RewardConfig(
        model=RewardModelConfig(path=reward_model_dir, batch_size=2), timeout_s=60.0, workers=1
    )
    with RewardScorer(cfg) as scorer:
        result = scorer.score(["any"] * 3, responses, [None] * 3, prompts=prompts)
        with pytest.raises(ValueError, match="pass prompts"):
            scorer.score(["any"], ["x"], [None])
    assert (result.errors, result.timeouts) == (0, 0)
    expected = _reference(
        reward_model_dir, [p + r for p, r in zip(prompts, responses, strict=True)]
    )
    assert result.scores == pytest.approx(expected, abs=1e-4)
    assert len(set(result.scores)) == 3  # a random model still tells the texts apart


def test_reward_model_reads_the_sample_in_its_own_chat_template_cut_from_the_left(reward_model_dir):
    """The raw prompt and the response re-rendered in the reward model's template (not the policy's
    text); max_length keeps the text's end, where the response is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    raw = [[{"role": "user", "content": "hi"}], "what is 2+2?"]
    responses = ["hello there", "4"]
    chats = [tokenizer.apply_chat_template([*([{"role": "user", "content": r}] if isinstance(r, str) else r),
                                            {"role": "assistant", "content": a}], tokenize=False)
             for r, a in zip(raw, responses, strict=True)]  # fmt: skip
    cut = [tokenizer.decode(tokenizer(c, add_special_tokens=False)["input_ids"][-12:]) for c in chats]
    cfg = RewardConfig(model=RewardModelConfig(path=reward_model_dir, max_length=12), timeout_s=60.0, workers=1)
    with RewardScorer(cfg) as scorer:
        result = scorer.score(["any"] * 2, responses, [None] * 2, prompts=["<policy template>"] * 2, raw_prompts=raw)
    assert (result.errors, result.timeouts) == (0, 0)
    assert result.scores == pytest.approx(_reference(reward_model_dir, cut), abs=1e-4)
