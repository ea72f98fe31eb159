"""A bare gpufeedd starts: without --listen it makes its runtime directory (here a
temp --runtime_dir, never the real /run) mode 0755 and serves in it; without root it listens
in $XDG_RUNTIME_DIR/gpufeed instead; one log line says where; an unsafe directory on the way
is refused naming it; clients (the C library's rule, gpufeedctl) look where it listens; and
gpufeedctl's "no daemon" error says how to name the socket."""

from __future__ import annotations

import os
import shutil
import signal
import socket as socketlib
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

import gpufeed
from conftest import GPUFEEDD, gpufeedctl

USER = 10031  # a uid (and gid) of no one: gpufeedd run without root
SYSTEM_SOCKET = "/run/gpufeed/gpufeed.sock"


def _answers(path: str) -> bool:
    s = socketlib.socket(socketlib.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def start(argv: List[str], env: Dict[str, str], log: Path, socket: str) -> subprocess.Popen:
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    # Ready once it says so: the socket is bound (and connectable) before the memory socket
    # and the GPUs are set up, and the "serving on" line comes last.
    while not (_answers(socket) and b" serving on " in log.read_bytes()):
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            pytest.fail(f"gpufeedd did not listen on {socket}: {log.read_text()}")
        time.sleep(0.02)
    return process


def stop(process: subprocess.Popen) -> Optional[int]:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def env_without_socket(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUFEED_SOCKET", "XDG_RUNTIME_DIR")}
    env.update(extra)
    return env


def serving_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if " serving on " in line]
    assert len(lines) == 1, log.read_text()
    return lines[0].split("] ", 2)[-1]  # after the time and level


def test_a_bare_gpufeedd_makes_its_runtime_directory_and_says_where_it_listens(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    runtime = run / "gpufeed"
    sock = f"{runtime}/gpufeed.sock"
    process = start([GPUFEEDD, f"--runtime_dir={runtime}", "--staging_bytes=67108864",
                     "--threads=2"], env_without_socket(), tmp_path / "log", sock)
    try:
        st = runtime.stat()
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == os.geteuid()
        assert (runtime / "gpufeed.mem.sock").exists()
        line = serving_line(tmp_path / "log")
        assert f"serving on unix://{sock} (memory socket {runtime}/gpufeed.mem.sock; runtime " \
               f"directory {runtime} created), " in line, line
        status = subprocess.run([gpufeedctl(), "--socket", sock, "status"],
                                capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
    finally:
        assert stop(process) == 0, (tmp_path / "log").read_text()


def test_an_unsafe_directory_on_the_way_is_refused_naming_it(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could swap the sockets: no sticky bit
    run = subprocess.run([GPUFEEDD, f"--runtime_dir={shared}/gpufeed", "--staging_bytes=67108864"],
                         env=env_without_socket(), capture_output=True, text=True, timeout=30)
    assert run.returncode == 1
    assert (f"gpufeedd cannot start: FAILED_PRECONDITION: runtime_dir: {shared} is writable by "
            f"its others without the sticky bit (mode 0777): another user could replace "
            f"gpufeedd's sockets beneath it; fix its owner or mode, or name the sockets with "
            f"--listen=unix:///PATH/gpufeed.sock") in run.stderr, run.stderr
    assert not (shared / "gpufeed").exists()


def test_without_root_it_listens_in_xdg_runtime_dir_where_clients_look(monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root (to run gpufeedd as another uid with setpriv)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    # Not pytest's tmp_path: its 0700 directories are closed to the daemon's uid.
    base = Path(tempfile.mkdtemp(prefix="gpufeed-first-run-"))
    try:
        base.chmod(0o755)
        run, xdg = base / "run", base / "xdg"
        run.mkdir(mode=0o755)  # root's: the daemon's uid may not make run/gpufeed
        xdg.mkdir(mode=0o700)
        os.chown(xdg, USER, USER)
        sock = f"{xdg}/gpufeed/gpufeed.sock"
        as_user = ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--clear-groups", "--"]
        env = env_without_socket(XDG_RUNTIME_DIR=str(xdg))
        log = base / "log"
        process = start(as_user + [GPUFEEDD, f"--runtime_dir={run}/gpufeed",
                                   "--staging_bytes=67108864", "--threads=2"], env, log, sock)
        try:
            assert not (run / "gpufeed").exists()
            st = (xdg / "gpufeed").stat()
            assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_uid == USER
            line = serving_line(log)
            assert (f"serving on unix://{sock} (memory socket {xdg}/gpufeed/gpufeed.mem.sock; in "
                    f"$XDG_RUNTIME_DIR/gpufeed (created) because uid {USER} may not create "
                    f"{run}/gpufeed (Permission denied)), ") in line, line
            if os.path.exists(SYSTEM_SOCKET):
                pytest.skip(f"{SYSTEM_SOCKET} exists here: clients would (rightly) go there first")
            # Clients of that user find it with no socket named: gpufeedctl, and Python through
            # the C library's rule.
            status = subprocess.run(as_user + [gpufeedctl(), "status"], env=env,
                                    capture_output=True, text=True, timeout=30)
            assert status.returncode == 0, status.stderr
            monkeypatch.delenv("GPUFEED_SOCKET", raising=False)
            monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
            assert gpufeed.default_socket() == sock
            assert gpufeed.Client().socket == sock
        finally:
            assert stop(process) == 0, log.read_text()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_gpufeedctl_without_a_daemon_says_how_to_name_the_socket(tmp_path):
    absent = str(tmp_path / "absent.sock")
    run = subprocess.run([gpufeedctl(), "--socket", absent, "status"], env=env_without_socket(),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1
    assert run.stderr == (f"error: UNAVAILABLE: no gpufeedd listening at {absent}: no socket there "
                          "(is gpufeedd running? it logs where it listens); give gpufeedctl its "
                          "socket with --socket PATH (or GPUFEED_SOCKET)\n")
    if os.path.exists(SYSTEM_SOCKET):
        return
    # No socket named, none in $XDG_RUNTIME_DIR either: the system path is the one named.
    run = subprocess.run([gpufeedctl(), "status"],
                         env=env_without_socket(XDG_RUNTIME_DIR=str(tmp_path)),
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1
    assert run.stderr.startswith(f"error: UNAVAILABLE: no gpufeedd listening at {SYSTEM_SOCKET}: "
                                 "no socket there"), run.stderr
