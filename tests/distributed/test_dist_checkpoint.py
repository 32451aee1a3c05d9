"""Dist-checkpoint of the policy with the distributed optimizer (TP=1 x DP=2, CPU/gloo).

One spawn: two updates with a warm-up + cosine schedule (the reported LRs are checked against
hand-computed values), save, then a second worker in the same processes loads the checkpoint:
optimizer state (sharded over DP), params and the schedule step must restore exactly, and one
more identical update on both workers must give identical weights. The checkpoint records the
megatron-core version that wrote it.

Without TE/apex Megatron trains with torch Adam (step per parameter); with either installed,
with their FusedAdam (step per param group). Neither installs here, so the FusedAdam restore
is checked on a stand-in with FusedAdam's state layout, in one process.
"""

from __future__ import annotations

import json
import math
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import ActorConfig, OptimizerConfig, ParallelConfig
from megarl.megatron_runtime.optim import adam_step_layout
from megarl.megatron_runtime.training import (
    _materialise_optimizer_state,
    _restore_adam_steps,
)
from megarl.parallel.mcore_version import VERSIONS_FILE

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
    from megarl.megatron_runtime.model import MegatronModel
    from megarl.megatron_runtime.training import load_trained_weights

    # The spawn helper's ranks are daemonic processes; Megatron's checkpoint writer starts a
    # multiprocessing Manager, which daemonic processes may not. torchrun / Ray ranks are not
    # daemonic, so this only adapts the test harness.
    multiprocessing.current_process()._config["daemon"] = False

    cfg = ActorConfig(parallel=ParallelConfig(tp=1), micro_batch_size=2, optimizer=OPT)
    batch = ac.make_batch(2, rows=8)
    first = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6)
    lrs = [first.update(batch, ac.pg_loss, mini_batch_size=8)["actor/lr"] for _ in range(3)]
    first.save(ckpt_dir)
    saved = _optimizer_state(first)
    versions = json.loads((Path(ckpt_dir) / VERSIONS_FILE).read_text())
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
        "written_by": versions["megatron_core"],
    }
    # What an export reads: the weights alone, into a bare model (no optimizer built or read).
    bare = MegatronModel.build(path, cfg, torch.float32, seed=2)
    before = {k: v.clone() for k, v in _weights(bare).items()}
    load_trained_weights(bare.core, ckpt_dir)
    trained, loaded_bare = _weights(first.model), _weights(bare)
    out["bare_was_fresh"] = any(not torch.equal(before[k], trained[k]) for k in trained)
    out["bare_equal"] = set(trained) == set(loaded_bare) and all(torch.equal(trained[k], loaded_bare[k]) for k in trained)
    m1 = first.update(batch, ac.pg_loss, mini_batch_size=8)
    m2 = second.update(batch, ac.pg_loss, mini_batch_size=8)
    out["metrics_equal"] = m1 == m2
    out["lrs"].append(m2["actor/lr"])
    w1, w2 = ac.exported_state(first), ac.exported_state(second)
    out["weights_equal"] = all(torch.equal(w1[k], w2[k]) for k in w1)
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.core.state_dict().items() if not k.endswith("_extra_state")}


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
        assert r["written_by"] == version("megatron-core")
        assert r["metrics_equal"] and r["weights_equal"]
        assert r["bare_was_fresh"] and r["bare_equal"]  # load_trained_weights: the trained weights exactly


def _never_stepped_run(rank: int, world: int, path: str, ckpt_dir: str) -> dict:
    """A policy saved before its first optimizer step (a PPO run's critic warm-up), loaded, then
    trained one step: the same as the saver's step and as a fresh policy's."""
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    multiprocessing.current_process()._config["daemon"] = False  # as in _ckpt_run
    cfg = ActorConfig(parallel=ParallelConfig(tp=1), micro_batch_size=2, optimizer=OPT)
    batch = ac.make_batch(2, rows=8)
    workers = [PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6) for _ in range(3)]
    saver, loader, fresh = workers
    saver.save(ckpt_dir)  # Megatron's distributed optimizer asserted on a state without a step
    loader.load(ckpt_dir)
    metrics = [w.update(batch, ac.pg_loss, mini_batch_size=8) for w in workers]
    weights = [ac.exported_state(w) for w in workers]
    return {"metrics_equal": metrics[0] == metrics[1] == metrics[2],
            "weights_equal": all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0]),
            "trained": any(not torch.equal(weights[0][k], ac.exported_state(PolicyWorker(path, cfg, "float32", seed=1,
                           total_optimizer_steps=6))[k]) for k in weights[0])}  # fmt: skip


