"""Generation through SGLangEngine against the fake SGLang server: request shape, reply
parsing, grouping of the n samples, bounded concurrency, errors."""

from __future__ import annotations

import http.server
import math
import pickle
import threading

import pytest

from megarl.engines.base import RolloutEngine, SamplingParams
from megarl.engines.seeds import sample_seed
from megarl.rollout_sglang.client import (
    SGLangClient,
    SGLangHTTPError,
    SGLangUnreachable,
    build_generate_payload,
    parse_generate_reply,
    sampling_params_dict,
)
from megarl.rollout_sglang.engine import EngineBusy, SGLangEngine, generate_across
from megarl.rollout_sglang.server import ServerSpec, pick_free_port


def test_payload_has_one_copy_per_sample_with_its_own_seed():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5, n=3,
                            stop=("</s>",), stop_token_ids=(7,), seed=11)  # fmt: skip
    body = build_generate_payload([1, 2, 3], params, first_sample_index=6)
    assert body["input_ids"] == [[1, 2, 3]] * 3
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    sp = body["sampling_params"]
    # SGLang takes int64 seeds (sampling_batch_info.py): megarl's 63-bit seeds go as they are.
    assert [p["sampling_seed"] for p in sp] == [sample_seed(11, i) for i in (6, 7, 8)]
    assert len({p["sampling_seed"] for p in sp}) == 3
    first = sp[0]
    assert first["temperature"] == 0.7 and first["top_p"] == 0.9 and first["top_k"] == 20
    assert (
        first["max_new_tokens"] == 5
        and first["stop"] == ["</s>"]
        and first["stop_token_ids"] == [7]
    )
    assert first["no_stop_trim"] is True and first["skip_special_tokens"] is False
    assert first["spaces_between_special_tokens"] is False
    assert "n" not in first  # n copies, never sampling_params.n (see build_generate_payload)


def test_seeds_stay_within_sglangs_int64_range():
    assert sampling_params_dict(SamplingParams(), seed=2**64 + 5)["sampling_seed"] == 5
    assert sampling_params_dict(SamplingParams(), seed=2**63 - 1)["sampling_seed"] == 2**63 - 1
    assert max(sample_seed(3, i) for i in range(1000)) >= 2**62  # 63 bits are in use


def test_fake_refuses_a_seed_outside_int64_as_sglang_does(fake_server):
    body = build_generate_payload([1, 2], SamplingParams(max_new_tokens=1, seed=1), 0)
    body["sampling_params"][0]["sampling_seed"] = 2**63
    reply = SGLangClient(fake_server().url).post("/generate", body)
    assert reply.status == 400 and "sampling_seed" in str(reply.body)


def test_payload_without_seed_or_stops_sends_no_such_fields():
    sp = build_generate_payload([5], SamplingParams(n=1), 0)["sampling_params"][0]
    assert "sampling_seed" not in sp and "stop" not in sp and "stop_token_ids" not in sp


def test_ignore_eos_goes_to_sglang_as_its_own_field():
    assert "ignore_eos" not in sampling_params_dict(SamplingParams())  # the default request is unchanged
    sp = build_generate_payload([5], SamplingParams(n=2, ignore_eos=True), 0)["sampling_params"]
    assert [p["ignore_eos"] for p in sp] == [True, True]


def test_parse_reply_reads_logprob_items_and_finish_reasons():
    body = [
        {"output_ids": [4, 5], "meta_info": {"finish_reason": {"type": "stop", "matched": 5},
         "weight_version": "3", "output_token_logprobs": [[-0.25, 4, None], [-1.5, 5, None]]}},
        {"output_ids": [6], "meta_info": {"finish_reason": {"type": "length", "length": 1},
         "weight_version": "3", "output_token_logprobs": [[-0.75, 6, "x"]]}},
    ]  # fmt: skip
    a, b = parse_generate_reply(body, prompt_index=4, n=2)
    assert (a.response_ids, a.logprobs, a.finish_reason, a.weight_version) == (
        [4, 5],
        [-0.25, -1.5],
        "stop",
        3,
    )
    assert (b.response_ids, b.finish_reason, b.prompt_index) == ([6], "length", 4)


