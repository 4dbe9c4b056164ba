"""The job's c10d stores, listening where they are meant to be reached, and joined with a bounded
handshake.

torch's ``TCPStore`` server listens on every interface whatever ``host_name`` says, and torch's
rendezvous unpickles what it reads from its store; the launcher's job store also names the ranks it
kills. So every store rrfp-run hosts for a job on one host listens on a loopback address only: the
listening socket is made here and handed to torch (``master_listen_fd``). Only a job across hosts
(srun or torchrun over several nodes, where the user named the first node's address) listens as
torch does.

A ``TCPStore`` client that reaches a listener which is not a store (another program holds the port)
waits forever, whatever its timeout (measured: torch 2.13 ignores it in the handshake). :func:`join_store`
bounds that: it waits for the port to accept a connection, then gives the store
:data:`HANDSHAKE_S` seconds to answer and to show the job's key.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from rrfp.errors import RunFailure

LOOPBACK = "127.0.0.1"
HANDSHAKE_S = 30.0
"""Most seconds a listening job store may take to answer a new client and show the job's key."""
CONNECT_POLL_S = 0.2
JOB_KEY = "rrfp/job"
"""Set by the store's host to the job's id; a task that joins checks it (the store is this job's)."""


class StoreError(RunFailure):
    """The job's store cannot be hosted or joined (one line: where, and what to do)."""


def is_loopback(host: str) -> bool:
    """Does ``host`` (a name or an address) resolve to loopback addresses only?"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host``'s first address (not every interface)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise StoreError(
            f"cannot listen on {host}:{port} for the job's store ({e.strerror or e}): another program "
            "holds the port? set MASTER_PORT to a free one"
        ) from None
    return sock


def host_store(host: str, port: int, timeout_s: float) -> Any:
    """A TCPStore server listening on ``host`` only (``port`` 0: a free one; its ``.port`` says which)."""
    import torch.distributed as dist

    sock = listener(host, port)
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())  # fmt: skip


def join_store(host: str, port: int, timeout_s: float, setup_s: float, job: str, handshake_s: float) -> Any:
    """A client of the job's store at ``host:port``: waits up to ``setup_s`` for the port to accept
    connections (the host task may still be importing torch), then up to ``handshake_s`` for the store
    to answer and show :data:`JOB_KEY` = ``job``; else a one-line StoreError."""
    import torch.distributed as dist

    deadline = time.monotonic() + setup_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, setup_s))).close()
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"nothing listens on {host}:{port} (MASTER_ADDR:MASTER_PORT) after {setup_s:g} s "
                    f"({e.strerror or e}): did rank 0 start?"
                ) from None
            time.sleep(CONNECT_POLL_S)
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=timeout_s))  # fmt: skip
            store.wait([JOB_KEY], timedelta(seconds=handshake_s))
            box["store"], box["job"] = store, store.get(JOB_KEY).decode(errors="replace")
        except Exception as e:  # said below, in one line
            box["error"] = e

    # A daemon thread: a listener that never answers keeps it blocked, and the rank exits without it.
    thread = threading.Thread(target=connect, name="rrfp-store-handshake", daemon=True)
    thread.start()
    thread.join(handshake_s + 1.0)
    if "store" in box and box["job"] == job:
        return box["store"]
    why = f"it is job {box['job']}'s store, not {job}'s" if "job" in box else "no answer as this job's store"
    raise StoreError(
        f"{host}:{port} (MASTER_ADDR:MASTER_PORT) accepts connections but gave {why} within "
        f"{handshake_s:g} s: another program holds the port? set MASTER_PORT to a free one"
    )


def loopback_interface() -> str | None:
    """The name of this host's loopback interface (Linux: ``lo``), None when none is found."""
    iff_loopback = 0x8
    for _, name in socket.if_nameindex() if hasattr(socket, "if_nameindex") else ():
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & iff_loopback:
            return name
    return None


def keep_sockets_local(env: MutableMapping[str, str] | None = None) -> None:
    """gloo's and NCCL's listening sockets on the loopback interface (a job on one host), unless the
    user chose an interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): gloo otherwise listens on the
    address the host name resolves to, NCCL's bootstrap on the first non-loopback interface."""
    env = os.environ if env is None else env
    name = loopback_interface()
    for var in SOCKET_IFNAMES if name is not None else ():
        env.setdefault(var, name)


SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo and NCCL read the interface to listen on."""
