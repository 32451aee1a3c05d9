"""Fixtures of the real-SGLang tests: the CPU venv, a tiny model, one shared server, and
transformers as the reference for every log-prob.

The SGLang venv is the one `make sglang-cpu` builds, found the way the build names it
(ci/sglang-cpu/venv_path.py: the sha256 of the same lock file). Without it every test here is
skipped with the command that builds it.

One server (``sglang_server``) serves the whole session: it starts once (about a minute on
a 2-core machine) and every test through ``engine`` leaves it as it found it (the model's
own weights, version 0, nothing paused or released). Tests that need a launch of their own
(restart, another load format) use ``launch_server``. Every server runs in its own process
group and is killed, group and all, when its fixture ends, whether the tests passed or not.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from megarl.rollout_sglang.engine import ALL_TAGS, SGLangEngine
from megarl.rollout_sglang.server import ServerSpec, SGLangServer

ROOT = Path(__file__).resolve().parents[2]
VENV_PATH_SCRIPT = ROOT / "ci" / "sglang-cpu" / "venv_path.py"
START_TIMEOUT = 600.0  # seconds; a cold start on a loaded 2-core machine took ~150 s


def sglang_venv() -> Path:
    spec = importlib.util.spec_from_file_location("megarl_sglang_cpu_venv_path", VENV_PATH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.venv_path()


@pytest.fixture(scope="session")
def locked_sglang_version() -> str:
    """The sglang pin of the lock the venv was built from."""
    lock = VENV_PATH_SCRIPT.with_name("requirements.lock").read_text()
    (line,) = [ln for ln in lock.splitlines() if ln.startswith("sglang==")]
    return line.split("==", 1)[1]


@pytest.fixture(scope="session")
def sglang_python() -> str:
    venv = sglang_venv()
    python = venv / "bin" / "python"
    if not python.exists():
        pytest.skip(
            f"no SGLang CPU venv at {venv}: run `make sglang-cpu` to build it "
            "(a few minutes and about 3 GB, once)"
        )
    return str(python)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Qwen2 (hidden 64, 4 heads of 16, 2 KV heads, 2 layers, byte vocabulary
    259) in fp32: SGLang's CPU engine runs Qwen2 with torch-native layers and attention."""
    from megarl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", dtype="float32")


def cpu_spec(model: Path, python: str, log_path: Path, **overrides: Any) -> ServerSpec:
    fields: dict[str, Any] = dict(
        model_path=str(model),
        device="cpu",
        memory_saver=False,  # CUDA-only
        mem_fraction=0.05,
        max_running_requests=16,
        dtype="float32",
        python=python,
        log_level="info",
        log_path=str(log_path),
    )
    fields.update(overrides)
    return ServerSpec(**fields)


@pytest.fixture(scope="session")
def launch_server(
    sglang_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., SGLangServer]]:
    """``launch_server(**spec_overrides)`` starts a server of its own; every one is shut down
    (its process group killed) at the end of the session, even after a failure."""
    servers: list[SGLangServer] = []

    def launch(**overrides: Any) -> SGLangServer:
        log = tmp_path_factory.mktemp("sglang-logs") / "server.log"
        server = SGLangServer(cpu_spec(tiny_model, sglang_python, log, **overrides))
        servers.append(server)
        server.start(timeout=START_TIMEOUT)
        return server

    try:
        yield launch
    finally:
        for server in servers:
            server.shutdown()


@pytest.fixture(scope="session")
def sglang_server(launch_server: Callable[..., SGLangServer]) -> SGLangServer:
    """The server most tests share (started once per session)."""
    return launch_server()


@pytest.fixture
def engine(sglang_server: SGLangServer, tiny_model: Path) -> Iterator[SGLangEngine]:
    """A fresh client of the shared server; afterwards the server is put back as it was."""
    eng = SGLangEngine(sglang_server, max_running_requests=16, flush_interval=0.2)
    yield eng
    eng.close()
    if not sglang_server.alive():  # relaunch for the next tests, then fail this one
        tail = sglang_server.log_tail()
        sglang_server.restart(timeout=START_TIMEOUT)
        pytest.fail(f"the shared SGLang server died during the test; its log:\n{tail}")
    if eng.update_session:
        eng.end_weight_update()
    eng.continue_generation()
    eng.resume_memory(ALL_TAGS)
    eng.update_from_disk(str(tiny_model), 0)  # the model's own weights again


class HFReference:
    """transformers on the same weights: the reference for SGLang's tokens and log-probs."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.base = load_file(str(model_dir / "model.safetensors"))

    def logprobs(
        self,
        prompt: Sequence[int],
        response: Sequence[int],
        state: dict[str, torch.Tensor] | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_softmax(logits / T) of each response token, the greedy token at each step)."""
        self.model.load_state_dict(self.base if state is None else state, strict=False)
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1].double()  # (R, V)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        picked = logp.gather(-1, ids[0, len(prompt) :, None])[:, 0]  # (R,)
        return picked, logits.argmax(-1)


@pytest.fixture(scope="session")
def hf(tiny_model: Path) -> HFReference:
    return HFReference(tiny_model)


def perturbed(
    state: dict[str, torch.Tensor], seed: int, scale: float = 0.05
) -> dict[str, torch.Tensor]:
    """New weights for a push: every tensor moved by noise (a fixed seed per test)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        n: t + scale * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in state.items()
    }


@pytest.fixture
def new_weights(hf: HFReference, request: pytest.FixtureRequest) -> dict[str, torch.Tensor]:
    return perturbed(hf.base, seed=sum(map(ord, request.node.name)))
