"""Starts the built gpufeedd on a socket in a temp dir for the deploy tests, and stops it."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import subprocess
import tempfile
import time
from typing import Iterator, List


class Daemon:
    def __init__(self, process: subprocess.Popen, socket: pathlib.Path, log: pathlib.Path,
                 gpufeedctl: str):
        self.process, self.socket, self.log, self.gpufeedctl = process, socket, log, gpufeedctl

    def ctl(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([self.gpufeedctl, "--socket", str(self.socket), *args],
                              capture_output=True, text=True, timeout=timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def running(gpufeedd: str, gpufeedctl: str, args: List[str]) -> Iterator[Daemon]:
    """gpufeedd with `args` plus --listen in a temp dir; yields once `gpufeedctl status` answers.
    On leaving, SIGTERM and a check that it exited 0."""
    with tempfile.TemporaryDirectory(prefix="gpufeed-deploy-") as tmp:
        socket = pathlib.Path(tmp) / "gpufeed.sock"
        log = pathlib.Path(tmp) / "gpufeedd.log"
        with open(log, "wb") as out:
            process = subprocess.Popen([gpufeedd, *args, f"--listen=unix://{socket}"],
                                       stdout=out, stderr=subprocess.STDOUT)
        daemon = Daemon(process, socket, log, gpufeedctl)
        try:
            deadline = time.monotonic() + 20
            while daemon.ctl("status", timeout=5).returncode != 0:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gpufeedd {' '.join(args)} did not start "
                                       f"(exit {process.poll()}):\n{daemon.log_text()}")
                time.sleep(0.05)
            yield daemon
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
                    raise RuntimeError(f"gpufeedd did not exit on SIGTERM:\n{daemon.log_text()}")
        if process.returncode != 0:
            raise RuntimeError(f"gpufeedd exited {process.returncode} on SIGTERM:\n"
                               f"{daemon.log_text()}")
