"""Mixture-of-experts load balance in the update step: the weight of Megatron's auxiliary losses
and the expert-load metrics.

The auxiliary losses (Switch load balance, router z-loss) are added inside each MoE layer by
Megatron's ``MoEAuxLossAutoScaler``: the policy loss does not hold them. Under
``calculate_per_token_loss`` (megarl's global normalisation) Megatron multiplies a layer's loss
by the micro-batch's router tokens T, and ``finalize_model_grads`` divides every gradient by the
global loss count N (response tokens, or sequences in the seq-mean modes). That weighs a
micro-batch's auxiliary loss by T / N: a multiple of the intended coefficient whenever N does
not count the router's tokens (prompts, padding, or sequences instead of tokens). So each
micro-batch's backward first sets the auxiliary losses' backward scale to count / T, where count
is the micro-batch's share of N: each micro-batch's auxiliary loss then weighs count / N, the
weights over every micro-batch and data-parallel rank sum to 1, and the auxiliary gradient is
exactly ``coef x d(aux)`` on one micro-batch. From megatron-core 0.19 on, Megatron multiplies by
T x the size of the router's tensor x context-parallel group (T is that rank's sequence-parallel
slice: the product counts the micro-batch's tokens over the group), so the scale is count / (T x
that size) there (:func:`premultiplied_ranks`).

Every pipeline stage needs that weight, and the loss (which gives the count) exists on the last
stage alone. So the count comes from the micro-batch's rows before the schedule runs (the loss
function's normaliser depends on the rows' masks, not on the model's outputs: the caller's
``loss_count``), and T from the micro-batch's width (the router sees this rank's sequence-parallel
slice). The scale is set by a gradient hook on the stage's output of that micro-batch: the root
of the micro-batch's backward on every stage, so it runs before any of the stage's MoE layers'
backward, whatever the order of micro-batches in the pipeline schedule (1F1B runs several
backwards in a row on the earlier stages). Megatron's schedule sets its own scale after each
forward; the hook's, set later, wins.

Metrics, per update (``<role>/moe/...``): the tokens each expert received per MoE layer
(training forwards only, after capacity drops), as max / mean over the experts (1 = perfect
balance; E / k = every token to the same k experts) per layer (``layer{i}``, HF's 0-based index)
and their mean over the layers; with the losses on, their values per micro-batch, mean over
micro-batches, data-parallel ranks and MoE layers (Megatron's per-layer tracker); with the
expert bias on, its largest magnitude per layer after the update and over the layers.

The expert bias (DeepSeek-V3's aux-loss-free balancing, ``moe.expert_bias_update_rate``) is not
moved here: Megatron moves it in ``finalize_model_grads``, which the schedule calls once per
optimizer step after the last micro-batch's backward (megatron_runtime/model.py sets it). Each
router adds the experts its tokens reached to ``local_tokens_per_expert`` only while gradients
are on, so forward-only passes (old log-probs, reference, the replay metrics' extra forward) and
the gradient-free first forward of full recomputation add nothing; finalize sums the counts over
the tensor x data-parallel group (every rank of a stage), moves each layer's bias by
``rate x sign(mean load - load)`` and zeroes the counts. The bias is a float32 buffer: no
gradient, not in the optimizer, saved in the model's dist-checkpoint. It moves even when the
optimizer then skips the step (a non-finite gradient), as Megatron's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megarl.megatron_runtime.routing_replay import moe_layer_indices
from megarl.parallel.mcore_version import installed_minor

# The first megatron-core whose routers multiply the auxiliary losses by the TP x CP group's size
# (NVIDIA/Megatron-LM #5047, "Fix MoE aux_loss / z_loss gradient scaling with TP > 1", first
# tagged core_v0.19.0; 0.16 to 0.18 multiply by the router's tokens alone).
_PREMULTIPLIES_TP_CP = (0, 19)


def premultiplied_ranks(routers: list[Any], mcore: tuple[int, int] | None) -> int:
    """The multiple beside the router's tokens T that megatron-core ``mcore`` (major, minor) gives
    each auxiliary loss under ``calculate_per_token_loss`` before the autoscaler's scale: the
    routers' tensor x context-parallel group size from 0.19 on (``TopKRouter``'s
    ``attach_and_log_load_balancing_loss`` and ``apply_z_loss`` use ``T x tp_cp_group.size()``),
    else 1. The hook's scale divides by it: without that, at TP 2 the auxiliary gradient is twice
    the intended one on 0.19."""
    if not routers or mcore is None or mcore < _PREMULTIPLIES_TP_CP:
        return 1
    return int(routers[0].tp_cp_group.size())  # one group for every router of the model


def _scale_hook(scale: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A gradient hook that sets the auxiliary losses' backward scale to ``scale``."""

    def hook(grad: torch.Tensor) -> None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # Copied into the scale Megatron holds (its schedule's forwards set it the same way).
        MoEAuxLossAutoScaler.set_loss_scale(scale)

    return hook


