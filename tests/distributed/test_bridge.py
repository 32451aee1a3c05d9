"""Model bridges against HF transformers, in 2 gloo processes (one launch per layout).

Each launch checks five models: Qwen2 (untied, qkv bias, vocab 259 padded at TP=2), Qwen3 (tied
embeddings, q/k norm), Llama (llama3 rope scaling with non-default constants), Llama with linear
rope scaling and no GQA, Qwen3 with head_dim 32 != hidden / heads:
- Megatron logits == HF logits (max abs diff <= 1e-4) on a left-padded batch of mixed lengths
  (at TP=2 with sequence parallelism, the default there),
  padded positions excluded, padded vocab columns dropped;
- export(import(hf)) == the HF safetensors, bit for bit, every tensor exactly once, on every rank
  (and, collected to the leader only, on the leader; the other ranks keep their stage's);
  the weight fingerprint computed from the shards (megarl/weight_sync/export_check.py) equals the
  file's, and tells apart the file with one tensor scaled by 1.01.
The TP=2 launch also checks the critic's value head and SdpaAttention against Megatron's own
unfused DotProductAttention; the PP=2 launch runs the forward through the 1F1B schedule.
A bf16 PP=2 launch checks that every tensor is bf16 (norms included), the export equals the
HF file cast to bf16 on both stages, and a receiving stage allocates the dtype the sender sends.
"""

from __future__ import annotations

import itertools
import time
from unittest import mock

import pytest
import torch
from spawn import run_distributed

# case -> (HF architecture, build_tiny_model options)
ARCHS = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True}),
    "llama": ("llama", {
        "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        }
    }),
    "llama_linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "num_kv_heads": 4}),
    "qwen3_head_dim_32": ("qwen3", {"head_dim": 32}),  # q_proj 128 wide on a 64 hidden size
}
TOL = 1e-4
# bf16 logits vs HF in fp32: measured 0.0033 (qwen2) and 0.0054 (qwen3) on logits up to ~0.6.
BF16_TOL = 0.02
LENGTHS = (12, 7, 3)  # left-padded to 12


