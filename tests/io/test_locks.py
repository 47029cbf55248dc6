"""One writer per folder: a second process is refused naming the holder; kill -9 frees the lock at once."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from mmtune.io.locks import LOCK_FILE, DirectoryLockedError, lock_directory, read_holder

# Takes the lock, optionally forks a child that keeps running (a DataLoader worker's
# situation), prints "locked <child pid>" and waits to be killed.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from mmtune.io.locks import lock_directory
    lock = lock_directory(sys.argv[1], purpose="holding for a test")
    child = 0
    if sys.argv[2] == "fork":
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
    print("locked", child, flush=True)
    time.sleep(600)
""")
# Tries the lock once: exit 0 when taken, 3 with the refusal on stderr.
TAKER = textwrap.dedent("""
    import sys
    from mmtune.io.locks import DirectoryLockedError, lock_directory
    try:
        lock_directory(sys.argv[1], hint="use another folder")
    except DirectoryLockedError as err:
        print(err, file=sys.stderr)
        sys.exit(3)
""")


def _hold(directory, mode="plain", *extra_args):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), mode, *extra_args],
                            stdout=subprocess.PIPE, text=True)
    word, child = proc.stdout.readline().split()
    assert word == "locked"
    return proc, int(child)


def _try_take(directory):
    return subprocess.run([sys.executable, "-c", TAKER, str(directory)], capture_output=True, text=True, timeout=60)


def test_a_second_process_is_refused_naming_the_holder_and_kill_9_frees_it(tmp_path):
    holder, _ = _hold(tmp_path, "plain", "--run-name=x", "judge.api_key=sk-secret")
    try:
        with pytest.raises(DirectoryLockedError) as info:
            lock_directory(tmp_path, hint="set training.output_dir to another folder")
        message = str(info.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "--run-name=x" in message and "judge.api_key=***" in message and "sk-secret" not in message
        assert "(holding for a test)" in message and "since 20" in message
        assert "How to fix: wait for that process to finish" in message
        assert "set training.output_dir to another folder" in message
        assert info.value.holder["pid"] == holder.pid
        assert read_holder(tmp_path)["pid"] == holder.pid
        # Another process is refused the same way.
        other = _try_take(tmp_path)
        assert other.returncode == 3 and f"pid {holder.pid}" in other.stderr and "use another folder" in other.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # Nothing to clean up: the kernel released the lock with the killed process.
    assert (tmp_path / LOCK_FILE).exists()
    with lock_directory(tmp_path, purpose="re-take") as lock:
        assert lock.held and read_holder(tmp_path)["pid"] == os.getpid()
        assert read_holder(tmp_path)["purpose"] == "re-take"
    assert read_holder(tmp_path) == {}  # released: no details left behind
    assert _try_take(tmp_path).returncode == 0


def test_a_forked_child_does_not_keep_a_killed_holders_lock(tmp_path):
    holder, child = _hold(tmp_path, "fork")
    try:
        assert _try_take(tmp_path).returncode == 3
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        os.kill(child, 0)  # the child is still running ...
        taken = _try_take(tmp_path)  # ... and the lock is free all the same
        assert taken.returncode == 0, taken.stderr
    finally:
        for pid in (holder.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_lock_is_reentrant_within_a_process_and_released_with_the_last_handle(tmp_path):
    outer = lock_directory(tmp_path / "run")  # created when missing
    inner = lock_directory(tmp_path / "run")
    assert _try_take(tmp_path / "run").returncode == 3
    inner.release()
    inner.release()  # idempotent: does not drop the outer handle
    assert _try_take(tmp_path / "run").returncode == 3
    outer.release()
    assert _try_take(tmp_path / "run").returncode == 0
    # Distinct folders are distinct locks, a folder inside a locked one included.
    with lock_directory(tmp_path / "run"), lock_directory(tmp_path / "run" / "eval"):
        assert _try_take(tmp_path / "other").returncode == 0


def test_a_file_system_without_locks_warns_and_goes_on_unlocked(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(RuntimeWarning, match="does not support file locks"):
        lock = lock_directory(tmp_path)
    assert not lock.held
    lock.release()


def test_the_holder_record_is_json_with_what_the_refusal_names(tmp_path):
    with lock_directory(tmp_path, purpose="evaluation"):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert set(record) == {"pid", "host", "command", "since", "purpose"}
    assert (record["pid"], record["host"], record["purpose"]) == (os.getpid(), socket.gethostname(), "evaluation")