class MoEBalance:
    """Hooks on the routers of one model's MoE layers (this pipeline stage's); see the module
    docstring. ``weigh`` every training micro-batch's loss, ``begin`` and ``metrics`` each update."""

    def __init__(self, core: torch.nn.Module, tcfg: Any, role: str) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.role = role
        self.routers = [m for m in core.modules() if isinstance(m, TopKRouter)]
        self.moe_layers = moe_layer_indices(tcfg)
        self.aux_on, self.z_on = bool(tcfg.moe_aux_loss_coeff), bool(tcfg.moe_z_loss_coeff)
        self.losses_on = self.aux_on or self.z_on
        self.ranks = premultiplied_ranks(self.routers, installed_minor())
        self.bias_on = bool(getattr(tcfg, "moe_router_enable_expert_bias", False))  # on every stage alike
        device = next(core.parameters()).device
        self.load = torch.zeros(tcfg.num_layers, tcfg.num_moe_experts, dtype=torch.float64, device=device)  # [L, E]
        self.tcfg = tcfg  # its grad_scale_func: the fp16 loss scale, set once the optimizer exists
        self.micro_batches = 0
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: Any, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        if not router.training:
            return  # forward-only passes (old log-probs, reference) are not the update's routing
        routing_map = output[1]  # [T, E] bool: token -> the experts it reaches
        # Under full recompute a training micro-batch's first forward runs without gradients and
        # the backward runs it again: its load is counted once.
        if torch.is_grad_enabled():
            self.load[router.layer_number - 1] += routing_map.sum(0)

    def begin(self) -> None:
        """Start an update's counts (and Megatron's loss tracker)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.load.zero_()
        self.micro_batches = 0
        clear_aux_losses_tracker()

    def weigh(self, output: torch.Tensor, tokens: int, count: torch.Tensor | float) -> None:
        """One training micro-batch's ``output`` of this stage, whose router tokens on this rank
        are ``tokens`` and whose loss count is ``count`` (0: a filler): its backward weighs the
        auxiliary losses by ``count / tokens`` (over the TP x CP group's tokens on 0.19)."""
        self.micro_batches += 1
        if not self.losses_on or not self.routers or not output.requires_grad:
            return
        ones = torch.ones(1, device=output.device)
        scale_func = self.tcfg.grad_scale_func  # as Megatron's schedule sets its scale after each forward
        base = scale_func(ones) if scale_func is not None else ones
        share = torch.as_tensor(count, dtype=torch.float32, device=output.device) / (max(tokens, 1) * self.ranks)
        output.register_hook(_scale_hook(base * share.to(base.dtype)))

    def metrics(self, tp_dp_group: Any, pp_group: Any, tp_size: int, dp_size: int) -> dict[str, float]:
        """The update's MoE metrics, identical on every rank (collective over the given groups)."""
        aux, z = self._tracked_losses()  # [L] each: sums over this rank's micro-batches
        # One all-reduce over TP x DP: loads add up (sequence-parallel ranks see different tokens,
        # replicas do not change max / mean), aux shares add up over TP, then PP joins the stages.
        table = torch.cat([self.load.flatten(), aux, z])
        dist.all_reduce(table, group=tp_dp_group)
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(table, group=pp_group)
        n = self.load.numel()
        load, aux, z = table[:n].view_as(self.load), table[n : n + aux.numel()], table[n + aux.numel() :]
        ratio = load.max(-1).values / load.mean(-1).clamp(min=1e-12)  # [L]
        values = {f"{self.role}/moe/expert_load_max_over_mean/layer{i}": ratio[i] for i in self.moe_layers}
        values[f"{self.role}/moe/expert_load_max_over_mean"] = ratio[self.moe_layers].mean()
        per_mb = max(self.micro_batches, 1) * dp_size * len(self.moe_layers)
        if self.aux_on:  # Megatron tracks only the losses it computes: an untracked one is not 0
            values[f"{self.role}/moe/aux_loss"] = aux.sum() / per_mb
        if self.z_on:
            values[f"{self.role}/moe/z_loss"] = z.sum() / (per_mb * tp_size)  # z: a mean over tokens per TP rank
        values |= self._bias_metrics(pp_group)
        host = torch.stack(list(values.values())).tolist()  # one host transfer
        return dict(zip(values, host))

    def _bias_metrics(self, pp_group: Any) -> dict[str, torch.Tensor]:
        """The routers' largest |expert bias| per MoE layer and over them; none without the bias.
        Every rank of a stage holds the same bias after finalize's all-reduce: only the stages'
        layers are joined (a MAX over PP; collective when the model has the bias)."""
        if not self.bias_on:
            return {}
        table = torch.zeros(self.load.shape[0], dtype=torch.float64, device=self.load.device)  # [L]
        for router in self.routers:
            table[router.layer_number - 1] = router.expert_bias.detach().abs().max()
        if pp_group is not None and dist.get_world_size(pp_group) > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=pp_group)
        values = {f"{self.role}/moe/expert_bias_abs_max/layer{i}": table[i] for i in self.moe_layers}
        values[f"{self.role}/moe/expert_bias_abs_max"] = table[self.moe_layers].max()
        return values

    def _tracked_losses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron's per-layer sums of the Switch loss and z-loss values (without coefficients)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        zeros = torch.zeros(self.load.shape[0], dtype=torch.float64, device=self.load.device)
        found = [tracker.get(name, {}).get("values") for name in ("load_balancing_loss", "z_loss")]
        aux, z = (zeros if v is None else v.to(torch.float64) for v in found)
        return aux, z
