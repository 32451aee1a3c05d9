"""Vocab-parallel log-probs on one process: equal to torch's full-vocabulary log_softmax."""

import torch

from megarl.actors.megatron_runtime.logprobs import vocab_parallel_logprobs


def test_logprobs_and_entropy_match_log_softmax_with_padding_masked():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 12, requires_grad=True)
    targets = torch.randint(0, 10, (2, 5))
    # Columns 10, 11 are vocabulary padding: huge values there must not matter.
    padded = torch.cat([logits[..., :10], torch.full((2, 5, 2), 50.0)], -1)
    lp, ent = vocab_parallel_logprobs(padded, targets, temperature=0.7, vocab_size=10, with_entropy=True)
    ref_logp = torch.log_softmax(logits[..., :10] / 0.7, -1)
    ref = ref_logp.gather(-1, targets[..., None])[..., 0]
    ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
    torch.testing.assert_close(lp, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    g1 = torch.autograd.grad((lp.sum() + ent.sum()), logits)[0]
    g2 = torch.autograd.grad((ref.sum() + ref_ent.sum()), logits)[0]
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=0)
