"""The chunked log-prob head on one process: equal to torch's full-vocabulary log_softmax of
``hidden @ W^T``, in values and gradients, whatever the chunk; no tensor grows with tokens x
vocabulary."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.megatron_runtime.logprobs import linear_logprobs

N, H, V, REAL, T = 37, 16, 12, 10, 0.7  # columns 10, 11 are vocabulary padding


def _inputs(dtype=torch.float32, n=N, v=V):
    gen = torch.Generator().manual_seed(0)
    hidden = (0.5 * torch.randn(n, H, generator=gen)).to(dtype).requires_grad_()
    weight = torch.randn(v, H, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, min(REAL, v), (n,), generator=gen)
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    """Plain torch over the whole vocabulary, padding columns cut off, in fp32."""
    logp = torch.log_softmax((hidden @ weight.t()).float()[:, :REAL] / T, dim=-1)  # [N, REAL]
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _run(hidden, weight, targets, chunk):
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=T, vocab_size=REAL, chunk_tokens=chunk, with_entropy=True)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    grads = torch.autograd.grad((lp * a).sum() + (ent * b).sum(), [hidden, weight])
    return (lp, ent, *grads), (a, b)


@pytest.mark.parametrize("chunk", [1, 5, N, 100])
def test_values_and_gradients_equal_full_log_softmax_with_padding_masked(chunk):
    hidden, weight, targets = _inputs()
    # Huge logits at the padding columns must not matter.
    with torch.no_grad():
        weight[REAL:] = 40.0
    ours, (a, b) = _run(hidden, weight, targets, chunk)
    ref_lp, ref_ent = _reference(hidden, weight, targets)
    ref_grads = torch.autograd.grad((ref_lp * a).sum() + (ref_ent * b).sum(), [hidden, weight])
    for got, want in zip(ours, (ref_lp, ref_ent, *ref_grads)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert ours[3][REAL:].abs().max() == 0  # padding rows of the weight get no gradient


def test_chunked_equals_one_chunk():
    hidden, weight, targets = _inputs()
    whole, _ = _run(hidden, weight, targets, N)
    for chunk in (1, 4):
        parts, _ = _run(hidden, weight, targets, chunk)
        for got, want in zip(parts[:2], whole[:2]):  # log-probs, entropy
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        for got, want in zip(parts[2:], whole[2:]):  # gradients: summed in another order
            assert (got - want).norm() <= 1e-5 * want.norm()


def test_bf16_follows_the_bf16_logits_and_keeps_the_dtype():
    hidden, weight, targets = _inputs(torch.bfloat16)
    (lp, ent, g_hidden, g_weight), _ = _run(hidden, weight, targets, 8)
    ref_lp, ref_ent = _reference(hidden, weight, targets)  # the same bf16 matmul, then fp32
    assert lp.dtype == ent.dtype == torch.float32
    assert g_hidden.dtype == g_weight.dtype == torch.bfloat16
    torch.testing.assert_close(lp, ref_lp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent.detach(), atol=1e-5, rtol=0)


def test_without_entropy_and_gradient_of_logprobs_only():
    hidden, weight, targets = _inputs()
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=T, vocab_size=REAL, chunk_tokens=3)
    assert ent is None
    g = torch.autograd.grad(lp.sum(), hidden)[0]
    ref = torch.autograd.grad(_reference(hidden, weight, targets)[0].sum(), hidden)[0]
    torch.testing.assert_close(g, ref, atol=1e-6, rtol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the most elements any single op produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_grows_with_tokens_times_vocabulary():
    n, v, chunk = 256, 512, 8  # tokens x vocab = 131072; chunk x vocab = 4096; weight 8192
    hidden, weight, targets = _inputs(n=n, v=v)
    with _LargestTensor() as mode:
        lp, ent = linear_logprobs(hidden, weight, targets, chunk_tokens=chunk, with_entropy=True)
        torch.autograd.grad(lp.sum() + ent.sum(), [hidden, weight])
    assert mode.largest <= max(chunk * v, v * H, n * H), mode.largest


def test_refuses_bad_arguments():
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        linear_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        linear_logprobs(hidden, weight, targets, chunk_tokens=0)


def test_an_unused_entropy_or_log_prob_takes_no_part_in_the_gradient():
    hidden, weight, targets = _inputs()
    lp, ent = linear_logprobs(hidden, weight, targets, temperature=T, vocab_size=REAL, chunk_tokens=4, with_entropy=True)
    ref_lp, ref_ent = _reference(hidden, weight, targets)
    for ours, ref in ((lp, ref_lp), (ent, ref_ent)):  # the other output is left unused
        got = torch.autograd.grad(ours.sum(), [hidden, weight], retain_graph=True)
        want = torch.autograd.grad(ref.sum(), [hidden, weight], retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
