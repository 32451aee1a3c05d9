"""Every config section forbids unknown keys, is frozen, and documents every field."""

import pydantic
import pytest

from megarl.config.section_base import Section
from megarl.config.sections import MegaRLConfig


def _all_sections() -> list[type[Section]]:
    """Every section class of megarl's config modules (MegaRLConfig imports them all), however
    the tree is split into modules."""
    found, todo = [], list(Section.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("megarl.config.") and cls not in found:
            found.append(cls)
    return sorted(found, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _all_sections(), ids=lambda c: c.__name__)
def test_every_field_has_a_description(cls):
    missing = [name for name, f in cls.model_fields.items() if not f.description]
    assert not missing, f"{cls.__name__} fields without description: {missing}"


def test_frozen_and_forbidding_extra():
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"})
    with pytest.raises(pydantic.ValidationError):
        cfg.rollout.n = 3  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        MegaRLConfig(model={"arch": "qwen3-8b"}, rolout={})


def test_derived_roles():
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"})
    assert not cfg.reference_enabled and not cfg.critic_enabled
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"}, algorithm={"estimator": "gae", "kl": {"use_in_reward": True}})
    assert cfg.reference_enabled and cfg.critic_enabled
    cfg = MegaRLConfig(model={"arch": "qwen3-8b"}, reference={"enabled": False}, algorithm={"kl": {"use_in_loss": True}})
    assert not cfg.reference_enabled


def test_a_checkpoint_format_needs_the_distributed_optimizer():
    from megarl.config.train_sections import OptimizerConfig

    assert OptimizerConfig(checkpoint_format="fully_reshardable").distributed  # the default optimizer takes it
    with pytest.raises(pydantic.ValidationError, match="checkpoint_format=fully_reshardable lays out the distributed"):
        OptimizerConfig(distributed=False, checkpoint_format="fully_reshardable")


def test_lora_target_modules_takes_a_plain_string_as_peft_does():
    # `actor.lora.target_modules=q_proj` was refused with pydantic's "Input should be a valid list"
    from pathlib import Path

    from megarl.config.loading import load_config

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
    assert load_config(tiny, ["actor.lora.target_modules=q_proj"]).actor.lora.target_modules == ["q_proj"]
    lora = load_config(tiny, ["actor.lora.target_modules=all-linear"]).actor.lora
    assert lora.target_modules == ["all-linear"] and len(lora.modules) == 7
    assert load_config(tiny, ["actor.lora={target_modules: v_proj}"]).actor.lora.modules == ("v_proj",)
    with pytest.raises(Exception, match="not module names LoRA can target"):
        load_config(tiny, ["actor.lora.target_modules=qkv"])


def test_an_empty_lora_section_turns_lora_on_with_its_defaults():
    from pathlib import Path

    from megarl.config.loading import load_config

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"
    lora = load_config(tiny, ["actor.lora={}"]).actor.lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ["all-linear"])
    assert load_config(tiny, ["actor.lora={}", "actor.lora=null"]).actor.lora is None


def test_every_section_of_the_key_tree_is_importable_from_sections():
    """User extensions import the section classes from megarl.config.sections (docs/extending.md),
    wherever they are defined."""
    import typing

    from pydantic import BaseModel

    from megarl.config import sections

    seen, todo = set(), [sections.MegaRLConfig]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            for arg in [field.annotation, *typing.get_args(field.annotation)]:
                for inner in [arg, *typing.get_args(arg)]:
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        todo.append(inner)
    missing = sorted(m.__name__ for m in seen if getattr(sections, m.__name__, None) is not m or m.__name__ not in sections.__all__)
    assert not missing and len(seen) > 20, missing
