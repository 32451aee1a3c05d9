"""How long the ranks may take to build their models: cluster.build_timeout_s (a 72B model read
from a slow shared filesystem takes longer than the 600 s that were fixed), passed to every
worker group of `megarl launch` and `megarl sft`, and named by the timeout's error."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("ray")

from megarl.config.loading import load_config  # noqa: E402
from megarl.config.sections import BUILD_TIMEOUT_S, ClusterConfig  # noqa: E402
from megarl.ray_cluster.worker_group import CallTimeout, GroupOptions, build_timeout_error  # noqa: E402

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_the_default_is_documented_and_0_means_no_deadline():
    assert ClusterConfig().build_timeout_s == BUILD_TIMEOUT_S == GroupOptions().init_timeout_s == 1800.0
    assert "0 = no deadline" in ClusterConfig.model_fields["build_timeout_s"].description
    assert ClusterConfig(build_timeout_s=0).build_timeout_s == 0
    with pytest.raises(ValueError, match="build_timeout_s"):
        ClusterConfig(build_timeout_s=-1)


def test_a_runs_worker_groups_take_the_configured_build_timeout(tmp_path):
    """launch and sft build their groups' options from the run's cluster section."""
    cfg = load_config(CONFIG, ["cluster.build_timeout_s=5400"])
    options = GroupOptions.of_run(cfg.cluster, tmp_path, {"X": "1"})
    assert (options.init_timeout_s, options.init_timeout_key) == (5400.0, "cluster.build_timeout_s")
    assert (options.log_dir, options.env) == (tmp_path, {"X": "1"})
    assert GroupOptions.of_run(load_config(CONFIG, ["cluster.build_timeout_s=0"]).cluster, tmp_path).init_timeout_s == 0


def test_a_build_past_the_deadline_names_the_key_its_value_and_the_fix():
    err = CallTimeout("policy: PolicyRank.__init__ did not finish within 1800 s on rank(s) [3]; logs: /run/logs",
                      "policy", [3])  # fmt: skip
    out = build_timeout_error(err, GroupOptions(init_timeout_s=1800.0, init_timeout_key="cluster.build_timeout_s"))
    assert isinstance(out, CallTimeout) and out.waiting == [3] and out.role == "policy"
    assert str(out) == ("policy: PolicyRank.__init__ did not finish within 1800 s on rank(s) [3]; logs: /run/logs; "
                        "raise cluster.build_timeout_s (1800) if the ranks are only slow to start or build their models "
                        "(a large checkpoint on a slow filesystem), or set it to 0 for no deadline")  # fmt: skip
    assert build_timeout_error(err, GroupOptions()) is err  # no key to name (a group of megarl convert)
