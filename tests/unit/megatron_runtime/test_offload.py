"""Moving a model's states off the device and back (on CPU storages: the same code as on CUDA,
without the pinning and the empty_cache): views keep their data, storages are really freed,
grads come back zeroed, each state's bytes live in one exact-size host buffer."""

import pytest
import torch

from megarl.megatron_runtime.offload import (
    ALIGN,
    ModelStates,
    model_grads,
    model_weights,
    optimizer_tensors,
    storage_bytes,
)


def adam_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A module after one real Adam step: grads and both moments exist."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(module.parameters(), lr=0.1)
    module(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    return module, opt


def states_of(module, opt) -> ModelStates:
    return ModelStates(torch.device("cpu"), {"weights": lambda: model_weights(module), "grads": lambda: model_grads(module),
                                             "optimizer": lambda: optimizer_tensors(opt)}, copied=("weights", "optimizer"))  # fmt: skip


def test_each_storage_belongs_to_the_first_state_that_names_it():
    module, opt = adam_model()
    params = sum(p.numel() for p in module.parameters())  # 8*16+16 + 16*4+4 = 212
    states = states_of(module, opt)
    # The optimizer's params are the weights themselves (like fp32 main params): counted once,
    # as weights; the optimizer holds Adam's two moments (the 0-dim step counters are not state).
    assert states.device_bytes() == {"weights": 4 * params, "grads": 4 * params, "optimizer": 8 * params}


def test_round_trip_frees_and_restores_every_view():
    module, opt = adam_model()
    weights = [p.detach().clone() for p in module.parameters()]
    moments = [opt.state[p]["exp_avg_sq"].clone() for p in module.parameters()]
    states = states_of(module, opt)
    freed = states.offload(["weights", "optimizer"])
    assert freed == 4 * 212 + 8 * 212
    assert states.device_bytes() == {"weights": 0, "grads": 4 * 212, "optimizer": 0}
    assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
    assert states.offload(["weights"]) == 0  # already off: nothing moves
    states.onload(["weights", "optimizer"])
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights))
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], m) for p, m in zip(module.parameters(), moments))
    opt.step()  # the optimizer still steps the module's own params
    assert not torch.equal(next(module.parameters()), weights[0])


def test_views_of_one_storage_move_together():
    buffer = torch.arange(12, dtype=torch.float32)  # like Megatron's contiguous param buffer
    a, b = buffer[:4].view(2, 2), buffer[4:]
    states = ModelStates(torch.device("cpu"), {"weights": lambda: [a, b]}, copied=("weights",))
    assert states.offload(["weights"]) == 48 and buffer.untyped_storage().nbytes() == 0
    states.onload(["weights"])
    assert torch.equal(buffer, torch.arange(12, dtype=torch.float32))
    a.add_(1)
    assert buffer[0] == 1.0


def test_grads_are_freed_without_a_copy_and_come_back_zeroed():
    module, opt = adam_model()
    states = states_of(module, opt)
    assert states.offload(["grads"]) == 4 * 212
    assert states.movers["grads"].host.data is None  # no host copy was made
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in module.parameters())
    states.onload(["grads"])
    assert all(p.grad.shape == p.shape and not p.grad.any() for p in module.parameters())


def test_one_exact_host_buffer_per_state_reused_by_the_next_offload():
    module, opt = adam_model()
    states = states_of(module, opt)
    states.offload(["optimizer"])
    host = states.movers["optimizer"].host.data
    # 8 storages (two moments of 4 params), each copy starting at an ALIGN boundary: no rounding
    # of the whole to a power of two.
    sizes = sorted(opt.state[p][k].untyped_storage().nbytes() for p in module.parameters() for k in ("exp_avg", "exp_avg_sq"))
    assert sizes == [0] * 8
    expected = sum(-(-4 * p.numel() // ALIGN) * ALIGN for p in module.parameters()) * 2
    assert host.numel() == expected
    states.onload(["optimizer"])
    states.offload(["optimizer"])
    assert states.movers["optimizer"].host.data.data_ptr() == host.data_ptr()


def test_unknown_state_is_refused():
    module, opt = adam_model()
    with pytest.raises(ValueError, match="unknown model states \\['kv_cache'\\]"):
        states_of(module, opt).offload(["kv_cache"])


def test_storage_bytes_counts_shared_storage_once():
    t = torch.zeros(10)
    assert storage_bytes([t, t[2:], torch.zeros(3)]) == 40 + 12


@pytest.fixture
def copied(monkeypatch) -> list[int]:
    """The bytes of every ``copy_`` (an offload's into its host buffer, an onload's back)."""
    sizes: list[int] = []
    real_copy = torch.Tensor.copy_
    depth = [0]

    def counting(self, src, *args, **kwargs):
        # once per copy: a torch function mode left on by an earlier test in this process (the CPU
        # compatibility mode of megarl/parallel/cpu_compat.py) calls the patched method again
        if not depth[0]:
            sizes.append(self.numel() * self.element_size())
        depth[0] += 1
        try:
            return real_copy(self, src, *args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    return sizes


def test_a_frozen_state_is_copied_to_the_host_once(copied):
    """The reference's weights never change: the first offload copies them to the host, later
    offloads only free the device memory, and every onload brings back the exact values."""
    module, _ = adam_model()
    weights = [p.detach().clone() for p in module.parameters()]
    states = ModelStates(torch.device("cpu"), {"weights": lambda: model_weights(module)}, copied=("weights",),
                         frozen=("weights",))  # fmt: skip
    mover = states.movers["weights"]
    assert states.offload(["weights"]) == 4 * 212 and sum(copied) == 4 * 212
    host = mover.host.data
    states.onload(["weights"])
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights))
    for _ in range(2):
        copied.clear()
        assert states.offload(["weights"]) == 4 * 212  # freed all the same
        assert copied == []  # no device-to-host copy
        assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
        states.onload(["weights"])
        assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights))
    assert mover.host.data.data_ptr() == host.data_ptr()  # the one host copy, kept


def test_trained_states_are_copied_at_every_offload(copied):
    module, opt = adam_model()
    states = states_of(module, opt)
    for _ in range(2):
        copied.clear()
        states.offload(["weights"])
        assert sum(copied) == 4 * 212  # trained: its values change between offloads
        states.onload(["weights"])
    with pytest.raises(ValueError, match="frozen states \\['grads'\\] must be copied states too"):
        ModelStates(torch.device("cpu"), {"grads": lambda: model_grads(module)}, copied=(), frozen=("grads",))
