"""``~`` in a config path means the home directory, whichever way the value arrives (YAML file,
override, a section built in Python); other strings are kept as written."""

import re

import pytest
from pydantic import BaseModel

from megarl.config.documentation import describe
from megarl.config.loading import _section_type, load_config
from megarl.config.sections import DataConfig, MegaRLConfig, TrainerConfig

BASE = ["model.arch=qwen2.5-7b", "trainer.total_steps=1"]

# Every field that names a file or directory; a list field takes a one-item list.
PATH_KEYS = [
    "model.path", "critic.path", "data.train_files", "data.val_files", "reward.custom.path", "reward.model.path",
    "trainer.output_dir", "trainer.resume", "sft.train_files", "sft.val_files", "sft.output_dir",
    "rollout.server_python", "rollout.weight_sync.disk_dir", "rollout.agent.tools_file", "rollout.agent.interactions_file",
    "trainer.rollout_data_dir", "data.custom_cls.path",
]  # fmt: skip


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def _value(cfg: MegaRLConfig, key: str) -> str:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    if isinstance(node, list):
        (node,) = node
    return node.path if isinstance(node, BaseModel) else node  # data.train_files holds DataFile sections


@pytest.mark.parametrize("key", PATH_KEYS)
def test_an_override_expands_tilde(home, key):
    value = "[~/p]" if key.endswith("_files") else "~/p"
    required = ["data.custom_cls.name=D"] if key == "data.custom_cls.path" else []  # its section's other required key
    assert _value(load_config(None, [*BASE, *required, f"{key}={value}"]), key) == f"{home}/p"


def test_a_quoted_override_expands_tilde(home):
    # the shell passes trainer.output_dir='~/runs/a' on as trainer.output_dir=~/runs/a; quoted in YAML too
    cfg = load_config(None, [*BASE, "trainer.output_dir='~/runs/a'", 'model.path="~/models/x"'])
    assert (cfg.trainer.output_dir, cfg.model.path) == (f"{home}/runs/a", f"{home}/models/x")


def test_a_yaml_file_expands_tilde(home, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: ~/models/x}\n"
                    "data: {train_files: [~/t.parquet, {path: ~/u.parquet, weight: 2}], val_files: ~/v.parquet}\n"
                    "trainer: {output_dir: ~/runs/a}\n")  # fmt: skip
    cfg = load_config(path)
    assert cfg.model.path == f"{home}/models/x"
    assert [f.path for f in cfg.data.train_files] == [f"{home}/t.parquet", f"{home}/u.parquet"]
    assert cfg.data.val_files == [f"{home}/v.parquet"]
    assert cfg.trainer.output_dir == f"{home}/runs/a"


def test_a_section_built_in_python_expands_tilde(home):
    assert TrainerConfig(output_dir="~/runs/a").output_dir == f"{home}/runs/a"
    assert DataConfig(train_files=["~/t.parquet"]).train_files[0].path == f"{home}/t.parquet"


def test_other_strings_keep_their_tilde(home):
    cfg = load_config(None, [*BASE, "trainer.experiment=~/x", "trainer.project=~/y", "rollout.sampling.stop=[~/]",
                             "reward.functions.src=~/z", "cluster.ray_address=~/h", "trainer.resume=auto"])  # fmt: skip
    assert (cfg.trainer.experiment, cfg.trainer.project, cfg.rollout.sampling.stop) == ("~/x", "~/y", ["~/"])
    assert (cfg.reward.functions, cfg.cluster.ray_address, cfg.trainer.resume) == ({"src": "~/z"}, "~/h", "auto")
    assert load_config(None, [*BASE, "trainer.output_dir=runs/~a"]).trainer.output_dir == "runs/~a"  # not at the start


def _keys(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None and not name.endswith("_files"):
            yield from _keys(sub, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_key_named_like_a_path_is_in_the_list():
    """A new ``*_dir`` / ``*_file`` / ``path`` key must be a UserPath and listed above (the test then checks it)."""
    named = {key for key in _keys(MegaRLConfig) if re.search(r"(^|\.)path$|_dir$|_files?$", key)}
    assert named and named <= set(PATH_KEYS), named - set(PATH_KEYS)


def test_megarl_config_shows_path_keys_as_paths():
    assert describe("model.path").startswith("model.path = None  (path | None)  ")
    assert describe("data.val_files").startswith("data.val_files = []  (list[path])  ")
    assert describe("trainer.output_dir").startswith("trainer.output_dir = 'outputs/run'  (path)  ")
    assert describe("trainer.experiment").startswith("trainer.experiment = 'run'  (str)  ")
    # a word or a path: both shown (it was shown as a path alone)
    assert describe("trainer.resume").startswith("trainer.resume = 'auto'  (auto | disable | path)  ")


def test_an_empty_rollout_data_dir_is_unset_and_shown_so(tmp_path):
    """``trainer.rollout_data_dir=`` wrote nothing while the resolved config showed '' (a directory
    that looked set): '' is read as unset, as every optional path key's is, and shown as null."""
    assert load_config(None, [*BASE, "trainer.rollout_data_dir="]).trainer.rollout_data_dir is None
    assert load_config(None, [*BASE, "trainer.rollout_data_dir=''"]).trainer.rollout_data_dir is None
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\ntrainer: {total_steps: 1, rollout_data_dir: ''}\n")
    assert load_config(path).trainer.rollout_data_dir is None
    assert load_config(None, [*BASE, "trainer.rollout_data_dir=d"]).trainer.rollout_data_dir == "d"  # kept as written
    text = " ".join(describe("trainer.rollout_data_dir").split())  # (wrapped to the terminal)
    assert "relative to the directory megarl is launched from" in text and "None (or '', as for other optional paths) = not written" in text
