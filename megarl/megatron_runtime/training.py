"""A trainable Megatron model: DDP, optimizer, LR schedule, the update loop, checkpoints, offload.

Shared by the policy and the critic (they differ only in their head and loss). Wraps a
:class:`MegatronModel` in Megatron's ``DistributedDataParallel`` with a SUMMING gradient
reduction (``calculate_per_token_loss=True`` makes DDP skip its 1/DP pre-scaling, and
``average_in_collective=False``), so that ``finalize_model_grads`` can divide by the global
token/sequence count once. The reduction overlaps the last micro-batch's backward
(``overlap_grad_reduce``; Megatron's schedule holds it back for the earlier micro-batches; under
PP only the first stage's reduction overlaps, the later stages reduce after the schedule).
With the distributed optimizer, the all-gather of the updated weights after each optimizer step
overlaps the next mini-batch's forward (``overlap_param_gather``: Megatron's forward pre-hooks
finish each bucket's gather before its layers run), and an update ends with a synchronous
gather of whatever is still pending, so everything that reads the weights after it (a weight
push, a checkpoint, the memory hand-over's offload, a forward pass) sees them whole.

``train``: for each of ``ppo_epochs`` passes, the batch is cut into consecutive mini-batches of
``mini_batch_size`` samples (all DP ranks together; in the batch's order, or with ``actor.shuffle``
permuted per epoch by a seed of the run's seed and the step, so runs stay reproducible), and
each mini-batch is one optimizer step: zero grads, set the step's LR, forward+backward over the
replica's micro-batches, clip, step, advance the schedule.

Checkpoints are Megatron ``dist_checkpointing`` directories (torch_dist format) holding the
model's and the optimizer's sharded state dicts plus the schedule's step counter. The
dist-checkpoint writer starts helper processes with "spawn": a script that saves must guard its
entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.algos.metrics import MetricAccumulator, pair
from megarl.checkpoint.dist_save import save_dist_checkpoint
from megarl.checkpoint.run_record import LORA_BASE_FILE
from megarl.config.train_sections import ActorConfig
from megarl.data.batch import Batch
from megarl.megatron_runtime.micro_batches import MicroBatch, MicroBatching, mini_batches
from megarl.megatron_runtime.model import MegatronModel
from megarl.megatron_runtime.moe_balance import MoEBalance
from megarl.megatron_runtime.offload import (
    ModelStates,
    model_grads,
    model_weights,
    optimizer_tensors,
)
from megarl.megatron_runtime.optim import LRSchedule, adam_step_layout, build_optimizer
from megarl.metrics import optimizer_metric_names
from megarl.models.lora import lora_of
from megarl.parallel.mcore_version import (
    OPTIMIZER_FORMAT_RECORD,
    UNPREFIXED_OPTIMIZER_RECORD,
    UNRECORDED_OPTIMIZER_FORMAT,
    check_checkpoint_readable,
    checkpoint_optimizer_format,
    checkpoint_optimizer_unprefixed,
    checkpoint_record,
    write_checkpoint_versions,
)

# How the model's and the optimizer's sharded state dicts are described. The optimizer's format
# is actor.optimizer.checkpoint_format at save (recorded in the checkpoint) and the recorded one
# at load; this default is what checkpoints without a record hold (megatron-core 0.16 refuses its
# own default, flattened-range format). dp_reshardable: saved per DP buffer, fully parallel, no
# gather, a resume keeps TP/PP; fully_reshardable: per parameter, any TP/PP.
CHECKPOINT_METADATA = {"distrib_optim_sharding_type": UNRECORDED_OPTIMIZER_FORMAT}
# LoRA checkpoints: the adapters' key prefix (the file naming their base model: LORA_BASE_FILE).
LORA_KEY = "lora."
# The record's key of the number of optimizers in Megatron's chain at save (an MoE model's dense and
# expert optimizers at ep > 1).
CHAIN_RECORD = "optimizer_chain"
# Parameters per gradient bucket (Megatron's default at DP <= 40); recorded in every checkpoint.
GRAD_BUCKET_PARAMS = 40_000_000

LossHead = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
# A micro-batch's loss count (what its LossHead returns as count) from its rows alone: every
# pipeline stage weighs the MoE auxiliary losses by it (moe_balance.py).
LossCount = Callable[[MicroBatch], torch.Tensor]


class TrainableModel:
    """DDP-wrapped :class:`MegatronModel` with optimizer and schedule (see module docstring)."""

    def __init__(self, model: MegatronModel, cfg: ActorConfig, dtype: torch.dtype, total_optimizer_steps: int | None,
                 role: str) -> None:  # fmt: skip
        """``role`` ("actor" or "critic") names the update's optimizer metrics (``<role>/lr`` ...)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.model = model
        self.role = role
        self.cfg = cfg
        check_expert_gradients(model.tcfg)
        self.closed = False  # close(): the gradient hooks are gone, so no more training
        # Each gradient bucket's reduction starts as soon as the last micro-batch's backward has
        # filled it, while the backward goes on through earlier layers. The bucket size is fixed
        # (not Megatron's DP-dependent default, nor one bucket without overlap): the distributed
        # optimizer's checkpoint is laid out by bucket, and a resume may change DP.
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            bucket_size=GRAD_BUCKET_PARAMS,
            use_distributed_optimizer=cfg.optimizer.distributed,
            # Only with the distributed optimizer (megatron-core 0.19 reads it alone as its
            # layer-wise optimizer's switch); train() finishes the gather before it returns.
            overlap_param_gather=cfg.optimizer.distributed,
            average_in_collective=False,  # a sum: finalize_model_grads divides by the global count
        )
        model.module = DistributedDataParallel(config=model.tcfg, ddp_config=ddp_cfg, module=model.module)
        # The schedule holds the reductions back until the last micro-batch.
        model.tcfg.no_sync_func = model.module.no_sync
        model.tcfg.grad_sync_func = model.module.start_grad_sync
        self.optimizer = build_optimizer(cfg.optimizer, [model.module], dtype)
        if dtype == torch.float16:
            model.tcfg.grad_scale_func = self.optimizer.scale_loss
        self.schedule = LRSchedule(cfg.optimizer, total_optimizer_steps)
        # LoRA: the frozen base model's path and fingerprint, saved with the adapters and checked on load.
        self.base_identity: dict[str, Any] | None = None
        # MoE models: the auxiliary losses' weight and the expert-load metrics (moe_balance.py).
        self.balance = MoEBalance(model.core, model.tcfg, role) if model.tcfg.num_moe_experts else None
        # What the memory hand-over moves (megarl/memory/residency.py); grads are freed, not copied.
        self.states = ModelStates(model.info.device, {"weights": lambda: model_weights(self.model.module),
                                                      "grads": lambda: model_grads(self.model.module),
                                                      "optimizer": lambda: optimizer_tensors(self.optimizer)},
                                  copied=("weights", "optimizer"))  # fmt: skip

    def close(self) -> None:
        """Breaks the reference cycle that keeps the model alive after the last reference to it
        is dropped: Megatron's DDP keeps each parameter's autograd grad accumulator in
        ``grad_accs``, whose hook closes over the DDP module; the cycle runs through autograd's
        C++ node, which Python's collector cannot see, so without this every worker built in a
        process (benches, tests, a GPU) stays in memory for good. The model cannot train after."""
        if self.closed:
            return
        self.closed = True
        ddp = self.model.module
        ddp.grad_accs.clear()
        if ddp.use_forward_hook:  # the param-gather pre-hooks (overlap_param_gather)
            ddp.disable_forward_pre_hook(param_sync=False)

    # ---- the update loop --------------------------------------------------------------------
    def train(self, batch: Batch, loss_head: LossHead, *, mini_batch_size: int | None, ppo_epochs: int | None,
              shuffle_seed: int | None = None, loss_count: LossCount | None = None) -> dict[str, float]:  # fmt: skip
        """Optimizer steps over ``batch`` (see module docstring); metrics equal on every rank.
        ``shuffle_seed``: permute the rows each epoch (micro_batches.mini_batches); None = in order.
        ``loss_count``: needed by an MoE model with auxiliary losses (moe_balance.py).

        Returns the loss function's metrics reduced over every micro-batch, mini-batch and DP
        rank by their catalogued reductions (megarl/metrics.py), plus ``<role>/grad_norm`` (mean
        over the steps taken), ``<role>/lr`` (last step), ``<role>/optimizer_steps`` and
        ``<role>/skipped_steps``; MoE models add ``<role>/moe/...`` (moe_balance.py).
        The metrics stay on the device until one host transfer at the end.
        """
        assert not self.closed, "train() after close(): the gradient hooks are gone"
        size = mini_batch_size or self.cfg.mini_batch_size or len(batch)
        epochs = ppo_epochs or self.cfg.ppo_epochs
        if len(batch) % size:
            raise ValueError(
                f"mini_batch_size ({size}) must divide the number of samples in the step ({len(batch)}); "
                f"pick a divisor of {len(batch)}"
            )
        metrics = MetricAccumulator(self.model.info.device)
        steps: list[tuple[float, bool]] = []  # (grad norm, taken) of each optimizer step
        lr = self.schedule.current_lr
        stage_output = self._balanced(loss_count)
        for mini in mini_batches(batch, size, epochs, shuffle_seed):
            grad_norm, ok, lr = self._step(mini, loss_head, metrics, stage_output)
            steps.append((grad_norm, ok))
        if self.model.module.ddp_config.overlap_param_gather:  # the last step's weights: gathered now, not in a later forward
            self.model.module.start_param_sync(force_sync=True)
        # The optimizer's values are the same on every rank, hence added after the DP reduction
        # (not summed), on the last stage, which broadcasts the whole table.
        replicated = self._optimizer_metrics(self.role, steps, lr) if self.model.info.is_last_stage else None
        self.model.reduce_metrics(metrics, replicated)
        return metrics.values() | self._moe_metrics()

    def _balanced(self, loss_count: LossCount | None) -> Callable[[MicroBatch, torch.Tensor], None] | None:
        """What each training micro-batch's stage output goes through so that its backward weighs
        the MoE auxiliary losses (moe_balance.py); None for a dense model."""
        balance, model = self.balance, self.model
        if balance is None:
            return None
        if balance.losses_on and loss_count is None:
            raise ValueError(f"{self.role}.moe aux_loss_coef / z_loss_coef need the update's loss count per micro-batch "
                             "(loss_count), to weigh the auxiliary losses on every pipeline stage")  # fmt: skip
        balance.begin()
        # The router's tokens on this rank: sequence parallelism gives each TP rank a slice.
        split = model.info.tp_size if model.tcfg.sequence_parallel else 1

        def stage_output(mb: MicroBatch, output: torch.Tensor) -> None:
            # Only the losses need the count (a filler's is 0: it must not weigh).
            count = loss_count(mb) if balance.losses_on and loss_count is not None and not mb.filler else 0.0
            balance.weigh(output, mb.tokens.numel() // split, count)

        return stage_output

    def _moe_metrics(self) -> dict[str, float]:
        if self.balance is None:
            return {}
        from megatron.core import parallel_state as ps

        info = self.model.info
        return self.balance.metrics(ps.get_tensor_and_data_parallel_group(), ps.get_pipeline_model_parallel_group(),
                                    info.tp_size, info.dp_size)  # fmt: skip

    def _step(self, mini: Batch, loss_head: LossHead, metrics: MetricAccumulator,
              stage_output: Callable[[MicroBatch, torch.Tensor], None] | None) -> tuple[float, bool, float]:  # fmt: skip
        """One optimizer step on ``mini``; its loss metrics go to ``metrics``. Returns
        ``(grad norm, step taken, lr)``: host values Megatron's optimizer already computed."""
        self.model.module.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = self.schedule.apply(self.optimizer)
        self.model.forward_backward(mini, loss_head, metrics, MicroBatching.of(self.cfg), stage_output)
        ok, grad_norm, _ = self.optimizer.step()
        self.schedule.advance()
        return float(grad_norm) if grad_norm is not None else float("nan"), bool(ok), lr

    @staticmethod
    def _optimizer_metrics(role: str, steps: list[tuple[float, bool]], lr: float) -> dict[str, torch.Tensor]:
        """The update's optimizer metrics of ``role`` as slices (``steps``: (grad norm, taken))."""
        names = optimizer_metric_names(role)
        taken = [norm for norm, ok in steps if ok]
        return {
            names["grad_norm"]: pair(sum(taken), len(taken)),  # mean over the steps taken; NaN if none
            names["lr"]: pair(lr),
            names["optimizer_steps"]: pair(float(len(steps))),
            names["skipped_steps"]: pair(float(len(steps) - len(taken))),
        }

    # ---- checkpoints ------------------------------------------------------------------------
    def _sharded_state(self, is_loading: bool, optimizer_format: str, unprefixed: bool) -> dict[str, Any]:
        """``unprefixed``: the optimizer state keyed per parameter alone, not under its member of
        Megatron's chain (fully_reshardable only): then a load may have another chain, as an MoE
        model's has at another ep (dense + expert optimizers at ep > 1, one at ep 1)."""
        lora = lora_of(self.model.core)  # LoRA: the adapters only, as the optimizer only holds them
        model_sd = _model_sharded_state(self.model.core) if lora is None else lora.sharded_state_dict(LORA_KEY)
        metadata = CHECKPOINT_METADATA | {"distrib_optim_sharding_type": optimizer_format,
                                          "chained_optim_avoid_prefix": unprefixed}  # fmt: skip
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
            "schedule": self.schedule.state_dict(),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write a dist-checkpoint of model + optimizer + schedule into directory ``path``
        (collective); the host memory it staged the tensors through is released afterwards."""
        os.makedirs(path, exist_ok=True)
        if self.base_identity is not None and torch.distributed.get_rank() == 0:
            (Path(path) / LORA_BASE_FILE).write_text(json.dumps(self.base_identity, indent=1) + "\n")
        # A never-stepped optimizer (the policy during critic warm-up) has no state for the
        # distributed optimizer to describe: give it the state a fresh Adam starts from (step 0).
        _materialise_optimizer_state(self.optimizer)
        fmt = self.cfg.optimizer.checkpoint_format
        unprefixed = self.cfg.optimizer.distributed and fmt == "fully_reshardable"
        save_dist_checkpoint(self._sharded_state(is_loading=False, optimizer_format=fmt, unprefixed=unprefixed), path)
        if torch.distributed.get_rank() == 0:  # which megatron-core can read it back, the buckets, the format
            # (the non-distributed optimizer has no format to choose: its state is per parameter)
            layout: dict[str, Any] = {OPTIMIZER_FORMAT_RECORD: fmt, UNPREFIXED_OPTIMIZER_RECORD: unprefixed,
                                      CHAIN_RECORD: _chain_length(self.optimizer)} if self.cfg.optimizer.distributed else {}
            write_checkpoint_versions(path, grad_bucket_params=GRAD_BUCKET_PARAMS, **layout)
        torch.distributed.barrier()  # the record exists for every rank once save returns

    def load(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`save` wrote (collective; same TP/PP/DP layout or a reshardable one)."""
        from megatron.core import dist_checkpointing

        _check_loadable(path)
        check_lora_base(path, self.base_identity)
        fmt = checkpoint_optimizer_format(path)
        # Only the distributed optimizer's dp_reshardable state is laid out by gradient bucket.
        if self.cfg.optimizer.distributed and fmt == "dp_reshardable":
            recorded = checkpoint_record(path).get("grad_bucket_params")
            error = bucket_layout_error(path, recorded, _trained_params(self.model.core))
            if error:
                raise ValueError(error)
        _materialise_optimizer_state(self.optimizer)
        unprefixed = checkpoint_optimizer_unprefixed(path)
        state = dist_checkpointing.load(self._sharded_state(is_loading=True, optimizer_format=fmt, unprefixed=unprefixed),
                                        str(path))  # fmt: skip
        # Another chain of optimizers than the save's (an MoE model at another ep): the state per
        # parameter loads; the chain's common state (param groups) is the save's, not this chain's.
        rechained = unprefixed and checkpoint_record(path).get(CHAIN_RECORD) != _chain_length(self.optimizer)
        # no_grad: with fp32 params the optimizer's main params are views of the model's leaf
        # params, which Megatron's loader fills in place.
        with torch.no_grad():
            lora = lora_of(self.model.core)
            if lora is None:
                self.model.core.load_state_dict(state["model"])
            else:
                lora.load_sharded(state["model"], LORA_KEY)
            _load_optimizer_state(self.optimizer, state["optimizer"], rechained)
        _restore_adam_steps(self.optimizer, state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])


