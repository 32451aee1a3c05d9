"""Which megatron-core megarl accepts, and which checkpoints it may load under which version."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from megarl.parallel import mcore_version as mv


@pytest.mark.parametrize(
    ("mcore", "has_triton", "error"),
    [
        ("0.16.1", False, None),  # 0.16 does not import triton
        ("0.19.2", True, None),
        ("0.19.2", False, "megatron-core 0.19.2 needs triton (megatron.core imports it); pip install triton"),
        ("0.17.0rc1", False, "megatron-core 0.17.0rc1 needs triton"),
        ("0.15.3", True, "megatron-core 0.15.3 is older than megarl supports; pip install 'megatron-core>=0.16,<0.20'"),
        (None, True, "megatron-core is not installed; pip install 'megatron-core>=0.16,<0.20'"),
    ],
)
def test_usability(mcore, has_triton, error):
    got = mv.usability_error(mcore, has_triton)
    assert got is None if error is None else (got is not None and got.startswith(error) and "\n" not in got)


def test_require_raises_one_line_without_triton(monkeypatch):
    """The installed megatron-core, declared as 0.19 with triton hidden: megarl's first megatron
    import fails with the one-line message, not an ImportError from deep inside megatron."""
    monkeypatch.setattr(mv, "installed_version", lambda: "0.19.2")
    monkeypatch.setattr(mv.importlib.util, "find_spec", lambda name: None)
    mv.require_megatron_core.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"^megatron-core 0.19.2 needs triton .*pip install triton"):
            mv.require_megatron_core()
    finally:
        mv.require_megatron_core.cache_clear()


def test_require_answers_the_installed_version():
    assert mv.require_megatron_core() == version("megatron-core")


@pytest.mark.parametrize(
    ("writer", "reader", "refused"),
    [
        ("0.16.1", "0.16.1", False),
        ("0.16.1", "0.19.2", False),  # seen: 0.19 loads 0.16's dist-checkpoints
        ("0.19.2", "0.19.0", False),
        ("0.19.2", "0.16.1", True),  # seen: 0.16 fails on 0.19's (no common.pt)
        (None, "0.16.1", False),
        ("0.17+", "0.16.1", True),
    ],
)
def test_checkpoint_versions(writer, reader, refused):
    error = mv.checkpoint_version_error("ckpt", writer, reader)
    assert (error is not None) == refused
    if refused:
        assert f"written by megatron-core {writer}" in error and f"installed megatron-core {reader}" in error


def test_a_newer_writer_is_refused_with_the_version_to_use(tmp_path, monkeypatch):
    (tmp_path / "common.pt").write_bytes(b"")
    mv.write_checkpoint_versions(tmp_path)
    record = json.loads((tmp_path / mv.VERSIONS_FILE).read_text())
    assert record["megatron_core"] == version("megatron-core") and "torch" in record
    mv.check_checkpoint_readable(tmp_path)  # the writer itself reads it
    (tmp_path / mv.VERSIONS_FILE).write_text(json.dumps({"megatron_core": "9.3.1"}))
    with pytest.raises(ValueError) as err:
        mv.check_checkpoint_readable(tmp_path)
    assert str(err.value) == (
        f"checkpoint {tmp_path} was written by megatron-core 9.3.1 and cannot be read by the installed "
        f"megatron-core {version('megatron-core')}; load it with megatron-core 9.3.1 "
        f"(pip install 'megatron-core>=9.3,<9.4')"
    )


def test_an_unrecorded_checkpoint_is_dated_by_its_files(tmp_path):
    assert mv.checkpoint_writer(tmp_path) == "0.17+"  # no common.pt: megatron-core >= 0.17 wrote it
    (tmp_path / "common.pt").write_bytes(b"")
    assert mv.checkpoint_writer(tmp_path) is None  # 0.16 layout: any supported version reads it
