"""The loss normaliser counts of a mini-batch: rounded on the device, checked with one host read."""

import pytest
import torch

from megarl.megatron_runtime.model import WholeCounts


def test_loss_counts_are_rounded_on_the_device_and_checked_once():
    counts = WholeCounts(torch.device("cpu"))
    assert counts.as_int(torch.tensor(7.0)).item() == 7 and counts.as_int(3).dtype == torch.int
    counts.check()  # whole numbers pass
    counts.as_int(torch.tensor(2.5))
    with pytest.raises(ValueError, match="normaliser_count must be a whole number.*0.5 away"):
        counts.check()
