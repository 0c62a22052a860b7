"""`meshrl up` reports a service that failed to start by the cause line of its own log, not torchrun's."""

import subprocess
import sys

from coordinator.cli.launcher import Child, cause_line, failure

# A trainer under torchrun whose rank 0 raised: the cause is the rank's ValueError, 30 lines above the end.
TORCHRUN_LOG = """\
2026-12-04 07:00:00 INFO meshrl.trainer: loading examples/arith/model
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/main/services/trainer/__main__.py", line 12, in <module>
[rank0]:     raise ValueError(f"critic: ...")
[rank0]: ValueError: critic: a critic with actor.pp_size > 1 is not implemented yet
E1204 07:00:01.000000 123 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 1) local_rank: 0
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 892, in main
    run(args)
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
services.trainer FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_07:00:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 124)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_the_cause_is_the_ranks_error_line_not_torchruns_child_failed_error(tmp_path):
    log = tmp_path / "trainer-0.log"
    log.write_text(TORCHRUN_LOG)
    assert cause_line(log) == "ValueError: critic: a critic with actor.pp_size > 1 is not implemented yet"


def test_a_log_without_an_error_line_gives_its_last_line(tmp_path):
    log = tmp_path / "reward-0.log"
    log.write_text("INFO loading\nKilled\n")
    assert cause_line(log) == "Killed"


def test_the_failure_line_names_the_service_its_exit_code_cause_and_log(tmp_path):
    log = tmp_path / "trainer-0.log"
    log.write_text(TORCHRUN_LOG)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    assert failure(Child("trainer", 0, proc, log), "before serving") == (
        f"trainer-0 exited with code 1 before serving: ValueError: critic: a critic with actor.pp_size > 1 is not "
        f"implemented yet (log: {log})")


def test_a_process_killed_by_a_signal_is_named_by_the_signal_not_its_last_log_line(tmp_path):
    log = tmp_path / "rollout-1.log"
    log.write_text("INFO meshrl.rollout: weights version 1 applied\n")
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    proc.wait()
    assert failure(Child("rollout", 1, proc, log), "during the run") == (
        f"rollout-1 exited with code -9 during the run: killed by SIGKILL (log: {log})")