def check_expert_gradients(tcfg: Any) -> None:
    """Refuse expert tensor parallelism that Megatron's gradient reduction gets wrong: at ep 1 it
    marks expert parameters as dense ones (``allreduce``: megatron/core/tensor_parallel/layers.py)
    and reduces their gradients over the data-parallel group, whose ranks hold the same expert
    slice only when etp equals tp (the planner refuses the rest before launch)."""
    ep, etp, tp = tcfg.expert_model_parallel_size, tcfg.expert_tensor_parallel_size or 1, tcfg.tensor_model_parallel_size
    if tcfg.num_moe_experts and etp > 1 and ep == 1 and etp != tp:
        raise ValueError(f"parallel.etp ({etp}) with parallel.ep 1 must equal parallel.tp ({tp}) to train: Megatron reduces "
                         "the experts' gradients over the data-parallel group at ep 1; set etp to 1 or to tp, or ep above 1")  # fmt: skip


def check_lora_base(path: str | os.PathLike, identity: dict[str, Any] | None) -> None:
    """Refuse a checkpoint whose adapters were trained on another base model, and a full
    fine-tuning checkpoint in a LoRA run or the reverse (``identity``: this run's base, None
    without LoRA)."""
    record = Path(path) / LORA_BASE_FILE
    saved = json.loads(record.read_text()) if record.exists() else None
    if identity is None and saved is not None:
        raise ValueError(f"checkpoint {path} holds LoRA adapters (of base {saved['path']}); this run trains the whole "
                         "model: set actor.lora as that run did, or start from a full fine-tuning checkpoint")  # fmt: skip
    if identity is not None and saved is None:
        raise ValueError(f"checkpoint {path} holds a whole model, not LoRA adapters; this run sets actor.lora: resume "
                         "it without actor.lora, or start the LoRA run from scratch")  # fmt: skip
    if identity is None or saved is None:
        return
    ours, theirs = identity["fingerprint"], saved["fingerprint"]  # (sum, sum of |x|)
    # Both sums' rounding across layouts scales with the sum of magnitudes (the signed sum may cancel).
    tolerance = 1e-9 * max(abs(ours[1]), abs(theirs[1]), 1.0)
    if any(abs(a - b) > tolerance for a, b in zip(ours, theirs, strict=True)):
        raise ValueError(f"checkpoint {path}'s adapters were trained on the base model {saved['path']} (fingerprint "
                         f"{theirs}); this run's model.path {identity['path']} differs (fingerprint {ours}): resume "
                         "with the base model the adapters were trained on")  # fmt: skip