def test_a_policy_saved_before_its_first_step_resumes_as_a_fresh_one(model_dir, tmp_path):
    for r in run_distributed(_never_stepped_run, 2, model_dir, str(tmp_path / "ckpt")):
        assert r["trained"], "the step must change the weights, or equality proves nothing"
        assert r["metrics_equal"] and r["weights_equal"]


def _fused_adam_class(package: str) -> type:
    """A stand-in with TE/apex FusedAdam's layout: moments per parameter, ``step`` an int in
    each param group that has parameters (incremented by ``step()``)."""

    class FusedAdam(torch.optim.Optimizer):
        def __init__(self, params, lr: float = 1e-3) -> None:
            super().__init__(params, {"lr": lr})

        def step(self, closure=None):
            for group in self.param_groups:
                if group["params"]:
                    group["step"] = group.get("step", 0) + 1
                for p in group["params"]:
                    self.state[p].setdefault("exp_avg", torch.zeros_like(p))

    FusedAdam.__module__ = f"{package}.optimizers.fused_adam"
    return FusedAdam


def _megatron_like(inner: torch.optim.Optimizer) -> SimpleNamespace:
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)])


def _params(n: int = 2) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3)) for _ in range(n)]


def test_the_step_layout_follows_the_optimizer_class():
    assert adam_step_layout(torch.optim.Adam(_params())) == "per_param"
    assert adam_step_layout(torch.optim.AdamW(_params())) == "per_param"
    for package in ("transformer_engine.pytorch", "apex"):
        assert adam_step_layout(_fused_adam_class(package)(_params())) == "per_group"
    for unknown in (torch.optim.SGD(_params(), lr=0.1), _fused_adam_class("somewhere")(_params())):
        with pytest.raises(ValueError, match=r"optimizer; megarl restores checkpoints exactly only for torch Adam"):
            adam_step_layout(unknown)


def test_build_refuses_an_optimizer_it_cannot_restore(monkeypatch):
    import megatron.core.optimizer as mcore_optimizer

    from megarl.megatron_runtime.optim import build_optimizer

    sgd = _megatron_like(torch.optim.SGD(_params(), lr=0.1))
    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer", lambda config, chunks: sgd)
    with pytest.raises(ValueError, match="torch.optim.sgd.SGD optimizer"):
        build_optimizer(OPT, [], torch.float32)
    fused = _megatron_like(_fused_adam_class("transformer_engine.pytorch")(_params()))
    monkeypatch.setattr(mcore_optimizer, "get_megatron_optimizer", lambda config, chunks: fused)
    assert build_optimizer(OPT, [], torch.float32) is fused


def test_fused_adam_restore_sets_the_group_step():
    params = _params(3)
    fused = _fused_adam_class("apex")([{"params": params[:2]}, {"params": params[2:]}, {"params": []}])
    wrapper = _megatron_like(fused)
    _materialise_optimizer_state(wrapper)  # FusedAdam needs no materialising step
    assert len(fused.state) == 0 and all("step" not in g for g in fused.param_groups)
    before = [p.detach().clone() for p in params]
    fused.step()
    saved = {"optimizer": {"param_groups": [{"step": 7}, {"step": 7}, {"step": 7}]}}
    _restore_adam_steps(wrapper, saved)
    assert [g.get("step") for g in fused.param_groups] == [7, 7, None]  # empty groups never step
    assert all(torch.equal(a, b) for a, b in zip(before, params))


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"foreach": False}, {"fused": True}])
def test_a_materialised_adam_is_the_state_torch_creates_and_steps_the_same(options):
    """The state set without a step (no gradients allocated) is what torch's own first step
    would have created before updating it, and the next step from it equals a fresh Adam's."""
    ours = _params(2)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    adam, fresh = torch.optim.Adam(ours, lr=0.1, **options), torch.optim.Adam(theirs, lr=0.1, **options)
    _materialise_optimizer_state(_megatron_like(adam))
    assert all(p.grad is None for p in ours)  # no gradient was allocated
    for p, q in zip(ours, theirs):
        p.grad, q.grad = torch.full_like(p, 0.5), torch.full_like(q, 0.5)
    fresh.step()
    adam.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    for p, q in zip(ours, theirs):
        mine, torchs = adam.state[p], fresh.state[q]
        assert sorted(mine) == sorted(torchs)
        for key in mine:
            assert (mine[key].dtype, mine[key].device, mine[key].shape) == (torchs[key].dtype, torchs[key].device, torchs[key].shape)
            assert torch.equal(mine[key], torchs[key]), key


