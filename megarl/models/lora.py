"""LoRA adapters on Megatron's tensor-parallel linears, named and laid out as HF PEFT's.

For every decoder layer and every targeted HF module (``q_proj`` ... ``down_proj``) the policy
gets an adapter ``A [r, in]``, ``B [out, r]``: the linear's output becomes
``base(x) + alpha / r * B (A dropout(x))``, as ``peft``'s ``LoraLayer`` computes it. The base
model is frozen (``requires_grad`` off: Megatron's DDP gives it no gradient buffer and its
optimizer no state); only the adapters train.

Megatron fuses some HF modules into one linear: ``q_proj``/``k_proj``/``v_proj`` into
``linear_qkv`` (per query group ``[q heads, k, v]``), ``gate_proj``/``up_proj`` into
``linear_fc1`` (``[gate; up]``). Each HF module keeps its own adapter, exactly PEFT's, and the
fused linear's output is assembled from the parts in Megatron's layout; an untargeted part adds
nothing. How an adapter is split over tensor parallelism follows its linear:

- column-parallel (q, k, v, gate, up): ``A`` replicated, ``B`` split by rows like the weight.
  Forward ``h = A x`` (full), then ``B_local h``. Without sequence parallelism ``h`` passes
  ``copy_to_tensor_model_parallel_region`` (its gradient is summed over TP); with it, ``x`` is
  this rank's slice of the sequence and ``h`` is gathered along the sequence (reduce-scatter
  backward), and ``A``'s gradient, a partial sum over this rank's tokens, is marked
  ``sequence_parallel`` so that Megatron's ``finalize_model_grads`` sums it over TP.
- row-parallel (o, down): ``A`` split by columns like the weight, ``B`` replicated.
  ``h = A_local x_local`` summed over TP (all-reduce; reduce-scatter to the sequence slice under
  SP, where ``B``'s gradient is then marked ``sequence_parallel``).

Split tensors carry Megatron's ``tensor_model_parallel`` attributes, so the gradient norm counts
a replicated adapter once. Pipeline stages hold their own layers' adapters; names use the
global layer index.

The adapters live in one module, ``gpt.lora_adapters`` (:class:`LoRAAdapters`), so DDP and the
optimizer see them as parameters of the model; their forward runs through hooks on the linears.
:meth:`LoRAAdapters.disabled` switches them off (the reference policy is the base model).
:meth:`LoRAAdapters.merged` gives a linear's local weight with its adapters merged by one fixed
formula, ``W + alpha / r * sum_k B[:, k] A[k, :]`` in fp32 with k ascending, then cast to W's
dtype: elementwise, so the result is bit-for-bit the same whatever the TP layout (a matmul's
reduction order depends on the shapes); a push and an HF export send those weights.
:meth:`LoRAAdapters.peft_tensors` gathers the full adapters under PEFT's names.

Mixture-of-experts layers (SequentialMLP, the local spec) give every local expert its own
adapters on its ``linear_fc1`` (gate, up) and ``linear_fc2`` (down), named by the global expert
(``model.layers.{i}.mlp.experts.{e}.gate_proj``). Expert tensor parallelism is 1, so an expert's
adapters are whole on its EP rank and their forward has no collective: the dispatcher brings the
tokens, ``[tokens, hidden]`` in full, whatever TP and SP. They carry the attributes Megatron's
expert weights carry (``allreduce`` False under EP: DDP reduces their gradients over the
expert-data-parallel group, and the expert optimizer of the chain steps them); checkpoints save
each expert once (replica id over the expert-data-parallel group, a key per global expert, so
they load at another EP), and :meth:`LoRAAdapters.peft_tensors` gathers them over EP.

Left out: Transformer Engine's fused layer-norm linears (the local layer spec only), dropout with TP > 1 (each TP rank
would draw its own mask for the replicated input).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

LORA_ATTR = "lora_adapters"  # the GPTModel attribute holding the adapters
PEFT_PREFIX = "base_model.model."  # what peft puts before the model's own module names
PEFT_WEIGHTS = "adapter_model.safetensors"  # the adapter files of peft's save_pretrained
PEFT_ADAPTER_DIR = "lora_adapter"  # where `megarl convert` and `megarl sft` write one (as verl's model merger)
# HF module -> (the Megatron linear that holds it, its part of that linear, the HF parent)
TARGETS: dict[str, tuple[str, str, str]] = {
    "q_proj": ("self_attention.linear_qkv", "q", "self_attn"),
    "k_proj": ("self_attention.linear_qkv", "k", "self_attn"),
    "v_proj": ("self_attention.linear_qkv", "v", "self_attn"),
    "o_proj": ("self_attention.linear_proj", "row", "self_attn"),
    "gate_proj": ("mlp.linear_fc1", "gate", "mlp"),
    "up_proj": ("mlp.linear_fc1", "up", "mlp"),
    "down_proj": ("mlp.linear_fc2", "row", "mlp"),
}
_PARTS = {"self_attention.linear_qkv": ("q", "k", "v"), "mlp.linear_fc1": ("gate", "up")}


@dataclass(frozen=True)
class LinearShape:
    """One linear's sizes as this TP rank holds it."""

    in_full: int
    in_local: int
    part_rows: dict[str, int]  # column-parallel: local output rows of each part (q/k/v, gate/up, or "row": out)
    groups: int  # query groups on this rank (the qkv interleave); 1 otherwise