def test_parse_reply_refuses_inconsistent_or_short_replies():
    item = {"output_ids": [4, 9], "meta_info": {"finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.25, 4, None], [-1.5, 5, None]]}}  # fmt: skip
    with pytest.raises(SGLangHTTPError, match="disagree"):
        parse_generate_reply([item], 0, 1)
    with pytest.raises(SGLangHTTPError, match="expected a list of 2"):
        parse_generate_reply([item], 0, 2)
    no_lp = {"output_ids": [4], "meta_info": {"finish_reason": {"type": "stop"}}}
    with pytest.raises(SGLangHTTPError, match="output_token_logprobs"):
        parse_generate_reply([no_lp], 0, 1)
    weird = {
        "output_ids": [],
        "meta_info": {"finish_reason": {"type": "eos?"}, "output_token_logprobs": []},
    }
    with pytest.raises(SGLangHTTPError, match="finish_reason"):
        parse_generate_reply([weird], 0, 1)


def test_engine_groups_samples_by_prompt_and_reports_finish_reasons(fake_server):
    server = fake_server()
    engine = SGLangEngine(server.url)
    assert isinstance(engine, RolloutEngine)
    prompts = [[1, 2], [3, 4, 5, 6], [7]]
    params = SamplingParams(max_new_tokens=3, n=2, seed=5)
    results = engine.generate(prompts, params)
    assert [r.prompt_index for r in results] == [0, 0, 1, 1, 2, 2]
    for j, r in enumerate(results):  # the fake's answer is a function of (prompt, seed)
        prompt = prompts[j // 2]
        seed = sample_seed(5, j)
        length = min(len(prompt), 3)
        assert r.response_ids == [(sum(prompt) + seed + k) % 97 for k in range(length)]
        assert r.logprobs == pytest.approx([-0.5 - 0.1 * k for k in range(length)])
        assert r.finish_reason == ("length" if length == 3 else "stop")
    assert all(r.weight_version == 0 for r in results)  # "default" before any update


def test_first_sample_index_shifts_the_seeds(fake_server):
    engine = SGLangEngine(fake_server().url)
    params = SamplingParams(max_new_tokens=2, n=2, seed=9)
    whole = engine.generate([[1, 2], [3, 4]], params)
    second = engine.generate([[3, 4]], params, first_sample_index=2)
    assert [r.response_ids for r in whole[2:]] == [r.response_ids for r in second]


def test_abort_is_reported_as_abort(fake_server):
    server = fake_server()
    server.fake.abort_sample = 1
    results = SGLangEngine(server.url).generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, n=2))
    assert [r.finish_reason for r in results] == ["stop", "abort"]


def test_concurrency_is_bounded_by_max_running_requests(fake_server):
    server = fake_server(generate_delay=0.1)
    engine = SGLangEngine(server.url, max_running_requests=4)
    results = engine.generate([[i + 1] for i in range(8)], SamplingParams(max_new_tokens=1, n=2))
    assert len(results) == 16
    assert server.fake.max_inflight == 4  # 4 // n = 2 requests of 2 sequences at a time


def test_http_error_names_server_endpoint_and_status(fake_server):
    server = fake_server()
    server.fake.ep_generate = lambda body: (400, {"error": {"message": "max_new_tokens too large"}})
    with pytest.raises(SGLangHTTPError, match=r"/generate: HTTP 400: .*max_new_tokens too large"):
        SGLangEngine(server.url).generate([[1]], SamplingParams())


def test_unreachable_server_is_retried_then_reported():
    engine = SGLangEngine(f"http://127.0.0.1:{pick_free_port()}", retries=1)
    engine.client.backoff = 0.01
    with pytest.raises(SGLangUnreachable, match="unreachable after 2 attempts") as info:
        engine.generate([[1]], SamplingParams())
    assert engine.health().alive is False
    # raised in a policy rank's push, Ray pickles it to the driver: it must come back whole (an
    # exception rebuilt from its message alone failed there, and the run ended in Ray's traceback)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is SGLangUnreachable and str(back) == str(info.value)
    assert (back.url, back.endpoint, back.status, back.detail) == (engine.url, "/generate", None, info.value.detail)


class _HalfAnswer(http.server.BaseHTTPRequestHandler):
    """Reads the whole request (so closing is an EOF, not a reset), sends the status line and
    headers of a 66-byte body, and closes without the body."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "66")
        self.end_headers()
        self.close_connection = True

    def log_message(self, *args) -> None:  # quiet
        pass


def test_a_server_dying_mid_answer_is_unreachable_not_a_raw_http_error():
    # What a killed SGLang server can leave: the status line and headers sent, the body cut
    # short (http.client.IncompleteRead). It means the same as a refused connection.
    server = http.server.HTTPServer(("127.0.0.1", 0), _HalfAnswer)
    thread = threading.Thread(target=server.handle_request)
    thread.start()
    try:
        engine = SGLangEngine(f"http://127.0.0.1:{server.server_port}", retries=0)
        with pytest.raises(SGLangUnreachable, match=r"/update_weights_from_disk: .*unreachable after 1 attempts: IncompleteRead"):
            engine.client.post("/update_weights_from_disk", {"model_path": "x"}, retries=0)
    finally:
        thread.join(5)
        server.server_close()


def test_generate_on_released_engine_is_refused(fake_server):
    engine = SGLangEngine(fake_server().url)
    engine.release_memory()
    with pytest.raises(EngineBusy, match="resume_memory"):
        engine.generate([[1]], SamplingParams())


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty prompt"):
        build_generate_payload([], SamplingParams(), 0)


def test_generate_across_engines_matches_one_engine(fake_server):
    servers = [fake_server(), fake_server()]
    engines = [SGLangEngine(s.url) for s in servers]
    prompts = [[1, 2], [3], [4, 5, 6], [7, 8]]
    params = SamplingParams(max_new_tokens=4, n=2, seed=3)
    split = generate_across(engines, prompts, params)
    whole = engines[0].generate(prompts, params)
    assert [(r.prompt_index, r.response_ids) for r in split] == [
        (r.prompt_index, r.response_ids) for r in whole
    ]
    first, second = (s.history[0] for s in servers)
    assert first.calls.count("/generate") == 2 + 4 and second.calls.count("/generate") == 2


def test_each_prompt_is_asked_for_its_own_max_new_tokens_across_engines(fake_server):
    """prompt_max_new_tokens (the agent driver's turns of different budgets) reaches SGLang as
    each request's max_new_tokens, also when the prompts are split over engines."""
    engines = [SGLangEngine(fake_server().url), SGLangEngine(fake_server().url)]
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 5], [9, 9, 9, 9]]
    params = SamplingParams(max_new_tokens=4, n=2, seed=3, prompt_max_new_tokens=(1, 4, 2, 3))
    results = generate_across(engines, prompts, params)
    assert [len(r.response_ids) for r in results] == [1, 1, 4, 4, 2, 2, 3, 3]  # the fake answers min(prompt, max_new_tokens)
    with pytest.raises(ValueError, match="prompt_max_new_tokens"):
        engines[0].generate(prompts, SamplingParams(max_new_tokens=4, prompt_max_new_tokens=(1, 2)))


