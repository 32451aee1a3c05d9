"""The forward-only passes' own micro-batching (actor.logprob_micro_batch_size /
logprob_max_tokens_per_gpu): selected for log-probs, never for the update."""

import torch

from megarl.config.train_sections import ActorConfig
from megarl.data.batch import Batch
from megarl.megatron_runtime import model as model_module
from megarl.megatron_runtime.micro_batches import MicroBatching


def _batch(n: int = 8) -> Batch:
    return Batch(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        response_ids=torch.ones(n, 6, dtype=torch.long),
        response_lengths=torch.full((n,), 6),
        response_mask=torch.ones(n, 6),
        group_id=torch.arange(n),
    )


def _counts(batching: MicroBatching, dp: int = 2) -> list[int]:
    return [len(groups) for groups in batching.replica_groups(_batch(), dp)]


def test_forward_only_micro_batches_are_the_logprob_keys_else_the_updates():
    old = ActorConfig(micro_batch_size=1)
    assert MicroBatching.forward_only(old) == MicroBatching.of(old)  # unset: as today
    by_count = ActorConfig(micro_batch_size=1, logprob_micro_batch_size=4)
    assert _counts(MicroBatching.of(by_count)) == [4, 4]  # the update: 4 rows per rank, one each
    assert _counts(MicroBatching.forward_only(by_count)) == [1, 1]
    by_tokens = ActorConfig(micro_batch_size=1, logprob_micro_batch_size=4, logprob_max_tokens_per_gpu=16)
    assert MicroBatching.forward_only(by_tokens) == MicroBatching(None, 16, True)  # 8-token rows: 2 a micro-batch
    assert _counts(MicroBatching.forward_only(by_tokens)) == [2, 2]


def test_response_logprobs_runs_the_forward_only_micro_batches(monkeypatch):
    seen = []

    class Model:
        def forward_tokens(self, batch, head, batching):
            seen.append(batching)

    monkeypatch.setattr(model_module, "token_logprob_head", lambda *a: None)
    cfg = ActorConfig(micro_batch_size=2, logprob_micro_batch_size=8)
    model_module.response_logprobs(Model(), cfg, _batch(), 1.0, False)
    assert seen == [MicroBatching(8, None, True)]
