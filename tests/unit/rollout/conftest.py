"""Shared tiny models for the rollout unit tests (built once per session, a few ms each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.models.tiny import build_tiny_model

TASK_VOCAB = "0123456789+= abcdefgh"


def _sharpen(model_dir: Path, scale: float) -> Path:
    """Scale lm_head so logits are peaked (no near-ties for greedy; top-p cuts something)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def task_model_dir(tmp_path_factory) -> Path:
    """A qwen2 tiny model with a per-character vocabulary (clean text for stop strings), peaked logits."""
    out = build_tiny_model(tmp_path_factory.mktemp("task_model"), task_vocab=TASK_VOCAB, seed=4)
    return _sharpen(out, 40.0)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory) -> Path:
    """A byte-level qwen3 tiny model with tied embeddings (HF pushes may omit lm_head.weight)."""
    return build_tiny_model(tmp_path_factory.mktemp("tied_model"), arch="qwen3", tie_word_embeddings=True, seed=5)


@pytest.fixture(scope="session")
def hf_task_model(task_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(task_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def task_engine(task_model_dir):
    from megarl.engines.torch_engine import TorchEngine

    return TorchEngine(task_model_dir, dtype="float32", max_running_requests=64)