def test_deterministic_engine_needs_a_seed(fake_server):
    server = fake_server()
    server.spec = ServerSpec(model_path="m", deterministic=True)  # what SGLangServer carries
    engine = SGLangEngine(server)
    with pytest.raises(ValueError, match="without SamplingParams.seed"):
        engine.generate([[1]], SamplingParams(n=2))
    assert len(engine.generate([[1]], SamplingParams(n=2, seed=1, max_new_tokens=1))) == 2


# ---- memory and health: what SGLang does, and what the engine does about it ----------------
# [real]: seen on SGLang 0.5.23 (CPU); [source]: read in SGLang's GPU code (conftest.py).


def _wait_inflight(fake, thread) -> None:
    while fake.inflight == 0 and thread.is_alive():
        thread.join(0.01)


def _raw_generate(url: str, out: dict):
    def run():
        try:
            out["reply"] = SGLangClient(url, retries=0).post(
                "/generate", build_generate_payload([1, 2], SamplingParams(max_new_tokens=2), 0)
            )
        except SGLangHTTPError as err:
            out["error"] = err

    return threading.Thread(target=run)


def test_release_while_a_request_runs_kills_sglang(fake_server):  # [real]
    running = threading.Event()  # the generation runs until the release was sent
    server = fake_server(generate_gate=running)
    out: dict = {}
    worker = _raw_generate(server.url, out)
    worker.start()
    _wait_inflight(server.fake, worker)
    try:
        with pytest.raises(SGLangUnreachable):
            SGLangClient(server.url, retries=0).post("/release_memory_occupation", {"tags": None})
    finally:
        running.set()
    worker.join()
    assert "idle" in server.fake.crashed and isinstance(out["error"], SGLangUnreachable)
    assert SGLangEngine(server.url, retries=0).health().alive is False


