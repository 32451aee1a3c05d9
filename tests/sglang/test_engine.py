"""megarl's SGLang engine against a real SGLang server (CPU, tiny Qwen2, fp32).

Every log-prob is compared with transformers on the same weights; every weight push is
checked by the generation that follows it (tokens and log-probs of the new weights) and by
the server's weight_version. The shared server comes from conftest.py.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megarl.engines.base import SamplingParams
from megarl.rollout_sglang.client import SGLangClient, SGLangHTTPError, build_generate_payload
from megarl.rollout_sglang.engine import (
    ALL_TAGS,
    FLATTENED_BUCKET,
    UPDATE_SESSION_SINCE,
    EngineBusy,
    SGLangEngine,
    WeightVersionMismatch,
    parse_version,
)
from megarl.rollout_sglang.server import pick_free_port
from megarl.rollout_sglang.tensor_payload import build_tensor_requests
from megarl.weight_sync.update_group import (
    broadcast_tensors,
    close_update_group,
    flattened_bucket,
    open_update_group,
)

pytestmark = pytest.mark.sglang

PROMPTS = [list(b"Hello, "), list(b"The cat sat on the mat and")]  # byte-level token ids
ATOL = 1e-4  # fp32, two implementations of the same arithmetic (measured: ~1e-6 or 0)


def assert_matches_hf(engine: SGLangEngine, hf, state=None, max_new_tokens=8):
    """Greedy generation equals transformers' (every token is the argmax of the reference's
    logits; log-probs equal its log_softmax). Returns the results."""
    results = engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    )
    for prompt, r in zip(PROMPTS, results, strict=True):
        assert len(r.response_ids) > 0
        ref, argmax = hf.logprobs(prompt, r.response_ids, state)
        assert r.response_ids == argmax.tolist()
        assert torch.tensor(r.logprobs, dtype=torch.float64) == pytest.approx(ref, abs=ATOL)
    return results


def open_push(engine: SGLangEngine) -> None:
    """The steps before the first bucket of a push, in the order the real server accepts."""
    engine.pause_generation()
    engine.flush_cache()
    engine.begin_weight_update()


def close_push(engine: SGLangEngine, version: int) -> None:
    engine.end_weight_update()
    engine.continue_generation()
    engine.check_weight_version(version)


def test_server_reports_the_locked_version_which_needs_update_sessions(
    engine, locked_sglang_version
):
    assert engine.server_version() == locked_sglang_version
    assert engine.needs_update_session == (
        parse_version(engine.server_version()) >= UPDATE_SESSION_SINCE
    )
    assert engine.needs_update_session  # 0.5.23: begin/end around tensor and distributed updates


def test_greedy_generation_matches_transformers(engine, hf):
    results = assert_matches_hf(engine, hf)
    assert [r.prompt_index for r in results] == [0, 1]
    assert all(r.weight_version == 0 and r.finish_reason in ("length", "stop") for r in results)


def test_sampled_logprobs_are_those_of_the_tempered_distribution(engine, hf):
    params = SamplingParams(temperature=0.7, max_new_tokens=6, n=3, seed=1234)
    results = engine.generate(PROMPTS[:1], params)
    assert len(results) == 3
    for r in results:
        ref, _ = hf.logprobs(PROMPTS[0], r.response_ids, temperature=0.7)
        assert torch.tensor(r.logprobs, dtype=torch.float64) == pytest.approx(ref, abs=ATOL)


def test_seeds_travel_as_int64(engine):
    # SGLang validates sampling_seed against the int64 range: a 63-bit seed passes, 2**63 not.
    body = build_generate_payload(PROMPTS[0], SamplingParams(max_new_tokens=2, seed=7), 0)
    assert body["sampling_params"][0]["sampling_seed"] >= 2**31  # megarl's seeds use 63 bits
    assert engine.client.post("/generate", body).status == 200
    body["sampling_params"][0]["sampling_seed"] = 2**63
    reply = engine.client.post("/generate", body)
    assert reply.status == 400 and "sampling_seed" in str(reply.body)


def test_tensor_update_needs_a_session_and_changes_generation(engine, hf, new_weights):
    before = assert_matches_hf(engine, hf)
    (request,) = build_tensor_requests(list(new_weights.items()), tp=1, bucket_class=None)
    body = {"serialized_named_tensors": request.payloads, "load_format": None,
            "flush_cache": False, "weight_version": "5"}  # fmt: skip
    # What megarl works around: SGLang 0.5.23 refuses an update outside a session ...
    refused = engine.client.post("/update_weights_from_tensor", body)
    assert refused.status == 400 and "begin_weight_update" in refused.body["message"]
    with pytest.raises(RuntimeError, match="call engine.begin_weight_update"):
        engine.update_from_tensor(request.payloads, request.load_format, 5)
    # ... and applies it inside one.
    open_push(engine)
    engine.update_from_tensor(request.payloads, request.load_format, 5)
    close_push(engine, 5)
    after = assert_matches_hf(engine, hf, new_weights)
    assert all(r.weight_version == 5 for r in after)
    assert max(abs(a - b) for x, y in zip(before, after, strict=True)
               for a, b in zip(x.logprobs, y.logprobs, strict=False)) > 1e-3  # fmt: skip


def test_flattened_bucket_built_by_sglangs_own_bucket_class(
    engine, hf, new_weights, sglang_python, tmp_path
):
    # megarl's payload code run where SGLang is importable (its FlattenedTensorBucket and
    # serializer), as on a GPU trainer with SGLang installed; the tensors are CPU ones here.
    save_file(new_weights, str(tmp_path / "w.safetensors"))
    script = Path(__file__).with_name("flattened_payload.py")
    payload_module = Path(__file__).parents[2] / "megarl" / "rollout_sglang" / "tensor_payload.py"
    out = subprocess.run(
        [sglang_python, str(script), str(payload_module), str(tmp_path / "w.safetensors")],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    requests = json.loads(out.stdout)
    assert [r["load_format"] for r in requests] == ["flattened_bucket"]  # one multi-dtype bucket
    open_push(engine)
    for i, r in enumerate(requests):
        engine.update_from_tensor(
            r["payloads"], r["load_format"], 6 if i == len(requests) - 1 else None
        )
    close_push(engine, 6)
    assert_matches_hf(engine, hf, new_weights)


def test_distributed_update_over_a_gloo_group(engine, hf, new_weights):
    port = pick_free_port()
    pending = engine.init_update_group_async("127.0.0.1", port, 1, 2, "megarl_test_g", "gloo")
    group = open_update_group("127.0.0.1", port, 0, 2, "megarl_test_g", "gloo")
    pending.result(timeout=120)
    try:
        names = list(new_weights)
        tensors = [new_weights[n] for n in names]
        meta = (
            [str(t.dtype).removeprefix("torch.") for t in tensors],
            [list(t.shape) for t in tensors],
        )
        # Outside a session the engine refuses before posting: a refused request would leave
        # this process's broadcast waiting for a receiver forever.
        with pytest.raises(RuntimeError, match="begin_weight_update"):
            engine.update_from_distributed_async(names, *meta, "megarl_test_g", 8)
        open_push(engine)
        reply = engine.update_from_distributed_async(names, *meta, "megarl_test_g", 8)
        broadcast_tensors(group, tensors)
        assert reply.result(timeout=120)["success"] is True
        close_push(engine, 8)
        assert_matches_hf(engine, hf, new_weights)
    finally:
        engine.destroy_update_group("megarl_test_g")
        close_update_group(group)


def test_flattened_distributed_update_is_one_broadcast_and_refuses_unaligned_tensors(engine, hf, new_weights):
    """What SGLangDistributedTransport sends to SGLang >= 0.5.6: a bucket's bytes as one broadcast
    (load_format flattened_bucket). A layout whose tensor starts at a byte offset that is not a
    multiple of its dtype's size is refused at once, before any broadcast (the fake's rule)."""
    assert engine.takes_flattened_distributed
    port = pick_free_port()
    pending = engine.init_update_group_async("127.0.0.1", port, 1, 2, "megarl_test_flat", "gloo")
    group = open_update_group("127.0.0.1", port, 0, 2, "megarl_test_flat", "gloo")
    pending.result(timeout=120)
    try:
        named, flat = flattened_bucket(sorted(new_weights.items()))
        meta = ([n for n, _ in named], [str(t.dtype).removeprefix("torch.") for _, t in named],
                [list(t.shape) for _, t in named])  # fmt: skip
        open_push(engine)
        reply = engine.update_from_distributed_async(*meta, "megarl_test_flat", 8, FLATTENED_BUCKET)
        broadcast_tensors(group, [flat])
        assert reply.result(timeout=120)["success"] is True
        unaligned = engine.update_from_distributed_async(["a", "b"], ["bfloat16", "float32"], [[3], [2]],
                                                         "megarl_test_flat", None, FLATTENED_BUCKET)  # fmt: skip
        refused = unaligned.exception(timeout=120)
        assert isinstance(refused, SGLangHTTPError) and refused.status == 400
        assert "Unaligned received tensor b: byte offset 6, dtype torch.float32" in str(refused)
        close_push(engine, 8)
        assert_matches_hf(engine, hf, new_weights)
    finally:
        engine.destroy_update_group("megarl_test_flat")
        close_update_group(group)


def _hf_dir(target, tiny_model, weights):
    """An HF directory: the tiny model's config and tokenizer files, ``weights`` as its safetensors."""
    target.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix != ".safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    save_file(weights, str(target / "model.safetensors"))
    return target


