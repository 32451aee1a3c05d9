"""A torch engine pushed to while it generates (asynchronous training, docs/async.md).

A push from another thread lands where the engine's gate lets it: between two decode steps
with partial rollouts (then every running row's KV cache is rebuilt under the new weights), or
between generate calls without. The push point is made deterministic by a forward hook on the
engine's model that, in the k-th forward, starts the push in another thread and waits until it
is queued at the gate.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megarl.engines.base import SamplingParams, WeightBucket
from megarl.engines.torch_engine import TorchEngine
from megarl.models.hf_files import copy_side_files

PROMPTS = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 2]]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=3)
NEW = 7  # the pushed weight version


@pytest.fixture(scope="module")
def new_model_dir(task_model_dir, tmp_path_factory):
    """The task model with every weight scaled by 1 + 10% noise, as an HF directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(task_model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("new_model")
    model.save_pretrained(out)
    copy_side_files(task_model_dir, out)
    return out


@pytest.fixture(scope="module")
def hf_new_model(new_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(new_model_dir), dtype=torch.float32).eval()


def _reference_logprobs(hf_model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax (T = 1) of each response token under a cache-free, unpadded forward, [R]."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _push_during_forward(engine: TorchEngine, forward: int, push) -> dict:
    """In the engine's ``forward``-th model forward (1 = the prefill), start ``push`` in another
    thread and wait until it is queued at the gate (or done: a broken gate lets it straight in)."""
    seen = {"forwards": 0, "version_while_queued": None}

    def hook(module, args, output):
        seen["forwards"] += 1
        if seen["forwards"] != forward:
            return
        thread = threading.Thread(target=push)
        thread.start()
        seen["thread"] = thread
        deadline = time.monotonic() + 30
        while engine._gate._pushes_waiting == 0 and thread.is_alive():  # the gate's own count of queued pushes
            assert time.monotonic() < deadline, "the push neither queued nor finished"
            time.sleep(0.001)
        seen["version_while_queued"] = engine.weight_version

    seen["handle"] = engine.model.register_forward_hook(hook)
    return seen


def test_partial_push_lands_between_steps_and_later_tokens_use_the_new_weights(task_model_dir, new_model_dir,
                                                                               hf_task_model, hf_new_model):  # fmt: skip
    engine = TorchEngine(task_model_dir, dtype="float32", max_running_requests=64, partial=True)
    seen = _push_during_forward(engine, 4, lambda: engine.load_weights_from_disk(new_model_dir, NEW))
    results = engine.generate(PROMPTS, PARAMS)
    seen["handle"].remove()
    seen["thread"].join()
    assert seen["version_while_queued"] == 0, "the push went in while a decode step was running"
    assert engine.weight_version == NEW
    # forward 4 = the decode forward after the 3rd token: its logits are of the old weights, so
    # the 4th token is sampled after a prefill under the new ones
    switched = 0
    for r in results:
        k = len(r.response_ids)
        assert r.token_versions == (0,) * min(3, k) + (NEW,) * max(0, k - 3)
        assert r.weight_version == r.token_versions[-1]
        lps = torch.tensor(r.logprobs)
        prompt = PROMPTS[r.prompt_index]
        old = _reference_logprobs(hf_task_model, prompt, r.response_ids)
        new = _reference_logprobs(hf_new_model, prompt, r.response_ids)
        assert torch.allclose(lps[:3], old[:3], atol=1e-5, rtol=0)
        assert torch.allclose(lps[3:], new[3:], atol=1e-5, rtol=0)
        if k > 3:
            switched += 1
            assert (old[3:] - new[3:]).abs().max() > 1e-3, "old and new weights agree: the test shows nothing"
    assert switched >= 2, "too few samples ran past the push"


def test_without_partial_a_push_waits_for_the_call_in_flight(task_model_dir, new_model_dir, hf_task_model):
    engine = TorchEngine(task_model_dir, dtype="float32", max_running_requests=64, partial=False)
    seen = _push_during_forward(engine, 3, lambda: engine.load_weights_from_disk(new_model_dir, NEW))
    results = engine.generate(PROMPTS, PARAMS)
    seen["handle"].remove()
    seen["thread"].join()
    assert seen["version_while_queued"] == 0 and engine.weight_version == NEW
    for r in results:
        assert r.token_versions == (0,) * len(r.response_ids) and r.weight_version == 0
        old = _reference_logprobs(hf_task_model, PROMPTS[r.prompt_index], r.response_ids)
        assert torch.allclose(torch.tensor(r.logprobs), old, atol=1e-5, rtol=0)


def test_without_partial_a_call_waits_for_a_push_in_progress(task_model_dir, new_model_dir, hf_new_model):
    """A push of two buckets: a generate started after the first waits for the last."""
    from safetensors.torch import load_file

    engine = TorchEngine(task_model_dir, dtype="float32", max_running_requests=64, partial=False)
    tensors = sorted(load_file(str(new_model_dir / "model.safetensors")).items())
    engine.load_weights(WeightBucket(tensors[:-1], NEW, last=False))
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(results=engine.generate(PROMPTS, PARAMS)))
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive(), "generate ran on half-pushed weights"
    engine.load_weights(WeightBucket(tensors[-1:], NEW, last=True))
    thread.join()
    for r in out["results"]:
        assert r.token_versions == (NEW,) * len(r.response_ids)
        new = _reference_logprobs(hf_new_model, PROMPTS[r.prompt_index], r.response_ids)
        assert torch.allclose(torch.tensor(r.logprobs), new, atol=1e-5, rtol=0)


def test_a_failed_push_releases_the_gate(task_model_dir):
    engine = TorchEngine(task_model_dir, dtype="float32", max_running_requests=64, partial=False)
    with pytest.raises(ValueError, match="no parameter for"):
        engine.load_weights(WeightBucket([("no.such.weight", torch.zeros(1))], NEW, last=False))
    result = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))[0]
    assert result.token_versions == (0,) * len(result.response_ids)


def test_a_push_left_open_by_this_thread_is_an_error_not_a_hang(task_model_dir):
    engine = TorchEngine(task_model_dir, dtype="float32", max_running_requests=64, partial=False)
    name, tensor = next(iter(engine.model.state_dict().items()))
    engine.load_weights(WeightBucket([(name, tensor.clone())], NEW, last=False))
    with pytest.raises(ValueError, match="last bucket never arrived"):
        engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=3))
