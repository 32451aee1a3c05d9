"""Resuming the distributed optimizer's state needs the gradient-bucket layout it was saved in."""

from megarl.megatron_runtime.training import GRAD_BUCKET_PARAMS, bucket_layout_error


def test_a_checkpoint_loads_when_its_bucket_layout_is_todays():
    assert bucket_layout_error("ck", GRAD_BUCKET_PARAMS, 10 * GRAD_BUCKET_PARAMS) is None  # recorded, equal
    # Older checkpoints record nothing: they used one bucket, today's layout for a stage that fits one.
    assert bucket_layout_error("ck", None, GRAD_BUCKET_PARAMS) is None


def test_a_different_layout_is_refused_naming_the_way_out():
    error = bucket_layout_error("ck", None, GRAD_BUCKET_PARAMS + 1)
    assert error is not None and error.startswith("checkpoint ck holds optimizer state laid out in one gradient bucket")
    assert "megarl convert megatron-to-hf" in error
    assert "buckets of 1000 parameters" in bucket_layout_error("ck", 1000, 5)  # type: ignore[operator]
