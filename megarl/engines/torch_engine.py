"""The torch reference rollout engine: a Hugging Face causal LM with its own decode loop.

Used for CI, the CPU demo and debugging, and as the reference the SGLang engine is compared
with. It runs ``AutoModelForCausalLM`` on CPU or one GPU with a KV cache (``DynamicCache``) and
a hand-written decode loop (not ``model.generate``) so that log-probs, sampling and stopping are
exactly what the rest of megarl assumes:

- log-prob of a response token = ``log_softmax(logits / T)`` of the sampled token, taken BEFORE
  top-p / top-k filtering (what SGLang reports and what the trainer recomputes). Greedy
  (T < 1e-6) takes the argmax and reports ``log_softmax(logits)``, i.e. T counted as 1 for the
  log-prob (there is no distribution at T = 0).
- top-k then top-p (SGLang's order) shape sampling only.
- stopping: EOS (tokenizer, model config and generation_config ids), ``stop_token_ids``,
  ``stop`` strings matched on the decoded response text (the matched token stays in the
  response, like SGLang with ``no_stop_trim``); EOS / stop ids stay in the response too and
  have a log-prob. ``finish_reason`` is "stop", or "length" when ``max_new_tokens`` cut it.
  ``ignore_eos`` drops EOS and ``stop_token_ids`` from the stops (SGLang's rule; stop strings
  still apply).
- reproducible sampling: sample ``i`` (global index within the request, ``first_sample_index``
  + position in ``[p0s0 .. p0s(n-1), p1s0 ...]``) draws its uniforms from its own CPU
  ``torch.Generator`` seeded with ``sample_seed(params.seed, i)``, so a sample's tokens do not
  depend on batch composition, chunking or device (up to the logits' own rounding).
- routing (``SamplingParams.return_routing``, MoE models): each token's experts and weights, as
  the HF model's routers chose them in the prefill and decode forwards (megarl/engines/routing.py).
- pushes while generating (asynchronous training, docs/async.md): ``load_weights`` /
  ``load_weights_from_disk`` may come from another thread during ``generate``
  (megarl/engines/weight_gate.py). With ``partial=True`` (partial rollouts) a push waits only
  for the decode step in progress; before the next token is sampled every running row's KV cache
  is rebuilt under the new weights by a prefill of its prompt and response so far (SGLang's
  ``retract`` pause mode, not ``in_place``: no token after the push is sampled from logits of old
  weights). With ``partial=False`` a push waits for the ``generate`` calls in flight, and a call
  that starts while a push waits or runs waits for it. Each response token records the weight
  version that sampled it (``GenerationResult.token_versions``).

Deliberately left out: prefix sharing between the ``n`` samples of a prompt, continuous
batching, tensor parallelism, min_p / penalties. Weights arrive through :meth:`load_weights`
(HF names, full tensors) from a weight-sync transport.
"""

from __future__ import annotations

import inspect
import random
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.checkpoint.model_checkpoint import is_model_checkpoint
from megarl.engines.base import (
    EngineHealth,
    GenerationResult,
    SamplingParams,
    WeightBucket,
    eos_token_ids,
)
from megarl.engines.routing import NoRecorder, RouterRecorder
from megarl.engines.seeds import sample_seed
from megarl.engines.weight_gate import WeightGate

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightLoadError(ValueError):
    """A weight push that does not match the engine's model (unknown name, shape, missing)."""


