"""torchtitan's pipeline parallelism on rrfp's ``ScheduleReadiness``, through torchtitan's ``--module``.

torchtitan 0.3.0 loads its configuration from ``--module <module> --config <function>``: a fully
qualified module is imported as is, and ``<function>()`` returns the ``Trainer.Config``. This module
answers every ``<family>_<name>`` of torchtitan's own registries (``llama3_debugmodel``,
``qwen3_0_6b``, ...) with that config whose ``model_spec.pipelining_fn`` builds the stages exactly as
torchtitan does and hands them to a :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness`::

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module rrfp.exec.integrations.torchtitan --config llama3_debugmodel \\
        --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \\
        --training.disable_cuda_graphs

(torchtitan's Trainer needs CUDA: on a CPU torch it stops at ``torch.cuda.set_device``; docs/library.md
says what was run without it.)

torchtitan's schedule name still decides how many stages a rank holds and where (its
``_pipeline_module_split``); the rrfp hint is derived from it (:data:`HINTS`) unless ``RRFP_HINT``
names another with the same placement. rrfp's options come from the environment (every rank reads the
same; the schedule checks that the ranks agree):

==================== ==================================================================
``RRFP_HINT``        the reference order (default: from torchtitan's schedule name or CSV)
``RRFP_POLICY``      ``auto`` (default), ``fixed``, ``rrfp``, ``backfill``, ``guarded``
``RRFP_MEMORY_BUDGET`` activation slots per rank: ``1x`` (default), ``2x``, or a count
``RRFP_BYTE_BUDGET`` bytes instead: ``1.5x`` or ``64MiB``
``RRFP_SEED``        the dropout streams' seed (an integer; default 0)
``RRFP_TIMEOUT``     seconds a rank waits for an input (default 120)
``RRFP_MB_ORDER``    ``none`` (default), ``size-asc``, ``size-desc``, ``verl``
==================== ==================================================================

In a script of one's own: ``dataclasses.replace(spec, pipelining_fn=pipelining_fn)`` (or
:func:`readiness_spec`) on any ``ModelSpec`` whose pipelining function is torchtitan's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from rrfp.errors import UserError

HINTS: dict[str, str] = {
    "1f1b": "1f1b",
    "gpipe": "gpipe",
    "interleaved1f1b": "interleaved-1f1b",
    "zbvzerobubble": "zbv",
    "loopedbfs": "torch:LoopedBFS",
    "interleavedzerobubble": "torch:InterleavedZeroBubble",
    "dualpipev": "torch:DualPipeV",
}
"""torchtitan's ``pipeline_parallel_schedule`` (lower case, as torch's ``get_schedule_class`` matches)
-> the rrfp hint with the same stage placement: rrfp's own order where it has one, else torch's."""

_ENV_KEYS = ("RRFP_HINT", "RRFP_POLICY", "RRFP_MEMORY_BUDGET", "RRFP_BYTE_BUDGET", "RRFP_SEED",
             "RRFP_TIMEOUT", "RRFP_MB_ORDER")  # fmt: skip


class TorchtitanOptionError(UserError):
    """An ``RRFP_*`` variable or torchtitan setting this integration cannot use (one line)."""


def hint_for(schedule: str, csv: str | None = None) -> str:
    """The rrfp hint for torchtitan's schedule name (or its schedule CSV, torch's format, read as is)."""
    if csv:
        return csv
    hint = HINTS.get(schedule.lower().removeprefix("schedule"))
    if hint is None:
        raise TorchtitanOptionError(
            f"torchtitan schedule {schedule!r} has no rrfp hint: use one of "
            f"{', '.join(sorted(HINTS))} or set RRFP_HINT"
        )
    return hint


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """ScheduleReadiness keyword arguments from the ``RRFP_*`` variables that are set (the module
    docstring); a value of the wrong kind raises :class:`TorchtitanOptionError` naming the variable."""
    env = os.environ if environ is None else environ
    got = {k: env[k].strip() for k in _ENV_KEYS if env.get(k, "").strip()}
    opts: dict[str, Any] = {}
    for key, name in (("RRFP_HINT", "hint"), ("RRFP_POLICY", "policy"), ("RRFP_BYTE_BUDGET", "byte_budget"),
                      ("RRFP_MB_ORDER", "mb_order")):  # fmt: skip
        if key in got:
            opts[name] = got[key]
    if "RRFP_MEMORY_BUDGET" in got:
        value = got["RRFP_MEMORY_BUDGET"]
        opts["memory_budget"] = int(value) if value.isdigit() else value
    if "RRFP_SEED" in got:
        opts["seed"] = _number("RRFP_SEED", got["RRFP_SEED"], int)
    if "RRFP_TIMEOUT" in got:
        opts["timeout"] = _number("RRFP_TIMEOUT", got["RRFP_TIMEOUT"], float)
        if not opts["timeout"] > 0:
            value = got["RRFP_TIMEOUT"]
            raise TorchtitanOptionError(f"RRFP_TIMEOUT must be a number of seconds > 0, got {value!r}")
    return opts


def _number(key: str, value: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise TorchtitanOptionError(f"{key} must be a number ({kind.__name__}), got {value!r}") from None


def readiness_from(schedule: Any, parallelism: Any, environ: Mapping[str, str] | None = None) -> Any:
    """A ScheduleReadiness on the stages, microbatch count, scalar loss and gradient scaling of the
    torch schedule torchtitan built (its ``_build_pipeline_schedule``), which is then dropped."""
    from rrfp.exec.pipelining.schedule import ScheduleReadiness

    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    opts = options_from_env(environ)
    hint = opts.pop("hint", None) or hint_for(
        parallelism.pipeline_parallel_schedule, parallelism.pipeline_parallel_schedule_csv
    )
    return ScheduleReadiness(
        stages,
        schedule._n_microbatches,
        schedule._loss_fn,
        scale_grads=schedule.scale_grads,
        backward_requires_autograd=getattr(schedule, "_backward_requires_autograd", True),
        hint=hint,
        **opts,
    )


def readiness_pipelining(base: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """A torchtitan pipelining function: ``base`` (default torchtitan's ``pipeline_llm``) splits the
    model, applies ``parallelize_fn`` to each part and builds torchtitan's schedule; its stages then run
    under ScheduleReadiness. Same arguments and result as torchtitan's:
    ``(schedule, model_parts, has_first_stage, has_last_stage)``."""

    def pipelining_fn(model: Any, **kwargs: Any) -> tuple[Any, list[Any], bool, bool]:
        build = base
        if build is None:
            from torchtitan.distributed.pipeline_parallel import pipeline_llm as build
        schedule, parts, has_first, has_last = build(model, **kwargs)
        return readiness_from(schedule, kwargs["parallelism"]), parts, has_first, has_last

    pipelining_fn.__doc__ = readiness_pipelining.__doc__
    return pipelining_fn


pipelining_fn = readiness_pipelining()
"""torchtitan's ``pipeline_llm`` with ScheduleReadiness as its schedule: the ``pipelining_fn`` of a
``ModelSpec`` (``dataclasses.replace(spec, pipelining_fn=pipelining_fn)``)."""


def readiness_spec(spec: Any) -> Any:
    """``spec`` (a torchtitan ``ModelSpec``) with its own pipelining function wrapped (pipeline_llm,
    pipeline_vlm, ...), so its stages run under ScheduleReadiness."""
    if spec.pipelining_fn is None:
        raise TorchtitanOptionError(f"torchtitan model {spec.name!r} does not support pipelining")
    return dataclasses.replace(spec, pipelining_fn=readiness_pipelining(spec.pipelining_fn))


def readiness_config(config: Any) -> Any:
    """A torchtitan ``Trainer.Config`` with its model spec's pipelining on ScheduleReadiness."""
    config.model_spec = readiness_spec(config.model_spec)
    return config


def _registry_function(name: str) -> Callable[[], Any] | None:
    """torchtitan's config function ``name`` from the registry of the model family its name starts
    with (``llama3_debugmodel`` -> torchtitan.models.llama3.config_registry), or None."""
    try:
        from torchtitan.models import _supported_models
    except ImportError:  # torchtitan is not installed: no config functions (hasattr() stays quiet)
        return None
    parts = name.split("_")
    for i in range(len(parts) - 1, 0, -1):  # the longest family name first (deepseek_v3_16b)
        family = "_".join(parts[:i])
        if family in _supported_models:
            registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
            fn = getattr(registry, name, None)
            return fn if callable(fn) else None
    return None


def __getattr__(name: str) -> Callable[[], Any]:
    """``--config <name>``: torchtitan's config function of that name, on ScheduleReadiness."""
    fn = None if name.startswith("_") else _registry_function(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    @functools.wraps(fn)
    def config() -> Any:
        return readiness_config(fn())

    return config
