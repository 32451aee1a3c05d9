"""The residency table against rows written out by hand from its rules (megarl/memory/residency.py)."""

from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.memory.residency import (
    CHECKPOINT,
    CRITIC_FORWARD,
    CRITIC_UPDATE,
    GENERATE,
    LAUNCH,
    PHASES,
    POLICY_FORWARD,
    POLICY_UPDATE,
    REFERENCE_FORWARD,
    REWARD,
    START,
    WEIGHT_PUSH,
    build_residency,
    residency_of,
)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
POLICY = {"policy/weights", "policy/grads", "policy/optimizer"}
CRITIC = {"critic/weights", "critic/grads", "critic/optimizer"}
REF = {"reference/weights"}
ENGINE = {"engine/weights", "engine/kv_cache", "engine/cuda_graph"}


def test_colocated_sglang_every_model_offloaded():
    table = build_residency("colocated", "sglang", critic=True, reference=True, actor_offload=True, critic_offload=True,
                            reference_offload=True)  # fmt: skip
    expected = {
        START: POLICY | CRITIC | REF,
        LAUNCH: ENGINE,
        GENERATE: ENGINE,
        POLICY_FORWARD: {"policy/weights", "engine/weights"},
        REFERENCE_FORWARD: {"reference/weights", "engine/weights"},
        CRITIC_FORWARD: {"critic/weights", "engine/weights"},
        CRITIC_UPDATE: CRITIC,
        POLICY_UPDATE: POLICY,
        WEIGHT_PUSH: {"policy/weights", "engine/weights"},
        CHECKPOINT: {"policy/weights", "policy/optimizer", "critic/weights", "critic/optimizer"},
    }
    assert table.phases == tuple(p for p in PHASES if p != REWARD)  # (no colocated reward model)
    assert {p: set(table.resident(p)) for p in table.phases} == expected
    assert "engine/weights" not in table.resident(POLICY_UPDATE)  # released: the hand-over re-pushes (no CPU copy)


def test_without_offload_flags_only_the_launch_moves_trained_states():
    table = build_residency("colocated", "sglang", critic=True, reference=True)
    for phase in table.phases:
        trained = {s for s in table.resident(phase) if not s.startswith("engine/")}
        assert trained == (set() if phase == LAUNCH else POLICY | CRITIC | REF), phase
    # the engine's side does not depend on the flags
    assert table.resident(POLICY_UPDATE) == POLICY | CRITIC | REF
    assert table.resident(GENERATE) == POLICY | CRITIC | REF | ENGINE


def test_torch_engine_keeps_its_weights_and_has_no_launch():
    table = build_residency("colocated", "torch", critic=True, actor_offload=True, critic_offload=True)
    assert LAUNCH not in table.phases and REFERENCE_FORWARD not in table.phases
    assert table.resident(GENERATE) == {"engine/weights", "engine/kv_cache"}  # critic.offload honoured too
    assert table.resident(POLICY_UPDATE) == POLICY | {"engine/weights"}
    assert table.resident(CRITIC_UPDATE) == CRITIC | {"engine/weights"}
    assert all("engine/weights" in table.resident(p) for p in table.phases)
    assert table.engine_shares_devices


def test_disaggregated_engines_keep_everything_and_the_critic_makes_room_for_the_policy():
    table = build_residency("disaggregated", "sglang", critic=True, critic_offload=True)
    assert LAUNCH not in table.phases
    assert all(ENGINE <= table.resident(p) for p in table.phases)
    assert table.resident(POLICY_UPDATE) == POLICY | ENGINE  # the critic is off the training GPUs
    assert table.resident(CRITIC_UPDATE) == POLICY | CRITIC | ENGINE  # the policy has no flag: it stays
    assert not table.engine_shares_devices and not table.on_training_devices("engine/kv_cache")
    assert table.on_training_devices("critic/grads")


