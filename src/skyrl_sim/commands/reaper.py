"""A detached watcher that ends what a command started when the command dies without ending it (``kill -9``).

A local Ray instance (``sweep --executor ray`` without ``--address``) is a tree of processes under the command:
Ray's GCS and raylet share the command's fate, but its dashboard and runtime-env agents outlive a SIGKILLed driver
and run on, orphaned. ``reap_when_gone`` starts this module in its own session with the tree's process ids and start
times; it waits for the command to end and then terminates whichever of them still run (SIGTERM, SIGKILL after
``GRACE_S``). The start times make sure a process id the system has since given to another process is left alone.
After a clean exit Ray has stopped them all, and the watcher has nothing to do.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

POLL_S = 0.5
"""How often the watcher looks whether the command is still alive."""
GRACE_S = 3.0
"""How long a process gets to exit after SIGTERM before SIGKILL."""


def reap_when_gone(parent: int | None = None) -> None:
    """Start the watcher for ``parent``'s (default: this process's) descendants as they are now. A no-op without
    psutil (Ray depends on it, so it is there whenever a local Ray instance is)."""
    try:
        import psutil
    except ImportError:
        return
    parent = parent or os.getpid()
    try:
        tree = [(p.pid, p.create_time()) for p in psutil.Process(parent).children(recursive=True)]
    except psutil.Error:
        return
    if not tree:
        return
    subprocess.Popen(
        [sys.executable, "-m", "skyrl_sim.commands.reaper", str(parent), json.dumps(tree)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # neither the terminal's Ctrl-C nor a signal to the command's group reaches it
        close_fds=True,
    )


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str]) -> int:
    import psutil

    parent, tree = int(argv[0]), json.loads(argv[1])
    while _alive(parent):
        time.sleep(POLL_S)
    left = []
    for pid, created in tree:
        try:
            process = psutil.Process(pid)
            if abs(process.create_time() - created) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
        except psutil.Error:
            continue
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
