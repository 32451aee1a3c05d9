"""`megarl generate`'s output checks, which run before any model is loaded (the generation
itself runs in tests/e2e/test_generate_evaluate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.checkpoint.manager import CheckpointManager
from megarl.commands.generate import generate
from megarl.commands.outputs import OutputError

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny_grpo.yaml"


def test_an_output_inside_the_runs_checkpoints_is_refused(tmp_path):
    run = tmp_path / "run"
    overrides = [f"model.path={tmp_path / 'model'}", f"trainer.output_dir={run}"]
    (run / "checkpoints").mkdir(parents=True)  # the config's run, before its first save
    out = run / "checkpoints" / "gen.parquet"
    with pytest.raises(OutputError, match=r"gen.parquet is inside the checkpoints folder of a run .*give a path outside it"):
        generate(CONFIG, overrides, tmp_path / "val.parquet", out)
    with CheckpointManager(tmp_path / "other").saving(2) as d:  # another run's, recognised by its step directory
        (d / "state").write_text("s")
    out = tmp_path / "other" / "checkpoints" / "step_000002" / "gen.parquet"
    with pytest.raises(OutputError, match=r"inside the checkpoints folder of a run"):
        generate(CONFIG, overrides, tmp_path / "val.parquet", out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["manifest.json", "state"]  # nothing written there


def test_a_partial_generation_with_other_settings_names_each_old_and_new_value(tmp_path):
    import json

    from megarl.commands.generate_partial import GenerateError, open_partial

    before = {"data_sha256": "ab", "model": "/m", "n": 4, "sampling": {"temperature": 1.0, "top_p": 1.0}, "batch_size": 64}
    partial = tmp_path / "gen.parquet.partial"
    open_partial(partial, before)
    (partial / "part-000000.parquet").write_bytes(b"a finished part")
    now = {**before, "data_sha256": "cd", "n": 2, "sampling": {"temperature": 0.5, "top_p": 1.0}}
    with pytest.raises(GenerateError, match=r"^\S+ holds a generation made with other settings \(the --data file's "
                                            r"contents differ; n was 4, now 2; sampling.temperature was 1.0, now 0.5\); "
                                            "run with the same settings to continue it, or move it away to start over$"):
        open_partial(partial, now)
    assert json.loads((partial / "generate.json").read_text()) == before  # the record of the work there stays
    newer = {**before, "seed": 3, "sampling": {**before["sampling"], "min_p": 0.0}}  # keys an older megarl did not record
    with pytest.raises(GenerateError, match=r"\(sampling.min_p was not recorded \(an older megarl wrote generate.json\), "
                                            r"now 0.0; seed was not recorded \(an older megarl wrote generate.json\), now 3\)"):
        open_partial(partial, newer)
    added = {**before, "agent_files_sha256": {"rollout.agent.tools_file": "abc123"}}  # a file set since: no hash shown
    with pytest.raises(GenerateError, match=r"\(agent_files_sha256 was not recorded \(an older megarl wrote generate.json\)\)"):
        open_partial(partial, added)  # a record without the field at all
    record = json.loads((partial / "generate.json").read_text())
    (partial / "generate.json").write_text(json.dumps({**record, "agent_files_sha256": {}}))
    with pytest.raises(GenerateError, match=r"\(the rollout.agent.tools_file file's contents differ\)"):
        open_partial(partial, added)


def test_a_cut_job_record_starts_afresh_without_parts_and_is_refused_with_them(tmp_path):
    """A job record a full disk or a kill cut (an older megarl wrote it in place): no traceback; with no
    finished part the generation starts again and the record is written whole, with parts it is refused."""
    import json

    from megarl.commands.generate_partial import GenerateError, open_partial

    job = {"data_sha256": "ab", "model": "/m", "n": 4, "batch_size": 64}
    partial = tmp_path / "gen.parquet.partial"
    partial.mkdir()
    (partial / "generate.json").write_text("")
    open_partial(partial, job)
    assert json.loads((partial / "generate.json").read_text()) == job
    assert sorted(p.name for p in partial.iterdir()) == ["generate.json"]  # no temporary file left
    (partial / "generate.json").write_text('{"data_sha')
    (partial / "part-000000.parquet").write_bytes(b"a finished part")
    with pytest.raises(GenerateError, match=r"generate.json is not a whole job record, so the finished parts in \S+ cannot be "
                                            "checked against these settings; move the folder away to start over$"):
        open_partial(partial, job)


def _model(path: Path, weights: bytes) -> Path:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_resume_with_other_agent_settings_or_other_weights_at_the_same_path_is_refused(tmp_path):
    from megarl.commands.generate_partial import GenerateError, job_record, open_partial
    from megarl.config.loading import load_config

    model, data = _model(tmp_path / "hfA", b"weights A"), tmp_path / "val.parquet"
    data.write_bytes(b"prompts")
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")

    def job(*overrides: str) -> dict:
        cfg = load_config(CONFIG, [f"model.path={model}", f"rollout.agent.tools_file={tools}", *overrides])
        return job_record(cfg, data, str(model), 64)

    partial = tmp_path / "gen.parquet.partial"
    open_partial(partial, job())
    (partial / "part-000000.parquet").write_bytes(b"a finished part")
    open_partial(partial, job())  # the same settings and model: continued
    with pytest.raises(GenerateError, match=r"\(agent.default_agent was \"single_turn\", now \"tool_agent\"; "
                                            r"agent.max_turns was 8, now 3\); run with the same settings"):  # fmt: skip
        open_partial(partial, job("rollout.agent.default_agent=tool_agent", "rollout.agent.max_turns=3"))
    tools.write_text("tools: []  # edited\n")
    with pytest.raises(GenerateError, match=r"\(the rollout.agent.tools_file file's contents differ\)"):
        open_partial(partial, job())
    tools.write_text("tools: []\n")
    _model(model, b"weights B")  # e.g. `megarl convert ... hfA --overwrite` from another checkpoint
    with pytest.raises(GenerateError, match=rf"\(the model at {model} holds other weights than the parts were generated "
                                            r"with\); run with the same model and settings to continue it"):  # fmt: skip
        open_partial(partial, job())
    _model(model, b"weights A")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(GenerateError, match=rf"the model at {model} has other chat_template.jinja than the parts"):
        open_partial(partial, job())


def test_a_training_checkpoint_is_identified_by_its_step_and_manifest(tmp_path):
    import shutil

    from megarl.commands.generate_partial import model_fingerprint

    for run, state in (("run", "s"), ("other", "t")):
        with CheckpointManager(tmp_path / run).saving(2) as d:
            (d / "state").write_text(state)
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    first = model_fingerprint(step)
    assert first is not None and first["step"] == 2
    shutil.rmtree(step)  # another run's step 2 in its place: the same path and step, other weights
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step_000002", step)
    again = model_fingerprint(step)
    assert again is not None and again["step"] == 2 and again != first


def test_a_damaged_part_is_named_before_any_generation_and_a_failed_merge_leaves_no_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.commands.generate_partial import (
        GenerateError,
        check_parts,
        merge_parts,
        part_path,
        parts_of,
    )

    partial = tmp_path / "gen.parquet.partial"
    partial.mkdir()
    parts = parts_of(5, 2)
    pq.write_table(pa.table({"x": [1, 2]}), part_path(partial, 0))
    pq.write_table(pa.table({"x": [3, 4]}), part_path(partial, 1))
    check_parts(partial, parts)  # part 2 not written yet: generated later
    damaged = part_path(partial, 1)
    damaged.write_bytes(damaged.read_bytes()[:100])  # e.g. a disk that filled up
    with pytest.raises(GenerateError, match=rf"^{damaged} is not a readable parquet file \(.*\); delete that part file "
                                            "and run the same command to generate its prompts again$"):  # fmt: skip
        check_parts(partial, parts)
    with pytest.raises(pa.ArrowInvalid):
        merge_parts(partial, 2, tmp_path / "gen.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen.parquet.partial"]  # no gen.parquet.tmp
    pq.write_table(pa.table({"x": [3]}), damaged)
    with pytest.raises(GenerateError, match=r"holds 1 rows, not the 2 prompts of its part"):
        check_parts(partial, parts)


def test_a_tool_parser_that_does_not_load_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    from megarl.commands.generate import GenerateError, _check_user_code
    from megarl.config.loading import load_config

    (tmp_path / "my_parsers.py").write_text("def parse(text):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(CONFIG, ["rollout.agent.tool_parser=my_parsers:nope", "algorithm.estimator=nowhere:at_all"])
    with pytest.raises(GenerateError, match=r"^rollout.agent.tool_parser: .*my_parsers:nope.*has no attribute 'nope'"):
        _check_user_code(cfg)
    # a training-only function (algorithm.*) is not generate's to load
    _check_user_code(load_config(CONFIG, ["rollout.agent.tool_parser=my_parsers:parse", "algorithm.estimator=nowhere:at_all"]))


def test_an_sglang_engine_without_sglang_is_one_line_before_anything_is_written(tmp_path):
    """rollout.engine=sglang with a server_python that has no SGLang: `megarl launch`'s check, before
    the partial directory is made (the server's start used to fail with SGLang's import error)."""
    from megarl.commands.demo import prepare_demo
    from megarl.commands.generate import GenerateError

    model, data = prepare_demo(tmp_path / "demo")
    no_sglang = tmp_path / "python"
    no_sglang.write_text("#!/bin/sh\nexit 1\n")  # finds no module: the probe exits non-zero
    no_sglang.chmod(0o755)
    overrides = [f"model.path={model}", "rollout.engine=sglang", f"rollout.server_python={no_sglang}"]
    out = tmp_path / "gen.parquet"
    with pytest.raises(GenerateError, match=rf"^rollout.server_python: \({no_sglang}\) cannot import sglang; point it at"):
        generate(CONFIG, overrides, data / "val.parquet", out)
    assert not out.exists() and not (tmp_path / "gen.parquet.partial").exists()


def test_sglang_deterministic_inference_on_cpu_is_one_line_before_anything_is_written(tmp_path):
    from megarl.commands.generate import GenerateError, _check_sglang
    from megarl.config.loading import load_config

    cfg = load_config(CONFIG, ["rollout.engine=sglang", "rollout.deterministic=true"])
    with pytest.raises(GenerateError, match=r"rollout.deterministic: \(true\) needs SGLang's deterministic GPU attention"):
        _check_sglang(cfg)
    _check_sglang(load_config(CONFIG, ["rollout.deterministic=true"]))  # the torch engine


def test_generate_with_sglang_on_cpu_finds_the_venv_make_sglang_cpu_built(tmp_path):
    """As `megarl demo` does: rollout.server_python unset on a CPU cluster, SGLang not in this
    interpreter, and generate's server check passes on the venv (only the deterministic refusal,
    kept as the one problem, stops it before anything is written)."""
    from megarl.commands.demo import prepare_demo
    from megarl.commands.generate import GenerateError
    from megarl.config.loading import load_config
    from megarl.rollout_sglang.cpu_venv import sglang_cpu_python, with_cpu_server_python

    python = sglang_cpu_python()
    if python is None:
        pytest.skip("`make sglang-cpu` has not built the SGLang CPU venv on this machine")
    model, data = prepare_demo(tmp_path / "demo")
    out = tmp_path / "gen.parquet"
    with pytest.raises(GenerateError) as info:
        generate(CONFIG, [f"model.path={model}", "rollout.engine=sglang", "rollout.deterministic=true"], data / "val.parquet", out)
    assert str(info.value).startswith("rollout.deterministic:") and "server_python" not in str(info.value)
    assert not out.exists() and not (tmp_path / "gen.parquet.partial").exists()
    assert with_cpu_server_python(load_config(CONFIG, ["rollout.engine=sglang"])).rollout.server_python == str(python)
    for kept in (["rollout.engine=sglang", "rollout.server_python=/usr/bin/python3"], ["rollout.engine=torch"],
                 ["rollout.engine=sglang", "cluster.device=cuda"]):  # fmt: skip
        cfg = load_config(CONFIG, kept)
        assert with_cpu_server_python(cfg) is cfg


@pytest.mark.parametrize("spelling", ["dotdot", "symlink", "hardlink"])
def test_an_output_that_is_the_input_under_another_name_is_refused(tmp_path, spelling):
    from megarl.commands.generate_partial import GenerateError

    data = tmp_path / "val.parquet"
    data.write_bytes(b"the user's prompts")
    out = {"dotdot": tmp_path / "sub" / ".." / "val.parquet", "symlink": tmp_path / "link.parquet",
           "hardlink": tmp_path / "hard.parquet"}[spelling]  # fmt: skip
    if spelling == "symlink":
        out.symlink_to(data)
    elif spelling == "hardlink":
        out.hardlink_to(data)
    with pytest.raises(GenerateError, match="is the input file; give another path"):
        generate(CONFIG, [f"model.path={tmp_path / 'model'}"], data, out, overwrite=True)
    assert data.read_bytes() == b"the user's prompts" and not (tmp_path / "sub").exists()


def test_an_unknown_agent_loop_in_a_row_is_one_line_before_anything_is_written(tmp_path, caplog):
    """A launch's check of its data files: without it, the parts before the row were generated
    first, and the corrected file (other contents) could not continue them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.commands.demo import prepare_demo
    from megarl.commands.generate import GenerateError

    model, data = prepare_demo(tmp_path / "demo")
    table = pq.read_table(data / "val.parquet")
    names = ["single_turn"] * table.num_rows
    names[150] = "tool_agnet"
    pq.write_table(table.append_column("agent_name", pa.array(names)), tmp_path / "agents.parquet")
    out = tmp_path / "gen.parquet"
    with pytest.raises(GenerateError, match=r"^--data \(agents.parquet\): row 150: agent_name 'tool_agnet' is not an agent "
                                            r"loop; use single_turn, tool_agent"):  # fmt: skip
        generate(CONFIG, [f"model.path={model}"], tmp_path / "agents.parquet", out, batch_size=50)
    assert not out.exists() and not (tmp_path / "gen.parquet.partial").exists()
    names[150] = "tool_agent"  # known, but with no tools to call: said, and generated
    pq.write_table(table.append_column("agent_name", pa.array(names)).slice(140, 20), tmp_path / "agents.parquet")
    generate(CONFIG, [f"model.path={model}", "rollout.n=1"], tmp_path / "agents.parquet", out)
    assert "rows run tool_agent: every call they make will be answered 'there is no tool'" in caplog.text
    assert pq.read_table(out).num_rows == 20


