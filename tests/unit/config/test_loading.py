"""YAML + dotted overrides -> validated config; unknown keys suggest the closest valid key."""

import re

import pytest

from megarl.config.loading import ConfigError, load_config, parse_override, validate_config

BASE = ["model.arch=qwen2.5-7b", "trainer.total_steps=1"]


def test_override_values_are_yaml_scalars():
    cfg = load_config(None, [*BASE, "rollout.n=4", "actor.optimizer.lr=2e-6", "rollout.sampling.stop=[a, b]",
                             "actor.optimizer.distributed=false", "cluster.ray_address=null"])
    assert cfg.rollout.n == 4
    assert cfg.actor.optimizer.lr == pytest.approx(2e-6)
    assert cfg.rollout.sampling.stop == ["a", "b"]
    assert cfg.actor.optimizer.distributed is False
    assert cfg.cluster.ray_address is None


def test_a_comment_yaml_would_drop_from_an_override_is_refused():
    # `run #1` read as YAML is `run`: the run would land in (and resume) another folder, silently
    with pytest.raises(ConfigError, match=re.escape("YAML reads '#1' as a comment and the value as '/runs/exp'; quote the value "
                                                    "to keep it whole: trainer.output_dir=\"'/runs/exp #1'\"")):  # fmt: skip
        parse_override("trainer.output_dir=/runs/exp #1")
    assert parse_override("trainer.output_dir='/runs/exp #1'") == ("trainer.output_dir", "/runs/exp #1")
    assert parse_override("data.prompt_key=q#1") == ("data.prompt_key", "q#1")  # no space before it: no comment


def test_override_wins_over_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\nrollout: {n: 16, tp: 2}\n")
    cfg = load_config(path, ["rollout.n=2"])
    assert (cfg.rollout.n, cfg.rollout.tp) == (2, 2)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rollout.nn=3", "unknown key rollout.nn; did you mean rollout.n?"),
        ("actor.optimizer.lrr=1", "did you mean actor.optimizer.lr?"),
        ("algorithm.kl.coeff=0.1", "did you mean algorithm.kl.coef?"),
        ("rollot.n=3", "did you mean rollout?"),
        ("rollout.temperature=0.7", "unknown key rollout.temperature; did you mean rollout.sampling.temperature?"),
        ("rollout.max_new_tokens=5", "did you mean rollout.sampling.max_new_tokens?"),
    ],
)
def test_unknown_override_key_suggests_closest(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("?", r"\?").replace(".", r"\.")):
        load_config(None, [*BASE, override])


def test_a_key_one_section_down_is_suggested_in_a_file_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\nrollout: {temperature: 0.7}\n")
    with pytest.raises(ConfigError, match=r"unknown key rollout\.temperature; did you mean rollout\.sampling\.temperature\?"):
        load_config(path)


def test_unknown_key_in_file_suggests_closest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\nrollout: {smapling: {temperature: 1}}\n")
    with pytest.raises(ConfigError, match=r"unknown key rollout\.smapling; did you mean rollout\.sampling\?"):
        load_config(path)


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"rollout\.n: .*integer.*'abc'"):
        load_config(None, [*BASE, "rollout.n=abc"])
    with pytest.raises(ConfigError, match=r"data\.truncation: .*'middle'"):
        load_config(None, [*BASE, "data.truncation=middle"])


