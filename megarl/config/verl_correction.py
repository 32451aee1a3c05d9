"""The converters of verl's ``algorithm.rollout_correction`` keys (verl/trainer/config/algorithm.py,
RolloutCorrectionConfig) into megarl's ``algorithm.old_logprobs``, ``algorithm.tis`` and
``algorithm.mis``: bypass mode, truncated importance weights and rejection sampling, with the
bounds verl's statistics imply. The rules that name them are in megarl/config/verl_keys.py; the
converter protocol (``Unused``, ``Refused``, ``Noted``) is megarl/config/verl_values.py's.
Torch-free, like every config module.
"""

from __future__ import annotations

from typing import Any

from megarl.config.verl_values import NOT_YET, Noted, Refused, Unused, Verl, choice

_CORRECTION = "algorithm.rollout_correction"
# rejection options whose statistic is -log(pi_train / pi_rollout) against ratio bounds (lower_upper):
# megarl's mis levels, which bound the ratio itself. verl's k2 / k3 / max options bound divergences.
_RS_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}
_RS_OTHERS = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _bypass(v: Verl) -> bool:
    return bool(v.get(f"{_CORRECTION}.bypass_mode"))


def bypass_mode(value: Any, v: Verl) -> str:
    """verl's bypass mode takes the engine's log-probs as PPO's old ones (no recomputation):
    megarl's algorithm.old_logprobs=engine."""
    return "engine" if value else "recompute"


def correction_loss_type(value: Any, v: Verl) -> Any:
    if not _bypass(v):
        raise Unused(f"verl reads it only with {_CORRECTION}.bypass_mode=true")
    choice(value, {"ppo_clip": None}, f"megarl has no {value} loss in bypass mode (REINFORCE with explicit IS weights)")
    raise Unused("ppo_clip: PPO's clipped ratio to the engine's log-probs, megarl's policy loss with algorithm.old_logprobs=engine")


def rollout_is(value: Any, v: Verl) -> str:
    """Truncated importance weights pi_old / pi_rollout, per token or per sequence (decoupled mode)."""
    if value is None:
        raise Unused("null: no importance weights (megarl's algorithm.tis.level none)")
    level = str(choice(value, {"token": "token", "sequence": "sequence"}, f"megarl has no {value} importance sampling"))
    if _bypass(v):
        raise Unused("verl applies no importance weights in bypass mode with ppo_clip (the PPO ratio is already taken to "
                     "the engine's log-probs; the weights are metrics only): megarl's tis stays none")  # fmt: skip
    return level


def rollout_is_threshold(value: Any, v: Verl) -> float:
    if v.get(f"{_CORRECTION}.rollout_is") is None or _bypass(v):
        raise Unused(f"verl applies it only with {_CORRECTION}.rollout_is set, outside bypass mode")
    return float(value)


def rollout_is_batch_normalize(value: Any, v: Verl) -> Any:
    if not value:
        raise Unused("false: the truncated weights as they are (megarl's tis)")
    if v.get(f"{_CORRECTION}.rollout_is") is None or _bypass(v):
        raise Unused(f"verl applies it only with {_CORRECTION}.rollout_is set, outside bypass mode")
    raise Unused("megarl's tis weights are not normalised to a batch mean of 1: the megarl run would differ from verl's",
                 NOT_YET, differs=True)  # fmt: skip


def _ratio_bounds(spec: Any) -> tuple[float, float]:
    """verl's k1 threshold as (lower, upper) bounds of pi_rollout / pi_train: "lower_upper", or one
    upper bound u with lower 1/u (verl's _parse_rollout_rs_thresholds); Refused naming the
    threshold key when it is neither."""
    text = str(spec).strip()
    lower, sep, upper = text.partition("_")
    try:
        return (1.0 / float(text), float(text)) if not sep else (float(lower), float(upper))
    except (ValueError, ZeroDivisionError):
        raise Refused(spec, ["LOWER_UPPER (e.g. 0.5_2.0)", "UPPER (e.g. 2.0)"],
                      f"{_CORRECTION}.rollout_rs_threshold={spec} is not verl's threshold") from None  # fmt: skip


def rollout_rs(value: Any, v: Verl) -> Any:
    """verl's rejection sampling with a k1 option is megarl's mis: the same tokens or sequences are
    rejected (verl's statistic -log r is bounded by log lower / log upper, so the kept ratio
    pi_train / pi_rollout lies in [1/upper, 1/lower])."""
    if value is None:
        raise Unused("null: no rejection (megarl's algorithm.mis.level none)")
    options = list(dict.fromkeys(o.strip() for o in str(value).split(",") if o.strip()))
    for option in options:
        choice(option, dict.fromkeys([*_RS_LEVELS, *_RS_OTHERS]), f"{option} is not a rejection option verl knows")
    if _bypass(v):
        raise Unused("in bypass mode verl rejects against the policy being trained, at every mini-batch; megarl's mis "
                     "needs algorithm.old_logprobs=recompute: the megarl run would differ from verl's", NOT_YET, differs=True)  # fmt: skip
    if len(options) > 1 or options[0] not in _RS_LEVELS:
        raise Unused(f"{value}: megarl's mis bounds the ratio pi_train / pi_rollout at one level ({', '.join(_RS_LEVELS)}); "
                     "verl's k2 / k3 / max options and chained options are not supported yet: the megarl run would differ "
                     "from verl's", NOT_YET, differs=True)  # fmt: skip
    threshold = v.get(f"{_CORRECTION}.rollout_rs_threshold")
    if threshold is None:
        raise Refused(None, ["lower_upper", "upper"], f"verl needs {_CORRECTION}.rollout_rs_threshold with rollout_rs={value}")
    lower, upper = _ratio_bounds(threshold)
    note = (f"kept where pi_train / pi_rollout lies in [1/{upper:g}, 1/{lower:g}]; verl takes rejected tokens out of "
            "response_mask (the loss normaliser, the KL and entropy terms, the critic), megarl's mis drops them from the "
            "policy-gradient term only and keeps them in the normaliser")  # fmt: skip
    return Noted((_RS_LEVELS[options[0]], 1.0 / upper, 1.0 / lower), note)


def rollout_rs_threshold(value: Any, v: Verl) -> Any:
    if v.get(f"{_CORRECTION}.rollout_rs") is None:
        raise Unused(f"verl reads it only with {_CORRECTION}.rollout_rs set")
    _ratio_bounds(value)  # a threshold verl cannot read is refused on its own row too
    raise Unused(f"the bounds of {_CORRECTION}.rollout_rs (its row gives algorithm.mis.low / high)")
