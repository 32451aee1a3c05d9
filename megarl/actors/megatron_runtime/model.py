"""One Megatron model in a worker process: build it, run batches through Megatron's schedule.

Shared by the policy, reference and critic workers. A :class:`MegatronModel` owns one
``GPTModel`` (this rank's TP shard of this rank's PP stage), built and loaded from an HF
directory through the model bridge. Its two entry points:

- :meth:`MegatronModel.forward_tokens` runs a whole batch forward-only and returns a per-token
  ``[B, R]`` result (log-probs / entropy / values) on EVERY rank;
- :meth:`MegatronModel.forward_backward` runs one mini-batch forward and backward with a loss
  function; gradients are normalised globally (see below) and metrics reduced to every rank.

Conventions (identical for all workers):

- Every rank of the worker group is handed the SAME whole batch. Each DP replica takes its
  share by index (``balanced_partition`` by token count), cuts it into micro-batches, and the
  per-token results are summed into a zero ``[B, R]`` tensor over the whole world: rows come
  only from the last pipeline stage's TP rank 0 of the replica that owned them, so every rank
  returns the full ``[B, R]``. Positions past a row's response length are 0.
- Normalisation is global: the schedule runs with ``calculate_per_token_loss=True``; a loss
  function returns a SUM and its count; Megatron adds the counts over micro-batches and DP
  ranks and divides the (summed, not averaged) DP gradient by that total once.
- Only response positions reach the output layer: a forward pre-hook on ``output_layer`` keeps
  the hidden states at each row's ``response_columns`` (``[S, b, h] -> [R, b, h]``), so the
  last stage returns ``[b, R, V/tp]`` logits (or ``[b, R, 1]`` values) already aligned with the
  response tokens. Prompt positions never pay for the LM head (its matmul and the ``[b, S, V]``
  logits, the largest activation with a big vocabulary).
- Several models may live in one process (policy + reference): Megatron's parallel state is
  process-global, so :func:`ensure_parallel` initialises it once and later models check that
  their layout matches.

Left out: virtual pipeline stages, context/expert parallelism, sequence packing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megarl.actors.megatron_runtime.logprobs import vocab_parallel_logprobs
from megarl.actors.megatron_runtime.micro_batches import (
    MicroBatch,
    balanced_partition,
    micro_batch_indices,
    pack_micro_batch,
    sequence_lengths,
)
from megarl.algos.losses import metric_reduction
from megarl.config.sections import ActorConfig, ParallelConfig
from megarl.data.batch import Batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# A head turns the last stage's output [b, R, ...] (response positions only) for one
# micro-batch into named per-token tensors [b, R] (on every TP rank of the stage; TP rank 0's
# copy is kept).
Head = Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]]


def ensure_parallel(parallel: ParallelConfig, seed: int) -> Any:
    """Initialise Megatron's groups for ``parallel`` once per process; later calls must match."""
    from megatron.core import parallel_state

    from megarl.parallel.groups import current_parallel_info, init_parallel

    for name in ("vpp", "cp", "ep"):
        if getattr(parallel, name) != 1:
            raise ValueError(f"parallel.{name}={getattr(parallel, name)} is not supported yet; set it to 1")
    if not parallel_state.model_parallel_is_initialized():
        return init_parallel(parallel.tp, parallel.pp, seed)
    info = current_parallel_info()
    if (info.tp_size, info.pp_size) != (parallel.tp, parallel.pp):
        raise ValueError(
            f"this process already runs a model with tp={info.tp_size}, pp={info.pp_size}; a second "
            f"model here must use the same layout, got tp={parallel.tp}, pp={parallel.pp} "
            f"(the reference shares the policy's layout: set it equal)"
        )
    return info


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass
class MegatronModel:
    """This rank's piece of one model plus what is needed to run it (see module docstring)."""

    bridge: Any
    hf_config: Any
    tcfg: Any  # megatron TransformerConfig (calculate_per_token_loss=True)
    module: torch.nn.Module  # GPTModel, or DDP(GPTModel) once wrapped for training
    info: Any  # megarl.parallel.groups.ParallelInfo
    vocab_size: int  # real vocabulary (padding columns past it are masked)
    positions: ResponsePositions  # the output layer's position selector (last stage)

    @classmethod
    def build(
        cls,
        hf_path: str,
        cfg: ActorConfig,
        dtype: torch.dtype,
        seed: int,
        *,
        value_head: bool = False,
    ) -> MegatronModel:
        """Build this rank's shard through the bridge and load the HF weights into it."""
        from transformers import AutoConfig

        from megarl.models.bridge import get_bridge

        info = ensure_parallel(cfg.parallel, seed)
        hf_config = AutoConfig.from_pretrained(hf_path)
        bridge = get_bridge(hf_config)
        tcfg = bridge.transformer_config(hf_config, cfg.parallel, dtype, cfg.recompute)
        _configure_schedule(tcfg, dtype)
        module = bridge.build_model(
            hf_config, tcfg, pre_process=info.is_first_stage, post_process=info.is_last_stage, value_head=value_head
        )
        bridge.load_hf_weights(module, hf_path)
        positions = ResponsePositions()
        if info.is_last_stage:
            module.output_layer.register_forward_pre_hook(positions, with_kwargs=True)
        return cls(bridge, hf_config, tcfg, module, info, bridge.vocab_size(hf_config), positions)

    @property
    def core(self) -> torch.nn.Module:
        """The GPTModel itself (unwrapped from DDP)."""
        return getattr(self.module, "module", self.module)

    # ---- forward only ---------------------------------------------------------------------
    def forward_tokens(
        self, batch: Batch, head: Head, names: tuple[str, ...], *, micro_batch_size: int | None, max_tokens: int | None
    ) -> dict[str, torch.Tensor]:
        """Run ``batch`` forward-only; returns ``{name: [B, R] float32}`` on every rank."""
        rows = self._replica_rows(batch)
        micro = self._micro_batches(batch, rows, micro_batch_size, max_tokens)
        results: list[tuple[MicroBatch, dict[str, torch.Tensor]]] = []

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            results.append((mb, {k: v.detach() for k, v in head(mb, output).items()}))
            return output.new_zeros(()), _int(0, output.device), {}

        self.module.eval()
        with torch.no_grad():
            self._run(batch, micro, loss_func, forward_only=True)
        b, r = batch.response_ids.shape
        full = {name: torch.zeros(b, r, dtype=torch.float32, device=self.info.device) for name in names}
        if self.info.is_last_stage and self.info.tp_rank == 0:
            for mb, values in results:
                for name in names:
                    full[name][mb.rows.to(self.info.device)] = values[name].float()
        for name in names:
            # Each row is written by exactly one rank of the world: a sum gathers them everywhere.
            dist.all_reduce(full[name], op=dist.ReduceOp.SUM)
            full[name] = full[name].cpu()
        return full

    # ---- training -------------------------------------------------------------------------
    def forward_backward(
        self,
        mini_batch: Batch,
        loss_head: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
        *,
        micro_batch_size: int | None,
        max_tokens: int | None,
    ) -> dict[str, tuple[float, float]]:
        """Forward + backward of this replica's share of ``mini_batch``; grads are left in the
        DDP buffers, normalised by the global count. Returns ``{name: (sum, count)}`` reduced over
        micro-batches, DP ranks and pipeline stages (identical on every rank); ``loss`` included. Metrics named
        ``*_max`` / ``*_min`` keep their extreme instead of a sum (megarl.algos' rule)."""
        rows = self._replica_rows(mini_batch)
        micro = self._micro_batches(mini_batch, rows, micro_batch_size, max_tokens)
        collected: dict[str, tuple[float, float]] = {}

        def loss_func(mb: MicroBatch, output: torch.Tensor):
            loss_sum, count, metrics = loss_head(mb, output)
            parts = {"loss": torch.stack([loss_sum.detach(), count.detach().to(loss_sum.dtype)])}
            parts.update(metrics)
            for name, value in parts.items():
                pair = tuple(float(x) for x in value.detach().double().cpu().reshape(2))
                collected[name] = merge_metric(name, collected[name], pair) if name in collected else pair
            return loss_sum, _count_as_int(count, output.device), {}

        self.module.train()
        self._run(mini_batch, micro, loss_func, forward_only=False)
        return self._reduce_metrics(collected)

    # ---- internals ------------------------------------------------------------------------
    def _replica_rows(self, batch: Batch) -> list[int]:
        """Row indices of ``batch`` that this DP replica processes (balanced by token count)."""
        if len(batch) < self.info.dp_size:
            raise ValueError(
                f"a batch of {len(batch)} samples cannot be spread over {self.info.dp_size} data-parallel "
                f"ranks; use at least {self.info.dp_size} samples per mini-batch"
            )
        lengths = sequence_lengths(batch).tolist()
        return balanced_partition(lengths, self.info.dp_size)[self.info.dp_rank]

    @staticmethod
    def _micro_batches(
        batch: Batch, rows: list[int], micro_batch_size: int | None, max_tokens: int | None
    ) -> list[list[int]]:
        lengths = sequence_lengths(batch)[rows].tolist()
        groups = micro_batch_indices(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
        return [[rows[i] for i in g] for g in groups]

    def _run(self, batch: Batch, micro: list[list[int]], loss_func: Callable, *, forward_only: bool) -> None:
        """Drive Megatron's schedule (1F1B under PP) over the ``micro`` row groups of ``batch``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = self.info.device
        packed = iter([pack_micro_batch(batch, rows, device) for rows in micro])

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            self.positions.columns = mb.response_columns
            # Rows are left-aligned: plain causal attention (mask None) is exact.
            output = model(input_ids=mb.tokens, position_ids=mb.position_ids, attention_mask=None)
            return output, partial(loss_func, mb)

        longest = max(int(sequence_lengths(batch)[rows].max()) for rows in micro)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=packed,
            model=[self.module],
            num_microbatches=len(micro),
            seq_length=longest,  # only a hint: variable_seq_lengths makes PP send shapes
            micro_batch_size=max(len(rows) for rows in micro),
            forward_only=forward_only,
        )

    def _reduce_metrics(self, collected: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """Reduce (value, count) pairs over DP ranks (by each metric's op), then hand the last
        stage's result to every pipeline stage."""
        from megatron.core import parallel_state as ps

        names = [sorted(collected)]
        pp_group = ps.get_pipeline_model_parallel_group()
        if self.info.pp_size > 1:
            dist.broadcast_object_list(names, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        ops = [metric_reduction(name) for name in names[0]]
        table = torch.zeros(len(ops), 2, dtype=torch.float64, device=self.info.device)  # [n, (value, count)]
        for i, (name, op) in enumerate(zip(names[0], ops)):
            value, count = collected.get(name, (0.0, 0.0))
            empty = {"max": -math.inf, "min": math.inf}.get(op, 0.0)
            table[i] = torch.tensor([value if count > 0 else empty, count], dtype=torch.float64)
        dp_group = ps.get_data_parallel_group()
        counts = table[:, 1].contiguous()  # collectives need contiguous buffers
        dist.all_reduce(counts, group=dp_group)
        table[:, 1] = counts
        for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            rows = [i for i, o in enumerate(ops) if o == op]
            if rows:
                part = table[rows, 0].contiguous()
                dist.all_reduce(part, op=reduce_op, group=dp_group)
                table[rows, 0] = part
        if self.info.pp_size > 1:
            dist.broadcast(table, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        return {name: (float(table[i, 0]), float(table[i, 1])) for i, name in enumerate(names[0])}


def merge_metric(name: str, a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Combine two (value, count) pairs of metric ``name``: sums add; ``*_max`` / ``*_min``
    metrics keep the extreme over the pairs that counted anything (megarl.algos' rule)."""
    op = metric_reduction(name)
    if op == "sum":
        return a[0] + b[0], a[1] + b[1]
    present = [p[0] for p in (a, b) if p[1] > 0]
    pick = max if op == "max" else min
    return (pick(present) if present else 0.0), a[1] + b[1]


def metric_value(name: str, pair: tuple[float, float]) -> float:
    """The reported number: sum / count for summed metrics, the extreme for max/min; nan if empty."""
    value, count = pair
    if count == 0:
        return math.nan
    return value / count if metric_reduction(name) == "sum" else value


class ResponsePositions:
    """Forward pre-hook of the output layer: keep the hidden states at the response columns.

    ``columns [b, R]`` is set per micro-batch before the model runs; the hook turns the output
    layer's input ``[S, b, h]`` into ``[R, b, h]`` (a gather, so gradients flow back to exactly
    those positions)."""

    def __init__(self) -> None:
        self.columns: torch.Tensor | None = None  # [b, R] long

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        if self.columns is None:
            return None
        hidden = args[0]  # [S, b, h]
        index = self.columns.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # [R, b, h]
        return (hidden.gather(0, index), *args[1:]), kwargs


def _configure_schedule(tcfg: Any, dtype: torch.dtype) -> None:
    """Schedule flags every worker relies on (see the module docstring)."""
    from megatron.core.distributed import finalize_model_grads

    tcfg.calculate_per_token_loss = True
    tcfg.variable_seq_lengths = True  # micro-batches differ in width; PP exchanges shapes
    tcfg.finalize_model_grads_func = finalize_model_grads
    if getattr(tcfg, "pipeline_dtype", None) is None:
        tcfg.pipeline_dtype = dtype


def _int(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int, device=device)


def _count_as_int(count: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Megatron accumulates the normaliser in an int tensor: the count must be a whole number."""
    value = float(count)
    if abs(value - round(value)) > 1e-6:
        raise ValueError(
            f"the loss function's normaliser_count must be a whole number of tokens or sequences "
            f"(Megatron adds it in an int tensor), got {value}"
        )
    return _int(round(value), device)


def response_logprobs(
    model: MegatronModel, cfg: ActorConfig, batch: Batch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs [B, R], entropy [B, R] | None)`` of the batch's responses, micro-batched as
    ``cfg`` says (the forward the policy and the reference share)."""
    names = ("logprobs", "entropy") if with_entropy else ("logprobs",)
    head = token_logprob_head(model, temperature, with_entropy)
    out = model.forward_tokens(batch, head, names, micro_batch_size=cfg.micro_batch_size, max_tokens=cfg.max_tokens_per_gpu)
    return out["logprobs"], out.get("entropy")


def token_logprob_head(
    model: MegatronModel, temperature: float, with_entropy: bool
) -> Callable[[MicroBatch, torch.Tensor], dict[str, torch.Tensor]]:
    """A head giving ``logprobs`` (and ``entropy``) ``[b, R]`` of the response tokens from
    vocab-parallel logits ``[b, R, V/tp]`` at the response positions; positions past each
    response's length are 0."""
    from megarl.parallel.sharding import tp_group

    def head(mb: MicroBatch, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        local_vocab = logits.shape[-1]  # logits: [b, R, V/tp]
        logprobs, entropy = vocab_parallel_logprobs(
            logits,
            mb.batch.response_ids,
            temperature=temperature,
            vocab_start=model.info.tp_rank * local_vocab,
            vocab_size=model.vocab_size,
            group=tp_group() if model.info.tp_size > 1 else None,
            with_entropy=with_entropy,
        )
        valid = mb.batch.response_valid.to(logprobs.dtype)  # [b, R]
        out = {"logprobs": logprobs * valid}
        if entropy is not None:
            out["entropy"] = entropy * valid
        return out

    return head
