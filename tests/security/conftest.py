"""Fixtures for tests/security: the node (directories, datasets, the victim and the attacker),
a shared gpufeedd and fresh ones. Without root or setpriv every test skips, saying why."""

from __future__ import annotations

import itertools
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator, List

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attacks  # noqa: E402

TEST_DEADLINE_S = 90
_runs = itertools.count(1)


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    reason = attacks.skip_reason()
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config: pytest.Config) -> List[str]:
    return [f"gpufeedd: {attacks.GPUFEEDD}", f"gpufeedctl: {attacks.GPUFEEDCTL}",
            f"victim uid {attacks.VICTIM_UID}, attacker uid {attacks.ATTACKER_UID}, "
            f"socket group {attacks.SOCKET_GID}"]


@pytest.fixture(autouse=True)
def _deadline():
    """Fails a test that hangs instead of stalling the suite."""

    def expire(signum, frame):
        raise TimeoutError(f"test ran over {TEST_DEADLINE_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_DEADLINE_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def node() -> Iterator[attacks.Node]:
    base = Path(tempfile.mkdtemp(prefix="gpufeed-security-", dir="/tmp"))
    base.chmod(0o755)
    try:
        pb_dir = base / "pb"
        pb_dir.mkdir()
        attacks.generate_protos(pb_dir)
        attacks.reachable_by_users(base / "tools")
        yield attacks.Node(base, pb_dir)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon(node: attacks.Node) -> Iterator[attacks.Daemon]:
    """One gpufeedd for the attacks that do not stop or wedge it."""
    d = attacks.Daemon(node.base / "run")
    yield d
    d.stop()


@pytest.fixture(scope="session")
def expected(node: attacks.Node, daemon: attacks.Daemon) -> int:
    """The victim's checksum with no attacker about."""
    return attacks.victim_checksum(node, daemon)


@pytest.fixture
def fresh(node: attacks.Node) -> Iterator[Callable[..., attacks.Daemon]]:
    """fresh(*flags): a gpufeedd of this test alone (killed at the end if still there)."""
    started: List[attacks.Daemon] = []

    def start(*flags: str) -> attacks.Daemon:
        # Short directory names: a socket path has at most 107 bytes.
        d = attacks.Daemon(node.base / f"run{next(_runs)}", *flags)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(timeout=5)
