"""Forward-only passes over micro-batches through Megatron's pipeline schedule: the bridge
tests' oracle for whole-model logits at PP > 1 (the workers drive the schedule themselves, in
megarl/megatron_runtime/model.py).

:func:`forward_only` runs ``get_forward_backward_func()`` with ``forward_only=True`` (the no-pipeline
schedule at PP=1, 1F1B otherwise) and returns, on the last pipeline stage, one collected value per
micro-batch (e.g. per-token log-probs); other stages get None. :func:`broadcast_from_last_stage`
hands those values to every stage when the caller needs them everywhere.

All micro-batches of one call must have the same sequence length and size (pad them; Megatron's
p2p communication uses fixed shapes here, see the dense bridge).

:func:`forward_backward` runs one micro-batch forward and backward through the same schedule
(gradients left in each parameter's ``.grad``; no DDP, no optimizer): the bridge tests' oracle
for whole-model gradients at PP > 1. Left out: many training micro-batches (the workers call the
schedule with their loss function themselves), virtual pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

MicroBatch = TypeVar("MicroBatch")


def forward_only(
    model: torch.nn.Module,
    micro_batches: Sequence[MicroBatch],
    step: Callable[[torch.nn.Module, MicroBatch], torch.Tensor],
    collect: Callable[[torch.Tensor, MicroBatch], Any],
    *,
    seq_length: int,
    micro_batch_size: int,
) -> list[Any] | None:
    """Run ``step(model, mb)`` (e.g. ``model(*gpt_inputs(...))``) for each micro-batch through the
    pipeline without gradients; on the last stage return ``[collect(output, mb) for mb]`` (output is
    the last stage's model output, e.g. vocab-parallel logits [b, s, V/tp]); None elsewhere.

    ``step`` runs on every stage: on a later stage the model ignores ``input_ids`` and reads the
    activations received from the previous stage, but the mask and position ids still matter.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()  # this thread may not be the one that called init_parallel

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)
        output = step(model_chunk, mb)

        def loss_func(output_tensor, non_loss_data: bool = False):
            assert non_loss_data, "forward_only collects outputs, not losses"
            return collect(output_tensor, mb)

        return output, loss_func

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(list(micro_batches)),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=True,
                collect_non_loss_data=True,
            )
    finally:
        model.train(was_training)
    return list(out) if parallel_state.is_pipeline_last_stage() else None


def forward_backward(
    model: torch.nn.Module,
    micro_batch: MicroBatch,
    step: Callable[[torch.nn.Module, MicroBatch], torch.Tensor],
    loss: Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, Any]],
    *,
    seq_length: int,
    micro_batch_size: int,
) -> Any:
    """Forward ``step(model, micro_batch)`` through the pipeline, then backward from the scalar of
    ``loss(output, micro_batch) -> (scalar, kept)`` on the last stage; return ``kept`` there (e.g.
    the logits), None elsewhere. One micro-batch: Megatron divides the loss by the micro-batch
    count, here 1, so every ``.grad`` is d(scalar)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.parallel.cpu_compat import enable_cpu_compat

    enable_cpu_compat()
    kept: list[Any] = []

    def forward_step(data_iterator, model_chunk):
        mb = next(data_iterator)

        def loss_func(output_tensor):
            value, keep = loss(output_tensor, mb)
            kept.append(keep)
            return value, {}

        return step(model_chunk, mb), loss_func

    model.train()
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([micro_batch]), model=[model], num_microbatches=1,
        seq_length=seq_length, micro_batch_size=micro_batch_size, forward_only=False,
    )  # fmt: skip
    return kept[0] if parallel_state.is_pipeline_last_stage() else None


def broadcast_from_last_stage(obj: Any) -> Any:
    """Every pipeline stage gets the last stage's ``obj`` (any picklable; tensors go to CPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return obj
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    box = [obj if parallel_state.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(box, src=last, group=group)
    return box[0]


# GPTModel.forward(input_ids, position_ids, attention_mask) inputs from a padded token batch, with
# an explicit mask (bool [b, 1, s, s], True = masked: causal + padding); exact for left- or right-
# padded rows (attention depends on relative positions and padding keys are masked).
def gpt_inputs(
    input_ids: torch.Tensor,  # [b, s]
    valid: torch.Tensor,  # [b, s] bool/int, 1 = a real token (left or right padding)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [b, s], position_ids [b, s], attention_mask bool [b, 1, s, s], True = masked)."""
    valid = valid.to(torch.bool)
    s = input_ids.shape[1]
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=input_ids.device), diagonal=1)
    attention_mask = causal[None, None] | ~valid[:, None, None, :]
    return input_ids, position_ids, attention_mask