def _build_dir(out, arch: str, options: dict) -> str:
    """build_tiny_model, except for a head_dim different from hidden / heads (config edited)."""
    from megarl.models.tiny import build_tiny_model, tiny_hf_config

    options = dict(options)
    head_dim = options.pop("head_dim", None)
    if head_dim is None:
        return str(build_tiny_model(out, arch, **options))
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch, vocab_size=259, **options)
    cfg.head_dim = head_dim
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bridge")
    return {case: _build_dir(root / case, arch, kw) for case, (arch, kw) in ARCHS.items()}


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [3, 12], valid [3, 12] (left padding)."""
    gen = torch.Generator().manual_seed(0)
    s = max(LENGTHS)
    ids = torch.randint(0, vocab, (len(LENGTHS), s), generator=gen)
    valid = torch.zeros(len(LENGTHS), s, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        valid[i, s - n:] = True
    return ids, valid


def _hf_logits(path: str, ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=valid.long(), position_ids=pos).logits


def _build(path: str, tp: int, pp: int, value_head: bool = False, recompute: str = "none", dtype=torch.float32,
           sequence_parallel: bool | None = None):  # fmt: skip
    from transformers import AutoConfig

    from megarl.config.train_sections import ParallelConfig
    from megarl.models.bridges import get_bridge
    from megarl.parallel.groups import current_parallel_info

    info = current_parallel_info()
    hf_config = AutoConfig.from_pretrained(path)
    bridge = get_bridge(hf_config)
    parallel = ParallelConfig(tp=tp, pp=pp, sequence_parallel=sequence_parallel)  # None: on when tp > 1
    tcfg = bridge.transformer_config(hf_config, parallel, dtype, recompute)
    model = bridge.build_model(
        hf_config, tcfg, pre_process=info.is_first_stage, post_process=info.is_last_stage, value_head=value_head
    )
    bridge.load_hf_weights(model, path)
    return bridge, hf_config, model


# gather_bytes of an export: each TP-split tensor gathered alone, in groups (a few tensors of the
# tiny models), all in one group
GATHERS = {"each": 1, "some": 48 << 10, "all": 1 << 40}


def _export_check(bridge, model, path: str) -> dict:
    """Bit equality of every exported tensor with the file, whatever the TP gather groups; how
    many all-gathers each grouping took; and how many tensors are TP-split here."""
    from safetensors.torch import load_file

    expected = load_file(f"{path}/model.safetensors")
    out: dict = {"names_equal": True, "unequal": set(), "all_gathers": {}}
    for grouping, gather_bytes in GATHERS.items():
        got: dict[str, torch.Tensor] = {}
        with _counted_all_gathers() as calls:
            for name, t in bridge.export_hf_tensors(model, gather_bytes=gather_bytes):
                assert name not in got, name
                got[name] = t.clone()
        out["all_gathers"][grouping] = calls.call_count
        out["names_equal"] &= set(got) == set(expected)
        out["unequal"] |= {n for n in expected if n in got and not torch.equal(got[n], expected[n])}
    out["unequal"] = sorted(out["unequal"])
    out["split"] = sum(len(r.hf) for r, _ in bridge.local_rules(model) if r.export and r.layout != "replicated")
    out["fingerprint"] = _fingerprint_check(bridge, model, expected)
    return out


def _counted_all_gathers():
    """A spy on the all-gather torch runs (all_gather_single, or all_gather_into_tensor before torch
    2.13; see megarl.parallel.sharding.all_gather_flat): ``call_count`` inside the block."""
    import torch.distributed as dist

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    return mock.patch.object(dist, name, wraps=getattr(dist, name))


def _gather_shards_check(rank: int) -> dict:
    """gather_shards against the concatenation of every rank's known shards: three dtypes,
    dims 0 and 1, a dtype with a lone dim-0 tensor (gathered straight into place; given as a
    non-contiguous view), odd shapes; one all-gather per dtype."""
    from megarl.parallel.sharding import gather_shards

    specs = [((3, 5), torch.float32, 0), ((4, 2), torch.bfloat16, 1), ((7,), torch.float32, 0),
             ((2, 3), torch.float32, 1), ((6, 2), torch.float64, 0)]  # fmt: skip

    def shard(r: int, i: int) -> torch.Tensor:
        shape, dtype, _ = specs[i]
        values = torch.arange(torch.Size(shape).numel()) + 100 * r + 10 * i
        if dtype == torch.float64:  # [6, 2] as the transpose of [2, 6]: not contiguous
            return values.reshape(shape[::-1]).to(dtype).t()
        return values.reshape(shape).to(dtype)

    with _counted_all_gathers() as calls:
        got = gather_shards([(shard(rank, i), dim) for i, (_, _, dim) in enumerate(specs)])
    want = [torch.cat([shard(r, i) for r in range(2)], dim) for i, (_, _, dim) in enumerate(specs)]
    return {"equal": [a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True)],
            "all_gathers": calls.call_count}  # fmt: skip


def _fingerprint_check(bridge, model, file_tensors: dict[str, torch.Tensor]) -> dict:
    """The fingerprint computed from this rank's shards (TP-summed, PP-collected) against the
    HF file's tensors; and the file with one tensor scaled by 1.01 must be told apart."""
    from megarl.weight_sync.export_check import Observation, expected_fingerprint

    expected = expected_fingerprint(bridge, model)

    def mismatches(tensors: dict[str, torch.Tensor]) -> list[str]:
        seen = Observation(expected, [])
        for name, t in tensors.items():
            seen.add(name, t)
        return seen.mismatches()

    name = "model.layers.0.mlp.down_proj.weight"
    scaled = mismatches({**file_tensors, name: file_tensors[name] * 1.01})
    return {"file": mismatches(file_tensors), "scaled": [m.split(":")[0] for m in scaled]}


