"""The planner's checks of the algorithm and of the run's length: what the estimator, the KL
terms, dynamic sampling and overlong shaping need of the other sections, and how many steps the
run takes (trainer.total_steps, or trainer.total_epochs once the data is read: the critic's
warm-up must leave steps to train). Used by megarl/plan/planner.py, and by the preflight and
the trainer for the epoch-derived check."""

from __future__ import annotations

from megarl.config.algorithm_sections import GROUP_ESTIMATORS
from megarl.config.sections import MegaRLConfig, TrainerConfig
from megarl.plan.issues import Issue


def check_algorithm(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """The algorithm's needs of the other sections (a critic, a reference, n >= 2, ...)."""
    alg = cfg.algorithm
    if alg.estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        issues.append(Issue("rollout.n", f"({cfg.rollout.n}) must be >= 2 for the group estimator {alg.estimator}: "
                            "advantages compare the samples of one prompt"))
    if alg.estimator == "gae" and not cfg.critic_enabled:
        issues.append(Issue("critic.enabled", "estimator gae needs a critic; set critic.enabled=true or pick a critic-free estimator (grpo, rloo, ...)"))
    if alg.kl.enabled and not cfg.reference_enabled:
        issues.append(Issue("reference.enabled", "a KL term (algorithm.kl.use_in_reward / use_in_loss) needs the reference policy; "
                            "set reference.enabled=true or turn the KL off"))
    if cfg.trainer.critic_warmup_steps and not cfg.critic_enabled:
        issues.append(Issue("trainer.critic_warmup_steps", "needs a critic (estimator gae)"))
    if alg.kl.controller == "adaptive" and not alg.kl.use_in_reward:
        issues.append(Issue("algorithm.kl.controller", "adaptive adjusts the KL penalty in the reward; with use_in_reward=false "
                            "it would be ignored: set algorithm.kl.use_in_reward=true or controller=fixed"))
    if alg.kl.controller == "adaptive" and alg.kl.use_in_reward and alg.kl.reward_kl_coef == 0:
        key = "algorithm.kl.coef" if alg.kl.reward_coef is None else "algorithm.kl.reward_coef"
        issues.append(Issue(key, "(0) is the adaptive controller's starting value, and its rule multiplies it: "
                            "it would stay 0 and the reward carry no KL penalty; set a positive value (e.g. 0.001)"))
    for use, on, switch in (("reward", alg.kl.use_in_reward, "use_in_reward"), ("loss", alg.kl.use_in_loss, "use_in_loss")):
        for knob in (f"{use}_coef", f"{use}_estimator"):
            if getattr(alg.kl, knob) is not None and not on:
                issues.append(Issue(f"algorithm.kl.{knob}", f"({getattr(alg.kl, knob)}) is ignored: there is no KL in the {use} "
                                    f"(algorithm.kl.{switch}=false); set {switch}=true or drop it", level="warning"))
    if alg.dynamic_sampling.enabled and (alg.estimator not in GROUP_ESTIMATORS or cfg.rollout.n < 2):
        issues.append(Issue("algorithm.dynamic_sampling", f"filters groups by reward variance, which only group estimators "
                            f"with n >= 2 learn from (estimator {alg.estimator}, n {cfg.rollout.n})", level="warning"))
    _check_engine_old_logprobs(cfg, issues)
    if alg.overlong.length >= cfg.rollout.sampling.max_new_tokens:
        issues.append(Issue("algorithm.overlong.length", f"({alg.overlong.length}) must be below rollout.sampling.max_new_tokens "
                            f"({cfg.rollout.sampling.max_new_tokens})"))


def _check_engine_old_logprobs(cfg: MegaRLConfig, issues: list[Issue]) -> None:
    """With the engine's log-probs as the old ones, the behaviour correction (old / engine) is 1
    for every token: TIS and MIS would do nothing while the user believes they correct."""
    if cfg.algorithm.old_logprobs != "engine":
        return
    for knob in ("tis", "mis"):
        if getattr(cfg.algorithm, knob).level != "none":
            issues.append(Issue(f"algorithm.{knob}.level", f"({getattr(cfg.algorithm, knob).level}) weighs by old / engine "
                                "log-probs, which is 1 with algorithm.old_logprobs=engine (the ratio is already taken to "
                                f"the engine's policy); set algorithm.{knob}.level=none or algorithm.old_logprobs=recompute"))  # fmt: skip


def check_run_length(t: TrainerConfig, issues: list[Issue]) -> None:
    """How many steps the run takes: trainer.total_steps wins over trainer.total_epochs (as verl's
    total_training_steps does), which is only resolved to steps once the data is read."""
    if t.total_steps is None and t.total_epochs is None:
        issues.append(Issue("trainer.total_steps", "set trainer.total_steps or trainer.total_epochs"))
    elif t.total_steps is not None and t.total_epochs is not None:
        # A warning, not a refusal: a config with total_epochs cut short by a total_steps override is common.
        issues.append(Issue("trainer.total_epochs", f"({t.total_epochs}) is ignored: trainer.total_steps ({t.total_steps}) "
                            "sets the run's length; drop one of them", level="warning"))  # fmt: skip
    if t.total_steps is not None:
        warmup = _critic_warmup_issue(t, t.total_steps, f"trainer.total_steps ({t.total_steps})", "trainer.total_steps")
        if warmup is not None:
            issues.append(warmup)


def _critic_warmup_issue(t: TrainerConfig, steps: int, length: str, knob: str) -> Issue | None:
    """The critic's warm-up must leave the policy steps to train. ``length`` says what the run's
    ``steps`` are (trainer.total_steps, or total_epochs over the data, known once it is read);
    ``knob`` is the field that raises them."""
    if t.critic_warmup_steps < steps:
        return None
    return Issue("trainer.critic_warmup_steps", f"({t.critic_warmup_steps}) must be below {length}, or the policy never "
                 f"trains; lower it or raise {knob}")


def epochs_warmup_issue(t: TrainerConfig, rows: int, per_epoch: int, *, at_most: bool = False) -> Issue | None:
    """:func:`_critic_warmup_issue` for a run of trainer.total_epochs passes of ``per_epoch`` steps
    over ``rows`` prompts; ``at_most``: the rows before overlong prompts are dropped."""
    assert t.total_epochs is not None
    steps = t.total_epochs * per_epoch
    length = (f"the run's {'at most ' if at_most else ''}{steps} steps (trainer.total_epochs {t.total_epochs} x "
              f"{per_epoch} steps per epoch over {rows} training prompts)")  # fmt: skip
    return _critic_warmup_issue(t, steps, length, "trainer.total_epochs")
