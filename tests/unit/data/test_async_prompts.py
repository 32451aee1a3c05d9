"""The asynchronous rollout producer's prompt accounting (megarl/rollout/producer.py): the
staleness bound, every prompt of an epoch trained exactly once across a checkpoint and resume,
stale groups re-issued once, groups without reward variance dropped with their reason.

The producer's ``collect`` is its one input from the engines; here it is a function that
builds each draw's Batch from the prompts the producer drew, with the token versions the test
decides (the real engines are exercised by tests/e2e/test_async_run.py)."""

from __future__ import annotations

import time

import torch

from megarl.config.sections import DataConfig
from megarl.data.stream import build_train_stream
from megarl.engines.base import GenerationResult, SamplingParams
from megarl.rollout.batching import batch_from_generations
from megarl.rollout.producer import RolloutProducer, RolloutStalled

N = 2  # samples per prompt


class Engines:
    """Draws become Batches whose tokens carry the weight version the test says is live."""

    def __init__(self) -> None:
        self.version = 0
        self.drawn: list[list[tuple[int, int]]] = []
        self.stale_draws: set[int] = set()  # draws (from 1) whose first prompt comes back 5 versions old
        self.flat: set[tuple[int, int]] = set()  # prompts whose samples all score the same

    def collect(self, prompts, params: SamplingParams, timer):
        keys = list(zip(prompts.file_index, prompts.index))
        self.drawn.append(keys)
        results = [GenerationResult(p, [1, 2], [-0.5, -0.5], "stop") for p in range(len(prompts)) for _ in range(N)]
        batch = batch_from_generations(prompts.prompt_ids, results, N, data_source=prompts.data_source,
                                       ground_truth=prompts.ground_truth, prompt_text=prompts.prompt_text)  # fmt: skip
        versions = [self.version] * (N * len(keys))
        if len(self.drawn) in self.stale_draws:
            versions[:N] = [self.version - 5] * N
        scores = [0.0 if keys[p] in self.flat else float(j) for p in range(len(keys)) for j in range(N)]
        token_versions = torch.tensor(versions)[:, None].expand(-1, batch.response_len).clone()
        return batch.replace(token_versions=token_versions, scores=torch.tensor(scores)), {"reward/errors": 0.0}


def _producer(stream, engines: Engines, k: int = 1, dynamic_sampling: bool = False) -> RolloutProducer:
    return RolloutProducer(engines.collect, stream, lambda draw: SamplingParams(seed=draw), groups_per_step=2,
                           max_staleness=k, dynamic_sampling=3 if dynamic_sampling else 0, timeout_s=60)  # fmt: skip


def _stream(prompt_file, digit_tokenizer, rows: int = 12):
    path = prompt_file("p.parquet", [[{"role": "user", "content": str(i).zfill(3)}] for i in range(rows)])
    return build_train_stream(DataConfig(train_files=[str(path)], prompts_per_step=2, max_prompt_length=16, seed=3),
                              digit_tokenizer)  # fmt: skip


def _train(producer: RolloutProducer, engines: Engines, steps: range, settle: int = 0, draws: int = 6) -> list:
    """Take, check and "push" each step; ``settle``: before the next take, wait until the
    producer drew ``settle`` draws ahead (or all ``draws``), as it does while a real step trains."""
    taken = []
    for step in steps:
        t = producer.take(step)
        assert t.batch.staleness is not None and len(t.batch) == 2 * N
        assert int(t.batch.staleness.max()) <= producer.k, (step, t.batch.staleness)
        assert t.batch.group_id.tolist() == [0, 0, 1, 1]
        taken.append(t)
        engines.version = step  # the step's push
        producer.pushed(step)
        deadline = time.monotonic() + 60
        while settle and len(engines.drawn) < min(step + settle, draws):
            assert time.monotonic() < deadline, engines.drawn
            time.sleep(0.005)
    return taken


def test_an_epoch_is_trained_exactly_once_within_the_staleness_bound(prompt_file, digit_tokenizer):
    engines = Engines()
    producer = _producer(_stream(prompt_file, digit_tokenizer), engines, k=1)
    producer.start(0, steps_left=6)
    taken = _train(producer, engines, range(1, 7), settle=2)
    producer.stop()
    trained = [k for t in taken for k in t.trained]
    assert sorted(trained) == [(0, i) for i in range(12)]  # 12 prompts, 6 steps of 2: each once
    assert any(int(t.batch.staleness.max()) == 1 for t in taken)  # generation ran ahead of training
    assert len(engines.drawn) == 6  # nothing drawn past the last step


def test_a_resume_reissues_exactly_the_pending_prompts(prompt_file, digit_tokenizer):
    engines = Engines()
    first = _producer(_stream(prompt_file, digit_tokenizer), engines, k=2)
    first.start(0, steps_left=6)
    before = _train(first, engines, range(1, 4), settle=3)  # k=2: steps 4 and 5 drawn ahead
    sampler, state = first.state_dict()  # a checkpoint after step 3, draws for later steps pending
    first.stop()
    assert state["pending"], "with k=2 the producer had drawn ahead"
    second = _producer(_stream(prompt_file, digit_tokenizer), engines, k=2)
    second.stream.load_state_dict(sampler)
    second.load_state_dict(state)
    second.start(3, steps_left=3)
    after = _train(second, engines, range(4, 7))
    second.stop()
    trained = [k for t in before + after for k in t.trained]
    assert sorted(trained) == [(0, i) for i in range(12)]
    assert [k for t in after for k in t.trained][: len(state["pending"])] == [tuple(k) for k in state["pending"]]