def _te_names_check(bridge, hf_config, model) -> dict:
    """Under the TE spec the input and pre-MLP norms are weights of linear_qkv / linear_fc1: each
    such name must map to the HF tensor and layout of the local norm it replaces. Returns the
    names compared and those that differ (TE cannot be built here; the names can)."""
    from megarl.models.layer_specs import TE_NAMES

    compared, differ = 0, []
    for name, _ in model.named_parameters():
        for te, local in TE_NAMES.items():
            if name.endswith("." + local):
                te_name = name[: -len(local)] + te
                a, b = bridge.param_rule(hf_config, model, name), bridge.param_rule(hf_config, model, te_name)
                compared += 1
                if (a.hf, a.layout) != (b.hf, b.layout) or b.megatron != te_name:
                    differ.append(te_name)
    # Two fused norms per layer of this stage.
    return {"compared": compared, "expected": 2 * len(model.decoder.layers), "differ": differ}


def _tp_logits(model, ids, valid) -> torch.Tensor:
    from pipeline_oracle import gpt_inputs

    from megarl.parallel.sharding import gather_shards

    model.eval()
    with torch.no_grad():
        (logits,) = gather_shards([(model(*gpt_inputs(ids, valid)), -1)])
        return logits  # [b, s, V_padded]


def _tp2_worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    from megarl.parallel.groups import init_parallel

    init_parallel(tp=2, pp=1, seed=0)
    out: dict = {}
    for arch, path in dirs.items():
        t0 = time.perf_counter()
        bridge, hf_config, model = _build(path, tp=2, pp=1)
        vocab = bridge.vocab_size(hf_config)
        ids, valid = _batch(vocab)
        logits = _tp_logits(model, ids, valid)
        ref = _hf_logits(path, ids, valid)
        out[arch] = {
            "padded_vocab": logits.shape[-1],
            "max_diff": (logits[..., :vocab] - ref)[valid].abs().max().item(),
            "export": _export_check(bridge, model, path),
            "te_names": _te_names_check(bridge, hf_config, model),
            "seconds": time.perf_counter() - t0,
        }
    out["critic"] = _critic_check(dirs["qwen2"])
    out["gather_shards"] = _gather_shards_check(rank)
    out["recompute"] = _recompute_check(dirs["qwen2"])
    out["attention"] = _attention_check()
    out["packed_attention"] = _packed_attention_check()
    return out


def _critic_check(path: str) -> dict:
    import torch.distributed as dist
    from pipeline_oracle import gpt_inputs

    from megarl.parallel.sharding import tp_group

    # Without sequence parallelism: under it the bare model's values stay split over the TP
    # ranks (the worker's position hook gathers them; test_sequence_parallel.py checks that).
    bridge, hf_config, model = _build(path, tp=2, pp=1, value_head=True, sequence_parallel=False)
    ids, valid = _batch(bridge.vocab_size(hf_config))
    model.eval()
    with torch.no_grad():
        values = model(*gpt_inputs(ids, valid))  # [b, s, 1]
    parts = [torch.empty_like(values) for _ in range(2)]
    dist.all_gather(parts, values.contiguous(), group=tp_group())
    names = {n for n, _ in bridge.export_hf_tensors(model, gather_bytes=GATHERS["some"])}
    return {
        "shape": tuple(values.shape),
        "finite": bool(torch.isfinite(values).all()),
        "same_on_tp_ranks": torch.equal(parts[0], parts[1]),
        "export_has_score": "score.weight" in names and "lm_head.weight" not in names,
    }


