"""The Qwen3-MoE bridge against HF transformers' Qwen3MoeForCausalLM, with expert parallelism, in
gloo processes: EP=2 (2 processes, TP=1: the expert-parallel group spans the two data-parallel
replicas) and TP=2 x EP=2 (4 processes: sequence parallel, each TP group holds every expert once
and the two DP replicas hold them again).

Two tiny models (hidden 64, 4 layers, 4 experts, top-2, fp32): ``renorm`` (norm_topk_prob, layer 1
dense through mlp_only_layers) and ``softmax`` (norm_topk_prob false, decoder_sparse_step 2: layers
1 and 3 MoE). Every DP replica runs its own batch of another length (the all-to-all's splits are
uneven across the EP group). Checked on every rank:
- logits == HF's (max |diff| <= 1e-5) and the gradients of a cross-entropy loss == HF's (each HF
  tensor within 1e-5 of its largest entry), the gradients read through the bridge's export;
- the export equals the HF file bit for bit, every tensor once, experts gathered over EP;
- experts loaded one place off (the mapping shifted by one, its checks bypassed) move the logits
  far past the tolerance: the parity catches a wrong expert order;
- (EP=2) bf16 logits against HF's fp32 ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from spawn import run_distributed

MODELS = {
    "renorm": {"norm_topk_prob": True, "mlp_only_layers": [1]},
    "softmax": {"norm_topk_prob": False, "decoder_sparse_step": 2},
}
SHAPE = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=96, num_experts=4,
             experts_per_token=2, moe_ffn_hidden_size=32)  # fmt: skip
LOGIT_TOL = 1e-5
GRAD_TOL = 1e-5  # relative to each tensor's largest gradient entry
SHIFTED_MIN = 1e-3  # the logits of experts loaded one place off differ at least this much (measured: see below)
BF16_MEAN_TOL, BF16_MAX_TOL = 0.01, 0.05  # mean / max |bf16 logit - HF fp32 logit| (measured: see below)
LENGTHS = {0: (2, 12), 1: (3, 6)}  # DP replica -> batch [rows, tokens] (tokens even: SP at TP 2): uneven over EP


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    from megarl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("moe")
    return {name: str(build_tiny_model(root / name, "qwen3_moe", seed=i, **SHAPE, **kw)) for i, (name, kw) in enumerate(MODELS.items())}


def _batch(dp_rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [b, s] (every token real) and next-token labels [b, s] of this DP replica."""
    gen = torch.Generator().manual_seed(10 + dp_rank)
    b, s = LENGTHS[dp_rank]
    return torch.randint(0, vocab, (b, s), generator=gen), torch.randint(0, vocab, (b, s), generator=gen)


def _build(path: str, tp: int, ep: int, dtype=torch.float32, etp: int = 1, pp: int = 1):
    from transformers import AutoConfig

    from megarl.config.train_sections import ParallelConfig
    from megarl.models.bridges import get_bridge
    from megarl.parallel.groups import current_parallel_info

    info = current_parallel_info()
    hf_config = AutoConfig.from_pretrained(path)
    bridge = get_bridge(hf_config)
    tcfg = bridge.transformer_config(hf_config, ParallelConfig(tp=tp, pp=pp, ep=ep, etp=etp), dtype)
    model = bridge.build_model(hf_config, tcfg, pre_process=info.is_first_stage, post_process=info.is_last_stage)
    bridge.load_hf_weights(model, path)
    return bridge, hf_config, model


def _megatron_loss(model, ids: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """The logits [b, s, V] on every pipeline stage, after a backward of the summed cross-entropy
    through Megatron's schedule (one micro-batch; 1F1B at PP > 1); the vocab-parallel logits
    gathered with autograd."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from pipeline_oracle import broadcast_from_last_stage, forward_backward, gpt_inputs

    def loss(output: torch.Tensor, mb) -> tuple[torch.Tensor, torch.Tensor]:
        logits = gather_from_tensor_model_parallel_region(output)[..., :vocab]
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"), logits.detach()

    logits = forward_backward(model, ids, lambda m, mb: m(*gpt_inputs(mb, torch.ones_like(mb))), loss,
                              seq_length=ids.shape[1], micro_batch_size=ids.shape[0])  # fmt: skip
    return broadcast_from_last_stage(logits)


def _finish_sequence_parallel_grads(model) -> None:
    """What Megatron's finalize_model_grads does for parameters marked sequence_parallel (norms,
    the router): each TP rank saw 1/TP of the tokens, so their gradients are summed over TP."""
    import torch.distributed as dist

    from megarl.parallel.sharding import tp_group

    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=tp_group())


def _exported_grads(bridge, model) -> dict[str, torch.Tensor]:
    """The gradients under HF names: the parameters' data swapped for their gradients, exported."""
    saved = [(p, p.data) for p in model.parameters()]
    for p, data in saved:
        p.data = p.grad if p.grad is not None else torch.zeros_like(data)
    try:
        return {n: t.clone() for n, t in bridge.export_hf_tensors(model, gather_bytes=1 << 20)}
    finally:
        for p, data in saved:
            p.data = data