def test_a_stale_group_is_dropped_counted_and_reissued_once(prompt_file, digit_tokenizer):
    engines = Engines()
    engines.stale_draws = {2}  # the first prompt of the 2nd draw comes back 5 versions old
    producer = _producer(_stream(prompt_file, digit_tokenizer), engines, k=1)
    producer.start(0, steps_left=6)
    taken = _train(producer, engines, range(1, 7))
    producer.stop()
    stale = engines.drawn[1][0]
    reissued = [(i, k) for i, t in enumerate(taken) for k in t.reissued]
    assert [k for _, k in reissued] == [stale]
    assert taken[reissued[0][0]].metrics["async/dropped_stale"] == 1.0
    assert stale in [k for t in taken[reissued[0][0]:] for k in t.trained]  # trained fresh, later
    trained = [k for t in taken for k in t.trained]
    assert sorted(trained) == [(0, i) for i in range(12)]


def test_groups_without_reward_variance_are_dropped_with_their_reason(prompt_file, digit_tokenizer):
    engines = Engines()
    stream = _stream(prompt_file, digit_tokenizer)
    engines.flat = {(0, i) for i in range(0, 12, 3)}
    producer = _producer(stream, engines, k=1, dynamic_sampling=True)
    producer.start(0, steps_left=4)
    taken = _train(producer, engines, range(1, 5))
    producer.stop()
    trained = [k for t in taken for k in t.trained]
    dropped = [(k, reason) for t in taken for k, reason in t.dropped]
    assert not set(trained) & engines.flat
    assert {k for k, _ in dropped} <= engines.flat and all(r == "no_reward_variance" for _, r in dropped)
    assert len(trained) == 8 and len(set(trained)) == 8


def test_a_group_stale_in_the_last_draw_is_reissued_and_trained(prompt_file, digit_tokenizer):
    """Every step is fed once the last draw is in; a stale group found then still gets its re-issue."""
    engines = Engines()
    engines.stale_draws = {6}
    producer = _producer(_stream(prompt_file, digit_tokenizer), engines, k=1)
    producer.start(0, steps_left=6)
    taken = _train(producer, engines, range(1, 7))
    producer.stop()
    assert [k for t in taken for k in t.reissued] == [engines.drawn[5][0]]
    assert sorted(k for t in taken for k in t.trained) == [(0, i) for i in range(12)]


def test_dynamic_sampling_keeps_a_draw_after_max_rounds_without_variance(prompt_file, digit_tokenizer):
    """All rewards equal (early training): not an endless search; every third draw is kept whole."""
    engines = Engines()
    engines.flat = {(0, i) for i in range(12)}
    producer = _producer(_stream(prompt_file, digit_tokenizer, rows=12), engines, k=1, dynamic_sampling=True)
    producer.start(0, steps_left=2)
    taken = _train(producer, engines, range(1, 3))
    producer.stop()
    assert len(engines.drawn) == 6  # 2 dropped draws then a kept one, per step
    dropped = [(k, r) for t in taken for k, r in t.dropped]  # (which step reports a drop depends on timing)
    assert len(dropped) == 8 and all(r == "no_reward_variance" for _, r in dropped)
    assert not {k for k, _ in dropped} & {k for t in taken for k in t.trained}


def test_a_stop_gives_up_on_the_producer_s_hanging_user_code(prompt_file, digit_tokenizer, monkeypatch):
    """rollout.max_staleness >= 1: user code runs in the producer thread while the trainer waits in
    take(). After a stop request, a tool that never returns there is given up on STOP_GRACE_S
    later (0.5 s here), as in a synchronous step; with no stop, the trainer's wait goes on."""
    import threading

    import pytest

    from megarl import user_code

    monkeypatch.setattr(user_code, "STOP_GRACE_S", 0.5)
    release = threading.Event()
    engines = Engines()

    def collect(prompts, params, timer):  # a tool call that hangs until released
        user_code.call_with_deadline(lambda: release.wait(120), 300, "tool `hang`")
        return engines.collect(prompts, params, timer)

    producer = RolloutProducer(collect, _stream(prompt_file, digit_tokenizer), lambda draw: SamplingParams(seed=draw),
                               groups_per_step=2, max_staleness=1, dynamic_sampling=0, timeout_s=3.0)  # fmt: skip
    producer.start(0, steps_left=2)
    try:
        with pytest.raises(RolloutStalled):  # no stop: only the producer's own deadline ends the wait
            producer.take(1)
        user_code.stop_requested(time.monotonic())
        with pytest.raises(user_code.WaitAbandoned, match=r"the rollout producer \(tool `hang`\)"):
            producer.take(1)
    finally:
        user_code.stop_requested(None)
        release.set()
        producer.stop()
