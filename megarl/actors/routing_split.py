"""Which rows' routing each policy rank is sent (routing replay): its data-parallel replica's.

A step's routing (``Batch.routed_experts`` / ``routing_weights``, ``[B, P+R, L, k]``) is the
largest thing its Batch carries for a large mixture-of-experts model, and a rank replays the
routing of its replica's rows only. The controller computes the ranks' split itself (the same
functions the ranks split with, megarl/megatron_runtime/micro_batches.py) and sends the rest of
the Batch once to every rank, and each replica's routing once to its ranks."""

from __future__ import annotations

from megarl.config.sections import MegaRLConfig
from megarl.data.batch import Batch
from megarl.engines.seeds import shuffle_seed
from megarl.megatron_runtime.micro_batches import mini_batch_rows, replica_rows


def policy_replica_rows(cfg: MegaRLConfig, batch: Batch, dp_size: int, step: int | None) -> list[list[int]]:
    """The rows each policy replica runs: of a forward over ``batch`` (``step`` None: log-probs,
    the reference's), or of the update of step ``step``, which also runs the replay metrics'
    forwards over the whole batch (PolicyRank.update: its mini-batches, shuffled as it does)."""
    if step is None:
        return replica_rows(batch, dp_size)
    a = cfg.actor
    seed = shuffle_seed(cfg.trainer.seed, step) if a.shuffle else None
    minis = list(mini_batch_rows(len(batch), a.mini_batch_size or len(batch), a.ppo_epochs, seed))
    return replica_rows(batch, dp_size, minis)