def _recompute_check(path: str) -> dict:
    """Gradients with selective / full activation recomputation equal those without."""
    from pipeline_oracle import gpt_inputs

    grads = {}
    for mode in ("none", "selective", "full"):
        bridge, hf_config, model = _build(path, tp=2, pp=1, recompute=mode)
        ids, valid = _batch(bridge.vocab_size(hf_config))
        model(*gpt_inputs(ids, valid)).logsumexp(-1)[valid].mean().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {m: torch.equal(grads[m], grads["none"]) for m in ("selective", "full")}


def _attention_check() -> dict:
    """SdpaAttention == Megatron's unfused DotProductAttention on valid rows (GQA, padding)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from pipeline_oracle import gpt_inputs

    from megarl.models.attention import SdpaAttention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        tensor_model_parallel_size=2, attention_dropout=0.0, use_cpu_initialization=True,
        masked_softmax_fusion=False,
    )
    kw = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    ref, sdpa = DotProductAttention(**kw).eval(), SdpaAttention(**kw).eval()
    gen = torch.Generator().manual_seed(1)
    s, b = 12, 3
    q = torch.randn(s, b, 2, 16, generator=gen)  # 4 heads / tp 2
    k = torch.randn(s, b, 1, 16, generator=gen)  # 2 groups / tp 2
    v = torch.randn(s, b, 1, 16, generator=gen)
    ids, valid = _batch(10)
    mask = gpt_inputs(ids, valid)[2]
    with torch.no_grad():
        a, c = ref(q, k, v, mask), sdpa(q, k, v, mask)  # [s, b, 32]
    rows = valid.t()  # [s, b]
    return {"max_diff": (a - c)[rows].abs().max().item(), "finite": bool(torch.isfinite(c).all())}


def _packed_attention_check() -> dict:
    """SdpaAttention on packed segments == each segment attended alone (causal, GQA): ragged
    lengths (grouped batches), equal lengths (the view path), one segment; each also through
    FlexAttention's document mask (uncompiled, forward: CPU has no backward). Max |diff| per case."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.models.attention import SdpaAttention, packed_seq_params
    from megarl.models.packed_sequences import PackedLayout

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            tensor_model_parallel_size=2, attention_dropout=0.0, use_cpu_initialization=True)  # fmt: skip
    sdpa = SdpaAttention(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").eval()
    gen = torch.Generator().manual_seed(2)
    out = {}
    cases = {"ragged": [5, 1, 9, 2, 6], "equal": [4, 4, 4], "one": [7], "ragged-long": [150, 3, 131, 1]}
    for (case, lengths), flex in itertools.product(cases.items(), (False, True)):
        t = sum(lengths)
        q, k, v = (torch.randn(t, h, 16, generator=gen) for h in (2, 1, 1))  # [T, heads / tp, hn]
        layout = PackedLayout.build(lengths)
        params = packed_seq_params(layout, host_offsets=True, flex=flex)
        assert (params.block_mask is not None) == flex
        with torch.no_grad():
            got = sdpa(q, k, v, None, packed_seq_params=params)  # [T, 32]
        start, worst = 0, 0.0
        for n in lengths:
            qs, ks, vs = (x[start : start + n].transpose(0, 1)[None] for x in (q, k, v))
            ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0]  # [heads, n, hn]
            worst = max(worst, (got[start : start + n] - ref.transpose(0, 1).reshape(n, -1)).abs().max().item())
            start += n
        out[f"{case}-flex" if flex else case] = worst
    return out


