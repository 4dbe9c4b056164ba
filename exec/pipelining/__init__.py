"""rrfp.exec.pipelining: rrfp's readiness dispatch on the user's own ``torch.distributed.pipelining`` stages.

    from rrfp.exec import ScheduleReadiness
    stage = PipelineStage(module, stage_index, num_stages, device)
    schedule = ScheduleReadiness(stage, n_microbatches=8, loss_fn=loss_fn, hint="1f1b", policy="rrfp")
    schedule.step(x, target=y, losses=losses)        # as torch's Schedule1F1B
    schedule.step_microbatches(xs, target_mbs=ys)    # microbatches of different shapes, no padding
    schedule.close()

Modules: ``schedule`` (:class:`ScheduleReadiness`, its rules), ``channels`` (:class:`ReadinessPipeline`,
the collective set-up shared by schedules), ``engine`` (extension points for a driver with its own
compute: rrfp-run's trials), ``compute`` (F/B/I/W of torch stages as runtime tasks),
``codec`` (tuples of tensors as one message), ``memory`` (byte-budget fits), ``sizing`` (microbatch
sizes: ``mb_order``, sized costs), ``profiling`` (:func:`profile`: a measured cost model of this
runtime for ``rrfp-sim --profile``), ``starts`` (how a clocked policy hears producer starts: the
same-host start board or messages, ``announce=``), ``errors`` (the one-line errors).
"""

from rrfp.exec.pipelining.channels import ReadinessPipeline
from rrfp.exec.pipelining.compute import microbatch_seed
from rrfp.exec.pipelining.errors import (
    ClosedError,
    LossError,
    MicrobatchError,
    PipeliningError,
    StageFailed,
    StageIOError,
    StageLayoutError,
)
from rrfp.exec.pipelining.profiling import profile
from rrfp.exec.pipelining.schedule import ScheduleReadiness

__all__ = [
    "ClosedError",
    "LossError",
    "MicrobatchError",
    "PipeliningError",
    "ReadinessPipeline",
    "ScheduleReadiness",
    "StageFailed",
    "StageIOError",
    "StageLayoutError",
    "microbatch_seed",
    "profile",
]
