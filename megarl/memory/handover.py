"""The memory hand-over: the one owner of what is on the devices in each phase of a run.

The residency table (megarl/memory/residency.py) says which states are resident in each phase;
:meth:`Handover.enter` moves exactly the states that differ between the phase it leaves and the
one it enters, freeing first (trained models' ``offload``, engines' ``release``) and taking
after (``resume``, ``onload``). Nothing else in megarl calls offload / onload / release /
resume; the workers move only what they are told.

Who enters which phase: the step's phase objects (megarl/trainer/phases.py) before they call
the workers, :class:`HandedOverEngines` before every generation (the step's, ReMax's baseline,
validation, the post-push check's), :class:`HandedOverScorer` before every scoring (with a
colocated reward model, the only run whose table has a ``reward`` phase), :class:`CheckpointedModel`
before save / load / the parameter checksum. One hand-over per run, built from the run's table, whatever the engine:

- torch engine (colocated by construction): only the trained models move (with their offload
  flags); the engine lives in the policy ranks and never moves;
- colocated SGLang (``engines``: megarl/memory/sglang_memory.py ``SGLangMemory``): the
  engines' tags are released and resumed as the table says; servers start (and restart) with
  nothing of the trained models on the GPUs (``launch``), so SGLang sizes its KV cache from the
  memory it will have;
- disaggregated SGLang: nothing of the engines moves; only restarts;
- a colocated reward model (``models["reward_model"]``: megarl/rollout/reward_model_role.py) is
  onloaded for ``reward`` and offloaded after, as a trained model's states are.

Engine weights released without SGLang's CPU copy come back as garbage: before a generation
that follows such a release (or a restart), the hand-over passes through ``weight_push`` and
re-pushes the last version. With the table's rules this happens after a checkpoint and after a
restart; the post-push check, ReMax's baseline and validation generate without a re-push. SGLang
engines start with random weights (``--load-format dummy``) and hold nothing of the trainer's
until its first push: a generation before it is refused.

A colocated SGLang step, with every offload flag on (``engine`` = every engine)::

    generate          policy: offload weights; engine: resume kv_cache, cuda_graph
    policy_forward    engine: release kv_cache, cuda_graph; policy: onload weights
    reference_forward policy: offload weights; policy(reference): onload weights
    policy_update     policy(reference): offload weights; engine: release weights;
                      policy: onload weights, grads (zeroed), optimizer
    weight_push       policy: offload grads (freed), optimizer; engine: resume weights; push
    (check) generate  policy: offload weights; engine: resume kv_cache, cuda_graph
    (check) policy_forward ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

from megarl.engines.base import Engines, GenerationResult, SamplingParams
from megarl.memory.residency import (
    CHECKPOINT,
    ENGINE,
    GENERATE,
    LAUNCH,
    POLICY,
    REWARD,
    START,
    WEIGHT_PUSH,
    Residency,
    owner_of,
    states_of,
)

log = logging.getLogger(__name__)
ENGINE_STATES = frozenset(states_of(ENGINE))


class EngineMemory(Protocol):
    """The engines' side of the hand-over (colocated or disaggregated SGLang)."""

    def release(self, states: Collection[str], engines: Sequence[Any] | None = None) -> None:
        """Release ``engine/...`` states on ``engines`` (None: all)."""
        ...

    def resume(self, states: Collection[str]) -> None: ...

    def dead(self) -> list[Any]:
        """The engines whose health check fails."""
        ...

    def restart(self, engines: Sequence[Any]) -> None:
        """Relaunch ``engines`` (they come up holding all their memory) and reconnect the policy."""
        ...


