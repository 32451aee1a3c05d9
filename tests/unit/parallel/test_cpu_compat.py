"""The CUDA -> CPU redirection that lets megatron-core run without a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from megarl.parallel.cpu_compat import enable_cpu_compat, is_active_in_this_thread

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the redirection is only active without CUDA")


@pytest.fixture(scope="module", autouse=True)
def active():
    assert enable_cpu_compat() is True
    assert enable_cpu_compat() is True  # idempotent


def test_cuda_device_arguments_land_on_cpu():
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA"
    a = torch.zeros(3, device="cuda")
    b = torch.arange(4, device=torch.device("cuda", 0))
    c = torch.ones(2).cuda()
    d = torch.ones(2).to("cuda")
    e = torch.ones(2).to(device="cuda", dtype=torch.float64)
    f = torch.empty(2, device=torch.cuda.current_device())
    assert all(t.device.type == "cpu" for t in (a, b, c, d, e, f))
    assert e.dtype == torch.float64 and b.tolist() == [0, 1, 2, 3]


def test_tensor_type_answers_cuda_names_and_converts_back():
    x = torch.ones(2)
    assert x.type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    y = x.type("torch.cuda.DoubleTensor")
    assert y.dtype == torch.float64 and y.device.type == "cpu"
    assert x.type(torch.int64).dtype == torch.int64


def test_ordinary_torch_code_is_unchanged():
    x = torch.randn(4, 4, requires_grad=True)
    y = (x @ x.t()).sum()
    y.backward()
    # y = sum_k (sum_i x_ik)^2, so dy/dx_ik = 2 * sum_i x_ik
    assert torch.allclose(x.grad, 2 * x.detach().sum(0, keepdim=True).expand(4, 4))
    assert torch.ones(2, device="cpu").to(torch.float16).dtype == torch.float16
    assert torch.nn.functional.softmax(torch.zeros(3), dim=0).tolist() == pytest.approx([1 / 3] * 3)


def test_active_in_threads_started_later():
    seen: list = []

    def work():
        seen.append((is_active_in_this_thread(), torch.zeros(1, device="cuda").device.type))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [(True, "cpu")]


def test_cuda_rng_state_is_empty_and_setting_it_is_harmless():
    state = torch.cuda.get_rng_state()
    assert state.numel() == 0
    torch.cuda.set_rng_state(state)
    torch.cuda.random.set_rng_state(torch.cuda.random.get_rng_state())
    cpu_before = torch.get_rng_state()
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU generator is untouched


def test_current_stream_waits_and_records_as_no_ops():
    """megatron-core >= 0.17's DDP start_grad_sync waits on CUDA-graph events of the current
    stream; without CUDA those calls must do nothing instead of initialising CUDA."""
    stream = torch.cuda.current_stream()
    assert stream is torch.cuda.current_stream(torch.device("cuda", 0))
    event = object()
    assert stream.wait_event(event) is None and stream.wait_stream(stream) is None
    assert stream.record_event(event) is event and stream.query() is True
    stream.synchronize()


def test_side_streams_contexts_and_events_are_null():
    """Megatron's alltoall MoE dispatcher makes a side stream at build, copies on it and waits on
    its event; transformers annotates ``torch.cuda.Stream | None`` (so it must stay a class)."""
    stream = torch.cuda.Stream()
    assert isinstance(stream, torch.cuda.Stream) and torch.cuda.Stream | None
    assert torch.cuda.current_stream() != stream  # a side stream, as on a GPU
    with torch.cuda.stream(stream):
        x = torch.ones(2) + 1
    event = stream.record_event()
    event.synchronize()
    other = torch.cuda.Event(enable_timing=False)
    other.record(stream)
    assert other.query() is True and x.tolist() == [2.0, 2.0]


def test_megatron_moe_fixes():
    """0.16's router reads ``te_general_gemm`` (unbound without transformer-engine); the alltoall
    dispatcher hands ``maybe_move_tensor_to_cpu(.., as_numpy=True)``'s answer to all_to_all_single
    as split sizes, which must be numpy (as the GPU path gives) for a CPU tensor too."""
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    assert moe_utils.te_general_gemm is None or callable(moe_utils.te_general_gemm)
    splits = moe_utils.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
    counts = torch.tensor([2, 2])
    assert moe_utils.maybe_move_tensor_to_cpu(counts) is counts  # without as_numpy: unchanged
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    inp, weight = torch.randn(5, 8), torch.randn(4, 8)  # [tokens, hidden], [experts, hidden]
    logits = moe_utils.router_gating_linear(inp, weight, None, torch.float32)  # NameError on 0.16 unfixed
    torch.testing.assert_close(logits, inp @ weight.t())