def test_torch_adam_restore_gives_each_parameter_its_own_step():
    params = _params(2)
    adam = torch.optim.Adam(params, lr=0.1)
    wrapper = _megatron_like(adam)
    before = [p.detach().clone() for p in params]
    _materialise_optimizer_state(wrapper)  # state exists, parameters unchanged
    assert all("step" in adam.state[p] for p in params)
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    _restore_adam_steps(wrapper, {"optimizer": {"param_groups": [{"step": 5.0}]}})
    steps = [adam.state[p]["step"] for p in params]
    assert [float(s) for s in steps] == [5.0, 5.0] and steps[0] is not steps[1]


def test_disagreeing_saved_steps_are_refused():
    wrapper = _megatron_like(torch.optim.Adam(_params(), lr=0.1))
    with pytest.raises(ValueError, match=r"disagree on Adam's step: \[3.0, 4.0\]"):
        _restore_adam_steps(wrapper, {"a": {"param_groups": [{"step": 3}]}, "b": {"param_groups": [{"step": 4}]}})


def _train_and_save(rank: int, world: int, path: str, ckpt_dir: str) -> dict:
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    multiprocessing.current_process()._config["daemon"] = False  # see _ckpt_run
    cfg = ActorConfig(parallel=ParallelConfig(tp=1), micro_batch_size=2, optimizer=OPT)  # DP=2, distributed Adam
    worker = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6)
    worker.update(ac.make_batch(2, rows=8), ac.pg_loss, mini_batch_size=8)
    worker.save(ckpt_dir)
    return ac.portable(ac.exported_state(worker))


def _export_at_tp2_in_bf16(rank: int, world: int, path: str, ckpt_dir: str) -> dict:
    from megarl.megatron_runtime.model import MegatronModel
    from megarl.megatron_runtime.training import load_trained_weights

    # What `megarl convert --config` with another layout and dtype builds: TP=2, bf16, no optimizer.
    model = MegatronModel.build(path, ActorConfig(parallel=ParallelConfig(tp=2)), torch.bfloat16, seed=2)
    load_trained_weights(model.core, ckpt_dir)
    exported = dict(model.bridge.export_hf_tensors(model.core, gather_bytes=1 << 20))
    # numpy has no bf16: the bits cross the spawn queue as int16
    return {"dtypes": {n: str(t.dtype) for n, t in exported.items()},
            "bits": ac.portable({n: t.detach().cpu().view(torch.int16) for n, t in exported.items()})}


def test_trained_weights_load_into_another_layout_and_dtype(model_dir, tmp_path):
    # A TP=1 x DP=2 fp32 checkpoint with the distributed optimizer's state, read as TP=2 in bf16:
    # Megatron reshards the weights; the optimizer's state (laid out for DP=2 fp32) is not read.
    ckpt = str(tmp_path / "ckpt")
    trained = ac.tensors(run_distributed(_train_and_save, 2, model_dir, ckpt)[0])
    for result in run_distributed(_export_at_tp2_in_bf16, 2, model_dir, ckpt):
        bits = ac.tensors(result["bits"])
        assert set(bits) == set(trained) and set(result["dtypes"].values()) == {"torch.bfloat16"}
        for name, tensor in trained.items():
            assert torch.equal(bits[name], tensor.to(torch.bfloat16).view(torch.int16)), name


