"""Generation through SGLangEngine against the fake SGLang server: request shape, reply
parsing, grouping of the n samples, bounded concurrency, errors."""

from __future__ import annotations

import pytest

from megarl.rollout.engine import RolloutEngine, SamplingParams
from megarl.rollout.seeds import sample_seed
from megarl.rollout_sglang.client import (
    SGLangHTTPError,
    SGLangUnreachable,
    build_generate_payload,
    parse_generate_reply,
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
    assert [p["sampling_seed"] for p in sp] == [sample_seed(11, i) & (2**31 - 1) for i in (6, 7, 8)]
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


def test_payload_without_seed_or_stops_sends_no_such_fields():
    sp = build_generate_payload([5], SamplingParams(n=1), 0)["sampling_params"][0]
    assert "sampling_seed" not in sp and "stop" not in sp and "stop_token_ids" not in sp


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
        seed = sample_seed(5, j) & (2**31 - 1)
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
    with pytest.raises(SGLangUnreachable, match="unreachable after 2 attempts"):
        engine.generate([[1]], SamplingParams())
    assert engine.health().alive is False


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


def test_deterministic_engine_needs_a_seed(fake_server):
    server = fake_server()
    server.spec = ServerSpec(model_path="m", deterministic=True)  # what SGLangServer carries
    engine = SGLangEngine(server)
    with pytest.raises(ValueError, match="without SamplingParams.seed"):
        engine.generate([[1]], SamplingParams(n=2))
    assert len(engine.generate([[1]], SamplingParams(n=2, seed=1, max_new_tokens=1))) == 2


def test_score_reads_teacher_forced_logprobs_of_the_response(fake_server):
    server = fake_server()
    engine = SGLangEngine(server.url)
    got = engine.score([[5, 6, 7], [9]], [[1, 2], [3, 4, 8]], temperature=1.0)
    assert got == [pytest.approx([-0.02, -0.03]), pytest.approx([-0.04, -0.05, -0.09])]
    (body,) = [b for p, b in server.fake.bodies if p == "/generate"][:1]
    assert body["return_logprob"] is True and body["input_ids"] in ([5, 6, 7, 1, 2], [9, 3, 4, 8])
    assert engine.score([[1]], [[]]) == [[]]
    with pytest.raises(ValueError, match="run the post-sync log-prob check at temperature 1.0"):
        engine.score([[1]], [[2]], temperature=0.7)
