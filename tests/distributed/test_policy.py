"""PolicyWorker (+ ReferenceWorker in the same processes) against plain HF transformers.

Three 2-process layouts and one 4-process (TP=2 x PP=2, marked slow), many checks per spawn
(spawning is the expensive part):
- TP=2 (vocab 259 padded to 260): log-probs / entropy vs HF, reference coexisting and frozen,
  offload/onload round trip, two Adam steps vs a plain-torch HF reference;
- TP=1 x DP=2 with a token budget (unequal micro-batches per rank): the same update;
- PP=2: log-probs, the update through the 1F1B schedule, metrics equal on both stages.
The HF reference normalises the loss over the whole mini-batch, so equal weights after the
update mean Megatron's normalisation is global across micro-batches and DP ranks.
"""

from __future__ import annotations

import gc
import weakref

import actor_cases as ac
import pytest
import torch
from spawn import run_distributed

from megarl.config.train_sections import ActorConfig, OptimizerConfig, ParallelConfig

TEMPERATURE = 0.7
LR, CLIP, MINI = 2e-4, 1.0, 3  # 6 rows -> two optimizer steps


def _cfg(tp: int = 1, pp: int = 1, **kw) -> ActorConfig:
    opt = OptimizerConfig(lr=LR, clip_grad=CLIP, distributed=True)
    # A chunk of 3 tokens: every micro-batch's log-prob head runs in several chunks.
    return ActorConfig(parallel=ParallelConfig(tp=tp, pp=pp), optimizer=opt, logprob_chunk_tokens=3, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("policy") / "m", **ac.TINY))


@pytest.fixture(scope="module")
def reference(model_dir):
    batch = ac.make_batch(0)
    with torch.no_grad():
        logprobs, entropy = ac.hf_token_logprobs(ac.hf_model(model_dir), batch, TEMPERATURE)
    state, norms, logp_max = ac.hf_reference_update(model_dir, batch, lr=LR, clip_grad=CLIP, mini_batch_size=MINI)
    return {"logprobs": logprobs, "entropy": entropy, "state": state, "grad_norms": norms, "logp_max": logp_max}


