"""model.layer_spec: which modules a layer is built from, and the one-line refusals.

transformer-engine is not installed on the CPU machines that run this: ``auto`` must fall back
to the local spec there, and ``te`` must be refused naming the field and the fix."""

from pathlib import Path

import pytest

from megarl.config.loading import load_config
from megarl.models.layer_specs import resolve_layer_spec, te_importable
from megarl.plan.planner import PlanError, make_plan


def test_local_is_local_everywhere_and_auto_is_local_off_cuda():
    assert resolve_layer_spec("local", "cuda") == "local"
    assert resolve_layer_spec("local", "cpu") == "local"
    assert resolve_layer_spec("auto", "cpu") == "local"


def test_te_is_refused_on_cpu_with_the_fix():
    with pytest.raises(ValueError, match=r"model.layer_spec \(te\) needs CUDA.*use auto or local"):
        resolve_layer_spec("te", "cpu")


@pytest.mark.skipif(te_importable(), reason="transformer-engine is installed here")
def test_without_transformer_engine_auto_falls_back_and_te_says_how_to_install():
    assert resolve_layer_spec("auto", "cuda") == "local"
    with pytest.raises(ValueError, match=r"needs transformer-engine.*pip install 'transformer-engine\[pytorch\]'"):
        resolve_layer_spec("te", "cuda")


def test_the_plan_refuses_te_on_a_cpu_cluster():
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml", ["model.layer_spec=te"])
    with pytest.raises(PlanError, match=r"model.layer_spec: \(te\) needs CUDA and cluster.device is cpu"):
        make_plan(cfg)
