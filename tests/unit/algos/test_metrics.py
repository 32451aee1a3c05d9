"""The metric accumulator: reductions over slices (empty ones included), the rank protocol
(all-reduce, broadcast) against one accumulator that saw everything, no host sync, and
refusal of names the catalogue does not declare."""

import math
import threading

import pytest
import torch

from megarl.algos.metrics import MetricAccumulator, pair, reduce_metrics
from megarl.metrics import UnknownMetricError


def p(value: float, count: float = 1.0) -> torch.Tensor:
    return torch.tensor([value, count])


# Three micro-batch slices; the second counted nothing (its values must be ignored).
SLICES = [
    {
        "actor/entropy": p(3.0, 2),  # mean: (sum, count)
        "actor/ratio_max": p(1.5),
        "actor/ratio_min": p(0.5),
        "actor/optimizer_steps": p(1.0),  # sum
        "actor/lr": p(0.1),  # last
        "actor/kl": p(0.0, 0),  # only ever empty
    },
    {
        "actor/entropy": p(0.0, 0),
        "actor/ratio_max": p(99.0, 0),
        "actor/ratio_min": p(-99.0, 0),
        "actor/lr": p(0.2),
        "actor/kl": p(0.0, 0),
    },
    {
        "actor/entropy": p(1.0, 2),
        "actor/ratio_max": p(1.2),
        "actor/ratio_min": p(0.7),
        "actor/optimizer_steps": p(2.0),
    },
]
EXPECTED = {
    "actor/entropy": (3.0 + 1.0) / 4,
    "actor/ratio_max": 1.5,
    "actor/ratio_min": 0.5,
    "actor/optimizer_steps": 3.0,
    "actor/lr": 0.2,  # the later slice's
}


def test_reductions_over_slices_with_an_empty_one():
    values = reduce_metrics(SLICES)
    assert math.isnan(values.pop("actor/kl"))  # named, nothing counted: NaN (null in the log)
    assert values == pytest.approx(EXPECTED)


def test_names_never_emitted_are_absent_and_order_does_not_matter():
    values = reduce_metrics(list(reversed(SLICES[::2])))  # the empty slice left out, reversed
    assert set(values) == set(EXPECTED) | {"actor/kl"}
    assert values["actor/entropy"] == 1.0 and values["actor/ratio_max"] == 1.5
    assert values["actor/ratio_min"] == 0.5
    assert values["actor/lr"] == pytest.approx(0.1)  # "last" is the last added: slice 0 here
    assert reduce_metrics([]) == {}


def test_min_and_max_of_negative_values():
    # Extremes must not rely on positive values: an empty slice's 0 must not win a max of
    # negatives, nor a min of values above 0.
    values = reduce_metrics(
        [{"actor/ratio_max": p(-3.0), "actor/ratio_min": p(4.0)}, {"actor/ratio_max": p(0.0, 0), "actor/ratio_min": p(0.0, 0)}]
    )
    assert values == {"actor/ratio_max": -3.0, "actor/ratio_min": 4.0}


def test_unknown_and_unaccumulable_names_are_refused():
    acc = MetricAccumulator()
    with pytest.raises(UnknownMetricError, match="actor/clip_frac"):  # the suggestion
        acc.add({"actor/pg_clipfrac": p(1.0)})
    with pytest.raises(UnknownMetricError, match="cannot be accumulated"):
        acc.add({"reward/std": p(1.0)})  # computed once on the controller
    with pytest.raises(UnknownMetricError, match="cannot be accumulated"):
        acc.add({"time/generate_s": p(1.0)})  # a family: no fixed row
    with pytest.raises(RuntimeError):
        acc.add({"actor/entropy": torch.tensor([1.0, 2.0, 3.0])})  # not a [2] pair
    assert acc.values() == {}


def test_pair_keeps_the_device_and_counts_default_to_one():
    assert pair(2.5).tolist() == [2.5, 1.0]
    assert pair(torch.tensor(3.0), 4).dtype == torch.float64


def _run_ranks(n: int, work) -> list:
    """Run ``work(rank, reduce, broadcast)`` in n threads that exchange tensors like a process
    group: all-reduce (sum/max) and broadcast from the last rank, in place."""
    barrier = threading.Barrier(n)
    slots: list[torch.Tensor | None] = [None] * n
    results: list = [None] * n

    def collective(rank: int, t: torch.Tensor, combine) -> None:
        slots[rank] = t.clone()
        barrier.wait()
        out = combine([s for s in slots])
        barrier.wait()
        t.copy_(out)

    def reduce(rank):
        ops = {"sum": lambda ts: torch.stack(ts).sum(0), "max": lambda ts: torch.stack(ts).amax(0)}
        return lambda t, op: collective(rank, t, ops[op])

    def broadcast(rank):
        return lambda t: collective(rank, t, lambda ts: ts[-1])

    def target(rank):
        results[rank] = work(rank, reduce(rank), broadcast(rank))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_all_reduce_over_ranks_equals_one_accumulator_of_every_slice():
    # Rank r gets slice r; rank 1 holds only the empty slice. Replicated "last" values are
    # added by every rank alike, as the trainer adds the optimizer's.
    def work(rank, reduce, broadcast):
        acc = MetricAccumulator()
        acc.add({k: v for k, v in SLICES[rank].items() if k != "actor/lr"})
        acc.all_reduce(reduce)
        acc.add({"actor/lr": p(0.2)})
        return acc.values()

    results = _run_ranks(3, work)
    for values in results:
        assert math.isnan(values.pop("actor/kl"))
        assert values == pytest.approx(EXPECTED)


def test_broadcast_hands_the_last_stage_state_to_stages_that_ran_no_loss():
    def work(rank, reduce, broadcast):
        acc = MetricAccumulator()
        if rank == 1:  # the last pipeline stage ran the loss
            acc.add(SLICES[0])
        acc.broadcast(broadcast)
        return acc.values()

    first, last = _run_ranks(2, work)
    assert first.keys() == last.keys() == set(SLICES[0])
    assert first["actor/entropy"] == last["actor/entropy"] == 1.5


def test_adding_and_reducing_never_reads_the_device():
    # Meta tensors have no data: any host sync (item, tolist, cpu, a data-dependent branch)
    # would raise, so this checks that slices combine and reduce without one.
    acc = MetricAccumulator("meta")
    for metrics in SLICES:
        acc.add({k: v.to("meta") for k, v in metrics.items()})
    acc.all_reduce(lambda t, op: None)
    acc.broadcast(lambda t: None)
    assert acc.table.device.type == "meta" and acc.table.shape[1] == 2
    assert acc.names == set(EXPECTED) | {"actor/kl"}
