"""The memory model against hand-computed figures."""

import pytest

from megarl.config.architectures import BUILTIN_ARCHS, ArchSpec
from megarl.plan.gpu_memory import (
    SGLANG_CONTEXT_GIB,
    SGLANG_GRAPHS_GIB,
    TRAINER_RUNTIME_GIB,
    activation_bytes_per_token,
    kv_bytes_per_token,
    largest_hf_tensor_bytes,
    moe_activation_bytes_per_token,
    phase_working_bytes,
    rollout_memory,
    runtime_memory,
    sglang_free_at_launch,
    stage_param_split,
    torch_engine_memory,
    train_memory,
)
from megarl.plan.host_memory import save_gather_host_bytes


# Published parameter counts (config.json shapes), to 0.5 %.
@pytest.mark.parametrize(("name", "billions"), [("qwen2.5-7b", 7.62), ("qwen2.5-72b", 72.7), ("qwen3-8b", 8.19), ("llama-3-8b", 8.03), ("llama-3-70b", 70.55)])
def test_param_counts_match_published(name, billions):
    assert BUILTIN_ARCHS[name].num_params / 1e9 == pytest.approx(billions, rel=5e-3)


def test_train_memory_by_hand():
    # A small llama-like model, numbers worked out on paper.
    arch = ArchSpec("hand", "llama", hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096,
                    vocab_size=1000, max_positions=4096, tie_embeddings=False)
    layer = 4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024  # attention + SwiGLU + 2 norms = 16_779_264
    assert arch.layer_params == layer
    # pp=2: the heaviest stage has 2 layers + the output layer and final norm (1000*1024 + 1024)
    stage = 2 * layer + 1000 * 1024 + 1024
    assert stage_param_split(arch, 2) == [(2 * layer + 1000 * 1024, 0), (stage, 0)]  # (non-expert, expert); the embedding first
    m = train_memory(arch, tp=2, pp=2, dp=4, tokens_per_micro_batch=2048, dtype="bfloat16", recompute="none",
                     sequence_parallel=False, distributed_optimizer=True)
    assert m.weights == 2 * stage / 2
    assert m.grads == 4 * stage / 2
    assert m.optimizer == 12 * stage / 2 / 4
    # per token per layer: sharded (3*1024 + 1024 + 3*4096) / 2 + replicated 4*1024, times 2 bytes
    per_token = 2 * ((3 * 1024 + 1024 + 3 * 4096) / 2 + 4 * 1024)
    assert activation_bytes_per_token(arch, 2, False) == per_token
    assert m.activations == 2048 * 4 * per_token
    # The LM head: four fp32 buffers of one 1024-token chunk of vocab / tp columns, and the
    # output layer's gradient (vocab / tp x hidden) summed in fp32 over the two chunks, then cast.
    assert m.logits == 4 * 4 * 1024 * 1000 / 2
    assert m.head_grad == (4 + 2) * 1000 / 2 * 1024  # the fp32 sum and its bf16 cast
    assert m.peak == m.states + m.activations + m.logits + m.head_grad
    small = train_memory(arch, tp=2, pp=2, dp=4, tokens_per_micro_batch=100, dtype="bfloat16", recompute="none",
                         sequence_parallel=False, distributed_optimizer=True, logprob_chunk_tokens=256)  # fmt: skip
    assert small.logits == 4 * 4 * 100 * 1000 / 2  # a micro-batch smaller than the chunk
    assert small.head_grad == 2 * 1000 / 2 * 1024  # one chunk: the gradient in the weights' dtype
    assert train_memory(arch, tp=2, pp=2, dp=4, tokens_per_micro_batch=2048, dtype="bfloat16", recompute="none",
                        sequence_parallel=False, distributed_optimizer=True, trainable=False).head_grad == 0  # fmt: skip
    full = train_memory(arch, tp=2, pp=2, dp=4, tokens_per_micro_batch=2048, dtype="bfloat16", recompute="full",
                        sequence_parallel=False, distributed_optimizer=True)
    assert full.activations == 2048 * 4 * 1024 * 2 + 2048 * per_token