def _load_model(model_path: str | Path, dtype: torch.dtype | None, device: torch.device) -> Any:
    """The HF model of ``model_path``; a model checkpoint (no HF weights) is built from its config
    with random weights, which the trainer's initial weight push replaces before any generation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if is_model_checkpoint(model_path):
        config = AutoConfig.from_pretrained(str(model_path))
        with torch.device(device):  # initialised where it runs: no CPU copy of a large model first
            return AutoModelForCausalLM.from_config(config, dtype=dtype or getattr(config, "dtype", None) or torch.float32)
    from megarl.terminal import hf_progress_bars_off

    with hf_progress_bars_off():
        return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype or "auto")


class TorchEngine:
    """One HF model that generates (see the module docstring for the exact conventions)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        max_running_requests: int = 256,
        compact_fraction: float = 0.25,
        partial: bool = False,
    ) -> None:
        """Load ``model_path`` (an HF directory, or a model checkpoint of `megarl convert
        hf-to-megatron`: its architecture, with the weights of the trainer's first push).
        ``dtype`` None = the config's dtype.

        ``max_running_requests`` bounds the rows decoded together; ``compact_fraction``: drop
        finished rows from the KV cache once that fraction of the running rows has finished.
        ``partial``: a push from another thread lands between two decode steps (partial
        rollouts), else between ``generate`` calls (see the module docstring).
        """
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests ({max_running_requests}) must be >= 1")
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
            dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        self.model = _load_model(model_path, dtype, self.device)
        self._cache = _cache_argument(self.model)
        # Built from a config alone, the weights are random until the first complete push.
        self._weights_missing = is_model_checkpoint(model_path)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = _load_tokenizer(model_path)
        self.max_running_requests = max_running_requests
        self.compact_fraction = compact_fraction
        self.eos_token_ids = eos_token_ids(model_path, self.tokenizer)
        self.pad_token_id = _pad_id(self.model, self.tokenizer, self.eos_token_ids)
        self._weight_version = 0
        self._experts = fused_expert_slices(self.model)  # a pushed per-expert name -> its place in a fused tensor
        fused = {piece.param for piece in self._experts.values()}
        # What a push must deliver: each parameter, except fused experts, which arrive one per expert.
        self._param_names = {k: v for k, v in _canonical_param_names(self.model).items() if k not in fused}
        self._param_names.update({name: name for name in self._experts})
        self._received: set[str] = set()
        self.partial = partial
        self._gate = WeightGate()
        self._push_open = False  # a push's first bucket arrived, its last not yet
        self._push_thread = 0  # the thread that sent that first bucket
        self._pushes = 0  # completed pushes: a decode loop that sees it change rebuilds its cache
        # Called by the decode loop between two steps, outside the gate, with the tokens sampled
        # per row so far (tests use it to push at a known point; None: nothing).
        self.step_hook: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        first_sample_index: int = 0,
    ) -> list[GenerationResult]:
        """Sample ``params.n`` responses per prompt; results grouped ``[p0s0 .. p0s(n-1), p1s0 ...]``.

        ``first_sample_index`` offsets the global sample index used for seeding, for a caller
        that splits one request across calls or engines (sample j of prompt p has index
        ``first_sample_index + p * n + j``). A result's ``weight_version`` is its last token's.
        """
        if self._push_open and self._push_thread == threading.get_ident():  # waiting for ourselves would hang
            raise WeightLoadError("this thread began a weight push whose last bucket never arrived (the push failed "
                                  "midway?); the engine's weights are incomplete, push them again before generating")
        # without partial rollouts a push waits for the whole call (and the call for a pending push)
        with nullcontext() if self.partial else self._gate.use():
            return self._generate(prompts, params, first_sample_index)

    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, first_sample_index: int) -> list[GenerationResult]:
        if self._weights_missing:
            raise WeightLoadError("this engine was built from a model checkpoint's config and has random weights "
                                  "until the first complete weight push; push the weights before generating")
        _validate_params(params, self.tokenizer)
        params.check_budgets(len(prompts))
        prompts = [list(map(int, p)) for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token; got an empty prompt")
        base_seed = params.seed if params.seed is not None else random.getrandbits(63)
        rows = [(p, j) for p in range(len(prompts)) for j in range(params.n)]
        results: list[GenerationResult] = []
        for start in range(0, len(rows), self.max_running_requests):
            chunk = rows[start : start + self.max_running_requests]
            seeds = [sample_seed(base_seed, first_sample_index + start + k) for k in range(len(chunk))]
            recorder = RouterRecorder(self.model, len(chunk)) if params.return_routing else NoRecorder()
            with recorder:
                decoded = self._decode([prompts[p] for p, _ in chunk], seeds, params, [params.budget(p) for p, _ in chunk],
                                       recorder)  # fmt: skip
            for k, ((p, _), (ids, lps, versions, reason)) in enumerate(zip(chunk, decoded, strict=True)):
                experts, weights = recorder.result(k)
                results.append(GenerationResult(p, ids, lps, reason, versions[-1] if versions else self._weight_version,
                                                experts, weights, token_versions=tuple(versions)))  # fmt: skip
        return results

    @torch.no_grad()
    def _decode(
        self, prompts: Sequence[Sequence[int]], seeds: list[int], params: SamplingParams, budgets: list[int],
        recorder: RouterRecorder | NoRecorder,
    ) -> list[tuple[list[int], list[float], list[int], str]]:
        """Prefill then decode one batch of rows, row ``r`` up to ``budgets[r]`` tokens; returns
        (response ids, log-probs, weight version of each token, finish reason). ``recorder`` is
        told whose tokens each forward held."""
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        stop_ids = set() if params.ignore_eos else set(self.eos_token_ids) | set(params.stop_token_ids)
        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * len(prompts)
        run: _Running | None = None
        for step in range(max(budgets)):
            if step and self.step_hook is not None:
                self.step_hook(step)
            with self._gate.use() if self.partial else nullcontext():  # a partial rollout's push lands between steps
                if run is None or run.pushes != self._pushes:
                    # first step, or new weights: every running row's cache from its tokens so far, under these weights
                    alive = [r for r in range(len(prompts)) if reasons[r] is None]
                    run = self._prefill([[*prompts[r], *responses[r]] for r in alive], alive, recorder)
                tokens, lps = sample_tokens(run.logits.float(), params, [gens[r] for r in run.rows])
                version = self._weight_version
                for r, tok, lp in zip(run.rows, tokens.tolist(), lps.tolist(), strict=True):
                    if reasons[r] is not None:
                        continue
                    responses[r].append(tok)
                    logprobs[r].append(lp)
                    versions[r].append(version)
                    reasons[r] = self._finish_reason(responses[r], budgets[r], stop_ids, params.stop)
                    run.finished += reasons[r] is not None
                if all(reason is not None for reason in reasons):
                    break
                self._advance(run, tokens, reasons, recorder)
        return [(responses[r], logprobs[r], versions[r], reasons[r] or "length") for r in range(len(prompts))]

    def _prefill(self, seqs: list[list[int]], rows: list[int], recorder: RouterRecorder | NoRecorder) -> _Running:
        """One forward over ``seqs`` (row ``rows[b]``'s prompt and response so far), left-padded."""
        ids, mask = _left_pad(seqs, self.pad_token_id, self.device)  # [B, S] each
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        recorder.prefill([len(s) for s in seqs], rows)
        return _Running(rows, getattr(out, self._cache), mask, positions[:, -1] + 1, out.logits[:, -1, :], self._pushes)

    def _advance(self, run: _Running, tokens: torch.Tensor, reasons: list[str | None],
                 recorder: RouterRecorder | NoRecorder) -> None:  # fmt: skip
        """Feed each cache row its newest token (``tokens`` [B]), after dropping finished rows
        from the cache once ``compact_fraction`` of them has finished; ``run.logits`` then predict the next."""
        if run.finished >= max(1, self.compact_fraction * len(run.rows)):
            alive = [k for k, r in enumerate(run.rows) if reasons[r] is None]
            keep = torch.tensor(alive, device=self.device)
            run.cache.batch_select_indices(keep)
            run.rows = [run.rows[k] for k in alive]
            tokens, run.mask, run.next_pos = tokens[keep], run.mask[keep], run.next_pos[keep]
            run.finished = 0
        run.mask = torch.cat([run.mask, run.mask.new_ones(len(run.rows), 1)], dim=1)
        out = self.model(input_ids=tokens[:, None], attention_mask=run.mask, position_ids=run.next_pos[:, None],
                         use_cache=True, **{self._cache: run.cache})  # fmt: skip
        # a row that finished stays in the cache until the next compaction: its token is no sample's
        recorder.decode([r if reasons[r] is None else None for r in run.rows])
        run.cache, run.logits = getattr(out, self._cache), out.logits[:, -1, :]
        run.next_pos = run.next_pos + 1

    def _finish_reason(self, response: list[int], budget: int, stop_ids: set[int], stops: Sequence[str]) -> str | None:
        """Why the response ends with its newest token: "stop", "length", or None (it goes on)."""
        if response[-1] in stop_ids or self._hits_stop_string(response, stops):
            return "stop"
        return "length" if len(response) >= budget else None

    def _hits_stop_string(self, response: list[int], stops: Sequence[str]) -> bool:
        """Whether the response text now contains a stop string (a new match ends in its last token).

        Decodes only a tail: every token holds at least one byte and a character at most four,
        so ``4 * len(stop) + 4`` tokens cover any match that ends in the newest token.
        """
        if not stops:
            return False
        window = 4 * max(len(s) for s in stops) + 4
        text = self.tokenizer.decode(response[-window:], skip_special_tokens=False)
        return any(s in text for s in stops)

    # ------------------------------------------------------------------ weights

    def load_weights(self, bucket: WeightBucket) -> None:
        """Copy HF-named full tensors into the model; at ``bucket.last`` check completeness.

        Strict: an unknown name or a shape mismatch raises :class:`WeightLoadError`; at the last
        bucket every parameter must have been received since the previous push ended, then the
        weight version becomes ``bucket.version``. Tied weights may arrive under either name.
        A push's first bucket waits at the gate (no generation uses the weights until its last
        bucket or a failure; see the module docstring).
        """
        if not self._push_open:
            self._gate.begin_push()
            self._push_open, self._push_thread = True, threading.get_ident()
        try:
            self._load_bucket(bucket)
        except BaseException:
            self._end_push()
            raise
        if bucket.last:
            self._end_push()

    def _end_push(self) -> None:
        self._push_open = False
        self._gate.end_push()

    @torch.no_grad()
    def _load_bucket(self, bucket: WeightBucket) -> None:
        state = self.model.state_dict(keep_vars=True)
        for name, tensor in bucket.tensors:
            if name not in self._param_names:
                raise WeightLoadError(
                    f"weight push sent {name!r}, which the engine's model has no parameter for "
                    f"(expected HF names such as {next(iter(self._param_names))!r}); "
                    "check that trainer and engine load the same architecture"
                )
            piece = self._experts.get(name)
            target = state[name] if piece is None else state[piece.param][piece.expert, piece.rows]
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightLoadError(
                    f"weight push sent {name!r} with shape {tuple(tensor.shape)}, "
                    f"the engine's model has {tuple(target.shape)}"
                )
            target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._received.add(self._param_names[name])
        if bucket.last:
            missing = sorted(set(self._param_names.values()) - self._received)
            self._received = set()
            if missing:
                raise WeightLoadError(
                    f"weight push {bucket.version} ended without {len(missing)} parameter(s): "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
                )
            self._weight_version = bucket.version
            self._weights_missing = False
            self._pushes += 1

    def load_weights_from_disk(self, directory: str | Path, version: int) -> None:
        """Load every ``*.safetensors`` file of ``directory`` (HF names) as one push."""
        from safetensors import safe_open

        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"no *.safetensors files in {directory}")
        try:
            for i, path in enumerate(files):
                with safe_open(str(path), framework="pt") as f:
                    tensors = [(k, f.get_tensor(k)) for k in f.keys()]
                self.load_weights(WeightBucket(tensors, version, last=i == len(files) - 1))
        except BaseException:
            if self._push_open:  # a file after the first failed to read: generation may go on
                self._end_push()
            raise

    @property
    def weight_version(self) -> int:
        return self._weight_version

    # ------------------------------------------------------------------ health

    def health(self) -> EngineHealth:
        dtype = next(self.model.parameters()).dtype
        return EngineHealth(True, self._weight_version, f"torch engine on {self.device} ({dtype})")


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V] (float32); returns (tokens [B], log-probs [B]).

    Row ``b`` draws one uniform from ``generators[b]`` and inverts the CDF of the (filtered)
    distribution, so its choice depends on its own generator and logits only.
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [B, V], reported (pre-filter)
    probs = logp.exp()
    order = None
    if params.top_k > 0 or params.top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        if params.top_k > 0:
            probs[:, params.top_k :] = 0.0
        if params.top_p < 1.0:
            before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
            probs = probs.masked_fill(before > params.top_p, 0.0)
    uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # rounding can put the target at the very top: fall back to the last token with mass
    last_positive = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
    picked = torch.minimum(picked, last_positive)
    tokens = picked if order is None else order.gather(-1, picked[:, None]).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _validate_params(params: SamplingParams, tokenizer) -> None:
    if params.n < 1:
        raise ValueError(f"SamplingParams.n ({params.n}) must be >= 1")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens ({params.max_new_tokens}) must be >= 1")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"SamplingParams.top_p ({params.top_p}) must be in (0, 1]")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"SamplingParams.top_k ({params.top_k}) must be -1 (whole vocabulary) or >= 1")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature ({params.temperature}) must be >= 0")
    if params.stop and tokenizer is None:
        raise ValueError(
            f"stop strings {list(params.stop)} need a tokenizer, and the engine's model directory "
            "has none; use stop_token_ids or save a tokenizer next to the model"
        )
    if any(s == "" for s in params.stop):
        raise ValueError("SamplingParams.stop contains an empty string; remove it")


