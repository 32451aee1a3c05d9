"""A config file that is a directory, not text, or repeats a key is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import EXIT_USER, main
from megarl.config.loading import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[3]


def test_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config file {tmp_path} is a directory; give a YAML file$"):
        load_config(tmp_path)


def test_a_binary_file_is_not_yaml_text(tmp_path, capsys):
    from megarl.data.tasks import write_reverse_digits

    train, _ = write_reverse_digits(tmp_path, val_size=100)
    assert main(["plan", str(train)]) == EXIT_USER
    err = capsys.readouterr().err
    assert err.startswith(f"error: config file {train} is not a YAML text file (") and err.count("\n") == 1
    nul = tmp_path / "nul.yaml"
    nul.write_text("model: {arch: qwen2.5-7b}\x00\n")
    with pytest.raises(ConfigError, match=r"is not a YAML text file \(character U\+0000 at offset 25"):
        load_config(nul)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("rollout:\n  sampling: {temperature: 1.0\nactor:\n  lr: 1\n",
         ":3:6: expected ',' or '}', but got ':' (while parsing a flow mapping started at 2:13); close the { with }"),
        ("rollout:\n\tn: 8\n", ":2:1: found character '\\t' that cannot start any token (while scanning for the next token); "
         "indent with spaces: YAML does not allow tabs"),
        ("model:\n  path: \"abc\n", ":3:1: found unexpected end of stream (while scanning a quoted scalar started at 2:9); "
         "close the quote"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_its_place(tmp_path, capsys, text, line):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["plan", str(path)]) == EXIT_USER
    assert capsys.readouterr().err == f"error: {path}{line}\n"


def test_a_key_given_twice_names_the_key_and_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 4\nmodel:\n  arch: qwen2.5-7b\nrollout:\n  tp: 2\n")
    with pytest.raises(ConfigError, match=rf"^config file {path}: key rollout is given twice \(lines 1 and 5\)"):
        load_config(path)
    path.write_text("model:\n  arch: qwen2.5-7b\nrollout:\n  n: 4\n  tp: 2\n  n: 8\n")
    with pytest.raises(ConfigError, match=r"key rollout.n is given twice \(lines 4 and 6\)"):  # its dotted path
        load_config(path)
    path.write_text("model: {arch: qwen2.5-7b}\nrollout: {sampling: {top_p: 0.9, top_p: 1.0}}\n")  # flow style
    with pytest.raises(ConfigError, match=r"key rollout\.sampling\.top_p is given twice \(lines 2 and 2\)"):
        load_config(path)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {arch: qwen2.5-7b}\nrollout:\n  <<: {n: 4, tp: 2}\n  n: 8\n")
    cfg = load_config(path)
    assert (cfg.rollout.n, cfg.rollout.tp) == (8, 2)


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_still_loads(config):
    load_config(config)