def test_disk_update_loads_a_directory(engine, hf, new_weights, tiny_model, tmp_path):
    target = _hf_dir(tmp_path / "v9", tiny_model, new_weights)
    engine.load_weights_from_disk(target, 9)
    assert engine.weight_version == 9 and engine.model_info()["load_format"] == "auto"
    assert_matches_hf(engine, hf, new_weights)


def long_request(url: str, tokens: int = 400) -> tuple[threading.Thread, dict]:
    """A generation of ``tokens`` tokens (EOS ignored) from another client, in a thread."""
    out: dict = {}
    body = {"input_ids": [PROMPTS[0]] * 4, "return_logprob": True,
            "sampling_params": [{"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True}] * 4}  # fmt: skip

    def run() -> None:
        try:
            out["reply"] = SGLangClient(url, retries=0).post("/generate", body, timeout=600)
        except Exception as err:  # noqa: BLE001 - the test asserts on it
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def wait_until_running(engine: SGLangEngine, thread: threading.Thread) -> bool:
    """Until SGLang refuses a flush (a request is running: True), or the request is over."""
    while thread.is_alive():
        if engine.client.post("/flush_cache", {}).status == 400:
            return True
        thread.join(0.05)
    return False


def test_release_waits_for_a_running_request_instead_of_killing_the_server(engine):
    # SGLang 0.5.23 dies when memory is released while a request runs; the engine flushes
    # first, which SGLang refuses (400, retried) until the request has finished.
    thread, out = long_request(engine.url)
    assert wait_until_running(engine, thread)
    engine.release_memory()
    thread.join(600)
    assert "error" not in out, out
    assert out["reply"].status == 200
    assert [i["meta_info"]["finish_reason"]["type"] for i in out["reply"].body] == ["length"] * 4
    assert engine.released == set(ALL_TAGS)
    assert engine.health().alive  # released: asked through /model_info
    with pytest.raises(EngineBusy, match="resume_memory"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=1))
    engine.resume_memory()
    engine.resume_memory()  # nothing released any more: nothing sent (a stray resume kills SGLang)
    assert engine.health().alive and engine.released == set()


def test_pause_aborts_running_requests_and_continue_serves_again(engine, hf):
    thread, out = long_request(engine.url)
    assert wait_until_running(engine, thread)
    engine.pause_generation()  # mode "abort"
    thread.join(600)
    assert out["reply"].status == 200
    assert {i["meta_info"]["finish_reason"]["type"] for i in out["reply"].body} == {"abort"}
    assert engine.flush_cache() == 1  # nothing runs any more
    assert engine.health().alive  # paused: /health_generate would wait; /model_info answers
    engine.continue_generation()
    assert engine.health().alive
    assert_matches_hf(engine, hf, max_new_tokens=4)


def test_retract_pause_holds_running_requests_through_a_weight_update(engine, hf, new_weights, tiny_model, tmp_path):
    """What an asynchronous push does (megarl/weight_sync/sglang_push.py): pause with retract,
    flush, update, continue; the requests in flight end as if never paused, on the new weights."""
    target = _hf_dir(tmp_path / "v3", tiny_model, new_weights)
    thread, out = long_request(engine.url)
    assert wait_until_running(engine, thread)
    engine.pause_generation("retract")
    assert engine.flush_cache() == 1  # accepted at once: paused, the retracted requests hold no KV
    thread.join(1.0)
    assert thread.is_alive()  # held in SGLang's queue, not aborted
    engine.update_from_disk(str(target), 3)
    engine.continue_generation()
    thread.join(600)
    assert "error" not in out, out
    for item in out["reply"].body:
        assert item["meta_info"]["finish_reason"]["type"] == "length" and len(item["output_ids"]) == 400
        logprobs = [lp for lp, _, _ in item["meta_info"]["output_token_logprobs"]]
        ref, _ = hf.logprobs(PROMPTS[0], item["output_ids"], new_weights)
        # the last token comes from the new weights over the whole sequence: its KV was recomputed
        assert logprobs[-1] == pytest.approx(float(ref[-1]), abs=ATOL)
    engine.check_weight_version(3)


def test_weight_version_label_and_mismatch(engine):
    engine.set_weight_version(3)
    engine.check_weight_version(3)
    assert engine.weight_version == 3
    results = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=2))
    assert results[0].weight_version == 3
    with pytest.raises(WeightVersionMismatch, match="weight_version is 3 after pushing version 4"):
        engine.check_weight_version(4)