def _resume_with_new_adam_settings(rank: int, world: int, path: str, ckpt_dir: str) -> dict:
    """Saved with OPT's Adam settings, resumed with others (a resume's config may change them:
    the preflight names the change and says the run goes on with the new values)."""
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    multiprocessing.current_process()._config["daemon"] = False  # see _ckpt_run
    batch = ac.make_batch(2, rows=8)
    cfg = ActorConfig(parallel=ParallelConfig(tp=1), micro_batch_size=2, optimizer=OPT)
    saver = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6)
    saver.update(batch, ac.pg_loss, mini_batch_size=8)
    saver.save(ckpt_dir)
    new = OPT.model_copy(update={"betas": (0.5, 0.6), "eps": 1e-3, "weight_decay": 0.1})
    resumed = PolicyWorker(path, cfg.model_copy(update={"optimizer": new}), "float32", seed=1, total_optimizer_steps=6)
    resumed.load(ckpt_dir)
    resumed.update(batch, ac.pg_loss, mini_batch_size=8)
    opt = resumed.trainer.optimizer
    groups = [g for inner in getattr(opt, "chained_optimizers", [opt]) for g in inner.optimizer.param_groups]
    return {"betas": sorted({tuple(g["betas"]) for g in groups}), "eps": sorted({g["eps"] for g in groups}),
            "decays": sorted({g["weight_decay"] / g.get("wd_mult", 1.0) for g in groups if g.get("wd_mult", 1.0)})}


def test_a_resume_trains_with_the_adam_settings_of_its_config(model_dir, tmp_path):
    for r in run_distributed(_resume_with_new_adam_settings, 2, model_dir, str(tmp_path / "ckpt")):
        assert r["betas"] == [(0.5, 0.6)] and r["eps"] == [1e-3], r  # not the checkpoint's (0.9, 0.999), 1e-8
        assert r["decays"] == [pytest.approx(0.1)], r


# A fully_reshardable checkpoint written at TP1 x DP2 resumes at TP2 x DP1 and at PP2 x DP1.
RESHARDABLE = OPT.model_copy(update={"checkpoint_format": "fully_reshardable"})


def _reshardable_cfg(tp: int, pp: int) -> ActorConfig:
    return ActorConfig(parallel=ParallelConfig(tp=tp, pp=pp), micro_batch_size=2, optimizer=RESHARDABLE)


def _save_reshardable(rank: int, world: int, path: str, ckpt_dir: str) -> tuple[dict, dict]:
    """Three updates at TP1 x DP2, save, then the uninterrupted run's fourth update."""
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    multiprocessing.current_process()._config["daemon"] = False  # as in _ckpt_run
    batch = ac.make_batch(2, rows=8)
    worker = PolicyWorker(path, _reshardable_cfg(1, 1), "float32", seed=1, total_optimizer_steps=6)
    before = ac.exported_state(worker)
    for _ in range(3):
        worker.update(batch, ac.pg_loss, mini_batch_size=8)
    worker.save(ckpt_dir)
    metrics = worker.update(batch, ac.pg_loss, mini_batch_size=8)
    return metrics, {"weights": ac.exported_state(worker), "initial": before}


def _full_optimizer_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Every per-parameter optimizer tensor of a fully_reshardable checkpoint, whole (main
    params, exp_avg, exp_avg_sq), by its model key."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    def flat(node: dict, prefix: str = "") -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out |= flat(value, f"{prefix}{key}.")
            elif isinstance(value, torch.Tensor) and f"{prefix}{key}".startswith("optimizer.state."):
                out[f"{prefix}{key}"] = value
        return out

    return flat(load_plain_tensors(ckpt_dir))