def test_phases_exist_with_their_models():
    table = build_residency("colocated", "sglang")
    assert table.phases == (START, LAUNCH, GENERATE, POLICY_FORWARD, POLICY_UPDATE, WEIGHT_PUSH, CHECKPOINT)
    with pytest.raises(ValueError, match="phase 'critic_update' is not in this run's residency table"):
        table.resident(CRITIC_UPDATE)


def test_residency_of_the_72b_config():
    table = residency_of(load_config(CONFIGS / "qwen72b_grpo.yaml", []))  # actor and reference offloaded, no critic
    assert table.models == ("policy", "reference") and table.offloaded == {"policy", "reference"}
    assert table.resident(GENERATE) == ENGINE
    assert table.resident(REFERENCE_FORWARD) == REF | {"engine/weights"}
    lines = table.text().splitlines()
    assert lines[0].split() == ["policy/weights", "policy/grads", "policy/optimizer", "reference/weights",
                                "engine/weights", "engine/kv_cache", "engine/cuda_graph"]  # fmt: skip
    assert lines[3].split() == ["generate", "-", "-", "-", "-", "x", "x", "x"]


def test_with_lora_the_policy_gives_the_reference_log_probs():
    """actor.lora: no reference model to place or offload; reference_forward stays, and is the
    policy's forward (adapters off), so an offloaded policy keeps its weights there."""
    cfg = load_config(CONFIGS / "qwen72b_grpo.yaml", ["actor.lora={rank: 8}"])
    table = residency_of(cfg)
    assert table.models == ("policy",) and table.offloaded == {"policy"}
    assert REFERENCE_FORWARD in table.phases and table.policy_is_reference
    assert table.resident(REFERENCE_FORWARD) == {"policy/weights", "engine/weights"}
    assert table.needs(REFERENCE_FORWARD) == table.needs(POLICY_FORWARD)
    # without the KL's reference there is no such phase, LoRA or not
    plain = residency_of(load_config(CONFIGS / "qwen72b_grpo.yaml", ["actor.lora={rank: 8}", "algorithm.kl.use_in_loss=false"]))
    assert REFERENCE_FORWARD not in plain.phases


class _Client:
    """A trained model's client that records what the hand-over moves."""

    def __init__(self) -> None:
        self.moves: list[tuple[str, list[str]]] = []

    def offload(self, states):
        self.moves.append(("offload", list(states)))

    def onload(self, states):
        self.moves.append(("onload", list(states)))


def test_sft_export_keeps_only_the_policy_weights():
    """`megarl sft` writes its model and loads a second copy to verify it: gradients and optimizer
    state leave the devices first, through the hand-over like every other move."""
    from megarl.memory.handover import Handover
    from megarl.memory.residency import EXPORT, sft_residency

    table = sft_residency()
    assert table.phases == ("start", "export")
    assert table.resident("export") == {"policy/weights"}
    client = _Client()
    Handover(table, {"policy": client}).enter(EXPORT)
    assert client.moves == [("offload", ["policy/grads", "policy/optimizer"])]


def test_a_colocated_reward_model_is_on_the_devices_for_its_scoring_phase_only():
    table = build_residency("colocated", "sglang", reference=True, actor_offload=True, reward_model=True)
    assert table.phases[:5] == (START, LAUNCH, GENERATE, REWARD, POLICY_FORWARD)
    assert {p for p in table.phases if "reward_model/weights" in table.resident(p)} == {REWARD}
    # the offloaded policy keeps nothing while it scores, the reference (not offloaded) everything,
    # SGLang its weights as in a forward phase
    assert table.resident(REWARD) == {"reward_model/weights", "engine/weights"} | REF
    assert table.on_training_devices("reward_model/weights")
    torch = build_residency("colocated", "torch", reward_model=True)
    assert torch.resident(REWARD) == POLICY | {"reward_model/weights", "engine/weights"}
    cfg = load_config(CONFIGS / "tiny_grpo.yaml", ["reward.model.path=/rm", "reward.model.placement=colocated"])
    assert REWARD in residency_of(cfg).phases and REWARD not in residency_of(load_config(CONFIGS / "tiny_grpo.yaml")).phases
