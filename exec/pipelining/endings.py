"""Clean ends for scripts that never call ``close()``: torch's schedules have no close, so a torch
script ends with ``dist.destroy_process_group()``, ``sys.exit()``, an exception, or nothing at all.

A :class:`~rrfp.exec.pipelining.channels.ReadinessPipeline` runs receiver threads that block inside
gloo's ``recv().wait()`` (rrfp.exec.comm.transport says why). Destroying the process groups -- or the
interpreter tearing them down at exit -- while such a thread is inside gloo makes the C++ runtime call
``std::terminate`` ("terminate called without an active exception", SIGABRT), after a correct run.
So every pipeline that owns a transport is tracked here until it is closed, and two moments end the
tracked ones locally first (:meth:`ReadinessPipeline.release`: no collective, bounded by the pipeline's
timeout, never raising):

* ``torch.distributed.destroy_process_group`` -- wrapped once, when the first pipeline is built: torch
  offers no hook before it shuts its backends down. Destroying the default group (or everything) ends
  every pipeline; destroying one group ends the pipelines built on it.
* interpreter exit (``atexit``: runs after the main module ended, normally or by an exception, and
  before the process groups are finalised).

Each rank's release tells its peers it sends nothing more and waits for theirs, so the threads end on
every rank that ends; a peer that died ends its channels by closing its sockets. ``close()`` stays the
collective, early release (and the one that frees the channel groups).
"""

from __future__ import annotations

import atexit
import functools
import threading
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Strong references: a pipeline a script dropped without close() still has receiver threads blocked in
# gloo (they keep its transport alive, not the pipeline), so it must stay reachable until released.
_live: dict[int, Any] = {}
_lock = threading.Lock()
_installed = False


def track(pipeline: Any) -> None:
    """Release ``pipeline`` at destroy or exit unless it is closed first (idempotent)."""
    global _installed
    with _lock:
        _live[id(pipeline)] = pipeline
        if not _installed:
            _install()
            _installed = True


def untrack(pipeline: Any) -> None:
    with _lock:
        _live.pop(id(pipeline), None)


def release_all(group: Any = None) -> None:
    """Release every tracked pipeline (``group`` None) or those built on ``group``."""
    with _lock:
        pipes = [p for p in _live.values() if group is None or group in (p.group, p.ctrl)]
    for p in pipes:
        p.release()


def _install() -> None:
    atexit.register(release_all)
    original = c10d.destroy_process_group
    if getattr(original, "_rrfp_wrapped", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        default = c10d.GroupMember.WORLD
        release_all(None if group is None or group is default else group)
        return original(group)

    destroy_process_group._rrfp_wrapped = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group  # type: ignore[assignment]
    dist.destroy_process_group = destroy_process_group  # type: ignore[assignment]
