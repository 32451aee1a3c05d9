"""Adapter-mode pushes into a real SGLang server (CPU, tiny Qwen2, fp32): PEFT adapters loaded by
name, generation with the active one, a new version swapped in and the old one unloaded.

The reference is transformers + peft on the same adapter directories (the format the trainer
writes: adapter_config.json + adapter_model.safetensors). One server with LoRA enabled serves the
module; it needs the pinned-memory guard `make sglang-cpu` installs (SGLang's LoRA layers pin
host tensors, which a CPU-only torch refuses).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megarl.config.train_sections import LORA_MODULES
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.rollout_sglang.client import SGLangHTTPError
from megarl.rollout_sglang.engine import SGLangEngine
from megarl.rollout_sglang.server import ServerSpec, SGLangServer

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPTS = [list(b"Hello, "), list(b"The cat sat on the mat and")]  # byte-level token ids
ATOL = 1e-4  # as test_engine.py (measured here: ~4e-7)
RANK, ALPHA = 4, 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def write_adapter(base: Path, out: Path, seed: int) -> Path:
    """A PEFT adapter of ``base`` on every linear module, B random (peft starts it at zero, which
    would leave the outputs unchanged)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(LORA_MODULES))
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(out)
    return out


def reference(base: Path, adapter: Path | None):  # noqa: ANN201 - a transformers model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return (model if adapter is None else PeftModel.from_pretrained(model, adapter)).eval()


def assert_matches(model, results: list[GenerationResult]) -> None:  # noqa: ANN001
    """Every greedy token is the reference's argmax and its log-prob the reference's."""
    for prompt, r in zip(PROMPTS, results, strict=True):
        ids = torch.tensor([prompt + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        assert r.response_ids == logits.argmax(-1).tolist()
        assert torch.tensor(r.logprobs, dtype=torch.float64) == pytest.approx(logp, abs=ATOL)


def responses(results: list[GenerationResult]) -> list[list[int]]:
    return [r.response_ids for r in results]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {v: write_adapter(tiny_model, root / v, seed) for v, seed in (("v1", 1), ("v2", 2))}


@pytest.fixture(scope="module")
def engine(
    sglang_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangEngine]:
    site = Path(sglang_python).parents[1] / "lib"
    if not any(site.glob("python3*/site-packages/megarl_pin_memory_guard.pth")):
        pytest.skip("the SGLang CPU venv has no pinned-memory guard: run `make sglang-cpu` again")
    log = tmp_path_factory.mktemp("sglang-lora-logs") / "server.log"
    server = SGLangServer(ServerSpec(model_path=str(tiny_model), device="cpu", memory_saver=False, mem_fraction=0.05,
                                     max_running_requests=16, dtype="float32", python=sglang_python, log_level="info",
                                     log_path=str(log), lora_rank=RANK, lora_modules=LORA_MODULES))  # fmt: skip
    try:
        server.start(timeout=600.0)
        eng = SGLangEngine(server, max_running_requests=16)
        yield eng
        eng.close()
    finally:
        server.shutdown()


def test_generation_with_an_adapter_is_peft_s_and_not_the_base_model_s(
    engine, adapters, tiny_model
):
    base = engine.generate(PROMPTS, GREEDY)  # no adapter active: the base model
    assert_matches(reference(tiny_model, None), base)
    engine.client.load_lora_adapter("v1", adapters["v1"])
    engine.active_adapter = "v1"
    tuned = engine.generate(PROMPTS, GREEDY)
    assert_matches(reference(tiny_model, adapters["v1"]), tuned)
    assert responses(tuned) != responses(base)


def test_a_new_version_replaces_the_old_one(engine, adapters, tiny_model):
    engine.client.load_lora_adapter("p1", adapters["v1"])
    engine.active_adapter = "p1"
    first = engine.generate(PROMPTS, GREEDY)
    engine.client.load_lora_adapter("p2", adapters["v2"])  # what an adapter-mode push does
    engine.active_adapter = "p2"
    engine.client.unload_lora_adapter("p1")
    second = engine.generate(PROMPTS, GREEDY)
    assert_matches(reference(tiny_model, adapters["v2"]), second)
    assert responses(second) != responses(first)
    served = {m["id"] for m in engine.client.get("/v1/models").body["data"]}
    assert "p2" in served and "p1" not in served


def test_refusals_name_the_server_and_the_adapter(engine, adapters):
    engine.client.load_lora_adapter("r1", adapters["v1"])
    with pytest.raises(SGLangHTTPError, match=rf"{engine.url}/load_lora_adapter: HTTP 400: loading LoRA "
                       r"adapter 'r1' from .*: Failed to load LoRA adapter r1 because it is already loaded"):  # fmt: skip
        engine.client.load_lora_adapter("r1", adapters["v2"])
    with pytest.raises(
        SGLangHTTPError, match=r"unloading LoRA adapter 'gone': LoRA with name gone does not exist"
    ) as unknown:
        engine.client.unload_lora_adapter("gone")
    assert unknown.value.status == 400  # what a re-push's unload of a name the server lost tolerates
    engine.active_adapter = "never_loaded"
    with pytest.raises(SGLangHTTPError, match="has never been loaded: never_loaded"):
        engine.generate(PROMPTS[:1], GREEDY)


def test_a_re_push_loads_a_version_the_server_still_holds(engine, adapters):
    """What an adapter-mode re-push of the same version does (megarl/weight_sync/lora_adapter.py):
    the name is unloaded where a server still holds it (the others, restarted, hold nothing: no
    error), then loaded again."""
    from megarl.weight_sync.lora_adapter import adapter_name, unload_if_held

    engine.client.load_lora_adapter(adapter_name(7), adapters["v1"])
    unload_if_held(engine, 7)
    engine.client.load_lora_adapter(adapter_name(7), adapters["v2"])  # refused had the name stayed loaded
    unload_if_held(engine, 8)  # a name this server never held
    served = {m["id"] for m in engine.client.get("/v1/models").body["data"]}
    assert adapter_name(7) in served and adapter_name(8) not in served


def test_an_adapter_sent_in_the_request_generates_as_peft(engine, adapters, tiny_model):
    """What an adapter-mode push does for a server on another host (megarl/weight_sync/lora_adapter.py):
    the PEFT-named tensors and megarl's adapter_config.json go in ``/load_lora_adapter_from_tensors``;
    the server reads no directory."""
    from safetensors.torch import load_file

    from megarl.config.train_sections import LoRAConfig
    from megarl.models.lora import PEFT_WEIGHTS
    from megarl.weight_sync.lora_adapter import adapter_request, load_adapter

    tensors = load_file(str(adapters["v2"] / PEFT_WEIGHTS))  # peft's names, as LoRAAdapters.peft_tensors gives them
    load_adapter(engine, "sent_v2", adapter_request(tensors, LoRAConfig(rank=RANK, alpha=ALPHA), str(tiny_model)))
    engine.active_adapter = "sent_v2"
    assert_matches(reference(tiny_model, adapters["v2"]), engine.generate(PROMPTS, GREEDY))