def test_a_runs_folder_as_the_model_names_its_latest_step_directory(tmp_path):
    """As `megarl convert` names it: the run's output_dir or checkpoints folder is not a checkpoint."""
    from megarl.commands.generate import GenerateError
    from megarl.data.datasets import write_prompt_file

    with CheckpointManager(tmp_path / "run").saving(3) as d:
        (d / "state").write_text("s")
    write_prompt_file([{"data_source": "reverse_digits", "prompt": "123", "reward_model": {"ground_truth": "321"}}],
                      tmp_path / "val.parquet")  # fmt: skip
    for given, what in ((tmp_path / "run", "a run's output_dir"), (tmp_path / "run" / "checkpoints", "the checkpoints folder of a run")):
        with pytest.raises(GenerateError, match=rf"^model {given} is {what}, not a checkpoint; give one of its step "
                                                rf"directories, e.g. the latest valid one: {tmp_path / 'run' / 'checkpoints' / 'step_000003'}$"):  # fmt: skip
            generate(CONFIG, [f"model.path={given}"], tmp_path / "val.parquet", tmp_path / "gen.parquet")
    assert not (tmp_path / "gen.parquet.partial").exists()


def test_an_hf_model_without_tokenizer_or_weight_files_is_one_line_before_anything_is_written(tmp_path):
    """The engine loads the model as it is: without tokenizer files transformers built one from
    config.json alone, and generate failed after the partial directory was made, blaming the chat
    template; without weight files the engine's start was an OSError traceback, and with a tensor
    missing it generated with that tensor at random."""
    import shutil

    from megarl.commands.demo import prepare_demo
    from megarl.commands.generate import GenerateError

    model, data = prepare_demo(tmp_path / "demo")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy2(model / name, bare / name)
    with pytest.raises(GenerateError, match=rf"^model {bare} has no tokenizer files: .*; copy the model's tokenizer files into it$"):
        generate(CONFIG, [f"model.path={model}"], data / "val.parquet", tmp_path / "gen.parquet", model=str(bare))
    (bare / "model.safetensors").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(model / name, bare / name)
    with pytest.raises(GenerateError, match=rf"^model {bare} has no weight files \(\*.safetensors or \*.bin\); copy the "
                                            "model's weights into it, or give a complete HF directory$"):  # fmt: skip
        generate(CONFIG, [f"model.path={model}"], data / "val.parquet", tmp_path / "gen.parquet", model=str(bare))
    # a tensor missing: transformers initialised it at random and the engine generated on
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bare / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GenerateError, match=rf"^model {bare} does not hold the weights its config.json implies \(ValueError: "
                                            r".*expected tensors missing: \['model.layers.1.mlp.up_proj.weight'\]\)"):  # fmt: skip
        generate(CONFIG, [f"model.path={model}"], data / "val.parquet", tmp_path / "gen.parquet", model=str(bare))
    (bare / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:100])  # cut short
    with pytest.raises(GenerateError, match=r"does not hold the weights its config.json implies \(ValueError: "
                                            rf"{bare / 'model.safetensors'} is not a readable safetensors file"):  # fmt: skip
        generate(CONFIG, [f"model.path={model}"], data / "val.parquet", tmp_path / "gen.parquet", model=str(bare))
    assert not (tmp_path / "gen.parquet.partial").exists()


