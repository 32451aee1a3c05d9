"""A change of expert parallelism at a resume, below the trainer (2 gloo processes, TP=1 x DP=2).

An MoE model's optimizer is a chain of two at ep > 1 (dense and expert parameters, each sharded
over its own data-parallel group) and one optimizer at ep 1. With the distributed optimizer's
fully_reshardable format megarl keys the state per parameter alone (not under the chain member's
prefix), so it loads into either chain. A tiny Qwen3-MoE (the load-balance test's) trains one
step at ep 2 and saves; a worker at ep 1 loads it and saves again; a worker at ep 2 loads that
and saves again. Every tensor of the three checkpoints (weights, fp32 main params, Adam's
moments, per global expert) is ``torch.equal``, and each loader's Adam steps are the saver's.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from spawn import run_distributed
from test_moe_balance import moe_dir  # noqa: F401  (the fixture: one tiny MoE model for both)


def _save_or_reload(rank: int, world: int, path: str, ep: int, source: str | None, target: str) -> dict:
    from actor_cases import make_batch, pg_loss

    from megarl.actors.policy import PolicyWorker
    from megarl.config.train_sections import ActorConfig

    # The spawn helper's ranks are daemonic and Megatron's checkpoint writer starts a Manager.
    multiprocessing.current_process()._config["daemon"] = False
    cfg = ActorConfig(micro_batch_size=3, parallel={"ep": ep},
                      optimizer={"lr": 1e-3, "distributed": True, "checkpoint_format": "fully_reshardable"})  # fmt: skip
    worker = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=4)
    if source is None:
        worker.update(make_batch(0, rows=6), pg_loss)
    else:
        worker.load(source)
    worker.save(target)
    optimizer = worker.trainer.optimizer
    inner = [o.optimizer for o in optimizer.chained_optimizers if o.optimizer is not None]
    steps = sorted({float(s["step"]) for o in inner for s in o.state.values()})
    worker.close()
    return {"chain": len(optimizer.chained_optimizers), "steps": steps}


def _plain_tensors(rank: int, world: int, directories: list[str]) -> list[dict[str, torch.Tensor]]:
    from megatron.core import dist_checkpointing

    loaded = [dist_checkpointing.load_plain_tensors(d) for d in directories]
    return [{k: v for k, v in tensors.items() if torch.is_tensor(v)} for tensors in loaded]


@pytest.mark.parametrize("layouts", [(2, 1, 2)])
def test_a_resume_may_change_ep_with_fully_reshardable_state(moe_dir, tmp_path, layouts):  # noqa: F811
    saved = [str(tmp_path / f"ckpt{i}") for i in range(len(layouts))]
    for i, ep in enumerate(layouts):
        ranks = run_distributed(_save_or_reload, 2, moe_dir, ep, saved[i - 1] if i else None, saved[i])
        assert [r["chain"] for r in ranks] == [2 if ep > 1 else 1] * 2  # dense + expert optimizers at ep 2 only
        assert all(r["steps"] == [1.0] for r in ranks), ranks  # the one step taken, restored
    first, *others = run_distributed(_plain_tensors, 1, saved)[0]
    assert any(".experts." in k and "exp_avg_sq" in k for k in first)  # the experts' Adam state is in it
    for other in others:
        assert set(other) == set(first)
        assert [k for k in first if not torch.equal(first[k], other[k])] == []
