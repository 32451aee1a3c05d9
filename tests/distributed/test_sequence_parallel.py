"""Sequence parallelism changes where activations live, not what is computed: at TP=2 the same
policy with SP on and off gives the same log-probs, entropy, loss, gradients and weights after
one Adam step (fp32); the critic the same values, gradients and weights after its own step.
Odd row lengths make every micro-batch pad its width to a multiple of TP."""

from __future__ import annotations

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import ActorConfig, OptimizerConfig, ParallelConfig

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
    out |= _grads_and_params(policy.model.core)
    out["marked"] = sorted(n for n, p in policy.model.core.named_parameters() if getattr(p, "sequence_parallel", False))
    critic = CriticWorker(path, cfg, "float32", seed=1)
    out["values"] = ac.gathered(critic.compute_values(batch), batch)["values"]
    returns = torch.linspace(-1.0, 1.0, batch.response_len).expand(len(batch), -1) * batch.response_mask
    critic.update(batch.replace(returns=returns.contiguous()), ac.mse_value_loss, mini_batch_size=len(batch), ppo_epochs=1)
    out["critic"] = _grads_and_params(critic.model.core)
    return out


def _grads_and_params(core) -> dict:
    """This rank's shards of every parameter and of its gradient (Megatron's main_grad)."""
    params = dict(core.named_parameters())
    return {"grads": {name: p.main_grad.detach().clone() for name, p in params.items()},
            "params": {name: p.detach().clone() for name, p in params.items()}}  # fmt: skip


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
        _same_step(on, off, param_atol=1e-6)
        # Adam turns a 1e-7 relative difference of a near-zero gradient into a larger step
        # difference; the critic's value loss has more of those.
        _same_step(on["critic"], off["critic"], param_atol=1e-5)
        # Megatron sums the gradient over TP of exactly the marked weights: every norm, only on.
        assert off["marked"] == []
        assert on["marked"] and all("layernorm" in name for name in on["marked"]), on["marked"]
        assert len(on["marked"]) == sum("layernorm" in name for name in on["params"])


def _same_step(on: dict, off: dict, param_atol: float) -> None:
    assert set(on["grads"]) == set(off["grads"])
    for name, grad in off["grads"].items():
        assert (on["grads"][name] - grad).norm() <= 1e-5 * grad.norm() + 1e-12, name
        torch.testing.assert_close(on["params"][name], off["params"][name], atol=param_atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