def test_rollout_memory_by_hand():
    arch = BUILTIN_ARCHS["qwen2.5-7b"]  # 28 layers, 4 kv heads of 128
    gib = 1024**3
    r = rollout_memory(arch, tp=2, free_bytes=80 * gib, mem_fraction=0.5, dtype="bfloat16", seq_len=4096)
    assert r.weights == 2 * arch.num_params / 2
    assert r.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2
    assert r.full_length_sequences == int((40 * gib - r.weights) // (r.kv_bytes_per_token * 4096))
    # tp 8 > 4 kv heads: SGLang replicates, one kv head per rank
    assert rollout_memory(arch, tp=8, free_bytes=80 * gib, mem_fraction=0.5, dtype="bfloat16", seq_len=4096).kv_bytes_per_token == 2 * 28 * 1 * 128 * 2


def test_sglang_sizes_its_kv_cache_from_the_memory_it_sees_free_at_launch():
    """SGLang takes mem_fraction of what is free after its own CUDA context and NCCL exist and,
    colocated, beside the trainer's process; its CUDA graphs come on top, outside mem_fraction."""
    gib = 1024**3
    assert (TRAINER_RUNTIME_GIB, SGLANG_CONTEXT_GIB, SGLANG_GRAPHS_GIB) == (3.0, 1.5, 2.5)  # the estimates the docs state
    assert sglang_free_at_launch(80 * gib, colocated=True) == (80 - 1.5 - 3.0) * gib
    assert sglang_free_at_launch(80 * gib, colocated=False) == (80 - 1.5) * gib  # the engines' own GPUs
    both = runtime_memory(trainer=True, sglang=True)
    assert (both.trainer, both.sglang_context, both.sglang_graphs, both.sglang) == (3 * gib, 1.5 * gib, 2.5 * gib, 4 * gib)
    assert runtime_memory(trainer=True, sglang=False).sglang == 0


def test_fp32_weights_are_their_own_master_copy():
    """Megatron's optimizer steps fp32 params in place: Adam's two moments only (8 B), and before
    the first step nothing; bf16 keeps an fp32 master copy (4 B) from the start."""
    arch = BUILTIN_ARCHS["tiny-demo"]
    kw = dict(tp=1, pp=1, dp=2, tokens_per_micro_batch=64, recompute="none", sequence_parallel=False, distributed_optimizer=True)
    [(params, _)] = stage_param_split(arch, 1)
    fp32, bf16 = train_memory(arch, dtype="float32", **kw), train_memory(arch, dtype="bfloat16", **kw)
    assert (fp32.weights, fp32.grads, fp32.optimizer, fp32.optimizer_at_build) == (4 * params, 4 * params, 8 * params / 2, 0)
    assert (bf16.weights, bf16.grads, bf16.optimizer, bf16.optimizer_at_build) == (2 * params, 4 * params, 12 * params / 2, 4 * params / 2)


def test_torch_engine_memory_and_phase_working_memory_by_hand():
    arch = BUILTIN_ARCHS["qwen2.5-7b"]  # 28 layers, 4 kv heads of 128
    weights, kv = torch_engine_memory(arch, dtype="bfloat16", max_running_requests=8, seq_len=1000)
    assert weights == 2 * arch.num_params and kv == 8 * 1000 * (2 * 28 * 4 * 128 * 2)
    m = train_memory(arch, tp=2, pp=1, dp=4, tokens_per_micro_batch=2048, dtype="bfloat16", recompute="full",
                     sequence_parallel=False, distributed_optimizer=True)  # fmt: skip
    largest = largest_hf_tensor_bytes(arch, "bfloat16")
    assert largest == 2 * 152064 * 3584  # the embedding (vocab x hidden) outweighs any projection
    working = phase_working_bytes(m, None, 512 * 1024**2, largest)  # the gather group: the embedding alone
    assert working == {"weight_push": 512 * 1024**2 + 2 * largest, "policy_forward": m.logits,
                       "reference_forward": m.logits, "policy_update": m.activations + m.logits + m.head_grad}  # fmt: skip
    # actor.logprob_*: the forward passes' head holds its own micro-batch (a chunk at most), the update's is unchanged
    small = train_memory(arch, tp=2, pp=1, dp=4, tokens_per_micro_batch=512, dtype="bfloat16", recompute="full",
                         sequence_parallel=False, distributed_optimizer=True, forward_tokens_per_micro_batch=256)  # fmt: skip
    assert small.forward_working == 4 * 4 * 256 * arch.vocab_size / 2 == small.logits / 2
    assert phase_working_bytes(small, None, 0, 0)["policy_forward"] == small.forward_working
    assert small.update_working == small.activations + small.logits + small.head_grad


def _hand_moe(**kw) -> ArchSpec:
    return ArchSpec("hand-moe", "qwen3_moe", hidden_size=1024, num_layers=4, num_heads=8, num_kv_heads=8, ffn_hidden_size=4096,
                    vocab_size=1000, max_positions=4096, tie_embeddings=False, num_experts=8, experts_per_token=2,
                    moe_ffn_hidden_size=512, **kw)  # fmt: skip


def test_moe_train_memory_by_hand():
    """Dense params split over tp, experts over ep; the distributed optimizer shards the dense
    state over dp and the experts' over the expert-data-parallel size tp x dp / ep."""
    arch = _hand_moe()
    attention = 4 * 1024 * 1024 + 2 * 128 + 2 * 1024  # q, k, v, o + q/k norms + two RMSNorms = 4_196_608
    assert arch.moe_layer_params == (attention + 8 * 1024, 8 * 3 * 1024 * 512)  # + the router; 8 experts
    # pp=2: the last stage is the heavier (2 layers + output layer 1000 x 1024 + final norm)
    dense, experts = 2 * (attention + 8 * 1024) + 1000 * 1024 + 1024, 2 * 8 * 3 * 1024 * 512
    m = train_memory(arch, tp=2, pp=2, dp=4, ep=4, tokens_per_micro_batch=2048, dtype="bfloat16", recompute="none",
                     sequence_parallel=True, distributed_optimizer=True)  # fmt: skip
    per_gpu = dense / 2 + experts / 4  # 4_717_312 + 6_291_456
    assert m.weights == 2 * per_gpu and m.grads == 4 * per_gpu
    assert m.optimizer == 12 * (dense / 2 / 4 + experts / 4 / 2)  # dp 4; expert dp = 2 x 4 / 4 = 2
    # per token per MoE layer: the attention block (sharded q, k, v, o and, under sp, 4 hidden / tp),
    # then for the 1/tp tokens this rank routes: fp32 router logits and probs (8 experts each),
    # the dispatcher's permuted in and out (top-2 x hidden each) and the experts' fc1 + activation (2 x 3 x 512)
    attn = 2 * ((1024 + 2 * 1024 + 1024) / 2 + 4 * 1024 / 2)
    routed = (4 * 8 * 2 + 2 * (2 * 2 * 1024 + 3 * 2 * 512)) / 2
    assert moe_activation_bytes_per_token(arch, 2, True) == attn + routed == 8192 + 7200
    assert m.activations == 2048 * 4 * (attn + routed)
    full = train_memory(arch, tp=2, pp=2, dp=4, ep=4, tokens_per_micro_batch=2048, dtype="bfloat16", recompute="full",
                        sequence_parallel=True, distributed_optimizer=True)  # fmt: skip
    assert full.activations == 2048 * 4 * 1024 * 2 / 2 + 2048 * (attn + routed)
    assert save_gather_host_bytes(arch, tp=2, pp=2, ep=4) == 12 * per_gpu  # a fully_reshardable save's fp32 state


def test_moe_model_with_dense_layers_adds_each_kind():
    arch = _hand_moe(dense_layers=(0,))  # layer 0 has a dense MLP of ffn_hidden_size
    assert arch.num_moe_layers == 3
    dense, moe = activation_bytes_per_token(arch, 1, False), moe_activation_bytes_per_token(arch, 1, False)
    m = train_memory(arch, tp=1, pp=1, dp=8, ep=8, tokens_per_micro_batch=100, dtype="bfloat16", recompute="none",
                     sequence_parallel=False, distributed_optimizer=False)  # fmt: skip
    assert m.activations == 100 * (dense + 3 * moe)
    non_expert = arch.layer_params + 3 * arch.moe_layer_params[0] + 2 * 1000 * 1024 + 1024
    assert m.weights == 2 * (non_expert + 3 * 8 * 3 * 1024 * 512 / 8)  # one expert of each MoE layer per GPU
    assert m.optimizer == 12 * m.weights / 2  # not distributed: the whole state on every rank


def test_mla_kv_cache_is_the_latent_and_rope_key_per_layer_whole_on_every_tp_rank():
    arch = BUILTIN_ARCHS["deepseek-v3"]
    for tp in (1, 8):  # SGLang's MLA pool is not split over TP
        assert kv_bytes_per_token(arch, tp, "bfloat16") == 61 * (512 + 64) * 2 == 70_272
    r = rollout_memory(arch, tp=8, free_bytes=260 * 2**30, mem_fraction=0.8, dtype="bfloat16", seq_len=9216)
    assert r.weights == 2 * arch.num_params / 8
    assert r.full_length_sequences == int((0.8 * 260 * 2**30 - r.weights) // (70_272 * 9216))
    # the largest tensor a push holds: the LM head [129280, 7168] (q up is [24576, 1536], output [7168, 16384])
    assert largest_hf_tensor_bytes(arch, "bfloat16") == 2 * 129280 * 7168


def test_shared_experts_follow_tp_and_dense_first_layers_their_own_width():
    """DeepSeek-V3's shape in small: layer 0 dense (ffn 1024), layers 1-3 MoE with 8 routed experts
    (ep-split) and 2 shared (a TP-split SwiGLU of 2 x 512), MLA attention."""
    arch = ArchSpec("hand-dsv3", "deepseek_v3", 256, 4, 4, 4, 1024, 1000, 4096, False, num_experts=8,
                    experts_per_token=2, moe_ffn_hidden_size=512, dense_layers=(0,), num_shared_experts=2,
                    router_bias=True, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16)  # fmt: skip
    mla = 256 * 64 + 64 + 64 * 4 * 24 + 256 * (32 + 8) + 32 + 32 * 4 * (16 + 16) + 4 * 16 * 256
    assert arch.attention_params == mla + 2 * 256
    expert = 3 * 256 * 512
    dense_part = mla + 2 * 256 + 8 * 257 + 2 * expert  # router, bias, shared experts
    assert arch.moe_layer_params == (dense_part, 8 * expert)
    m = train_memory(arch, tp=2, pp=1, dp=4, ep=8, tokens_per_micro_batch=100, dtype="bfloat16", recompute="none",
                     sequence_parallel=True, distributed_optimizer=False)  # fmt: skip
    non_expert = (mla + 2 * 256 + 3 * 256 * 1024) + 3 * dense_part + 2 * 1000 * 256 + 256
    assert m.weights == 2 * (non_expert / 2 + 3 * 8 * expert / 8)
    # per token: MLA's q, k (per head), v, output over tp, its latents whole; the shared experts' fc1 + act over tp
    attn = 2 * ((4 * 24 + 4 * 24 + 4 * 16 + 4 * 16) / 2 + 4 * 256 / 2 + 64 + 32 + 8)
    routed = (8 * 8 + 2 * (2 * 2 * 256 + 3 * 2 * 512)) / 2
    assert moe_activation_bytes_per_token(arch, 2, True) == attn + routed + 2 * 3 * 2 * 512 / 2
    assert m.activations == 100 * (activation_bytes_per_token(arch, 2, True) + 3 * moe_activation_bytes_per_token(arch, 2, True))
