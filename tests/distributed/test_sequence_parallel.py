"""Sequence parallelism changes where activations live, not what is computed: at TP=2 the same
policy with SP on and off gives the same log-probs, entropy, loss, gradients and weights after
one Adam step (fp32), and the critic the same values. Odd row lengths make every micro-batch
pad its width to a multiple of TP."""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.sections import ActorConfig, OptimizerConfig, ParallelConfig

TEMPERATURE = 0.7


def _cfg(sequence_parallel: bool) -> ActorConfig:
    return ActorConfig(
        parallel=ParallelConfig(tp=2, sequence_parallel=sequence_parallel),
        optimizer=OptimizerConfig(lr=2e-4, clip_grad=0.0),
        micro_batch_size=2,
        logprob_chunk_tokens=5,
    )


def _one_layout(path: str, sequence_parallel: bool) -> dict:
    from megarl.actors.critic import CriticWorker
    from megarl.actors.policy import PolicyWorker

    batch = ac.make_batch(0)
    cfg = _cfg(sequence_parallel)
    policy = PolicyWorker(path, cfg, "float32", seed=1)
    assert policy.model.tcfg.sequence_parallel is sequence_parallel
    out = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE, with_entropy=True), batch)
    out["metrics"] = policy.update(batch, ac.pg_loss, mini_batch_size=len(batch), ppo_epochs=1)
    params = dict(policy.model.core.named_parameters())
    out["grads"] = {name: p.main_grad.detach().clone() for name, p in params.items()}  # this rank's shards
    out["params"] = {name: p.detach().clone() for name, p in params.items()}
    critic = CriticWorker(path, cfg, "float32", seed=1)
    out["values"] = ac.gathered(critic.compute_values(batch), batch)["values"]
    return out


def _both(rank: int, world: int, path: str) -> dict:
    return ac.portable({"off": _one_layout(path, False), "on": _one_layout(path, True)})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("sp") / "m", **ac.TINY))


def test_sequence_parallel_equals_off_at_tp2(model_dir):
    for result in run_distributed(_both, 2, model_dir):
        off, on = ac.tensors(result["off"]), ac.tensors(result["on"])
        for name in ("logprobs", "entropy", "values"):
            torch.testing.assert_close(on[name], off[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        for name in ("actor/pg_loss", "actor/entropy"):
            assert on["metrics"][name] == pytest.approx(off["metrics"][name], abs=1e-5)
        assert on["metrics"]["actor/grad_norm"] == pytest.approx(off["metrics"]["actor/grad_norm"], rel=1e-5)
        assert set(on["grads"]) == set(off["grads"])
        for name, grad in off["grads"].items():
            assert (on["grads"][name] - grad).norm() <= 1e-5 * grad.norm() + 1e-12, name
            torch.testing.assert_close(on["params"][name], off["params"][name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        # The norms' gradients are summed over TP under SP (their mark is what Megatron reads).
        assert any("layernorm" in name for name in off["grads"])
