"""One study: what both CLIs compare and how often -- the shared part of their configs.

rrfp-sim's :class:`~rrfp.sim.config.ExperimentConfig` is a :class:`Study` plus the cluster model (and
the workload the simulator samples); rrfp-run's :class:`~rrfp.exec.config.RunConfig` is a Study plus
the model, launch and fault settings. Both CLIs fill it once from the shared options
(rrfp.study.options.SHARED) with :meth:`Study.from_options`, and both expand its one trial grid,
:meth:`Study.trials`::

    >>> s = Study(pp=4, hints=("1f1b", "bfw"), policies=("fixed", "rrfp"), memory_budget=("1x", "2x"))
    >>> [t.label for t in s.trials()]
    ['fixed/1f1b', 'rrfp/1f1b', 'fixed/1f1b@2x', 'rrfp/1f1b@2x', 'rrfp/bfw', 'rrfp/bfw@2x']
    >>> [t.label for t in s.trials(split_fixed=True)][4:]
    ['fixed/bfw', 'rrfp/bfw', 'fixed/bfw@2x', 'rrfp/bfw@2x']

A Study is a plain record: each config that holds one checks its values and names a bad one in its own
CLI's words (``--pp`` in rrfp-run, ``stages`` in rrfp-sim), so neither CLI's refusals change with it.
Text given for ``hints``, ``policies`` or ``memory_budget`` is read as a comma list
(:func:`rrfp.study.options.split_list`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rrfp.study.compare import FIXED, base_hint_name, fixed_hint
from rrfp.study.options import BY_NAME, budget_label, parse_budgets, split_list
from rrfp.study.trial import TrialId

STUDY_OPTIONS = {"stages": "pp", "microbatches": "microbatches", "virtual_stages": "virtual_stages",
                 "hints": "hints", "policies": "policies", "memory_budget": "memory_budget",
                 "seed": "seed", "iterations": "iterations", "warmup": "warmup"}  # fmt: skip
"""The shared options a :class:`Study` holds: option name -> field name (``--stages``/``--pp`` is
``pp``)."""
ELSEWHERE = {
    "gpu_memory": "byte budgets: rrfp-sim's ExperimentConfig, rrfp-run's planner",
    "send": "the fixed baseline's sends: rrfp-sim's ClusterConfig, RunConfig.send",
    "jitter": "what tasks cost: rrfp-sim's workload, RunConfig.jitter (what is jittered)",
    "cv": "what tasks cost: rrfp-sim's workload, RunConfig.cv",
    "json": "output: each CLI's report",
    "trace_out": "output: each CLI's trace writer",
    "progress": "output: each CLI's progress bar",
    "version": "the CLIs' --version",
    **{name: "token mode: the TokenWorkload both CLIs build (rrfp.workload.tokens)"
       for name in ("lengths", "packing", "pack_tokens", "layers", "hidden", "heads", "microbatch_size",
                    "seq_len", "encoder", "encoder_stages", "freeze_encoder", "vision_layers", "image_size",
                    "patch", "images_dist", "images_mean", "images_cv", "mb_order")},
}  # fmt: skip
"""The other shared options, and where each goes: what tasks cost, how they send, what is written.
Every shared option is in :data:`STUDY_OPTIONS` or here (tests/test_study.py holds it), so a new one
says where it belongs."""

_LISTS = ("hints", "policies", "memory_budget")
_FLAGS = {"hints": "--hint", "policies": "--policy", "memory_budget": "--memory-budget"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Study:
    """What is compared (hints x budgets x policies on one pipeline shape) and how often. Defaults:
    the shared table's (rrfp-sim's)."""

    pp: int = BY_NAME["stages"].default
    """Pipeline ranks (``spec.num_stages`` is pp x v)."""
    microbatches: int | None = None
    """Microbatches per iteration; None = 4 x pp (:attr:`m`)."""
    virtual_stages: int | None = None
    """Stages per rank; None = each hint's own default (2 for interleaved-1f1b and zbv, else 1)."""
    hints: tuple[str, ...] = split_list(BY_NAME["hints"].default)
    """Hint names (rrfp.hint_names(), torch:<Name>, or a torch CSV path)."""
    policies: tuple[str, ...] = split_list(BY_NAME["policies"].default)
    """Policies run on every hint at every budget."""
    memory_budget: tuple[str, ...] = parse_budgets(BY_NAME["memory_budget"].default)
    """Activation budgets per rank, as written (``1x``, ``2x``, a slot count; bytes in token mode)."""
    seed: int = BY_NAME["seed"].default
    """Root of every random stream."""
    iterations: int = BY_NAME["iterations"].default
    """Measured iterations (per replication or trial), after ``warmup``."""
    warmup: int = BY_NAME["warmup"].default
    """Unmeasured iterations before the measured ones."""

    def __post_init__(self) -> None:
        for name in _LISTS:  # comma text or a list -> a tuple of names; anything else: the owner refuses it
            value = getattr(self, name)
            texts = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
            if isinstance(value, str) or texts:
                object.__setattr__(self, name, split_list(value, _FLAGS[name]))

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Study:
        """The study of the parsed shared options ``options`` (by option name, as click passes them;
        every name in :data:`STUDY_OPTIONS` is needed). Budget text is checked against its grammar."""
        values = {field: options[name] for name, field in STUDY_OPTIONS.items()}
        if isinstance(values["memory_budget"], str):
            values["memory_budget"] = parse_budgets(values["memory_budget"])
        return cls(**values)

    @property
    def m(self) -> int:
        """Microbatches per iteration after the default (4 x pp) is applied."""
        return self.microbatches if self.microbatches is not None else 4 * self.pp

    def budget_labels(self) -> tuple[str | None, ...]:
        """The budgets as trial labels write them: None for the default ``1x``."""
        return tuple(budget_label(b) for b in self.memory_budget)

    def grid(self, *, split_fixed: bool = False) -> Iterator[tuple[str, str, str, TrialId]]:
        """(hint, budget as written, policy, trial) for every cell of hints x budgets x policies,
        hint-major, then budget, then policy. A trial may come more than once (fixed on two class hints
        with one reference order); :meth:`trials` lists each once. ``split_fixed``: see :meth:`trials`."""
        for hint in self.hints:
            for budget in self.memory_budget:
                for policy in self.policies:
                    name = self._fixed_name(hint, split_fixed) if policy == FIXED else hint
                    yield hint, budget, policy, TrialId(policy, name, budget_label(budget))

    def trials(self, *, split_fixed: bool = False) -> list[TrialId]:
        """The trial grid (:meth:`grid`), each trial once, in order. ``fixed`` on a class hint (bf, fb,
        bfw: no order of its own) runs its reference order and is named after it -- ``--hint 1f1b,bf`` is
        fixed/1f1b, rrfp/1f1b, rrfp/bf. ``split_fixed`` (rrfp-run) keeps ``fixed/bfw``: bfw's reference
        lowered to the split backward is a schedule of its own on real hardware; the simulator, where
        B = I + W exactly, runs fixed/1f1b for it (rrfp.study.compare.fixed_hint)."""
        return list(dict.fromkeys(trial for *_, trial in self.grid(split_fixed=split_fixed)))

    def _fixed_name(self, hint: str, split_fixed: bool) -> str:
        if split_fixed:
            return fixed_hint(hint, self.virtual_stages)
        return base_hint_name(hint, self.virtual_stages)