def test_release_waits_for_other_clients_requests_by_flushing_first(fake_server):
    server = fake_server(generate_delay=0.3)
    engine = SGLangEngine(server.url, flush_interval=0.05)
    out: dict = {}
    worker = _raw_generate(server.url, out)  # another client: the engine cannot count it
    worker.start()
    _wait_inflight(server.fake, worker)
    engine.release_memory()  # flush answers 400 until that request is done
    worker.join()
    assert server.fake.crashed is None and out["reply"].status == 200
    calls = server.fake.control_calls()
    assert calls[0] == "/flush_cache" and calls[-2:] == [
        "/flush_cache",
        "/release_memory_occupation",
    ]
    assert engine.released == {"kv_cache", "weights", "cuda_graph"}


def test_resuming_a_tag_that_is_not_released_kills_sglang_and_the_engine_never_sends_it(
    fake_server,
):
    server = fake_server()
    engine = SGLangEngine(server.url)
    engine.release_memory(["kv_cache"])
    engine.resume_memory()  # all tags asked, only kv_cache sent
    engine.resume_memory()  # nothing released: nothing sent
    assert [b["tags"] for p, b in server.fake.bodies if p == "/resume_memory_occupation"] == [
        ["kv_cache"]
    ]
    assert server.fake.crashed is None
    with pytest.raises(SGLangUnreachable):  # [real] what the bookkeeping prevents
        SGLangClient(server.url, retries=0).post("/resume_memory_occupation", {"tags": ["weights"]})
    assert "not released" in server.fake.crashed


def test_a_forward_on_released_memory_kills_sglang_so_health_asks_model_info(
    fake_server,
):  # [source]
    server = fake_server()
    engine = SGLangEngine(server.url, retries=0)
    engine.release_memory()
    assert engine.health().alive  # through /model_info: no forward
    assert server.fake.crashed is None and server.fake.calls[-1] == "/model_info"
    with pytest.raises(SGLangUnreachable):
        SGLangClient(server.url, retries=0).get("/health_generate")
    assert "released memory" in server.fake.crashed
    assert engine.health().alive is False


def test_health_generate_while_paused_answers_503(fake_server):  # [real]
    server = fake_server()
    engine = SGLangEngine(server.url)
    engine.pause_generation()
    assert SGLangClient(server.url).get("/health_generate").status == 503
    assert engine.health().alive  # paused: /model_info
    engine.continue_generation()
    assert engine.health().alive and server.fake.calls[-1] == "/health_generate"


@pytest.mark.parametrize("cpu_backup", [False, True])
def test_weights_resumed_without_a_cpu_backup_are_garbage_until_a_push(
    fake_server, cpu_backup
):  # [source]
    server = fake_server(weights_cpu_backup=cpu_backup)
    engine = SGLangEngine(server.url)
    engine.release_memory()
    engine.resume_memory()
    (result,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    lost = [math.isnan(x) for x in result.logprobs]
    assert lost == [not cpu_backup] * 2


def test_payload_names_the_active_adapter_for_every_copy():
    params = SamplingParams(max_new_tokens=2, n=3)
    assert "lora_path" not in build_generate_payload([1, 2], params, 0)
    payload = build_generate_payload([1, 2], params, 0, adapter="policy_v4")
    assert payload["lora_path"] == ["policy_v4"] * 3
