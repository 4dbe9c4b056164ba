"""The per-pipeline set-up of :class:`~rrfp.exec.pipelining.schedule.ScheduleReadiness`: channel groups,
the transport, a control group.

rrfp's transport (rrfp.exec.comm.transport) gives every directed pair of neighbouring pipeline ranks its
own process group, so a receive pending on one channel never blocks another, and receiver threads take
messages of any shape in any order. Creating groups is collective, so this is built once per pipeline,
by every rank of the job at the same time (``torch.distributed.new_group`` is collective over the default
group, even for ranks outside the new group), and shared by any number of schedules on the same stages'
process group. A schedule creates one implicitly when none is given (and closes it in its ``close()``).

    pipe = ReadinessPipeline(group=pp_group, device=device)     # once, on every rank
    train = ScheduleReadiness(stages, 8, loss_fn, pipeline=pipe)
    evals = ScheduleReadiness(stages, 8, loss_fn, pipeline=pipe, policy="fixed")
    ...
    pipe.close()                                                # frees the groups and threads

Several pipelines (data parallel replicas, each with its own pipeline group) are fine: every rank
gathers every rank's pipeline group once, and all of them are built in one agreed order.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rrfp.exec.comm.topology import CHANNEL_TIMEOUT, ring_channels
from rrfp.exec.comm.transport import Transport
from rrfp.exec.comm.wire import one_line
from rrfp.exec.pipelining import endings
from rrfp.exec.pipelining.errors import ClosedError, StageFailed, StageLayoutError

ABORT_WAIT = 2.0
"""Seconds a failing rank waits for each neighbour to take its stop message (a stopped neighbour's
socket takes it at once; a dead one refuses it)."""
REPORT_WAIT = 5.0
"""Seconds the ranks of a failed step wait for each other's report (who raised first): the others have
all noticed by then, but for a rank that stopped; ABORT_WAIT + REPORT_WAIT keeps every rank within
``timeout`` + 10 s."""


class ReadinessPipeline:
    """Channels and control group of one pipeline (this rank's), shared by the schedules built on it.

    ``group``: the pipeline's process group (the ``group`` of its ``PipelineStage`` objects; None: the
    default group). ``device``: where activations live (CUDA: NCCL channels; CPU: gloo).
    ``timeout``: seconds a schedule's rank waits for an input (its default); control collectives (set-up
    checks, failure reports) wait up to twice that, so a rank that had to time out still reports in.
    ``tp_group``: this rank's tensor-parallel group (every rank gives one, or none): gloo control groups
    for the TP members' task agreement and for the model replica's calibration are built with the
    channels.
    """

    def __init__(
        self, group: Any = None, device: torch.device | str = "cpu", timeout: float = 120.0,
        tp_group: Any = None,
    ) -> None:  # fmt: skip
        if not dist.is_initialized():
            raise StageLayoutError("torch.distributed is not initialised: call init_process_group first")
        self.device = torch.device(device)
        self.group = group
        self.ranks: list[int] = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise StageLayoutError(f"rank {self.rank} is not in the stages' process group {self.ranks}")
        self.pp = len(self.ranks)
        self.pp_rank = self.ranks.index(self.rank)
        self.timeout = float(timeout)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.tp_ranks: tuple[int, ...] | None = None
        """The global ranks of this rank's tensor-parallel group (None: no TP)."""
        if tp_group is not None:
            self.tp_ranks = tuple(dist.get_process_group_ranks(tp_group))
        mine: list[Any] = [None] * dist.get_world_size()
        # Every rank's pipeline and TP group, to build them all in one order.
        dist.all_gather_object(mine, (tuple(self.ranks), self.tp_ranks))
        pipelines = list(dict.fromkeys(r for r, _ in mine))
        self._all_pipelines = pipelines
        wait = timedelta(seconds=2 * self.timeout + 5)
        channels: dict[tuple[int, int], Any] = {}
        self._groups: list[Any] = []
        self.ctrl: Any = None
        """gloo over this pipeline: set-up agreement and the trace merge (CPU objects, also with NCCL)."""
        self.report: Any = None
        """gloo over this pipeline for a failed step's report only, with a short timeout
        (:data:`REPORT_WAIT`): a rank that stopped (hung, not dead) cannot hold the others past the one
        deadline, ``timeout`` + 10 s from the last input that arrived."""
        for ranks in pipelines:
            ours = ranks == tuple(self.ranks)
            ctrl = dist.new_group(list(ranks), timeout=wait, backend="gloo")
            report = dist.new_group(list(ranks), timeout=timedelta(seconds=REPORT_WAIT), backend="gloo")
            if ours:
                self.ctrl, self.report = ctrl, report
            for src, dst in ring_channels(len(ranks)):
                pair = sorted((ranks[src], ranks[dst]))
                ch = dist.new_group(pair, timeout=CHANNEL_TIMEOUT, backend=backend)
                if ours and self.pp_rank in (src, dst):
                    channels[(src, dst)] = ch
                    self._groups.append(ch)
        self.tp_ctrl: Any = None
        """gloo over this rank's TP group: its members agree on every task they start (None: no TP)."""
        self.model_ctrl: Any = self.ctrl
        """gloo over this pipeline and every pipeline its TP groups reach (one model replica): set-up
        checks and the calibration, so TP members plan alike; the pipeline's control group without TP."""
        self._tp_groups([tp for _, tp in mine], wait)
        self.transport: Transport | None = None
        if self.pp > 1:
            self.transport = Transport(channels, self.pp_rank, self.to_global, self.device)
        self.early: dict[tuple[int, int], list[Any]] = defaultdict(list)
        """Messages for a schedule's later step (a peer ran ahead), shared by every schedule's loop."""
        self._finish(owned=True)

    def _finish(self, owned: bool) -> None:
        self._owned = owned  # close() frees the transport and groups only when this pipeline made them
        self._trials = itertools.count()
        self.closed = False
        self.broken: str | None = None
        """Why the channels carry nothing more (a step failed), or None."""
        if owned and self.transport is not None:
            endings.track(self)  # ended at destroy_process_group or exit if never closed

    @classmethod
    def over(
        cls, transport: Transport | None, ranks: list[int], ctrl: Any, device: torch.device | str,
        timeout: float, early: dict[tuple[int, int], list[Any]] | None = None, group: Any = None,
    ) -> ReadinessPipeline:  # fmt: skip
        """A pipeline on channels its caller already has (not collective): ``transport`` between this
        pipeline's ranks (None: one rank), their global ``ranks`` in pipeline order, ``ctrl`` a gloo group
        of exactly those ranks (set-up agreement), ``early`` the mailbox shared with the caller's other
        loops on the same transport, ``group`` the stages' process group (None: ``ctrl``), for a driver
        that owns its channels. :meth:`close` leaves the transport and groups to their owner."""
        self = cls.__new__(cls)
        self.device, self.ranks, self.rank = torch.device(device), list(ranks), dist.get_rank()
        if self.rank not in self.ranks:
            raise StageLayoutError(f"rank {self.rank} is not in the pipeline's ranks {self.ranks}")
        self.group = ctrl if group is None else group
        self.pp, self.pp_rank = len(self.ranks), self.ranks.index(self.rank)
        self.timeout, self.ctrl, self.transport, self._groups = float(timeout), ctrl, transport, []
        self.report = ctrl  # the caller's groups: its failure reports wait as its control group does
        self.early = defaultdict(list) if early is None else early
        # The caller's own TP agreement (rrfp-run: its loop's TP group), so none of the library's.
        self.tp_ranks, self.tp_ctrl, self.model_ctrl = None, None, ctrl
        self._all_pipelines = [tuple(self.ranks)]
        self._finish(owned=False)
        return self

    def _tp_groups(self, given: list[tuple[int, ...] | None], wait: timedelta) -> None:
        """The TP control groups and the model replicas' control groups, every one on every rank in one
        order (new_group is collective over the world); nothing when no rank has a TP group. Checked
        from every rank's groups, so every rank raises alike."""
        if all(tp is None for tp in given):
            return
        tps = [tp for tp in given if tp is not None]
        if len(tps) != len(given):
            raise StageLayoutError("every rank or none must give a tp_group")
        for rank, tp in enumerate(tps):
            if rank not in tp or any(tps[r] != tp for r in tp):
                raise StageLayoutError(f"rank {rank}'s tp_group {list(tp)} is not its members' tp_group")
        where = {r: (len(p), p.index(r)) for p in self._all_pipelines for r in p}
        for tp in tps:
            if len({where[r] for r in tp}) > 1:
                raise StageLayoutError(
                    f"tp_group {list(tp)} spans different pipeline ranks (each member holds the same stages)"
                )
        me = dist.get_rank()
        for tp in dict.fromkeys(tps):
            g = dist.new_group(list(tp), timeout=wait, backend="gloo")
            if me in tp:
                self.tp_ctrl = g
        for model in _replicas(tps, self._all_pipelines):
            g = dist.new_group(list(model), timeout=wait, backend="gloo")
            if me in model:
                self.model_ctrl = g

    def to_global(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank``."""
        return self.ranks[pp_rank]

    def next_schedule(self) -> int:
        """A number for the next schedule built on this pipeline: its messages carry it. Schedules must be
        built in the same order on every rank."""
        self.check_open()
        return next(self._trials)

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("this ReadinessPipeline was closed")
        if self.broken is not None:
            raise ClosedError(f"this pipeline stopped after a failed step ({self.broken}); build a new one")

    def abort(self, why: str) -> None:
        """Tell the neighbours this rank stopped (they stop waiting for it at once); the channels are
        unusable afterwards."""
        if self.broken is None and self.transport is not None:
            self.transport.abort(ABORT_WAIT)
        self.broken = self.broken or why

    def close(self) -> None:
        """Stop the receiver threads and free the channel groups (collective: every rank of the pipeline
        calls it). After a failed step the threads are left to the process's end instead (daemons)."""
        if self.closed:
            return
        self.closed = True
        endings.untrack(self)
        if self.transport is not None and self.broken is None and self._owned:
            gone = dict(self.transport.failed_peers)
            if gone:  # a peer died since the last step: nothing collective can complete
                self.transport.shutdown(ABORT_WAIT)
                peer, why = next(iter(gone.items()))
                raise StageFailed(f"rank {peer} is gone, the pipeline's channels cannot close: {why}")
            try:
                silent = self.transport.close(self.timeout)
                if silent:  # the barrier would wait out the control group's longer timeout in vain
                    raise TimeoutError(f"rank {silent[0]} sent no close within {self.timeout:g} s (hung?)")
                dist.barrier(group=self.ctrl)  # every peer's threads took our close before the groups go
            except Exception as e:  # a peer gone or stuck: end our side alone, then say so in one line
                self.transport.shutdown(min(self.timeout, 5.0))
                raise StageFailed(f"a peer did not close its channels: {one_line(e)}") from e
            for g in self._groups:
                dist.destroy_process_group(g)
        self._groups = []

    def release(self) -> None:
        """End this rank's channels without a collective and without raising, waiting up to the
        pipeline's timeout for its peers' ends (rrfp.exec.pipelining.endings: a script that never calls
        :meth:`close`), then destroy the channel groups once their threads ended (as ``close()`` does;
        left to the interpreter's end they are torn down in no particular order). The pipeline is
        closed."""
        if self.closed:
            return
        self.closed = True
        endings.untrack(self)
        if self.transport is None or not self._owned:
            return
        # After a failed step a peer may be hung for good: its channel never closes, so wait briefly.
        if self.transport.shutdown(self.timeout if self.broken is None else ABORT_WAIT):
            for g in self._groups:
                try:
                    dist.destroy_process_group(g)
                except Exception:  # torch's destroy ran first (the default group is gone)
                    pass
        self._groups = []


def _replicas(tps: list[tuple[int, ...]], pipelines: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The model replicas: the ranks of pipelines that TP groups join, in one order on every rank."""
    owner = {r: i for i, p in enumerate(pipelines) for r in p}
    parent = list(range(len(pipelines)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for tp in tps:
        for r in tp[1:]:
            a, b = root(owner[tp[0]]), root(owner[r])
            parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(pipelines):
        groups.setdefault(root(i), []).extend(p)
    return [tuple(sorted(g)) for _, g in sorted(groups.items())]
