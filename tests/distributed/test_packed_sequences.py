"""Packing changes where tokens sit, not what is computed: the same policy with its micro-batches
packed (THD, one sequence per micro-batch) and padded gives the same log-probs, entropy, loss,
gradients and weights after one Adam step (fp32), at TP=2 (with sequence parallelism, so the
packed length is rounded up by a padding segment), PP=2 and DP=2. Rows are ragged (responses
of 1 to 40 tokens), and each packed micro-batch holds several rows under a token budget.

Without recomputation, the packed micro-batches also go through FlexAttention's document mask
(actor.packed_attention flex; forward only, as torch has no FlexAttention backward on CPU) and
give the same log-probs and entropy.

The packed micro-batches' rotary embedding has one row per token (megarl/models/packed_rope.py):
the same values as Megatron's per-segment mapping, or the log-probs would differ.

Recomputation (full, selective) hands the packed-sequence parameters to the recomputed forward
too: two cases run packed with it against padded without.

The DP=2 case deals the rows so that one replica has more micro-batches than the other: the
other runs a filler micro-batch (loss weight 0) and nothing hangs or changes, also in a second
step after one without fillers (Megatron's DDP then checks that the last micro-batch readies
every parameter the first step's did)."""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import ActorConfig, OptimizerConfig, ParallelConfig
from megarl.megatron_runtime.micro_batches import MicroBatching

TEMPERATURE = 0.7
BUDGET = 48  # tokens per micro-batch: several rows packed, a long one alone
RAGGED = ([3, 6, 2, 5, 4, 2, 7, 3], [40, 1, 17, 3, 29, 8, 2, 11])  # prompt, response lengths
# DP=2: 3 rows of 34 tokens and one of 3 -> one replica gets two long rows (two micro-batches),
# the other a long and the short one (one packed micro-batch of 37 tokens).
UNEVEN = ([4, 4, 4, 2], [30, 30, 30, 1])
EVEN = ([4, 4], [10, 10])  # one row per replica: one micro-batch each, no filler


def _cfg(tp: int, pp: int, packed: bool, recompute: str = "none") -> ActorConfig:
    return ActorConfig(
        recompute=recompute,
        parallel=ParallelConfig(tp=tp, pp=pp),
        optimizer=OptimizerConfig(lr=2e-4, clip_grad=0.0),
        micro_batch_size=None,
        max_tokens_per_gpu=BUDGET,
        pack_sequences=packed,
        logprob_chunk_tokens=7,
    )


def _batch(lengths: tuple[list[int], list[int]]):
    return ac.batch_of_lengths(*lengths, torch.Generator().manual_seed(3))


def _one_layout(path: str, tp: int, pp: int, packed: bool, lengths, recompute: str) -> dict:
    from megarl.actors.policy import PolicyWorker
    from megarl.models.packed_rope import PackedRotaryEmbedding

    batch = _batch(lengths)
    policy = PolicyWorker(path, _cfg(tp, pp, packed, recompute), "float32", seed=1)
    assert (policy.model.tcfg.recompute_granularity or "none") == recompute
    assert type(policy.model.core.rotary_pos_emb) is PackedRotaryEmbedding  # one row per packed token
    if tuple(lengths) == UNEVEN:  # (a copy: the arguments travel to the ranks by pickle)
        # A first step without fillers: Megatron's DDP takes the parameters the last micro-batch
        # readies in its first step as the rule for every later step's last micro-batch.
        policy.update(_batch(EVEN), ac.pg_loss, mini_batch_size=2, ppo_epochs=1)
    out = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE, with_entropy=True), batch)
    out["metrics"] = policy.update(batch, ac.pg_loss, mini_batch_size=len(batch), ppo_epochs=1)
    params = dict(policy.model.core.named_parameters())
    out["grads"] = {name: p.main_grad.detach().clone() for name, p in params.items()}
    out["params"] = {name: p.detach().clone() for name, p in params.items()}
    return out


def _flex_logprobs(path: str, tp: int, pp: int, lengths) -> dict:
    """Log-probs and entropy of packed micro-batches attended through FlexAttention (forward
    only: torch has no FlexAttention backward on CPU)."""
    from megarl.actors.policy import PolicyWorker

    batch = _batch(lengths)
    cfg = _cfg(tp, pp, True).model_copy(update={"packed_attention": "flex"})
    policy = PolicyWorker(path, cfg, "float32", seed=1)
    assert policy.model.flex_attention
    return ac.gathered(policy.compute_logprobs(batch, TEMPERATURE, with_entropy=True), batch)


def _both(rank: int, world: int, path: str, tp: int, pp: int, lengths, recompute: str) -> dict:
    """Padded without recomputation against packed with ``recompute`` (and, without, packed
    through FlexAttention)."""
    out = {packed: _one_layout(path, tp, pp, packed, lengths, recompute if packed else "none") for packed in (False, True)}
    if recompute == "none" and tuple(lengths) != UNEVEN:  # (the uneven case's policies train a step first)
        out["flex"] = _flex_logprobs(path, tp, pp, lengths)
    return ac.portable(out)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("packed") / "m", **ac.TINY))


@pytest.mark.parametrize(
    ("tp", "pp", "lengths", "recompute"),
    [(2, 1, RAGGED, "none"), (1, 2, RAGGED, "none"), (1, 1, UNEVEN, "none"),
     (2, 1, RAGGED, "full"), (1, 2, RAGGED, "selective")],
    ids=["tp2", "pp2", "dp2-uneven", "tp2-recompute-full", "pp2-recompute-selective"],
)  # fmt: skip
def test_packed_equals_padded(model_dir, tp, pp, lengths, recompute):
    if tp == pp == 1:  # the DP case must really give the replicas different micro-batch counts
        replicas = MicroBatching(None, BUDGET, True).replica_groups(_batch(lengths), 2)
        assert sorted(len(r) for r in replicas) == [1, 2], replicas
    for result in run_distributed(_both, 2, model_dir, tp, pp, lengths, recompute):
        padded, packed = ac.tensors(result[False]), ac.tensors(result[True])
        assert ("flex" in result) == (recompute == "none" and lengths != UNEVEN)
        flex = ac.tensors(result.get("flex", {}))
        for name in ("logprobs", "entropy"):
            torch.testing.assert_close(packed[name], padded[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
            if flex:
                torch.testing.assert_close(flex[name], padded[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"flex {n}: {m}")
        for name in ("actor/pg_loss", "actor/entropy"):
            assert packed["metrics"][name] == pytest.approx(padded["metrics"][name], abs=1e-5)
        for name, grad in padded["grads"].items():
            assert (packed["grads"][name] - grad).norm() <= 1e-5 * grad.norm() + 1e-12, name
            torch.testing.assert_close(packed["params"][name], padded["params"][name], atol=1e-6, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