def _left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists; returns (ids [B, L] long, attention mask [B, L] long)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids[b, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[b, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def _load_tokenizer(model_path: str | Path):
    """The directory's tokenizer, or None (a model-only directory still generates from ids)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _pad_id(model, tokenizer, eos_ids: tuple[int, ...]) -> int:
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model.generation_config, "pad_token_id", None),
        getattr(model.config, "pad_token_id", None),
    ):
        if candidate is not None:
            return int(candidate)
    return eos_ids[0] if eos_ids else 0  # padded positions are masked out: any id works


@dataclass
class _Running:
    """The rows one decode loop runs together and their KV cache, built under one push's weights."""

    rows: list[int]  # the loop's row of each cache row
    cache: Any  # the model's KV cache (DynamicCache) of those rows
    mask: torch.Tensor  # [B, S] long, 1 = a real token
    next_pos: torch.Tensor  # [B] the position of each row's next token
    logits: torch.Tensor  # [B, V] predicting each row's next token
    pushes: int  # the engine's completed pushes when the cache was built
    finished: int = 0  # rows finished since the cache was built or last compacted


@dataclass(frozen=True)
class ExpertSlice:
    """Where one expert's HF tensor lives inside a fused experts parameter."""

    param: str  # the fused parameter's state-dict key, e.g. model.layers.0.mlp.experts.gate_up_proj
    expert: int  # its index along dim 0 ([E, ...])
    rows: slice  # its rows along dim 1: gate or up half of gate_up_proj, all of down_proj


def fused_expert_slices(model: torch.nn.Module) -> dict[str, ExpertSlice]:
    """Per-expert HF name -> its slice of the fused parameter, for every experts module.

    transformers 5 holds an MoE layer's experts fused in memory (``gate_up_proj`` [E, 2F, H]:
    gate rows first, as its forward chunks them; ``down_proj`` [E, H, F]) but saves them one
    tensor per expert (``experts.{e}.gate_proj.weight`` ...), which is what the trainer pushes.
    Its own loader fuses whole checkpoint files; a push arrives a bucket at a time, so the engine
    copies each expert's tensor into its slice. Dense models have no such module: empty."""
    out: dict[str, ExpertSlice] = {}
    for path, module in model.named_modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3):
            continue
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{path}.{e}.gate_proj.weight"] = ExpertSlice(f"{path}.gate_up_proj", e, slice(0, half))
            out[f"{path}.{e}.up_proj.weight"] = ExpertSlice(f"{path}.gate_up_proj", e, slice(half, 2 * half))
            out[f"{path}.{e}.down_proj.weight"] = ExpertSlice(f"{path}.down_proj", e, slice(None))
    return out


def _canonical_param_names(model: torch.nn.Module) -> dict[str, str]:
    """Every state-dict key -> the name of that parameter (tied ones share one); a persistent
    buffer, such as DeepSeek-V3's router ``e_score_correction_bias`` (in the checkpoint, pushed,
    moved by load outside the optimizer), is its own name."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    return {key: by_id.get(id(t), key) for key, t in model.state_dict(keep_vars=True).items()}


def _cache_argument(model: torch.nn.Module) -> str:
    """The name of the KV cache in the model's forward and output: ``cache`` since transformers
    5.2x (where the older ``past_key_values`` still works, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
