"""A worker that dies at start-up is named by its own exception: the error message's excerpt of the workers' log is
the last Python traceback (its last frames and exception), not torchrun's summary printed after it."""

from __future__ import annotations

from pathlib import Path

from skyrl_sim_plugins.megatron_vllm.workers import log_excerpt

TRACEBACK = """\
/venv/megatron/core/optimizer/__init__.py:24: UserWarning: Transformer Engine and Apex are not installed.
  warnings.warn(
[rank1]: Traceback (most recent call last):
[rank1]:   File "/src/worker.py", line 270, in main
[rank1]:     worker.hello()
[rank1]:   File "/src/worker.py", line 120, in hello
[rank1]:     applied = apply_memory_limit(int(limit) if limit else None)
[rank1]: OSError: [Errno 12] Cannot allocate memory
E1202 20:41:07.123 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 1
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
  exitcode  : 1 (pid: 4242)
"""


def test_the_excerpt_is_the_last_traceback_ending_in_its_exception(tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    log.write_text(TRACEBACK)
    excerpt = log_excerpt(log)
    assert excerpt.strip().endswith("OSError: [Errno 12] Cannot allocate memory")
    assert "in hello" in excerpt and "worker.hello()" in excerpt
    assert "Root Cause" not in excerpt and "[rank1]" not in excerpt


def test_without_a_traceback_the_excerpt_is_the_logs_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "workers.log"
    log.write_text("\n".join(f"line {i}" for i in range(20)) + "\n\n")
    assert log_excerpt(log, lines=3).split() == ["line", "17", "line", "18", "line", "19"]


def test_a_missing_log_gives_no_excerpt(tmp_path: Path) -> None:
    assert log_excerpt(tmp_path / "absent.log") == ""
