"""Dist-checkpoint of the policy with the distributed optimizer (TP=1 x DP=2, CPU/gloo).

One spawn: two updates with a warm-up + cosine schedule (the reported LRs are checked against
hand-computed values), save, then a second worker in the same processes loads the checkpoint:
optimizer state (sharded over DP), params and the schedule step must restore exactly, and one
more identical update on both workers must give identical weights.
"""

from __future__ import annotations

import math

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.sections import ActorConfig, OptimizerConfig, ParallelConfig

OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, schedule="cosine", clip_grad=0.5, distributed=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("ckpt") / "m", **ac.TINY))


def _optimizer_state(worker) -> dict[str, torch.Tensor]:
    """Every tensor of this rank's optimizer state (its DP shard), by a stable key."""
    out = {}
    opt = worker.trainer.optimizer
    for k, inner in enumerate(getattr(opt, "chained_optimizers", [opt])):
        torch_opt = inner.optimizer
        for g, group in enumerate(torch_opt.param_groups):
            for i, p in enumerate(group["params"]):
                out[f"{k}.{g}.{i}.param"] = p.detach().clone()
                for name, value in torch_opt.state.get(p, {}).items():
                    out[f"{k}.{g}.{i}.{name}"] = torch.as_tensor(value).detach().clone()
    return out


def _ckpt_run(rank: int, world: int, path: str, ckpt_dir: str) -> dict:
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    # The spawn helper's ranks are daemonic processes; Megatron's checkpoint writer starts a
    # multiprocessing Manager, which daemonic processes may not. torchrun / Ray ranks are not
    # daemonic, so this only adapts the test harness.
    multiprocessing.current_process()._config["daemon"] = False

    cfg = ActorConfig(parallel=ParallelConfig(tp=1), micro_batch_size=2, optimizer=OPT)
    batch = ac.make_batch(2, rows=8)
    first = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6)
    lrs = [first.update(batch, ac.pg_loss, mini_batch_size=8)["lr"] for _ in range(3)]
    first.save(ckpt_dir)
    saved = _optimizer_state(first)
    second = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6)
    fresh_differs = any(not torch.equal(v, _optimizer_state(second)[k]) for k, v in saved.items())
    second.load(ckpt_dir)
    loaded = _optimizer_state(second)
    out = {
        "lrs": lrs,
        "fresh_differs": fresh_differs,
        "same_keys": set(saved) == set(loaded),
        "state_equal": all(torch.equal(saved[k], loaded[k]) for k in saved),
        "differing": [(k, saved[k].flatten()[:3].tolist(), loaded[k].flatten()[:3].tolist()) for k in saved if not torch.equal(saved[k], loaded[k])][:6],
        "n_state": len(saved),
        "step": second.trainer.schedule.step_count,
    }
    m1 = first.update(batch, ac.pg_loss, mini_batch_size=8)
    m2 = second.update(batch, ac.pg_loss, mini_batch_size=8)
    out["metrics_equal"] = m1 == m2
    out["lrs"].append(m2["lr"])
    w1, w2 = ac.exported_state(first), ac.exported_state(second)
    out["weights_equal"] = all(torch.equal(w1[k], w2[k]) for k in w1)
    return out


def test_distributed_optimizer_checkpoint_restores_exactly(model_dir, tmp_path):
    results = run_distributed(_ckpt_run, 2, model_dir, str(tmp_path / "ckpt"))
    # Warm-up over 2 steps, then cosine from step 2 over the remaining 4 (step 3 after resume).
    expected_lrs = [5e-4, 1e-3, 1e-3, 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 1 / 4))]
    for r in results:
        assert r["lrs"] == pytest.approx(expected_lrs)
        assert r["fresh_differs"], "a fresh optimizer must differ, or the check proves nothing"
        assert r["same_keys"] and r["n_state"] > 0
        assert r["state_equal"], r["differing"]
        assert r["step"] == 3
        assert r["metrics_equal"] and r["weights_equal"]
