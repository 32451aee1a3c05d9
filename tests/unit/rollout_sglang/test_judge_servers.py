"""The LLM judge's SGLang servers behind one Engines (megarl/rollout/judge_server.py JudgeServers),
against two fake SGLang servers: a call's samples split over them in contiguous slices with what a
single server would sample, a late call aborted on every server, close stopping what started them."""

from __future__ import annotations

from megarl.engines.base import SamplingParams
from megarl.rollout.judge_server import JudgeServers
from megarl.rollout_sglang.engine import SGLangEngine


def test_a_judge_call_is_split_over_its_servers_and_aborted_on_each(fake_server):
    first, second, alone = fake_server(), fake_server(), fake_server()
    stopped: list[bool] = []
    servers = JudgeServers([SGLangEngine(first.url), SGLangEngine(second.url)], lambda: stopped.append(True))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12]]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, n=1, seed=3)
    results = servers.generate(prompts, params)
    reference = JudgeServers([SGLangEngine(alone.url)], lambda: None).generate(prompts, params)
    assert [(r.prompt_index, r.response_ids) for r in results] == [(r.prompt_index, r.response_ids) for r in reference]
    # each server got a contiguous slice (the first one more), one request per prompt, sent concurrently
    sent = [sorted(p for path, b in fake.fake.bodies if path == "/generate" for p in b["input_ids"]) for fake in (first, second)]
    assert sent == [sorted(prompts[:3]), sorted(prompts[3:])]
    servers.abort()
    for fake in (first, second):
        assert fake.fake.calls[-2:] == ["/pause_generation", "/continue_generation"] and not fake.fake.paused
    servers.close()
    assert stopped == [True]
