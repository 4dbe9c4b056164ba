"""rrfp.exec: the torch.distributed executor -- rrfp's policies on real processes (``rrfp-run``).

Layout: ``cli`` (options -> ``config.RunConfig``, checked by ``preflight``) -> ``launch`` (torch's
elastic launcher, or join torchrun) -> ``worker`` (per rank: ``topology`` groups, trials, results)
-> ``trials`` (one policy/hint/budget, step by step) -> ``runtime`` (the loop around the core
scheduler) with ``transport`` (channels, receiver threads), ``stage`` (F/B/I/W and gradient
accumulation), ``model``/``layers``/``data`` (GPT and multimodal stages, TP linears), ``check``
(single-process reference), ``faults`` (timeouts, dumps), ``synthetic`` (injected jitter, sleep-only
mode), ``baseline`` (torch.distributed.pipelining beside rrfp), ``results`` (a trial's
``rrfp.study.result.TrialResult`` with exec's own measurements), ``report`` (table, JSON, trace).

    rrfp-run --gpus 4 --check
    torchrun --standalone --nproc-per-node 2 -m rrfp.exec --check

The library API (``pipelining``): :class:`ScheduleReadiness`, a drop-in for torch.distributed.pipelining's
schedules on the user's own ``PipelineStage`` objects, and :class:`ReadinessPipeline`, its channels::

    from rrfp.exec import ScheduleReadiness
    schedule = ScheduleReadiness(stage, n_microbatches, loss_fn, hint="1f1b")  # for Schedule1F1B(...)
    schedule.step(x, target=y, losses=losses)

Importing ``rrfp.exec`` itself stays light; torch is imported by the modules that need it.
"""

from typing import Any

_LIBRARY = ("ScheduleReadiness", "ReadinessPipeline", "microbatch_seed", "profile")


def __getattr__(name: str) -> Any:
    """``rrfp.exec.ScheduleReadiness``, ``ReadinessPipeline`` and ``profile`` (rrfp.exec.pipelining),
    imported on first use so that ``import rrfp.exec`` stays light."""
    if name in _LIBRARY:
        from rrfp.exec import pipelining

        return getattr(pipelining, name)
    raise AttributeError(f"module 'rrfp.exec' has no attribute {name!r}")


__all__ = list(_LIBRARY)