def _policy_run(rank: int, world: int, path: str, cfg: ActorConfig, with_reference: bool) -> dict:
    from megarl.actors.policy import PolicyWorker
    from megarl.actors.reference import ReferenceWorker

    batch = ac.make_batch(0)
    policy = PolicyWorker(path, cfg, "float32", seed=1)
    out: dict = {}
    first = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE, with_entropy=True), batch)
    out["logprobs"], out["entropy"] = first["logprobs"], first["entropy"]
    if with_reference:
        ref = ReferenceWorker(path, cfg, "float32", seed=1)
        ref.states.offload(["weights"])  # what the memory hand-over does; really moves on CPU too
        ref.states.onload(["weights"])
        try:  # a second model in these processes must share the layout
            ReferenceWorker(path, _cfg(tp=1), "float32", seed=1)
            out["layout_error"] = ""
        except ValueError as e:
            out["layout_error"] = str(e)
        out["ref_before"] = ac.gathered(ref.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
        policy.trainer.states.offload(["weights", "grads", "optimizer"])
        policy.trainer.states.onload(["weights", "grads", "optimizer"])
        out["after_offload"] = ac.gathered(policy.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
    out["metrics"] = policy.update(batch, ac.pg_loss, mini_batch_size=MINI, ppo_epochs=1)
    out["state"] = ac.exported_state(policy)
    out["logprobs_after"] = ac.gathered(policy.compute_logprobs(batch, 1.0), batch)["logprobs"]
    if with_reference:
        out["ref_after"] = ac.gathered(ref.compute_logprobs(batch, TEMPERATURE), batch)["logprobs"]
    # A closed worker, once dropped, is freed (not kept by Megatron DDP's autograd hooks).
    model = weakref.ref(policy.model.module)
    policy.close()
    del policy
    gc.collect()  # the first pass runs the cycle's finalizers, the second frees it
    gc.collect()
    out["freed"] = model() is None
    return ac.portable(out)


def _check_against_hf(results: list[dict], reference: dict) -> None:
    results[:] = [ac.tensors(r) for r in results]
    for r in results:  # the rows assemble to the full [B, R] tensors; every rank has the same metrics
        torch.testing.assert_close(r["logprobs"], reference["logprobs"], atol=1e-4, rtol=0)
        torch.testing.assert_close(r["entropy"], reference["entropy"], atol=1e-4, rtol=0)
        assert r["metrics"] == results[0]["metrics"]
        assert r["freed"]
    metrics = results[0]["metrics"]
    assert metrics["actor/optimizer_steps"] == 2 and metrics["actor/lr"] == LR
    # The grad norm is sensitive to the normalisation (Adam's update mostly is not).
    mean_norm = sum(reference["grad_norms"]) / 2
    assert metrics["actor/grad_norm"] == pytest.approx(mean_norm, rel=1e-4)
    assert metrics["actor/ratio_max"] == pytest.approx(reference["logp_max"], abs=1e-4)  # see ac.pg_loss
    assert metrics["actor/skipped_steps"] == 0
    state = results[0]["state"]
    assert set(state) == set(reference["state"])
    for name, tensor in reference["state"].items():
        torch.testing.assert_close(state[name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    # The update changed the policy.
    assert (results[0]["logprobs_after"] - reference["logprobs"]).abs().max() > 1e-4


def test_tp2_logprobs_update_and_reference(model_dir, reference):
    results = run_distributed(_policy_run, 2, model_dir, _cfg(tp=2, micro_batch_size=2), True)
    _check_against_hf(results, reference)
    for r in results:
        # The reference lives beside the policy, stays frozen, and survives its own offload.
        torch.testing.assert_close(r["ref_before"], reference["logprobs"], atol=1e-4, rtol=0)
        assert torch.equal(r["ref_after"], r["ref_before"])
        assert torch.equal(r["after_offload"], r["logprobs"])
        assert "must use the same layout" in r["layout_error"]
    # Padding positions (past each response) are 0.
    batch = ac.make_batch(0)
    assert (results[0]["logprobs"][batch.response_valid == 0] == 0).all()


def test_dp2_token_budget_matches_whole_batch(model_dir, reference):
    # A budget of 24 tokens cuts each rank's 1-2 rows per mini-batch into unequal micro-batches.
    results = run_distributed(_policy_run, 2, model_dir, _cfg(max_tokens_per_gpu=24), False)
    _check_against_hf(results, reference)


def test_pp2_logprobs_and_update(model_dir, reference):
    results = run_distributed(_policy_run, 2, model_dir, _cfg(pp=2, micro_batch_size=1), False)
    _check_against_hf(results, reference)


@pytest.mark.slow
def test_tp2_pp2_logprobs_and_update(model_dir, reference):
    # 4 processes: TP=2 inside each of 2 pipeline stages (vocab-parallel head on the last one).
    results = run_distributed(_policy_run, 4, model_dir, _cfg(tp=2, pp=2, micro_batch_size=2), False)
    _check_against_hf(results, reference)


def _checksum_run(rank: int, world: int, path: str, tp: int, pp: int) -> float:
    from pathlib import Path

    from megarl.actors.policy_rank import PolicyRank
    from megarl.config.loading import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / "tiny_grpo.yaml", [
        f"model.path={path}", "rollout.engine=sglang", "reference.enabled=false", f"actor.parallel.tp={tp}",
        f"actor.parallel.pp={pp}",
    ])  # fmt: skip
    return PolicyRank(cfg, total_optimizer_steps=1).parameter_checksum()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_the_parameter_checksum_is_the_models_whatever_the_layout(model_dir, tp, pp):
    # a resume may change TP/PP (actor.optimizer.checkpoint_format=fully_reshardable): the
    # checksum counted TP-replicated parameters (norms) once per TP rank
    from safetensors.torch import load_file

    from megarl.weight_sync.export_check import tensor_stats

    hf = load_file(f"{model_dir}/model.safetensors")
    expected = sum(float(tensor_stats(t)[1]) for t in hf.values())
    for got in run_distributed(_checksum_run, 2, model_dir, tp, pp):
        assert got == pytest.approx(expected, rel=1e-12)