@pytest.mark.parametrize("override", ["rollout.n=true", "actor.optimizer.lr=false", "trainer.total_steps=yes"])
def test_a_boolean_is_not_a_number(override):
    """YAML reads true/yes as booleans, which pydantic would take as 1 (rollout.n=true ran with n = 1)."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: (true|false) is a boolean; give a number"):
        load_config(None, [*BASE, override])


@pytest.mark.parametrize(
    ("override", "item"),
    [("actor.optimizer.betas=[true,0.9]", "item 0 (true)"), ("rollout.sampling.stop_token_ids=[2,no]", "item 1 (false)"),
     ("trainer.profile_steps=[yes]", "item 0 (true)")],
)
def test_a_boolean_is_not_a_number_in_a_list_either(override, item):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: {re.escape(item)} is a boolean; give a number$"):
        load_config(None, [*BASE, override])
    assert load_config(None, [*BASE, "actor.optimizer.betas=[0.9,1]"]).actor.optimizer.betas == (0.9, 1.0)


@pytest.mark.parametrize("bad", ["rollout.n", "=3", "a..b=1"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError):
        parse_override(bad)


@pytest.mark.parametrize(("override", "fixed"), [
    ("reward.custom={path:/tmp/r.py}", "'reward.custom={path: /tmp/r.py}'"),
    ("data.train_files=[{path:/a.parquet,weight:2}]", "'data.train_files=[{path: /a.parquet,weight: 2}]'"),
    ("rollout.agent.loops={mine:pkg.mod:Loop}", "'rollout.agent.loops={mine: pkg.mod:Loop}'"),
    ("reward.functions={openai/gsm8k:gsm8k}", "'reward.functions={openai/gsm8k: gsm8k}'"),
])
def test_a_mapping_entry_without_a_space_after_its_colon_is_refused_with_the_fixed_override(override, fixed):
    # The shell splits `{path: /x}` unless quoted, so `{path:/x}` is what users type; YAML reads
    # it as {"path:/x": None}, which validation would report as an unknown key.
    with pytest.raises(ConfigError) as exc:
        parse_override(override)
    assert str(exc.value).endswith(f"write it as {fixed}, quoted for the shell")
    key, value = parse_override(fixed.strip("'"))
    assert isinstance(value, (dict, list)) and key == override.split("=")[0]


def test_a_mapping_given_for_a_section_is_merged_into_the_files(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\nrollout: {n: 4, sampling: {max_new_tokens: 3072, temperature: 1.0}}\n")
    cfg = load_config(path, ["rollout.sampling={temperature: 0.7}", "rollout={tp: 2, sampling: {top_p: 0.9}}"])
    assert (cfg.rollout.n, cfg.rollout.tp) == (4, 2)
    s = cfg.rollout.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p) == (3072, 0.7, 0.9)  # the file's max_new_tokens kept


def test_an_override_sets_one_entry_of_a_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\nreward: {functions: {a: gsm8k}}\n")
    cfg = load_config(path, ["reward.functions.b=math", "rollout.agent.loops.mine=pkg.mod:loop"])
    assert cfg.reward.functions == {"a": "gsm8k", "b": "math"}  # merged into the file's mapping
    assert cfg.rollout.agent.loops == {"mine": "pkg.mod:loop"}
    with pytest.raises(ConfigError, match=r"reward\.functions is a mapping; set one entry, reward\.functions\.NAME=VALUE"):
        load_config(path, ["reward.functions.b.c=math"])


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="rollout.n is a value, not a section"):
        load_config(None, [*BASE, "rollout.n.x=1"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)


def test_an_unknown_arch_is_refused_even_beside_a_path():
    with pytest.raises(ConfigError, match=r"model.arch: 'nope' is not a built-in architecture; choose one of: .*qwen2.5-72b"):
        load_config(None, ["model.path=/some/model", "model.arch=nope", "trainer.total_steps=1"])


def test_model_needs_path_or_arch():
    with pytest.raises(ConfigError, match="set model.path"):
        validate_config({"model": {}})


def test_train_files_accept_strings_and_weights():
    cfg = validate_config({"model": {"arch": "qwen3-8b"}, "data": {"train_files": ["a.parquet", {"path": "b.parquet", "weight": 3}]}})
    assert [(f.path, f.weight) for f in cfg.data.train_files] == [("a.parquet", 1.0), ("b.parquet", 3.0)]


def test_one_section_from_overrides_without_a_file():
    from megarl.config.loading import load_section

    reward = load_section(["reward.workers=3", "reward.functions={a: gsm8k}"], "reward")
    assert reward.workers == 3 and reward.functions == {"a": "gsm8k"}
    with pytest.raises(ConfigError, match="only reward.\\* settings apply here; give the config file to set rollout.n"):
        load_section(["rollout.n=4"], "reward")
    with pytest.raises(ConfigError, match="reward.workers: Input should be greater than or equal to 1"):
        load_section(["reward.workers=0"], "reward")
    with pytest.raises(ConfigError, match="unknown key reward.worker"):
        load_section(["reward.worker=2"], "reward")


def test_an_unknown_key_hides_no_other_mistake():
    # the unknown key used to be the only line: the wrong values showed one fix later
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*BASE, "trainer.bogus=1", "rollout.n=0", "rollout.sampling.stop=[a", "actor.optimizer.lr=abc"])
    lines = str(refused.value).splitlines()
    assert lines[0].startswith("unknown key trainer.bogus; ")
    assert lines[1].startswith("override 'rollout.sampling.stop=[a': value '[a' is not valid YAML")
    assert lines[2:] == ["override rollout.n=0: invalid configuration",
                         "  - rollout.n: Input should be greater than or equal to 1 (got 0)",
                         "override actor.optimizer.lr=abc: invalid configuration",
                         "  - actor.optimizer.lr: Input should be a valid number, unable to parse string as a number (got 'abc')"]


@pytest.mark.parametrize(("overrides", "said"), [
    (["model.arh=qwen2.5-7b", "trainer.total_steps=1"], "unknown key model.arh; did you mean model.arch? valid keys here: "),
    ([*BASE, "rollout.n=0", "rollout.n=[1"], "override 'rollout.n=[1': value '[1' is not valid YAML"),
    ([*BASE, "rollout=5", "rollout.n=2"], "override rollout.n: rollout is a value (5), not a section"),
], ids=["a-section-missing-for-it", "a-value-it-replaced", "a-section-it-needs"])  # fmt: skip
def test_a_left_out_override_is_named_once_and_what_it_would_have_set_is_not_blamed(overrides, said):
    # the left-out override's key: not "model: Field required" (blaming the file), not the value
    # the failing override would have replaced, not its own mistake a second time
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_without_a_config_file_every_override_mistake_is_named_too():
    from megarl.config.loading import load_section

    with pytest.raises(ConfigError) as refused:
        load_section(["reward.worker=2", "reward.timeout_s=-1", "trainer.seed=1"], "reward")
    lines = str(refused.value).splitlines()
    assert lines[0].startswith("unknown key reward.worker; did you mean reward.workers?")
    assert lines[1].startswith("override 'trainer.seed=1': without a config file only reward.* settings apply here")
    assert lines[2:] == ["override reward.timeout_s=-1: invalid configuration", "  - reward.timeout_s: Input should be greater than 0 (got -1)"]
