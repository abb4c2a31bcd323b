"""A process group of this process alone, for probes, tracing scripts and in-process tests.

It rendezvouses on an in-memory store, so it binds no TCP port and sets no environment variable. A fixed
``MASTER_PORT`` collides with any other group on the machine (another test run, another probe), and one written into
``os.environ`` is inherited by every child process the caller starts, whose own group then fails to listen on a port
the caller still holds. The training workers are several processes and rendezvous through ``torch.distributed.run``
instead (``workers.WorkerGroup``)."""

from __future__ import annotations

from datetime import timedelta

SINGLE_RANK_TIMEOUT = timedelta(seconds=120)
"""How long a collective of the one-rank group may wait (it never waits on another process)."""


def init_single_rank_group(backend: str = "gloo") -> None:
    """Initialise the default process group as rank 0 of 1 on a ``HashStore``; a no-op when one exists already."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=SINGLE_RANK_TIMEOUT)
