"""The parent's handle on the torchrun training workers: launch, command, watch, and always clean up.

``WorkerGroup`` starts ``python -m torch.distributed.run`` in a new session (its own process group), listens on
127.0.0.1 for the ranks, and sends each command to every rank. Every wait has a deadline and checks that torchrun is
still alive, so a crashed or killed worker turns into ``WorkerDied`` within a second or so, never a hang.
``close`` asks the ranks to shut down, then kills the whole process group (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from skyrl_sim_plugins.megatron_vllm import protocol
from skyrl_sim_plugins.megatron_vllm.local_ports import free_port

RANK_PREFIX = re.compile(r"^\[(?:default)?(?:rank)?\d+\]: ?")


class WorkerDied(RuntimeError):
    """A rank crashed, was killed, or stopped answering."""


class WorkerGroup:
    """``world`` ranks of the training worker under one torchrun."""

    def __init__(
        self,
        config: dict[str, Any],
        world: int,
        run_dir: Path,
        startup_timeout_s: float = 300.0,
        call_timeout_s: float = 1800.0,
    ) -> None:
        self.world = world
        self.model_ids: list[str] = list(config["model_ids"])
        self.run_dir = run_dir
        self.call_timeout_s = call_timeout_s
        self.token = secrets.token_hex(16)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(1.0)
        address = self.listener.getsockname()
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "worker_config.json"
        config_path.write_text(json.dumps({**config, "address": list(address), "run_dir": str(run_dir)}))
        self.log_path = run_dir / "workers.log"
        self._log = self.log_path.open("ab")
        env = dict(os.environ)
        env[protocol.TOKEN_ENV] = self.token
        # The CPU memory limit is on tensors (memory_meter.LiveTensorMeter); the address-space backstop above it stays
        # far away when the part of the address space no tensor holds stays flat: few 64 MiB malloc arenas, and no
        # oneDNN primitive cache (on a CPU with avx512_bf16 it caches JIT code and a scratchpad per matmul shape,
        # tens of MiB per new width). oneDNN is not used on CUDA.
        env.setdefault("MALLOC_ARENA_MAX", "2")
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "skyrl_sim_plugins.megatron_vllm.worker",
            str(config_path),
        ]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.socks: dict[int, socket.socket] = {}
        self.hellos: dict[int, dict[str, Any]] = {}
        try:
            self._accept(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle

    def _check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise WorkerDied(f"training workers exited with code {code} (log: {self.log_path}){self._log_tail()}")

    def _log_tail(self) -> str:
        return log_excerpt(self.log_path)

    def _accept(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending: list[socket.socket] = []
        while len(pending) < self.world:
            self._check_alive()
            if time.monotonic() > deadline:
                raise WorkerDied(
                    f"training workers did not connect within {timeout_s:.0f} s (log: {self.log_path}){self._log_tail()}"
                )
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending.append(conn)
        for conn in pending:
            hello = self._recv(conn, deadline - time.monotonic())
            if hello.get("token") != self.token or not hello.get("hello"):
                raise WorkerDied("a process that is not our worker connected to the command socket")
            self.socks[int(hello["rank"])] = conn
            self.hellos[int(hello["rank"])] = hello

    def _recv(self, conn: socket.socket, timeout_s: float) -> dict[str, Any]:
        """Wait for one message, checking every second that torchrun is alive."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        selector = selectors.DefaultSelector()
        selector.register(conn, selectors.EVENT_READ)
        try:
            while True:
                self._check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerDied(f"a training worker did not answer within {timeout_s:.0f} s{self._log_tail()}")
                if selector.select(min(left, 1.0)):
                    try:
                        return protocol.recv(conn, max(left, 1.0))
                    except protocol.ProtocolError as exc:
                        time.sleep(0.5)  # let torchrun notice the death, for a better message
                        code = self.proc.poll()
                        raise WorkerDied(
                            f"lost a training worker ({exc}; torchrun exit code {code}; log: {self.log_path})"
                            f"{self._log_tail()}"
                        ) from exc
        finally:
            selector.close()

    def command(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Send one command to every rank; their replies by rank. Raises WorkerDied."""
        timeout = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            for conn in self.socks.values():
                protocol.send(conn, message)
        except OSError as exc:
            raise WorkerDied(f"cannot reach a training worker: {exc}{self._log_tail()}") from exc
        deadline = time.monotonic() + timeout
        return {rank: self._recv(conn, deadline - time.monotonic()) for rank, conn in sorted(self.socks.items())}

    @property
    def pids(self) -> list[int]:
        return [int(h["pid"]) for h in self.hellos.values()]

    def close(self, timeout_s: float = 10.0) -> None:
        """Shut the ranks down politely, then kill torchrun's whole process group. Idempotent."""
        if self.proc.poll() is None and self.socks:
            with contextlib.suppress(OSError):
                for conn in self.socks.values():
                    protocol.send(conn, {"cmd": "shutdown"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers that outlived torchrun
        for conn in self.socks.values():
            conn.close()
        self.socks.clear()
        self.listener.close()
        self._log.close()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def log_excerpt(log_path: Path, lines: int = 8) -> str:
    """The end of the workers' log for an error message: the last Python traceback's last frames and its exception
    when the log has one (torchrun's summary after it says less), else the last ``lines`` lines."""
    try:
        raw = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    text = [RANK_PREFIX.sub("", line) for line in raw if line.strip()]  # torchrun may prefix a rank's lines
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")]
    if starts:
        block = text[starts[-1] + 1 :]
        ends = [i for i, line in enumerate(block) if not line.startswith(" ")]
        tail = block[: ends[0] + 1][-(2 * lines) :] if ends else block[-(2 * lines) :]
    else:
        tail = text[-lines:]
    return ("\n  " + "\n  ".join(tail)) if tail else ""