def _resume_reshardable(rank: int, world: int, path: str, ckpt_dir: str, tp: int, pp: int, resaved: str) -> dict:
    """Load at TP x PP, save again (the loaded state, whole), then the fourth update."""
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    multiprocessing.current_process()._config["daemon"] = False
    worker = PolicyWorker(path, _reshardable_cfg(tp, pp), "float32", seed=1, total_optimizer_steps=6)
    worker.load(ckpt_dir)
    worker.save(resaved)
    saved, loaded = _full_optimizer_state(ckpt_dir), _full_optimizer_state(resaved)
    # TP2 pads the vocabulary (259 -> 260 rows); the padding row loads as zeros
    padded = {k: v for k, v in loaded.items() if k in saved and v.shape != saved[k].shape}
    metrics = worker.update(ac.make_batch(2, rows=8), ac.pg_loss, mini_batch_size=8)
    return {
        "keys": sorted(saved) == sorted(loaded),
        "n": len(saved),
        "differing": [k for k in saved if not torch.equal(saved[k], loaded[k][: saved[k].shape[0]])],
        "padding_zero": all(not v[saved[k].shape[0]:].any() for k, v in padded.items()),
        "step": worker.trainer.schedule.step_count,
        "metrics": metrics,
        "weights": ac.exported_state(worker),
    }


@pytest.fixture(scope="module")
def reshardable_ckpt(model_dir, tmp_path_factory) -> tuple[str, dict, dict]:
    """(checkpoint, the uninterrupted run's fourth update's metrics, its weights before and after)."""
    ckpt = str(tmp_path_factory.mktemp("reshardable") / "ckpt")
    metrics, run = run_distributed(_save_reshardable, 2, model_dir, ckpt)[0]
    return ckpt, metrics, run


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_fully_reshardable_checkpoint_resumes_in_another_tp_pp_layout(model_dir, reshardable_ckpt, tmp_path, tp, pp):
    ckpt, metrics, run = reshardable_ckpt
    assert json.loads((Path(ckpt) / VERSIONS_FILE).read_text())["optimizer_format"] == "fully_reshardable"
    for r in run_distributed(_resume_reshardable, 2, model_dir, ckpt, tp, pp, str(tmp_path / "again")):
        assert r["keys"] and r["n"] >= 3 * 10  # main param, exp_avg, exp_avg_sq of every parameter
        assert r["differing"] == [] and r["padding_zero"]
        assert r["step"] == 4
        # the same step as the uninterrupted run's, to fp32 rounding (another reduction order)
        assert r["metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-6)
        moved = max((run["weights"][k] - run["initial"][k]).abs().max().item() for k in run["weights"])
        worst = max((r["weights"][k] - run["weights"][k]).abs().max().item() for k in run["weights"])
        assert worst < 1e-6 < moved, (worst, moved)


def _plain_run(rank: int, world: int, path: str, ckpt_dir: str, tp: int, pp: int, save: bool) -> tuple[float, dict]:
    """The non-distributed optimizer: (save=True) three updates at TP1 x DP2, save, the fourth;
    (save=False) load at TP x PP, the fourth. Returns its grad norm and the weights after it."""
    import multiprocessing

    from megarl.actors.policy import PolicyWorker

    multiprocessing.current_process()._config["daemon"] = False  # as in _ckpt_run
    opt = OPT.model_copy(update={"distributed": False})
    cfg = ActorConfig(parallel=ParallelConfig(tp=tp, pp=pp), micro_batch_size=2, optimizer=opt)
    worker, batch = PolicyWorker(path, cfg, "float32", seed=1, total_optimizer_steps=6), ac.make_batch(2, rows=8)
    if save:
        for _ in range(3):
            worker.update(batch, ac.pg_loss, mini_batch_size=8)
        worker.save(ckpt_dir)
    else:
        worker.load(ckpt_dir)
    return worker.update(batch, ac.pg_loss, mini_batch_size=8)["actor/grad_norm"], ac.exported_state(worker)


def test_the_plain_optimizers_checkpoint_resumes_in_another_tp_pp_layout(model_dir, tmp_path):
    # Its Adam state is per parameter, keyed like the weights: a resume may change TP/PP (the
    # preflight lets it). A load that lost the state would move the weights ~1e-4 away.
    ckpt = str(tmp_path / "ckpt")
    norm, weights = run_distributed(_plain_run, 2, model_dir, ckpt, 1, 1, True)[0]
    for tp, pp in ((2, 1), (1, 2)):
        got_norm, got = run_distributed(_plain_run, 2, model_dir, ckpt, tp, pp, False)[0]
        assert got_norm == pytest.approx(norm, rel=1e-6)
        assert max((got[k] - weights[k]).abs().max().item() for k in weights) < 1e-6, (tp, pp)