def _chain_length(optimizer: Any) -> int:
    """The members of Megatron's chain of optimizers (1: a plain optimizer)."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def _load_optimizer_state(optimizer: Any, loaded: Any, rechained: bool = False) -> None:
    """``optimizer.load_state_dict(loaded)``, except for fully_reshardable state under torch Adam.

    megatron-core 0.16 (``load_parameter_state_from_fully_reshardable``) copies every entry of
    a parameter's optimizer state from the checkpoint, and torch Adam's per-parameter ``step``
    (which its own ``load_state_dict`` has just put there) is not in it: a KeyError. So the
    parameter state loads here after the rest, with the steps held aside (and
    :func:`_restore_adam_steps` sets them afterwards). TE/apex FusedAdam keep no such entry.

    An MoE model trains with a chain of two (dense and expert parameters, each sharded over its
    own data-parallel group); its state is one entry per optimizer, by index. ``rechained``: the
    checkpoint was saved by another chain (fully_reshardable state without the members' prefix):
    each member takes its parameters' state, and keeps its own param groups (their hyperparameters
    come from the config and the schedule; Adam's step is restored by :func:`_restore_adam_steps`).
    That path skips each member's ``load_state_dict``, and with it the fp16 grad scaler's state:
    the loss scale starts afresh from Megatron's initial dynamic scale (docs/moe.md); bf16 and fp32
    have no scaler."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if rechained:
        members = [loaded] if len(chained) == 1 else [loaded[i] for i in range(len(chained))]
        for inner, state in zip(chained, members, strict=True):
            _load_parameter_state(inner, state["param_state"])
        return
    if len(chained) == 1:
        states = [loaded]
    elif isinstance(loaded, dict):  # Megatron's chain keys its members' state by index
        states = [v for _, v in sorted(loaded.items())]
    else:
        states = list(loaded)
    if not any(isinstance(s, dict) and s.get("param_state_sharding_type") == "fully_reshardable" for s in states):
        optimizer.load_state_dict(loaded)
        return
    for inner, state in zip(chained, states, strict=True):
        param_state = state.pop("param_state")
        inner.load_state_dict(state)  # param groups (Adam's step), grad scaler
        _load_parameter_state(inner, param_state)


def _load_parameter_state(inner: Any, param_state: Any) -> None:
    """One member's fully_reshardable parameter state, torch Adam's per-parameter steps held
    aside (see :func:`_load_optimizer_state`)."""
    held = {p: s.pop("step") for p, s in inner.optimizer.state.items() if "step" in s} if inner.optimizer else {}
    inner.load_parameter_state_from_fully_reshardable(param_state)
    for p, step in held.items():
        inner.optimizer.state[p]["step"] = step


def _model_sharded_state(core: Any) -> dict[str, Any]:  # a megatron GPTModel (untyped)
    """The model's part of a training checkpoint (the ``model`` key of what :meth:`TrainableModel.save` writes)."""
    return core.sharded_state_dict(metadata=CHECKPOINT_METADATA)


def load_trained_weights(core: torch.nn.Module, path: str | os.PathLike) -> None:
    """Fill ``core``'s parameters from the training checkpoint at ``path`` (what
    :meth:`TrainableModel.save` wrote; collective), reading neither the optimizer state nor the
    schedule: an export needs the weights alone, without training's memory for Adam's state
    and whatever optimizer layout (distributed or not, gradient buckets) wrote them. With LoRA
    (adapters attached to ``core``), the adapters only: the caller built ``core`` from the base
    and checks it against the checkpoint's (:func:`check_lora_base`)."""
    # Not load_model_weights: a training checkpoint describes its model with CHECKPOINT_METADATA and holds every parameter.
    # A LoRA checkpoint holds the adapters alone: ``core`` has its base model loaded and the adapters attached.
    from megatron.core import dist_checkpointing

    _check_loadable(path)
    lora = lora_of(core)
    state = dist_checkpointing.load({"model": _model_sharded_state(core) if lora is None else lora.sharded_state_dict(LORA_KEY)},
                                    str(path))  # fmt: skip
    with torch.no_grad():
        if lora is None:
            core.load_state_dict(state["model"])
        else:
            lora.load_sharded(state["model"], LORA_KEY)


def _check_loadable(path: str | os.PathLike) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    check_checkpoint_readable(path)


def _trained_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def bucket_layout_error(path: str | os.PathLike, recorded: int | None, params: int) -> str | None:
    """Why this rank cannot load the optimizer state of checkpoint ``path`` (one line), or None.

    The distributed optimizer's state is laid out by gradient bucket. Checkpoints of earlier
    megarl versions record no bucket size: they were written with one bucket per stage (no
    overlap), which equals today's layout only when the stage's ``params`` fit one bucket."""
    if recorded == GRAD_BUCKET_PARAMS or (recorded is None and params <= GRAD_BUCKET_PARAMS):
        return None
    written = "one gradient bucket (an earlier megarl)" if recorded is None else f"buckets of {recorded} parameters"
    return (
        f"checkpoint {path} holds optimizer state laid out in {written}; this megarl uses buckets of "
        f"{GRAD_BUCKET_PARAMS} parameters and this rank holds {params}; resume it with the megarl that wrote it, "
        f"or start a new run from its weights (megarl convert megatron-to-hf, then model.path)"
    )


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's (chained) optimizer; ranks without parameters
    have none."""
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [opt for opt in inner if opt is not None]


def _materialise_optimizer_state(optimizer: Any, step: float = 0.0) -> None:
    """Give a never-stepped torch Adam the state its first step would create (``step``, zero
    moments) so that Megatron can describe it for loading or saving (without apex/TE it reads
    ``step`` from the per-parameter state). Zero moments at step 0 are exactly the state a fresh
    Adam starts from, and a load overwrites them. Set directly, not by a zero-LR step: a step
    needs a gradient per parameter, memory the plan does not count (a rank's fp32 main params
    again, at save time). TE/apex FusedAdam needs none: Megatron allocates its moments itself and
    its ``step`` lives in the param groups, which the load restores."""
    for inner in _inner_optimizers(optimizer):
        if adam_step_layout(inner) != "per_param" or len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            # where torch.optim.Adam keeps ``step``: with the parameter for fused/capturable, else on the CPU
            on_param = group.get("fused") or group.get("capturable")
            moments = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
            for p in group["params"]:
                state = inner.state[p]
                state["step"] = torch.tensor(step, dtype=torch.float32, device=p.device if on_param else "cpu")
                for name in moments:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _saved_adam_step(loaded: Any) -> float | None:
    """The one Adam step count in a loaded optimizer state tree (Megatron saves it in every
    param group, for torch Adam and FusedAdam alike); None if it saved none."""
    steps: set[float] = set()

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            groups = node.get("param_groups")
            for group in groups if isinstance(groups, list) else []:
                if isinstance(group, dict) and group.get("step") is not None:
                    steps.add(float(group["step"]))
            for value in node.values():
                collect(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                collect(value)

    collect(loaded)
    if len(steps) > 1:
        raise ValueError(f"the checkpoint's optimizer param groups disagree on Adam's step: {sorted(steps)}")
    return steps.pop() if steps else None


def _restore_adam_steps(optimizer: Any, loaded: Any) -> None:
    """Set every Adam step count to the checkpoint's, where this optimizer class keeps it.

    torch Adam keeps a ``step`` tensor per parameter: on load (0.16) the saved value did not
    reach an already materialised state (seen in the checkpoint test), and on a fresh state
    Megatron assigns one tensor to all parameters, which Adam then increments in place; so each
    parameter gets its own tensor here. TE/apex FusedAdam keep one int ``step`` per param group
    (Megatron aligns the groups on save); groups with parameters get the saved value."""
    step = _saved_adam_step(loaded)
    if step is None:
        return
    for inner in _inner_optimizers(optimizer):
        if adam_step_layout(inner) == "per_param":
            for param_state in inner.state.values():
                if "step" in param_state:
                    param_state["step"] = torch.tensor(step, dtype=torch.float32)
        else:
            for group in inner.param_groups:
                if group["params"]:
                    group["step"] = int(step)


class TrainedWorker:
    """What every trained worker (policy, critic) exposes of its TrainableModel ``self.trainer``."""

    trainer: TrainableModel

    def save(self, path: str | os.PathLike) -> None:
        """Dist-checkpoint of model, optimizer and LR schedule into directory ``path`` (collective)."""
        self.trainer.save(path)

    def load(self, path: str | os.PathLike) -> None:
        self.trainer.load(path)

    def close(self) -> None:
        """Lets the model and optimizer be freed once the worker is dropped (see TrainableModel.close)."""
        self.trainer.close()
