"""Fixtures for the gpufeed Python tests: a real gpufeedd on a temp socket, and datasets.

The package is imported from the source tree (client/python/src; GPUFEED_PYTHON_SRC names
another, "" an installed one). Binaries come from the build unless the environment names
others:
  GPUFEEDD          gpufeedd binary     (default build/server/gpufeedd)
  GPUFEED_LIBRARY   libgpufeed_c.so     (default build/client/c/libgpufeed_c.so)
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket as socketlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# GPUFEED_PYTHON_SRC: where to import gpufeed from ("" = wherever it is installed).
_SRC = os.environ.get("GPUFEED_PYTHON_SRC", str(ROOT / "client" / "python" / "src"))
if _SRC:
    sys.path.insert(0, _SRC)
sys.path.insert(0, str(Path(__file__).resolve().parent))
if _SRC:  # an installed package finds its own library (the wheel's gpufeed/_lib)
    os.environ.setdefault("GPUFEED_LIBRARY",
                          str(ROOT / "build" / "client" / "c" / "libgpufeed_c.so"))
GPUFEEDD = os.environ.get("GPUFEEDD") or str(ROOT / "build" / "server" / "gpufeedd")


def gpufeedctl() -> str:
    """gpufeedctl: $GPUFEEDCTL, else the one of GPUFEEDD's build tree; skips the test
    visibly where there is neither."""
    given = os.environ.get("GPUFEEDCTL")
    if given:
        return given
    beside = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(GPUFEEDD))),
                          "client", "ctl", "gpufeedctl")
    if not os.path.exists(beside):
        pytest.skip("no gpufeedctl beside $GPUFEEDD (set $GPUFEEDCTL)")
    return beside

import reference  # noqa: E402  (tests/python/reference.py, after the path is set)


class Daemon:
    """A gpufeedd process on `socket`, its stderr in `log`."""

    def __init__(self, directory: Path, *flags: str) -> None:
        if not os.access(GPUFEEDD, os.X_OK):
            pytest.fail(f"no gpufeedd binary at {GPUFEEDD} (build it, or set GPUFEEDD)")
        self.directory, self.flags = directory, flags
        self.socket = str(directory / "gf.sock")
        self.log = directory / "gpufeedd.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [GPUFEEDD, f"--listen=unix://{self.socket}", "--staging_bytes=67108864",
                 "--threads=2", *flags],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"gpufeedd exited with {self.process.returncode}: "
                            f"{self.log.read_text()}")
            if self._answers():
                return
            time.sleep(0.02)
        self.stop()
        pytest.fail(f"gpufeedd did not listen on {self.socket} within 10 s: {self.log.read_text()}")

    def _answers(self) -> bool:
        if not (os.path.exists(self.socket) and os.path.exists(self.socket[:-5] + ".mem.sock")):
            return False
        s = socketlib.socket(socketlib.AF_UNIX)
        try:
            s.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def kill_and_restart(self) -> "Daemon":
        """SIGKILL (a crash: no drain, no goodbye), then a new gpufeedd with the same flags on
        the same socket (the stale socket file is replaced)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        return Daemon(self.directory, *self.flags)

    def stop(self) -> int:
        """SIGTERM, then the exit code (SIGKILL after 10 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


TEST_DEADLINE_S = 120


@pytest.fixture(autouse=True)
def _deadline():
    """Fails a test that hangs (e.g. a slot never returned) instead of stalling the suite:
    SIGALRM raises in the main thread, which gpufeed's waits leave every 200 ms."""

    def expire(signum, frame):
        raise TimeoutError(f"test ran over {TEST_DEADLINE_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_DEADLINE_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One gpufeedd for the whole run (tests use distinct job names)."""
    d = Daemon(tmp_path_factory.mktemp("gpufeedd"))
    yield d
    code = d.stop()
    assert code == 0, f"gpufeedd exited with {code}: {d.log.read_text()}"


@pytest.fixture
def fresh_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A gpufeedd of this test alone (for tests that stop it)."""
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job name unique to the test (the session daemon is shared)."""
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    return f"py-{request.node.originalname}-{digest}"


# ---- datasets ----

SEQ_LEN = 16
TOKENS_N = 203  # samples: 16 * 203 + 1 + 5 tokens -> floor((T - 1) / 16) = 203 windows


@pytest.fixture(scope="session")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> "reference.Datasets":
    """Token files (uint16, uint32), record files (.npy) and an image folder, with the values
    the tests compare against."""
    return reference.make_datasets(tmp_path_factory.mktemp("data"), SEQ_LEN, TOKENS_N)


def pytest_report_header(config: pytest.Config) -> List[str]:
    try:
        import torch

        torch_line = f"torch {torch.__version__}"
    except ImportError:
        torch_line = "torch: not installed (gpufeed.torch tests skip)"
    return [f"gpufeedd: {GPUFEEDD}", f"libgpufeed_c.so: {os.environ['GPUFEED_LIBRARY']}",
            f"numpy {np.__version__}; {torch_line}"]
