"""`meshrl up` stopped by Ctrl-C or SIGTERM: the run finishes its step in flight (a bounded wait), is paused and
checkpointed, and the command that continues it (`meshrl up --resume RUN_ID RECIPE`) is printed before every
service stops."""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
import time
from typing import Callable

from coordinator.cli.common import Interrupted


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler's stop, `kill`) raises Interrupted in the main thread, as Ctrl-C raises
    KeyboardInterrupt: both stop `meshrl up` the same way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signum)

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def pause_for_exit(client, run_id: str, wait_s: float, say: Callable[[str], None], *, checkpoint: bool = True):
    """Asks the run to pause after its step in flight and waits up to `wait_s` for it; a paused run is
    checkpointed at its step when `checkpoint` (it can be resumed: a restarted trainer continues from there). -> the run's status, or None when the
    coordinator stopped answering. Another Ctrl-C or SIGTERM ends the wait at once."""
    import grpc

    say(f"meshrl up: stopping: run {run_id} finishes its step in flight (up to {wait_s:g}s; Ctrl-C again "
        f"stops at once)")
    try:
        try:
            status = client.pause_run(run_id)
        except grpc.RpcError as e:   # the run ended (or paused) meanwhile: nothing is in flight
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            status = client.get_run(run_id)
        deadline = time.monotonic() + wait_s
        while status.state != "PAUSED" and not status.finished and time.monotonic() < deadline:
            time.sleep(0.2)
            status = client.get_run(run_id)
        if status.state != "PAUSED":
            if not status.finished:
                say(f"meshrl up: run {run_id}'s step {status.step + 1} did not finish within {wait_s:g}s; it "
                    f"resumes from step {status.step} (or its last checkpoint)")
            return status
        if checkpoint and not status.checkpoint_path.endswith(f"step_{status.step}"):
            status = client.save_checkpoint(run_id)
        return status
    except (grpc.RpcError, KeyboardInterrupt) as e:
        why = "interrupted again" if isinstance(e, KeyboardInterrupt) else "the coordinator stopped answering"
        say(f"meshrl up: {why}: run {run_id} resumes from its last committed step (or its last checkpoint)")
        return None


def resume_line(run_id: str, status, resumable: bool) -> str:
    """What to tell the user: where the run stopped and the command that continues it."""
    if status is not None and status.finished:
        return f"meshrl up: run {run_id} {status.state} after {status.step} steps; there is nothing to resume"
    at = f" at step {status.step}/{status.num_steps}" if status is not None else ""
    if not resumable:
        return (f"meshrl up: run {run_id} interrupted{at}; its record lived in the coordinator's memory (no "
                f"run.redis_url), so it cannot be resumed: set run.redis_url to make runs resumable")
    saved = f" (checkpoint {status.checkpoint_path})" if status is not None and status.checkpoint_path else ""
    return f"meshrl up: run {run_id} interrupted{at}{saved}; resume it with: {resume_command(run_id)}"


def resume_command(run_id: str, argv: list[str] | None = None) -> str:
    """This `meshrl up` command line with `--resume RUN_ID` in place of any earlier one."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    at = kept.index("up") + 1 if "up" in kept else 0
    return "meshrl " + shlex.join([*kept[:at], "--resume", run_id, *kept[at:]])


def check_resumable(run, run_id: str, timeout_s: float = 15.0) -> None:
    """`--resume RUN_ID` names a run in the store at run.redis_url with steps left: checked before a service starts
    (a mistyped id cost a whole mesh start, then failed there). Read as the run store writes it
    (coordinator/run_keys.py); the CLI loads no run manager."""
    import json

    import redis
    from redis.exceptions import RedisError

    from coordinator.run_keys import UNFINISHED, redis_key

    client = redis.Redis.from_url(run.redis_url, decode_responses=True, socket_timeout=timeout_s,
                                  socket_connect_timeout=timeout_s)
    try:
        text = client.get(redis_key(run.redis_prefix, "run", run_id))
        ids = [] if text else sorted(client.smembers(redis_key(run.redis_prefix, "runs")))
        others = [json.loads(t) for t in (client.mget([redis_key(run.redis_prefix, "run", i) for i in ids])
                                          if ids else []) if t]
    except (RedisError, OSError) as e:          # the URL is not printed: it may hold a password
        raise ValueError(f"--resume: the run store at run.redis_url did not answer ({type(e).__name__}: {e})") from e
    finally:
        client.close()
    if text is None:
        latest = sorted(others, key=lambda r: r.get("updated_at", 0))[-5:][::-1]
        known = ", ".join(f"{r['run_id']} ({r['state']}, step {r['step']}/{r['num_steps']})" for r in latest)
        raise ValueError(f"--resume: no run {run_id!r} in the store at run.redis_url (prefix "
                         f"{run.redis_prefix!r}); its latest runs: {known or 'none'}")
    state = json.loads(text)["state"]
    if state not in UNFINISHED:
        raise ValueError(f"--resume: run {run_id!r} is {state}; there is nothing to resume")
