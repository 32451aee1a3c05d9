"""Model bridges: HF config/weights <-> Megatron GPTModel, one bridge per HF ``model_type``.

A bridge answers four questions for its architecture: which TransformerConfig an HF config
means (refusing what it does not handle, by name), how to build the GPTModel, which Megatron
parameter holds which HF tensor(s) in which layout (:class:`megarl.models.layouts.ParamRule`),
and what the full set of HF tensor names and shapes is. From the rules, this base class
implements streaming import (:meth:`ModelBridge.load_hf_weights`) and streaming export
(:meth:`ModelBridge.export_hf_tensors`), each checking that every tensor maps exactly once.

Export (the data path of weight sync and `megarl convert`) is a collective over the model's
TP and PP groups. Every rank of a DP replica calls it: TP shards are all-gathered within each
stage, and the stages' tensors reach the ranks that load them as ``collect`` says
(megarl/parallel/stage_collection.py: every rank, the replica's leader only, or none: each
stage yields its own). DP replicas of a dense model work independently (no cross-DP traffic);
a mixture-of-experts model's experts are also all-gathered over the expert-parallel group, which
may span DP replicas (megarl/models/layouts.py): then every rank of that group exports
together. Memory: one full tensor at a time beyond the model (one per EP rank for an expert).

Left out: vision towers; registering new architectures happens in their own modules
with :func:`register_bridge` (megarl/models/qwen3_moe.py: the first MoE family;
megarl/models/deepseek_v3.py: multi-latent attention);
megarl/models/bridges.py finds a model's bridge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from megarl.models.layer_specs import LayerSpec
from megarl.models.layouts import VALUE_HEAD_HF_NAME, ParamRule, ShardInfo, export_full, read_shard
from megarl.models.lora import is_adapter_name, lora_of
from megarl.models.safetensors_reader import SafetensorsReader
from megarl.parallel.cpu_compat import enable_cpu_compat
from megarl.parallel.sharding import all_gather_objects
from megarl.parallel.stage_collection import Collect, collect_stages, dtype_name, receives_all

BRIDGES: dict[str, type[ModelBridge]] = {}  # HF model_type -> bridge class (megarl/models/bridges.py looks up)
HF_CONFIG_ATTR = "megarl_hf_config"  # set on every GPTModel built by a bridge


def register_bridge(*model_types: str):
    """Class decorator: make ``get_bridge(model_type)`` (megarl/models/bridges.py) return an instance of the class."""

    def wrap(cls: type[ModelBridge]) -> type[ModelBridge]:
        for t in model_types:
            BRIDGES[t] = cls
        return cls

    return wrap


def unwrap_model(model: torch.nn.Module) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers (they hold it as ``.module``; megatron's, untyped)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


class ModelBridge:
    """Base of the per-architecture bridges (see module docstring). Subclasses implement the
    methods that raise NotImplementedError; the weight streaming below is shared."""

    # ---- architecture-specific -------------------------------------------------------------
    def check_hf_config(self, hf_config: Any) -> None:
        """Refuse, by name, every HF setting this bridge does not implement."""
        raise NotImplementedError

    def check_parallel(self, hf_config: Any, parallel: Any) -> None:
        """Refuse a parallel layout (a ParallelConfig) this model cannot be split into."""
        raise NotImplementedError

    def transformer_config(self, hf_config: Any, parallel: Any, dtype: torch.dtype, recompute: str = "none",
                           spec: LayerSpec = "local", moe: Any = None):  # fmt: skip
        """Megatron's TransformerConfig; ``moe``: the role's MoEConfig (None: its defaults), read by
        mixture-of-experts bridges only."""
        raise NotImplementedError

    def build_model(self, hf_config: Any, transformer_config: Any, *, pre_process: bool, post_process: bool,
                    value_head: bool = False, spec: LayerSpec = "local"):  # fmt: skip
        raise NotImplementedError

    def vocab_size(self, hf_config: Any) -> int:
        """The true vocabulary; logits columns at and beyond it are padding to mask out."""
        return int(hf_config.vocab_size)

    def padded_vocab_size(self, hf_config: Any, tp: int) -> int:
        raise NotImplementedError

    def hf_tensor_shapes(self, hf_config: Any) -> dict[str, tuple[int, ...]]:
        """Every tensor of the HF checkpoint (causal LM), by name."""
        raise NotImplementedError

    def param_rule(self, hf_config: Any, model: torch.nn.Module, megatron_name: str) -> ParamRule:
        """The rule of one local parameter; raises KeyError for a parameter it does not know."""
        raise NotImplementedError

    # ---- shared ------------------------------------------------------------------------------
    def mapped_buffers(self, gpt: Any) -> list[tuple[str, torch.Tensor]]:
        """Buffers (not parameters) that hold HF tensors too, by name: mapped by :meth:`param_rule`
        like parameters (DeepSeek-V3's router correction bias); none by default."""
        return []

    def carried_names(self, hf_config: Any, names: set[str]) -> set[str]:
        """Tensors among a checkpoint's ``names`` that no Megatron parameter holds and conversion
        carries through untouched (DeepSeek-V3's multi-token-prediction layers); none by default."""
        return set()

    def hf_param_names(self, hf_config: Any) -> set[str]:
        return set(self.hf_tensor_shapes(hf_config))

    def shard_info(self, hf_config: Any, model: torch.nn.Module) -> ShardInfo:
        from megatron.core import parallel_state as ps

        cfg = unwrap_model(model).config
        tp = ps.get_tensor_model_parallel_world_size()
        return ShardInfo(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=tp,
            num_heads=cfg.num_attention_heads,
            num_groups=cfg.num_query_groups,
            head_dim=cfg.kv_channels,
            vocab_size=self.vocab_size(hf_config),
            padded_vocab_size=self.padded_vocab_size(hf_config, tp),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
        )

    def local_rules(self, model: torch.nn.Module) -> list[tuple[ParamRule, torch.nn.Parameter]]:
        """(rule, parameter) for every parameter of this rank's model, in module order; the rules
        are checked (:meth:`check_rules`) before anything reads or writes a weight."""
        gpt = unwrap_model(model)
        hf_config = hf_config_of(gpt)
        out = []
        for name, param in [*gpt.named_parameters(), *self.mapped_buffers(gpt)]:
            if is_adapter_name(name):  # LoRA's own (megarl/models/lora.py): merged into the weights they adapt
                continue
            try:
                out.append((self.param_rule(hf_config, gpt, name), param))
            except KeyError as e:
                raise ValueError(f"Megatron parameter {name!r} has no HF mapping in {type(self).__name__}") from e
        self.check_rules(hf_config, [r for r, _ in out], self.shard_info(hf_config, gpt))
        return out

    def check_rules(self, hf_config: Any, rules: list[ParamRule], info: ShardInfo) -> None:
        """Raise ValueError unless every HF tensor is held by one exported rule of this rank at
        most (a tied embedding's second copy is not exported). A bridge with more to check about
        its rules (experts over the EP group: megarl/models/qwen3_moe.py) extends it."""
        owner: dict[str, str] = {}
        for rule in rules:
            for name in rule.exported_names() if rule.export else ():
                if name in owner:
                    raise ValueError(f"HF tensor {name} is mapped twice, by Megatron parameters {owner[name]} and {rule.megatron}")
                owner[name] = rule.megatron

    def load_hf_weights(self, model: torch.nn.Module, hf_path: str,
                        progress: Callable[[int, int], None] | None = None) -> None:  # fmt: skip
        """Fill this rank's parameters (its TP shard of its PP stage) from an HF directory.

        Reads only the needed slices. Errors name the tensor: an HF tensor no parameter maps to,
        an expected tensor missing from the files, a shape mismatch, an unmapped parameter.
        The value head of a critic is not in HF checkpoints and keeps its initialisation.
        ``progress(done, total)`` is called after each parameter.
        """
        gpt = unwrap_model(model)
        hf_config = hf_config_of(gpt)
        reader = SafetensorsReader(hf_path)
        self.check_hf_checkpoint(hf_config, reader, value_head=has_value_head(gpt))
        info = self.shard_info(hf_config, gpt)
        filled: set[str] = set()
        rules = self.local_rules(gpt)
        with torch.no_grad():
            for done, (rule, param) in enumerate(rules, 1):
                if progress is not None:
                    progress(done, len(rules))
                if rule.hf == (VALUE_HEAD_HF_NAME,):  # the critic's head: not in HF checkpoints
                    continue
                shard = read_shard(rule, reader, info)
                if tuple(shard.shape) != tuple(param.shape):
                    raise ValueError(
                        f"HF tensor(s) {', '.join(rule.hf)} give shape {tuple(shard.shape)} for "
                        f"Megatron parameter {rule.megatron} of shape {tuple(param.shape)}"
                    )
                param.data.copy_(shard.to(dtype=param.dtype))
                assert rule.megatron not in filled, rule.megatron
                filled.add(rule.megatron)

    def check_hf_checkpoint(self, hf_config: Any, hf: str | SafetensorsReader, value_head: bool = False) -> None:
        """Raise ValueError unless the checkpoint's tensor names and shapes are exactly what the
        config implies (no tensor mapping nowhere, none missing). Reads headers only."""
        reader = hf if isinstance(hf, SafetensorsReader) else SafetensorsReader(hf)
        expected = self.hf_tensor_shapes(hf_config)
        present = reader.names()
        # Present in some checkpoints but carrying nothing: a critic's (unused) lm_head, the
        # duplicate lm_head some tied checkpoints store, old rotary inv_freq buffers.
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        unused_ok = {"lm_head.weight"} if value_head or tied else set()
        unused_ok |= {n for n in present if n.endswith("rotary_emb.inv_freq")} | self.carried_names(hf_config, present)
        unknown = sorted(present - set(expected) - unused_ok)
        missing = sorted(set(expected) - present - unused_ok)
        if unknown or missing:
            raise ValueError(
                f"HF checkpoint {reader.path} does not match a {hf_config.model_type} model: "
                f"tensors that map to no Megatron parameter: {_some(unknown)}; expected tensors missing: {_some(missing)}"
            )
        for name in sorted(set(expected) & present):
            if reader.shape(name) != tuple(expected[name]):
                raise ValueError(
                    f"HF tensor {name} has shape {reader.shape(name)}, the config implies {tuple(expected[name])}"
                )

    def export_names(self, hf_config: Any, value_head: bool = False) -> set[str]:
        """Names a full export yields (the HF checkpoint's, or the critic's trunk + value head)."""
        names = self.hf_param_names(hf_config)
        if value_head:
            names = (names - {"lm_head.weight"}) | {VALUE_HEAD_HF_NAME}
        return names

    def export_hf_tensors(self, model: torch.nn.Module, *, gather_bytes: int,
                          collect: Collect = "all") -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """Yield ``(HF name, full tensor)`` one at a time (a collective over the replica's TP and
        PP groups). ``gather_bytes``: the TP shards of up to this many full bytes (one larger
        tensor alone) are gathered with one collective (a push passes its bucket size).
        ``collect``: which ranks also receive the other pipeline stages' tensors
        (megarl/parallel/stage_collection.py); the others yield their own stage's. Packing them
        into transfer buckets is the weight stream's job (megarl/weight_sync/stream.py)."""
        from megatron.core import parallel_state as ps

        enable_cpu_compat()  # this thread may not be the one that called init_parallel
        gpt = unwrap_model(model)
        hf_config = hf_config_of(gpt)
        info = self.shard_info(hf_config, gpt)
        mine = [(r, p) for r, p in self.local_rules(gpt) if r.export]
        pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        lora = lora_of(gpt)  # the weights with their adapters merged, one at a time
        own = export_full(mine if lora is None else ((r, lora.merged(p)) for r, p in mine), info, gather_bytes)
        if collect != "stage" and pp_size > 1:
            # Each stage announces (name, shape, dtype) of what it will send; receivers allocate
            # exactly that, so sender and receivers cannot disagree on a buffer's size.
            shapes = self.hf_tensor_shapes(hf_config) | _value_head_shapes(gpt)
            specs = all_gather_objects([(n, tuple(shapes[n]), dtype_name(p.dtype)) for r, p in mine for n in r.exported_names()])
            own = collect_stages(own, specs, collect, next(gpt.parameters()).device)
        seen: set[str] = set()
        for name, full in own:
            _note_once(seen, name)
            yield name, full
        if receives_all(collect, pp_rank, info.tp_rank, pp_size):
            _check_all_exported(seen, self.export_names(hf_config, has_value_head(gpt)))


def _note_once(seen: set[str], name: str) -> None:
    if name in seen:
        raise AssertionError(f"export produced HF tensor {name} twice")
    seen.add(name)


def _check_all_exported(seen: set[str], expected: set[str]) -> None:
    if seen != expected:
        raise AssertionError(
            f"export mismatch: missing {sorted(expected - seen)}, unexpected {sorted(seen - expected)}"
        )


def hf_config_of(gpt: torch.nn.Module) -> Any:
    cfg = getattr(gpt, HF_CONFIG_ATTR, None)
    if cfg is None:
        raise ValueError("this GPTModel was not built by a megarl ModelBridge (build_model); cannot map its weights")
    return cfg


def has_value_head(gpt: torch.nn.Module) -> bool:
    from megarl.models.value_head import ValueHead  # megatron-core: imported only with a model

    return isinstance(getattr(gpt, "output_layer", None), ValueHead)


def _value_head_shapes(gpt: Any) -> dict[str, tuple[int, ...]]:  # a megatron GPTModel (untyped)
    if not has_value_head(gpt):
        return {}
    return {VALUE_HEAD_HF_NAME: tuple(gpt.output_layer.weight.shape)}


def _some(names: list[str], shown: int = 8) -> str:
    """A list of tensor names for one error line: a real model's hundreds cut to the first few."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"