class LoRALinear(torch.nn.Module):
    """The adapters of one Megatron linear (one per targeted HF module it holds)."""

    def __init__(self, hf_names: dict[str, str], shape: LinearShape, row: bool, rank: int, scale: float,
                 dropout: float, sequence_parallel: bool, tp: tuple[int, int], expert: bool = False) -> None:  # fmt: skip
        """``hf_names``: part -> HF module name (``model.layers.3.self_attn.q_proj``) of the targeted parts;
        ``expert``: a mixture-of-experts expert's linear (whole on its rank: ``tp`` is ``(0, 1)``)."""
        super().__init__()
        self.hf_names = hf_names
        self.expert = expert
        self.shape = shape
        self.row = row
        self.rank, self.scale, self.dropout = rank, scale, dropout
        self.sequence_parallel = sequence_parallel
        self.tp_rank, self.tp_size = tp
        self.active = True  # False: the base linear alone (LoRAAdapters.disabled)
        self.adapter_A = torch.nn.ParameterDict()
        self.adapter_B = torch.nn.ParameterDict()

    def add(self, part: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Register ``part``'s local ``A`` and ``B`` with the TP attributes Megatron reads."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        A, B = torch.nn.Parameter(a), torch.nn.Parameter(b)
        self.adapter_A[part], self.adapter_B[part] = A, B
        if self.expert:
            # As Megatron marks the expert weights: tensor-parallel (each is this rank's own, counted
            # once in the gradient norm), and no dense all-reduce under EP.
            set_tensor_model_parallel_attributes(A, True, 1, 1)
            set_tensor_model_parallel_attributes(B, True, 0, 1)
            for t in (A, B):
                setattr(t, "allreduce", self.expert_allreduce)  # noqa: B010 (Megatron reads it)
            return
        split, whole, dim = (A, B, 1) if self.row else (B, A, 0)
        set_tensor_model_parallel_attributes(split, True, dim, 1)
        # Under SP the replicated adapter sees only this rank's tokens: Megatron sums its gradient over TP.
        setattr(whole, "sequence_parallel", self.sequence_parallel)  # noqa: B010 (Megatron reads it)

    expert_allreduce = True  # an expert's: its base weight's ``allreduce`` (False under EP), set by attach_lora

    def split_dim(self, ab: str) -> int | None:
        """The TP-split dim of this linear's ``lora_A`` / ``lora_B`` (None: whole on every rank)."""
        if self.expert:
            return None
        return (1 if self.row else None) if ab == "lora_A" else (None if self.row else 0)

    # ---- forward -------------------------------------------------------------------------
    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' addition to the linear's output for input ``x`` ``[s(/tp), b, in(/tp)]``."""
        from megatron.core import tensor_parallel as tpm

        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        if self.row:
            (part,) = self.adapter_A
            h = F.linear(x, self.adapter_A[part])  # [s, b, r] partial over TP
            if self.tp_size > 1:
                h = (tpm.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
                     else tpm.reduce_from_tensor_model_parallel_region(h))  # fmt: skip
            return F.linear(h, self.adapter_B[part]) * self.scale  # [s(/tp), b, out]
        outs = {}
        for part, A in self.adapter_A.items():
            h = F.linear(x, A)  # [s(/tp), b, r]
            if self.tp_size > 1:
                h = (tpm.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
                     if self.sequence_parallel else tpm.copy_to_tensor_model_parallel_region(h))  # fmt: skip
            outs[part] = F.linear(h, self.adapter_B[part]) * self.scale  # [s, b, rows of part]
        return self._assemble(outs, dim=-1)

    def _assemble(self, outs: dict[str, torch.Tensor], dim: int) -> torch.Tensor:
        """The parts' outputs (or weights) in the fused linear's layout along ``dim`` (zeros
        for an untargeted part): ``[gate; up]``, or per query group ``[q heads, k, v]``."""
        rows = self.shape.part_rows
        like = next(iter(outs.values()))
        pieces = []
        for part in rows:
            t = outs.get(part)
            if t is None:
                size = list(like.shape)
                size[dim] = rows[part]
                t = like.new_zeros(size)
            pieces.append(t)
        if "q" not in rows:
            return torch.cat(pieces, dim=dim)
        g = self.shape.groups
        d = dim % like.dim()
        grouped = [p.unflatten(d, (g, p.shape[d] // g)) for p in pieces]  # [..., g, part rows / g, ...]
        return torch.cat(grouped, dim=d + 1).flatten(d, d + 1)

    # ---- merging -------------------------------------------------------------------------
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (this rank's ``[out, in]`` shard) plus the adapters, by the fixed
        elementwise formula of the module docstring."""
        deltas = {part: _outer_sum(self.adapter_B[part], self.adapter_A[part]) for part in self.adapter_A}
        delta = next(iter(deltas.values())) if self.row else self._assemble(deltas, dim=0)
        return (weight.detach().float() + self.scale * delta).to(weight.dtype)


def _outer_sum(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``B @ A`` in fp32 as ``sum_k B[:, k] A[k, :]``, k ascending: the same bits for every slice."""
    b, a = b.detach().float(), a.detach().float()
    out = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float32, device=a.device)
    for k in range(a.shape[0]):
        out += b[:, k : k + 1] * a[k : k + 1, :]
    return out


class LoRAAdapters(torch.nn.Module):
    """Every adapter of this rank's stage (see the module docstring); ``gpt.lora_adapters``."""

    def __init__(self, cfg: Any) -> None:
        """``cfg``: the run's LoRAConfig."""
        super().__init__()
        self.cfg = cfg
        self.linears = torch.nn.ModuleDict()
        self._by_weight: dict[int, LoRALinear] = {}  # id(base weight) -> its adapters
        self._bases: list[tuple[torch.nn.Parameter, LoRALinear]] = []  # (base weight, its adapters); not registered
        self.merged_in = False  # merge_into_base ran: the base weights are the merged model

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: the reference policy's forward passes."""
        assert not self.merged_in, "the adapters are merged into the base weights: there is no base model left"
        linears = [lin for lin in self.linears.values() if isinstance(lin, LoRALinear)]
        for lin in linears:
            lin.active = False
        try:
            yield
        finally:
            for lin in linears:
                lin.active = True

    def merged(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` with its adapters merged (itself when it has none)."""
        lin = self._by_weight.get(id(param))
        return param if lin is None or not lin.active else lin.merged(param)

    def merge_into_base(self) -> None:
        """Write every adapted weight as :meth:`merged` gives it into the base weight itself and
        switch the adapters off: the model is then the merged model as plain weights, which a
        model checkpoint (no adapter keys) and a bit-for-bit check against an HF export need.
        The adapters keep their values (:meth:`peft_tensors`); the base is gone. Not undone."""
        with torch.no_grad():
            for weight, lin in self._bases:
                weight.copy_(lin.merged(weight))
                lin.active = False
        self.merged_in = True

    def items(self, experts: bool | None = None) -> Iterator[tuple[str, str, torch.nn.Parameter, int | None]]:
        """``(HF module name, "lora_A" | "lora_B", local tensor, TP-split dim or None)`` of every
        adapter; ``experts``: only the experts' (True) or only the others' (False)."""
        for lin in self.linears.values():
            assert isinstance(lin, LoRALinear)
            if experts is not None and lin.expert != experts:
                continue
            for part, name in lin.hf_names.items():
                yield name, "lora_A", lin.adapter_A[part], lin.split_dim("lora_A")
                yield name, "lora_B", lin.adapter_B[part], lin.split_dim("lora_B")

    def has_experts(self) -> bool:
        """Whether this rank holds adapters on mixture-of-experts experts (every EP rank alike)."""
        return any(isinstance(lin, LoRALinear) and lin.expert for lin in self.linears.values())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: Any = (), metadata: Any = None) -> dict[str, Any]:
        """The adapters for Megatron's dist-checkpoint: keys by HF name (global layer, global
        expert), each split tensor with its TP axis, so a checkpoint loads at another TP, PP or EP.
        An expert's adapters are whole and replicated over the expert-data-parallel group only
        (as SequentialMLP's weights): the replica id comes from that group, so each is saved once."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        tensors = {f"{name}.{ab}": t for name, ab, t, _ in self.items(experts=False)}
        axes = {f"{name}.{ab}": dim for name, ab, _, dim in self.items(experts=False) if dim is not None}
        out = make_sharded_tensors_for_checkpoint(tensors, prefix, axes)
        experts = {f"{name}.{ab}": t for name, ab, t, _ in self.items(experts=True)}
        if experts:
            out |= make_sharded_tensors_for_checkpoint(experts, prefix, {}, tp_group=ps.get_expert_tensor_parallel_group(),
                                                       dp_cp_group=ps.get_expert_data_parallel_group())  # fmt: skip
        return out

    def peft_tensors(self, grads: bool = False, experts: bool = True) -> dict[str, torch.Tensor]:
        """Every adapter of the whole model, full, on the CPU, under PEFT's names
        (``base_model.model.<module>.lora_A.weight``, experts by global index); ``grads``: their
        gradients instead (Megatron's ``main_grad``); ``experts``: False leaves the experts' out
        (an HF PEFT directory cannot hold them: docs/lora.md). A collective over the TP, EP and PP groups."""
        from megarl.parallel.sharding import (
            all_gather_objects,
            ep_group,
            gather_shards,
            pp_group,
            tp_group,
        )

        def value(t: torch.nn.Parameter) -> torch.Tensor:
            return (t.main_grad if grads else t).detach()  # type: ignore[attr-defined]  # main_grad: set by Megatron's DDP

        items = [(name, ab, value(t), dim) for name, ab, t, dim in self.items(experts=False)]
        split = [(t, dim) for _, _, t, dim in items if dim is not None]
        tp = dist.get_world_size(tp_group()) if dist.is_initialized() else 1
        gathered = iter(gather_shards(split, tp_group()) if tp > 1 else [t for t, _ in split])
        # copies: on the CPU .cpu() would hand out the live parameter (or gradient buffer) itself
        mine = {f"{PEFT_PREFIX}{name}.{ab}.weight": (next(gathered) if dim is not None else t).to("cpu", copy=True)
                for name, ab, t, dim in items}  # fmt: skip
        if experts:  # whole on their EP rank: every EP rank gets every expert
            held = {f"{PEFT_PREFIX}{name}.{ab}.weight": value(t).to("cpu", copy=True) for name, ab, t, _ in self.items(experts=True)}
            ep = dist.get_world_size(ep_group()) if dist.is_initialized() else 1
            mine |= held if ep == 1 else {k: v for rank in all_gather_objects(held, ep_group()) for k, v in rank.items()}
        if not dist.is_initialized() or dist.get_world_size(pp_group()) == 1:
            return mine
        return {k: v for stage in all_gather_objects(mine, pp_group()) for k, v in stage.items()}

    def load_peft(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set this rank's adapters from full PEFT-named tensors (as :meth:`peft_tensors` gives
        them, or an HF PEFT adapter's safetensors), each cut to this rank's TP slice."""
        from megarl.parallel.sharding import tp_group

        tp = dist.get_world_size(tp_group()) if dist.is_initialized() else 1
        rank = dist.get_rank(tp_group()) if tp > 1 else 0
        with torch.no_grad():
            for name, ab, t, dim in self.items():
                key = f"{PEFT_PREFIX}{name}.{ab}.weight"
                if key not in tensors:
                    raise ValueError(f"the adapter has no tensor {key}")
                full = tensors[key]
                part = full if dim is None else full.chunk(tp, dim=dim)[rank]
                if tuple(part.shape) != tuple(t.shape):
                    raise ValueError(f"adapter tensor {key} has shape {tuple(full.shape)}; this model's is "
                                     f"{tuple(t.shape)} per rank (rank or target modules differ)")  # fmt: skip
                t.copy_(part)

    def load_sharded(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy a dist-checkpoint's loaded adapters (keys as :meth:`sharded_state_dict` with ``prefix``) in place."""
        with torch.no_grad():
            for name, ab, t, _ in self.items():
                t.copy_(state[f"{prefix}{name}.{ab}"])

    def trainable(self) -> int:
        """Adapter parameters on this rank."""
        return sum(t.numel() for _, _, t, _ in self.items())


def peft_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The HF module names (``q_proj`` ...) that PEFT-named ``tensors`` adapt, in TARGETS order:
    peft's ``target_modules`` (on a mixture-of-experts model all-linear adapts the attention only)."""
    names = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors}
    return [m for m in TARGETS if m in names]


def peft_config(tensors: dict[str, torch.Tensor], cfg: Any, base: str) -> Any:
    """peft's own ``LoraConfig`` of an adapter: ``cfg`` (the run's LoRAConfig) on the modules
    ``tensors`` adapt, ``base`` its ``base_model_name_or_path``. Refuses expert tensors (ValueError):
    transformers holds a layer's experts as fused parameters, not modules an adapter can name."""
    from peft import LoraConfig

    experts = sorted(name for name in tensors if ".mlp.experts." in name)
    if experts:
        raise ValueError(f"an HF PEFT adapter cannot hold mixture-of-experts expert adapters ({experts[0]} and "
                         f"{len(experts) - 1} more): export the merged model (megarl convert --no-adapter)")  # fmt: skip
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else cfg.alpha  # peft types lora_alpha as int
    return LoraConfig(r=cfg.rank, lora_alpha=alpha, lora_dropout=cfg.dropout, target_modules=peft_modules(tensors),
                      base_model_name_or_path=str(base), task_type="CAUSAL_LM", inference_mode=True)  # fmt: skip


def peft_config_dict(tensors: dict[str, torch.Tensor], cfg: Any, base: str) -> dict[str, Any]:
    """What :func:`write_peft_adapter` writes as ``adapter_config.json``, as a JSON-ready dict
    (peft's ``save_pretrained`` turns its sets into lists the same way)."""
    import json

    return json.loads(json.dumps(peft_config(tensors, cfg, base).to_dict(), default=sorted))  # enums: str subclasses


def write_peft_adapter(directory: str | Path, tensors: dict[str, torch.Tensor], cfg: Any, base: str) -> None:
    """An HF PEFT adapter directory as ``PeftModel.save_pretrained`` writes it, which
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)`` loads:
    ``adapter_config.json`` from :func:`peft_config` and ``adapter_model.safetensors`` of ``tensors``
    (:meth:`LoRAAdapters.peft_tensors`, already peft's names); then read back and compared bit for
    bit (ValueError if they differ)."""
    from safetensors.torch import load_file, save_file

    config = peft_config(tensors, cfg, base)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / PEFT_WEIGHTS), metadata={"format": "pt"})
    back = load_file(str(directory / PEFT_WEIGHTS))
    wrong = [k for k, v in tensors.items() if k not in back or not torch.equal(back[k], v)]
    if wrong or len(back) != len(tensors):
        raise ValueError(f"{directory / PEFT_WEIGHTS} does not hold the adapters written (e.g. {(wrong or list(back))[0]})")


def adapts_experts(model_dir: str | Path, cfg: Any) -> bool:
    """Whether LoRA ``cfg`` adapts mixture-of-experts experts of the HF model in ``model_dir`` (its
    MLP modules on a model with experts), which no HF PEFT adapter can hold; False without a
    config.json."""
    from megarl.config.architectures import arch_from_hf_dir

    if not (Path(model_dir) / "config.json").is_file():
        return False
    experts = arch_from_hf_dir(model_dir).num_experts
    return bool(experts) and any(m in cfg.modules for m in ("gate_proj", "up_proj", "down_proj"))


def inputs_need_grad(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on the frozen embedding: its output requires grad, so that a recomputed
    (checkpointed) block still passes gradients to the adapters inside it."""
    return output.requires_grad_(True) if torch.is_grad_enabled() else output


def lora_of(gpt: torch.nn.Module) -> LoRAAdapters | None:
    """The adapters attached to this GPTModel, if any."""
    adapters = getattr(gpt, LORA_ATTR, None)
    return adapters if isinstance(adapters, LoRAAdapters) else None


def is_adapter_name(name: str) -> bool:
    """Whether a GPTModel parameter name is an adapter's (not a base weight the bridge maps)."""
    return name.startswith(f"{LORA_ATTR}.")


def attach_lora(gpt: Any, cfg: Any, seed: int) -> LoRAAdapters:
    """Freeze ``gpt``'s weights and give every targeted linear of its layers an adapter;
    ``B`` starts at zero and ``A`` as peft initialises it (from a generator seeded by ``seed``
    and the HF module name, the full tensor then this rank's slice: any layout starts alike).
    In a mixture-of-experts layer the MLP targets adapt each local expert."""
    for p in gpt.parameters():
        p.requires_grad_(False)
    adapters = LoRAAdapters(cfg)
    for layer in gpt.decoder.layers:
        index = layer.layer_number - 1  # global: Megatron numbers layers across stages from 1
        for key, path, linear, names in _targets(layer, index, cfg.modules):
            lin = _adapt_linear(layer, index, path, linear, names, cfg, seed)
            adapters.linears[key] = lin
            adapters._by_weight[id(linear.weight)] = lin
            adapters._bases.append((linear.weight, lin))
    setattr(gpt, LORA_ATTR, adapters)
    return adapters


def _targets(layer: Any, index: int, modules: tuple[str, ...]) -> Iterator[tuple[str, str, Any, dict[str, str]]]:
    """``(adapter key, linear path as in TARGETS, the linear, part -> HF name)`` of every linear of
    ``layer`` that ``modules`` target: one per local expert in a mixture-of-experts layer, named by
    its global expert (Megatron's ``local_expert_indices``)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    for path in dict.fromkeys(TARGETS[m][0] for m in modules):
        parts = {TARGETS[m][1]: m for m in modules if TARGETS[m][0] == path}
        if experts is None or not path.startswith("mlp."):
            names = {part: f"model.layers.{index}.{TARGETS[m][2]}.{m}" for part, m in parts.items()}
            linear = _module(layer, path)
            if linear is None:  # multi-latent attention has no linear_qkv (the planner refuses q/k/v there too)
                raise ValueError(f"actor.lora.target_modules: layer {index} has no {path} for {', '.join(parts.values())} "
                                 "(multi-latent attention: low-rank q and kv projections, not adapted yet); target "
                                 "o_proj, gate_proj, up_proj or down_proj")  # fmt: skip
            yield f"{index}_{path.replace('.', '_')}", path, linear, names
            continue
        local = getattr(experts, "local_experts", None)
        if local is None:
            raise ValueError(f"actor.lora needs model.layer_spec=local: layer {index}'s experts are a "
                             f"{type(experts).__name__}, not SequentialMLP")  # fmt: skip
        for j, expert in enumerate(local):
            e = int(layer.mlp.local_expert_indices[j])
            names = {part: f"model.layers.{index}.mlp.experts.{e}.{m}" for part, m in parts.items()}
            yield f"{index}_mlp_experts_{e}_{path.split('.')[-1]}", path, _module(expert, path[len("mlp.") :]), names


def _module(layer: Any, path: str) -> Any:
    obj = layer
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _adapt_linear(layer: Any, index: int, path: str, linear: Any, names: dict[str, str], cfg: Any, seed: int) -> LoRALinear:
    """The adapters (``names``: part -> HF module) of one linear of ``layer`` with a forward hook
    on it. An expert's linear is whole on its rank (expert TP 1): no TP split, no collective."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    row = isinstance(linear, RowParallelLinear)
    if not (row or isinstance(linear, ColumnParallelLinear)):
        raise ValueError(f"actor.lora needs model.layer_spec=local: layer {index}'s {path} is a {type(linear).__name__}")
    expert = bool(getattr(linear, "is_expert", False))
    if expert and ps.get_expert_tensor_parallel_world_size() != 1:
        raise ValueError(f"actor.lora on experts needs parallel.etp=1 (layer {index}'s experts are split over "
                         f"{ps.get_expert_tensor_parallel_world_size()} ranks); set parallel.etp to 1")  # fmt: skip
    tp = (0, 1) if expert else (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    shape = _linear_shape(linear, path, layer.config, tp[1])
    sp = bool(linear.sequence_parallel) and not expert
    lin = LoRALinear(names, shape, row, cfg.rank, cfg.scale, cfg.dropout, sp, tp, expert=expert)
    lin.expert_allreduce = bool(getattr(linear.weight, "allreduce", True))
    dtype, device = linear.weight.dtype, linear.weight.device
    for part, name in names.items():
        a = _init_A(cfg, shape.in_full, seed, name)
        if row:  # this rank's columns
            width = shape.in_local
            a = a[:, tp[0] * width : (tp[0] + 1) * width]
        b = torch.zeros(shape.part_rows[part] if not row else linear.weight.shape[0], cfg.rank)
        lin.add(part, a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    linear.register_forward_hook(_hook(lin))
    return lin


def _linear_shape(linear: Any, path: str, config: Any, tp_size: int) -> LinearShape:
    """The sizes of ``linear`` on this rank (its weight is ``[out/tp, in]`` or ``[out, in/tp]``)."""
    out_local, in_local = linear.weight.shape
    if path in ("self_attention.linear_proj", "mlp.linear_fc2"):
        return LinearShape(in_local * tp_size, in_local, {"row": out_local}, 1)
    if path == "mlp.linear_fc1":  # gated: [gate; up]
        return LinearShape(in_local, in_local, {"gate": out_local // 2, "up": out_local // 2}, 1)
    per_group, d = config.num_attention_heads // config.num_query_groups, config.kv_channels
    groups = out_local // ((per_group + 2) * d)
    return LinearShape(in_local, in_local, {"q": groups * per_group * d, "k": groups * d, "v": groups * d}, groups)


def _init_A(cfg: Any, in_features: int, seed: int, name: str) -> torch.Tensor:
    """``A [r, in]`` as peft's ``reset_lora_parameters`` draws it (kaiming-uniform with a=sqrt(5),
    i.e. bound 1/sqrt(in); or normal with std 1/r), from a generator of its own."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(cfg.rank, in_features)
    if cfg.init == "gaussian":
        return a.normal_(0.0, 1.0 / cfg.rank, generator=gen)
    bound = 1.0 / in_features**0.5
    return a.uniform_(-bound, bound, generator=gen)


def _hook(lin: LoRALinear):
    """The linear's forward hook: its output plus the adapters' (unless they are switched off)."""

    def hook(module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        if not lin.active:
            return None
        out, bias = output
        return out + lin.delta(args[0]), bias

    return hook