def test_shards_without_an_index_are_weight_files(tmp_path):
    # (SGLang loads every *.safetensors of the directory; the check named one file or an index)
    from megarl.models.weight_files import has_hf_weights

    (tmp_path / "config.json").write_text("{}")
    assert not has_hf_weights(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert has_hf_weights(tmp_path)


def test_an_hf_model_with_settings_megarl_does_not_train_is_left_to_the_engine(tmp_path):
    # A Llama with attention and MLP biases (or a quantized checkpoint's scale tensors): the
    # engines load it; megarl's bridge does not train it, so its tensors are not megarl's to check.
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl.commands.generate import _hf_tensors_problem

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, mlp_bias=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "biased")
    assert _hf_tensors_problem(tmp_path / "biased") is None


def test_several_greedy_responses_per_prompt_are_a_warning(caplog):
    from megarl.commands.generate import _warn_greedy_copies
    from megarl.config.loading import load_config

    _warn_greedy_copies(load_config(CONFIG, ["rollout.n=4", "rollout.sampling.temperature=0"]))
    assert "--n 4 (temperature 0): 4 greedy responses of one prompt are all the same one, so pass@k" in caplog.text
    caplog.clear()
    for fine in (["rollout.n=1", "rollout.sampling.temperature=0"], ["rollout.n=4"]):
        _warn_greedy_copies(load_config(CONFIG, fine))
    assert not caplog.text