def _pp2_worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    from pipeline_oracle import broadcast_from_last_stage, forward_only, gpt_inputs

    from megarl.parallel.groups import init_parallel

    info = init_parallel(tp=1, pp=2, seed=0)
    out: dict = {"stage": info.pp_rank}
    for arch, path in dirs.items():
        t0 = time.perf_counter()
        bridge, hf_config, model = _build(path, tp=1, pp=2)
        vocab = bridge.vocab_size(hf_config)
        ids, valid = _batch(vocab)
        # Two micro-batches (rows 0-1 and row 2 padded with a copy) through the 1F1B schedule.
        mbs = [(ids[:2], valid[:2]), (ids[1:], valid[1:])]
        got = forward_only(
            model, mbs, step=lambda m, mb: m(*gpt_inputs(*mb)), collect=lambda o, mb: o.clone(),
            seq_length=ids.shape[1], micro_batch_size=2,
        )
        got = broadcast_from_last_stage(got)
        logits = torch.cat([got[0], got[1][1:]])[..., :vocab]
        ref = _hf_logits(path, ids, valid)
        out[arch] = {
            "max_diff": (logits - ref)[valid].abs().max().item(),
            "export": _export_check(bridge, model, path),
            "leader": _collected_check(bridge, model, path, "leader"),
            "seconds": time.perf_counter() - t0,
        }
    return out


def _tp2_pp2_worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    """TP=2 x PP=2: logits through the pipeline (TP-gathered), the export with each ``collect``
    (every rank, the leader only, each stage its own), and the stage collection of odd sizes."""
    from pipeline_oracle import broadcast_from_last_stage, forward_only, gpt_inputs

    from megarl.parallel.groups import init_parallel
    from megarl.parallel.sharding import gather_shards

    info = init_parallel(tp=2, pp=2, seed=0)
    out: dict = {"stage": (info.pp_rank, info.tp_rank)}
    for arch, path in dirs.items():
        bridge, hf_config, model = _build(path, tp=2, pp=2)
        vocab = bridge.vocab_size(hf_config)
        ids, valid = _batch(vocab)
        got = forward_only(
            model, [(ids, valid)], step=lambda m, mb: m(*gpt_inputs(*mb)),
            collect=lambda o, mb: gather_shards([(o, -1)])[0], seq_length=ids.shape[1], micro_batch_size=3,
        )
        logits = broadcast_from_last_stage(got)[0][..., :vocab]
        out[arch] = {
            "max_diff": (logits - _hf_logits(path, ids, valid))[valid].abs().max().item(),
            "export": _export_check(bridge, model, path),  # collect="all": TP slices over PP, then TP all-gather
        }
        for collect in ("stage", "leader"):
            out[arch][collect] = _collected_check(bridge, model, path, collect)
    out["odd_sizes"] = _odd_sizes_check(info)
    return out


def _collected_check(bridge, model, path: str, collect: str) -> dict:
    """What this rank yields with ``collect``: its names, any tensor unequal to the file's, and
    the names the fingerprint of the same collect expects here."""
    from safetensors.torch import load_file

    from megarl.weight_sync.export_check import expected_fingerprint

    expected = load_file(f"{path}/model.safetensors")
    got = {n: t.clone() for n, t in bridge.export_hf_tensors(model, gather_bytes=GATHERS["some"], collect=collect)}
    fingerprint = expected_fingerprint(bridge, model, collect=collect)
    return {
        "names": sorted(got),
        "unequal": sorted(n for n, t in got.items() if not torch.equal(t, expected[n])),
        "fingerprint_names": sorted(n for names in fingerprint for n in names),
    }


def _odd_sizes_check(info) -> dict:
    """collect_stages at TP=2 x PP=2 on tensors whose sizes do not split evenly over TP (the
    slices are padded), of two dtypes and 0-d (tests/distributed/stage_cases.py)."""
    from stage_cases import collected, expected_names

    out = collected(info.pp_rank, info.pp_size)
    return {c: {**got, "expected": expected_names(c, info.pp_rank, info.tp_rank, info.pp_size)} for c, got in out.items()}