def _hf_run(path: str, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, dict, dict]:
    """HF's logits [b, s, V] on the first batch; the gradients of its loss, and those summed over
    every batch, under the on-disk names (transformers 5 holds each layer's experts fused:
    gate_up_proj [E, 2f, h] = cat(gate, up) and down_proj [E, h, f])."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    grads, first = [], None
    for ids, labels in batches:
        logits = hf(input_ids=ids).logits
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").backward()
        grads.append(_disk_names({n: p.grad.clone() for n, p in hf.named_parameters()}))
        first = logits.detach() if first is None else first
    assert first is not None
    return first, grads[0], grads[-1]


def _disk_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, g in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, f = name.removesuffix("gate_up_proj"), g.shape[1] // 2
            for e, ge in enumerate(g):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = ge[:f], ge[f:]
        elif name.endswith("mlp.experts.down_proj"):
            out.update({f"{name.removesuffix('down_proj')}{e}.down_proj.weight": ge for e, ge in enumerate(g)})
        else:
            out[name] = g
    return out


def _ep_replicas(dp_rank: int) -> list[int]:
    """The DP replicas whose tokens this rank's experts see: those of its expert-parallel group
    (the all-to-all sends each token to its expert's rank) and its expert-tensor-parallel group
    (which gathers every token for its experts' slices), this rank's own first."""
    from megatron.core import parallel_state as ps

    from megarl.parallel.sharding import all_gather_objects

    group = ps.get_expert_tensor_and_model_parallel_group()
    others = [r for r in dict.fromkeys(all_gather_objects(dp_rank, group=group)) if r != dp_rank]
    return [dp_rank, *others]


@dataclass
class TensorParity:
    """One model against HF on one DP replica's batch (:func:`tensor_parity`)."""

    bridge: Any
    hf_config: Any
    model: Any
    ids: torch.Tensor  # this replica's batch
    ref_logits: torch.Tensor  # HF's on it
    max_diff: float  # max |Megatron logit - HF's|
    grads: dict[str, torch.Tensor]  # Megatron's gradients under HF names (through the export)
    ref_grads: dict[str, torch.Tensor]  # HF's, for the tokens each tensor saw
    worst_grad: tuple[str, float]  # the tensor whose gradient is furthest from HF's, relative to its largest entry
    file: dict[str, torch.Tensor]  # the HF checkpoint
    exported: dict[str, torch.Tensor]  # what the bridge exports of the loaded model

    @property
    def export_unequal(self) -> list[str]:
        return sorted(n for n in self.exported if n in self.file and not torch.equal(self.exported[n], self.file[n]))


def tensor_parity(path: str, tp: int, ep: int, dp_rank: int, etp: int = 1, pp: int = 1) -> TensorParity:
    """Logits, gradients and export of one model against HF on this DP replica's batch, at any
    layout (the pipeline's logits handed to every stage, the export gathered from every stage)."""
    from safetensors.torch import load_file

    bridge, hf_config, model = _build(path, tp, ep, etp=etp, pp=pp)
    vocab = bridge.vocab_size(hf_config)
    ids, labels = _batch(dp_rank, vocab)
    logits = _megatron_loss(model, ids, labels, vocab)
    _finish_sequence_parallel_grads(model)
    # Before DDP's reductions a dense parameter's gradient is this replica's; an expert's covers the
    # tokens of every replica of its EP group (the same expert everywhere: the export gathers over EP).
    ref_logits, own, summed = _hf_run(path, [_batch(r, vocab) for r in _ep_replicas(dp_rank)])
    ref_grads = {n: summed[n] if ".mlp.experts." in n else g for n, g in own.items()}
    got = _exported_grads(bridge, model)  # (a buffer, e.g. DeepSeek-V3's correction bias, comes out as itself)
    grad_err = {n: ((got[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in ref_grads.items()}
    return TensorParity(
        bridge, hf_config, model, ids, ref_logits, max_diff=(logits - ref_logits).abs().max().item(), grads=got,
        ref_grads=ref_grads, worst_grad=max(grad_err.items(), key=lambda kv: kv[1]),
        file=load_file(f"{path}/model.safetensors"),
        exported={n: t.clone() for n, t in bridge.export_hf_tensors(model, gather_bytes=48 << 10)},
    )  # fmt: skip


def _parity(path: str, tp: int, ep: int, dp_rank: int, etp: int = 1) -> dict:
    """:func:`tensor_parity`, a wrong expert order and the push's export check on experts."""
    p = tensor_parity(path, tp, ep, dp_rank, etp)
    return {
        "max_diff": p.max_diff,
        "grad_names_equal": set(p.grads) == set(p.ref_grads),
        "worst_grad": p.worst_grad,
        "export_names_equal": set(p.exported) == set(p.file),
        "export_unequal": p.export_unequal,
        "experts_here": list(p.model.decoder.layers[0 if "renorm" in path else 1].mlp.local_expert_indices),
        "shifted_diff": _shifted_diff(path, tp, ep, p.ids, p.ref_logits, etp),
        "fingerprint": _fingerprint_check(p.bridge, p.model, p.file),
    }


def _fingerprint_check(bridge, model, file: dict[str, torch.Tensor]) -> dict:
    """The push's export check (megarl/weight_sync/export_check.py) on experts: the fingerprint
    from this rank's shards (experts gathered over EP, not summed over TP) against the HF file,
    and against the file with two experts of layer 0 swapped (a wrong expert order)."""
    from megarl.weight_sync.export_check import Observation, expected_fingerprint

    expected = expected_fingerprint(bridge, model)

    def mismatches(tensors: dict[str, torch.Tensor]) -> list[str]:
        seen = Observation(expected, [])  # type: ignore[arg-type]  # (no ExportCheck: mismatches() alone)
        for name, t in tensors.items():
            seen.add(name, t)
        return sorted(m.split(":")[0] for m in seen.mismatches())

    a, b = (f"model.layers.{_first_moe_layer(file)}.mlp.experts.{e}.down_proj.weight" for e in (0, 1))
    return {"file": mismatches(file), "swapped": mismatches({**file, a: file[b], b: file[a]})}


def _first_moe_layer(file: dict[str, torch.Tensor]) -> int:
    return min(int(n.split(".")[2]) for n in file if ".mlp.experts." in n)


def _shifted_diff(path: str, tp: int, ep: int, ids: torch.Tensor, ref_logits: torch.Tensor, etp: int) -> float:
    """Max |logit - HF| with each local expert loaded from the next global expert (mod E), the
    mapping's checks bypassed (they refuse it: tests/unit/models/test_qwen3_moe_bridge.py)."""
    from pipeline_oracle import gpt_inputs

    from megarl.models import qwen3_moe
    from megarl.models.bridge import ModelBridge
    from megarl.parallel.sharding import gather_shards

    real = qwen3_moe.experts_per_ep_rank

    def shifted(moe_layer, local: int) -> list[int]:
        return [(e + 1) % moe_layer.config.num_moe_experts for e in real(moe_layer, local)]

    with mock.patch.object(qwen3_moe, "experts_per_ep_rank", shifted), \
         mock.patch.object(qwen3_moe.Qwen3MoeBridge, "check_rules", ModelBridge.check_rules):  # fmt: skip
        bridge, hf_config, model = _build(path, tp, ep, etp=etp)
    model.eval()
    with torch.no_grad():
        (logits,) = gather_shards([(model(*gpt_inputs(ids, torch.ones_like(ids))), -1)])
    return (logits[..., : bridge.vocab_size(hf_config)] - ref_logits).abs().max().item()


def bf16_against_fp32(path: str, ep: int, dp_rank: int = 0) -> dict:
    """Megatron in bf16 at TP=1 against HF in fp32 (the reference; HF's bf16 rounds elsewhere):
    the logits' mean and max gap, and the reference's largest logit. Shared with the DeepSeek-V3 test."""
    from pipeline_oracle import gpt_inputs

    bridge, hf_config, model = _build(path, 1, ep, dtype=torch.bfloat16)
    vocab = bridge.vocab_size(hf_config)
    ids, labels = _batch(dp_rank, vocab)
    ref, _, _ = _hf_run(path, [(ids, labels)])
    model.eval()
    with torch.no_grad():
        logits = model(*gpt_inputs(ids, torch.ones_like(ids)))[..., :vocab].float()
    diff = (logits - ref).abs()
    return {"mean": diff.mean().item(), "max": diff.max().item(), "ref_max": ref.abs().max().item()}


def _worker(rank: int, world: int, dirs: dict[str, str], tp: int, ep: int, etp: int = 1) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.parallel.groups import init_parallel

    info = init_parallel(tp=tp, pp=1, seed=0, ep=ep, etp=etp)
    out: dict = {"ranks": (info.tp_rank, info.ep_rank, info.dp_rank), "etp_rank": ps.get_expert_tensor_parallel_rank()}
    for name, path in dirs.items():
        t0 = time.perf_counter()
        out[name] = _parity(path, tp, ep, info.dp_rank, etp)
        out[name]["seconds"] = time.perf_counter() - t0
    if tp == 1 and etp == 1:
        out["bf16"] = bf16_against_fp32(dirs["renorm"], 2, info.dp_rank)
    return out


def _assert_parity(results: list[dict]) -> None:
    for r in results:
        for name in MODELS:
            got = r[name]
            assert got["max_diff"] <= LOGIT_TOL, (r["ranks"], name, got["max_diff"])
            assert got["grad_names_equal"] and got["worst_grad"][1] <= GRAD_TOL, (r["ranks"], name, got["worst_grad"])
            assert got["export_names_equal"] and got["export_unequal"] == [], (r["ranks"], name, got["export_unequal"])
            assert got["shifted_diff"] > SHIFTED_MIN, (r["ranks"], name, got["shifted_diff"])
            assert got["fingerprint"]["file"] == [], (r["ranks"], name, got["fingerprint"])
            layer = 0 if name == "renorm" else 1
            assert got["fingerprint"]["swapped"] == [f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight" for e in (0, 1)]


def test_qwen3_moe_ep2(moe_dirs):
    t0 = time.perf_counter()
    results = run_distributed(_worker, 2, moe_dirs, 1, 2)
    assert [r["ranks"] for r in results] == [(0, 0, 0), (0, 1, 1)]  # EP spans the DP replicas
    assert [r["renorm"]["experts_here"] for r in results] == [[0, 1], [2, 3]]
    _assert_parity(results)
    for r in results:
        assert r["bf16"]["mean"] <= BF16_MEAN_TOL and r["bf16"]["max"] <= BF16_MAX_TOL, r["bf16"]
    print(f"ep2 launch {time.perf_counter() - t0:.1f}s", _summary(results))


def test_qwen3_moe_tp2_ep2(moe_dirs):
    t0 = time.perf_counter()
    results = run_distributed(_worker, 4, moe_dirs, 2, 2, timeout_s=400)
    # ranks 0, 1: one TP group = one EP group (DP replica 0); ranks 2, 3 the same for replica 1
    assert [r["ranks"] for r in results] == [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1)]
    _assert_parity(results)
    print(f"tp2 x ep2 launch {time.perf_counter() - t0:.1f}s", _summary(results))


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_moe_etp2(moe_dirs, tp):
    """Each expert split over 2 ranks (expert tensor parallelism): at tp 1 the ETP group spans the
    two DP replicas (their tokens, of different counts, gathered for each expert's slices: the
    CPU shim's uneven gathers; a layout conversion takes, and training refuses, since Megatron
    would reduce the expert slices' gradients over DP), at tp 2 it is the TP group (sequence
    parallel)."""
    t0 = time.perf_counter()
    results = run_distributed(_worker, 2, moe_dirs, tp, 1, 2)
    assert [r["etp_rank"] for r in results] == [0, 1]
    assert [r["ranks"] for r in results] == ([(0, 0, 0), (0, 0, 1)] if tp == 1 else [(0, 0, 0), (1, 0, 0)])
    _assert_parity(results)
    print(f"tp{tp} x etp2 launch {time.perf_counter() - t0:.1f}s", _summary(results))


def _summary(results: list[dict]) -> dict:
    return {name: {k: results[0][name][k] for k in ("max_diff", "worst_grad", "shifted_diff", "seconds")} for name in MODELS} | (
        {"bf16": results[0]["bf16"]} if "bf16" in results[0] else {})  # fmt: skip