def test_visible_gpus_keep_uuids_as_cuda_visible_devices_lists_them(monkeypatch):
    """The GPUs `megarl generate` spreads its SGLang servers over: CUDA_VISIBLE_DEVICES's entries
    as they are, indices or UUIDs (UUIDs were dropped: "this machine shows 0 GPUs")."""
    from megarl.commands.generate import _visible_gpus

    uuids = "GPU-5f3e9a7c-0d1e-4b2f-9c3d-000000000000,GPU-7a21c0de-1111-4b2f-9c3d-000000000001"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids)
    assert _visible_gpus() == uuids.split(",")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    assert _visible_gpus() == ["3", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _visible_gpus() == []


HOLD_OUT = """import sys, time
from megarl.trainer.run_lock import output_lock
with output_lock(sys.argv[1]):
    print('held', flush=True)
    sys.stdin.read()
"""


def test_a_second_generate_into_a_held_out_is_refused_before_its_config_is_read(tmp_path, capsys):
    """Another generate writing OUT (a process holding its lock) is the first thing checked, in the
    command's process and in the driver: before the config (here missing, which would be refused
    otherwise), the model's checks and the driver's start; the check takes no lock of its own."""
    import subprocess
    import sys

    from megarl.cli import main
    from megarl.trainer.run_lock import OutputDirInUse, output_lock

    out = tmp_path / "gen.parquet"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OUT, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        missing = tmp_path / "missing.yaml"
        with pytest.raises(OutputDirInUse, match=rf"^--out {out} is in use by pid {holder.pid} on "):
            generate(missing, [], tmp_path / "val.parquet", out)
        assert main(["generate", str(missing), "--data", str(tmp_path / "val.parquet"), "--out", str(out)]) == 2
        assert capsys.readouterr().err.startswith(f"error: --out {out} is in use by pid {holder.pid} on ")
    finally:
        holder.communicate("")
    from megarl.config.loading import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):  # the holder gone, the config is read (and refused)
        generate(missing, [], tmp_path / "val.parquet", out)
    with output_lock(out):  # nothing was left held
        pass