def _pp2_bf16_worker(rank: int, world: int, dirs: dict[str, str]) -> dict:
    """bf16 at PP=2: every tensor bf16 (norms included), logits near HF's, the export equal to
    the HF file cast to bf16 on both stages; then a stage sends an fp32 tensor on purpose and
    the other stage must receive it as fp32 (receivers allocate what the sender announces)."""
    from pipeline_oracle import broadcast_from_last_stage, forward_only, gpt_inputs
    from safetensors.torch import load_file

    from megarl.models.placement import placement_errors
    from megarl.parallel.groups import init_parallel

    info = init_parallel(tp=1, pp=2, seed=0)
    out: dict = {"stage": info.pp_rank}
    for arch in ("qwen2", "qwen3"):  # untied with qkv bias; tied with q/k norms
        path = dirs[arch]
        bridge, hf_config, model = _build(path, tp=1, pp=2, dtype=torch.bfloat16)
        ids, valid = _batch(bridge.vocab_size(hf_config))
        got = forward_only(
            model, [(ids, valid)], step=lambda m, mb: m(*gpt_inputs(*mb)), collect=lambda o, mb: o.float(),
            seq_length=ids.shape[1], micro_batch_size=3,
        )
        logits = broadcast_from_last_stage(got)[0][..., : bridge.vocab_size(hf_config)]
        expected = {k: v.to(torch.bfloat16) for k, v in load_file(f"{path}/model.safetensors").items()}
        exported = {n: t.clone() for n, t in bridge.export_hf_tensors(model, gather_bytes=GATHERS["some"])}
        out[arch] = {
            "placement_errors": placement_errors(model, torch.bfloat16, torch.device("cpu")),
            "norm_dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if "norm" in n}),
            "max_diff": (logits - _hf_logits(path, ids, valid))[valid].abs().max().item(),
            "names_equal": set(exported) == set(expected),
            "dtypes": sorted({str(t.dtype) for t in exported.values()}),
            "unequal": sorted(n for n in expected if n in exported and not torch.equal(exported[n], expected[n])),
        }
    # The last stage now holds its final norm in fp32: a receiver must allocate fp32 for it.
    norm = model.decoder.final_layernorm if info.is_last_stage else None
    if norm is not None:
        norm.weight.data = norm.weight.data.float() + 0.001  # not representable in bf16
    sent = {n: t.clone() for n, t in bridge.export_hf_tensors(model, gather_bytes=GATHERS["some"])}["model.norm.weight"]
    reference = torch.ones(sent.shape) if norm is None else norm.weight.detach().clone()
    reference = broadcast_from_last_stage([reference])[0]
    out["mixed"] = {"dtype": str(sent.dtype), "equal": torch.equal(sent, reference)}
    return out


def _assert_arch_results(results: list[dict]) -> None:
    for rank_out in results:
        for arch in ARCHS:
            r = rank_out[arch]
            assert r["max_diff"] <= TOL, (arch, r["max_diff"])
            assert r["export"]["names_equal"], arch
            assert r["export"]["unequal"] == [], (arch, r["export"]["unequal"])
            assert r["export"]["fingerprint"] == {"file": [], "scaled": ["model.layers.0.mlp.down_proj.weight"]}, arch
            if "te_names" in r:
                te = r["te_names"]
                assert te["compared"] == te["expected"] > 0 and te["differ"] == [], (arch, te)


def test_bridges_tp2(model_dirs):
    t0 = time.perf_counter()
    results = run_distributed(_tp2_worker, 2, model_dirs)
    _assert_arch_results(results)
    assert results[0]["qwen2"]["padded_vocab"] == 260  # 259 padded to a multiple of tp
    for r in results:
        assert r["gather_shards"] == {"equal": [True] * 5, "all_gathers": 3}, r["gather_shards"]
        for arch in ARCHS:  # one fp32 model: one all-gather per group of tensors, never per tensor
            export = r[arch]["export"]
            gathers = export["all_gathers"]
            assert gathers["each"] == export["split"] > gathers["some"] > gathers["all"] == 1, (arch, export)
        assert r["critic"] == {"shape": (3, 12, 1), "finite": True, "same_on_tp_ranks": True, "export_has_score": True}
        assert r["recompute"] == {"selective": True, "full": True}
        assert r["attention"]["finite"] and r["attention"]["max_diff"] <= 1e-5, r["attention"]
        assert len(r["packed_attention"]) == 8 and max(r["packed_attention"].values()) <= 1e-6, r["packed_attention"]
    print(f"tp2 launch {time.perf_counter() - t0:.1f}s", {a: round(results[0][a]["seconds"], 2) for a in ARCHS})