class Handover:
    """Moves memory between the phases of the run's residency table (module docstring).

    ``models``: the trained models' clients by role (``policy``: a PolicyClient, which also
    owns the reference's states; ``critic``); ``engines``: the SGLang engines' memory (None
    with the torch engine; :meth:`launch` sets it).
    """

    def __init__(self, table: Residency, models: Mapping[str, Any], engines: EngineMemory | None = None) -> None:
        self.table, self.models, self.engines = table, dict(models), engines
        self.phase = START
        self.version: int | None = None  # the last version pushed to every engine
        # engine weights not the trainer's: lost since that push (released without a CPU copy,
        # restarted), or never pushed (just launched)
        self.stale = False
        self.repushes = 0
        self.restarts = 0

    # ---- the phases ---------------------------------------------------------------------
    def enter(self, phase: str) -> None:
        """Make the devices hold what ``phase`` needs. Before the engines are used (generate,
        push), dead ones are restarted; before a generation, stale engine weights are re-pushed."""
        if phase in (GENERATE, WEIGHT_PUSH):
            self._recover()
        if phase == GENERATE and self.stale:
            self._repush()
        self._move(self.table.resident(self.phase), self.table.resident(phase))
        self.phase = phase

    def pushed(self, version: int) -> None:
        """Every engine holds ``version`` now (called after each push)."""
        self.version, self.stale = version, False

    def launch(self, start: Callable[[], EngineMemory]) -> None:
        """Start the engines with the devices as the ``launch`` phase says (colocated SGLang:
        nothing of the trained models on them), then back to the current phase."""

        def started() -> None:
            self.engines = start()  # every engine was just started: None = all of them

        self._relaunch(started)
        # Launched from random weights (--load-format dummy) or the checkpoint, never the trainer's
        # (a resumed run's): nothing generates before the first push (_repush refuses).
        self.stale = True

    # ---- moves --------------------------------------------------------------------------
    def _move(self, now: frozenset[str], then: frozenset[str]) -> None:
        leaving, arriving = now - then, then - now
        self._offload(leaving)
        self._release(leaving & ENGINE_STATES)
        self.stale |= "engine/weights" in leaving and not self.table.weights_cpu_backup
        self._resume(arriving)
        self._onload(arriving)

    def _by_client(self, states: Collection[str]) -> dict[str, list[str]]:
        """Trained states grouped by the role whose client owns them (the reference: the policy's)."""
        out: dict[str, list[str]] = {}
        for state in sorted(states):
            owner = owner_of(state)
            if owner != ENGINE:
                out.setdefault(POLICY if owner == "reference" else owner, []).append(state)
        return out

    def _offload(self, states: Collection[str]) -> None:
        for role, mine in self._by_client(states).items():
            self.models[role].offload(mine)

    def _onload(self, states: Collection[str]) -> None:
        for role, mine in self._by_client(states).items():
            self.models[role].onload(mine)

    def _release(self, states: Collection[str], engines: Sequence[Any] | None = None) -> None:
        mine = sorted(s for s in states if owner_of(s) == ENGINE)
        if mine and self.engines is not None:
            self.engines.release(mine, engines)

    def _resume(self, states: Collection[str]) -> None:
        mine = sorted(s for s in states if owner_of(s) == ENGINE)
        if mine and self.engines is not None:
            self.engines.resume(mine)

    # ---- stale weights and restarts -----------------------------------------------------
    def _repush(self) -> None:
        """The last version again, through the weight_push phase (the push reads the policy's
        weights and writes the engines')."""
        if self.version is None:
            raise RuntimeError("the engines hold no pushed weights yet (they start from random weights, "
                               "--load-format dummy); push first: the trainer pushes before it generates")  # fmt: skip
        log.info("re-pushing weight version %d: the engines' weights were released or restarted since", self.version)
        self._move(self.table.resident(self.phase), self.table.resident(WEIGHT_PUSH))
        self.phase = WEIGHT_PUSH
        self.models[POLICY].push_weights(self.version)
        self.pushed(self.version)
        self.repushes += 1

    def _recover(self) -> None:
        """Restart dead engines the way they were launched, then back to the current phase; their
        weights are the initial ones until the next push."""
        dead = self.engines.dead() if self.engines is not None else []
        if not dead:
            return
        assert self.engines is not None
        engines = self.engines

        def restarted() -> Sequence[Any]:
            engines.restart(dead)
            return dead

        self._relaunch(restarted)
        self.restarts += len(dead)
        self.stale = True

    def _relaunch(self, start: Callable[[], Sequence[Any] | None]) -> None:
        """Around an engine (re)start: the trained states the ``launch`` row does not hold leave
        first (colocated SGLang: all), the (re)started engines release what the current phase
        does not hold, the trained states come back."""
        now = self.table.resident(self.phase)
        launch = self.table.rows.get(LAUNCH)
        out = frozenset(s for s in now if owner_of(s) != ENGINE) - launch if launch is not None else frozenset()
        self._offload(out)
        started = start()
        self._release(ENGINE_STATES - now, started)
        self.stale |= "engine/weights" not in now and not self.table.weights_cpu_backup
        self._onload(out)


class HandedOverEngines:
    """``engines`` whose every generation runs in the ``generate`` phase."""

    def __init__(self, engines: Engines, handover: Handover) -> None:
        self.engines, self.handover = engines, handover

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[GenerationResult]:
        self.handover.enter(GENERATE)
        return self.engines.generate(prompts, params)


class HandedOverScorer:
    """A reward scorer whose every call runs in the ``reward`` phase: a colocated reward model comes
    to the devices first (and leaves them at the next phase); ``scorer``: RewardScorer's ``score``."""

    def __init__(self, scorer: Any, handover: Handover) -> None:
        self.scorer, self.handover = scorer, handover

    def score(self, *args: Any, **kwargs: Any) -> Any:
        self.handover.enter(REWARD)
        return self.scorer.score(*args, **kwargs)

    def close(self) -> None:
        self.scorer.close()


class CheckpointedModel:
    """A trained model's client as the loop sees it: save, load and the parameter checksum run
    in the ``checkpoint`` phase (weights and optimizer state on the devices)."""

    def __init__(self, client: Any, handover: Handover) -> None:
        self.client, self.handover = client, handover

    @property
    def group(self) -> Any:
        return self.client.group

    def save(self, path: str) -> None:
        self.handover.enter(CHECKPOINT)
        self.client.save(path)

    def load(self, path: str) -> None:
        self.handover.enter(CHECKPOINT)
        self.client.load(path)

    def parameter_checksum(self) -> float:
        self.handover.enter(CHECKPOINT)
        return self.client.parameter_checksum()

    def start_profile(self) -> None:
        self.client.start_profile()

    def stop_profile(self, folder: str) -> None:
        self.client.stop_profile(folder)