def test_bridges_pp2(model_dirs):
    t0 = time.perf_counter()
    results = run_distributed(_pp2_worker, 2, model_dirs)
    assert sorted(r["stage"] for r in results) == [0, 1]
    _assert_arch_results(results)
    for arch in ARCHS:  # collect="leader": stage 0 gets every tensor, stage 1 keeps its own
        got = {r["stage"]: r[arch]["leader"] for r in results}
        assert got[0]["names"] == sorted(_names_of(model_dirs[arch])) and got[0]["unequal"] == [], arch
        assert set(got[1]["names"]) < set(got[0]["names"]) and got[1]["unequal"] == [], arch
        assert "model.norm.weight" in got[1]["names"] and "model.embed_tokens.weight" not in got[1]["names"], arch
        assert [g["fingerprint_names"] for g in got.values()] == [g["names"] for g in got.values()], arch
    print(f"pp2 launch {time.perf_counter() - t0:.1f}s", {a: round(results[0][a]["seconds"], 2) for a in ARCHS})


def test_bf16_pp2_export_keeps_one_dtype_per_tensor(model_dirs):
    results = run_distributed(_pp2_bf16_worker, 2, model_dirs)
    assert sorted(r["stage"] for r in results) == [0, 1]
    for r in results:
        for arch in ("qwen2", "qwen3"):
            got = r[arch]
            assert got["placement_errors"] == [] and got["norm_dtypes"] == ["torch.bfloat16"], got
            assert got["max_diff"] <= BF16_TOL, (arch, got["max_diff"])
            assert got["names_equal"] and got["dtypes"] == ["torch.bfloat16"], got
            assert got["unequal"] == [], (arch, got["unequal"])
        assert r["mixed"] == {"dtype": "torch.float32", "equal": True}, r["mixed"]
    print("bf16 pp2 max |logits - HF fp32|:", {a: round(results[0][a]["max_diff"], 4) for a in ("qwen2", "qwen3")})


@pytest.mark.slow
def test_bridges_tp2_pp2(model_dirs):
    t0 = time.perf_counter()
    results = run_distributed(_tp2_pp2_worker, 4, model_dirs)
    assert sorted(r["stage"] for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _assert_arch_results(results)
    everything = {a: sorted(_names_of(model_dirs[a])) for a in ARCHS}
    for arch in ARCHS:
        # per-stage export: the two stages partition the checkpoint, TP ranks of a stage agree
        by_stage = {r["stage"][0]: set(r[arch]["stage"]["names"]) for r in results}
        assert not by_stage[0] & by_stage[1]
        assert by_stage[0] | by_stage[1] == set(everything[arch])
        assert "model.embed_tokens.weight" in by_stage[0] and "model.norm.weight" in by_stage[1]
        for r in results:
            for collect in ("stage", "leader"):
                got = r[arch][collect]
                assert got["unequal"] == [], (arch, collect, got["unequal"])
                # a fingerprint covers exactly what the same collect yields on this rank
                assert got["fingerprint_names"] == got["names"], (arch, collect)
            # leader: the replica's first rank (stage 0, TP rank 0) gets every tensor, the others their stage's
            leader = r["stage"] == (0, 0)
            assert r[arch]["leader"]["names"] == (everything[arch] if leader else sorted(by_stage[r["stage"][0]])), arch
    for r in results:
        for collect, got in r["odd_sizes"].items():
            assert got["names"] == got["expected"] and got["unequal"] == [], (r["stage"], collect, got)
    print(f"tp2 x pp2 launch {time.perf_counter() - t0:.1f}s")


def _names_of(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return list(f.keys())
