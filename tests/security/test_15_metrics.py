"""Who is an admin (a root pod need not be), what /metrics shows to
anyone who can scrape it, idle HTTP connections against scrapes, and the client's check of
who serves the memory socket before it hands over a dataset descriptor (docs/SECURITY.md
sections 1, 2 and 4)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import List

import attacks
from attacks import (ATTACKER_UID, GPUFEEDCTL, GPUFEEDD, SOCKET_GID, VICTIM_UID, Daemon, Node,
                     as_uid, error_code, user_env)

VICTIM_JOB = "victim-job-7f3a"
# The daemon's bounds (server/service/metrics.h): worker threads and the request timeout.
HTTP_THREADS = 16
REQUEST_TIMEOUT_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 20) -> str:
    """/metrics as the attacker would fetch it: a plain HTTP GET (one connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def idle_partial_requests(port: int, count: int) -> List[socket.socket]:
    """`count` connections that each send the start of a request line and nothing more."""
    held = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"GET /metr")
        held.append(s)
    return held


def victim_streaming(node: Node, daemon: Daemon) -> subprocess.Popen:
    victim = node.victim(daemon).popen("consume", "--dataset", str(node.victim_tokens),
                                       "--token-dtype", "uint16", "--seq-len", "16",
                                       "--batch-size", "4", "--step-ms", "100",
                                       "--job", VICTIM_JOB, "--max-batches", "100000")
    daemon.wait_for(lambda: any(s["job"] == VICTIM_JOB for s in daemon.sessions()), 20,
                    "the victim's session")
    return victim


# ---- 9a: /metrics shows no other user's job names or uids ----

def test_15_metrics_show_no_job_names_or_uids_by_default(node: Node, fresh) -> None:
    port = free_port()
    daemon = fresh(f"--metrics_listen=127.0.0.1:{port}")
    victim = victim_streaming(node, daemon)
    try:
        text = scrape(port)
        wall = [line for line in text.splitlines()
                if line.startswith("gpufeed_consumer_wall_seconds_total{")]
        assert len(wall) == 1, f"want the victim's one consumer series: {wall}"
        assert VICTIM_JOB not in text, f"/metrics shows the victim's job name: {wall}"
        assert f'uid="{VICTIM_UID}"' not in text, f"/metrics shows the victim's uid: {wall}"
        # A per-job id that says nothing: still one series per job and rank.
        assert re.fullmatch(r'gpufeed_consumer_wall_seconds_total\{job="job-[0-9a-f]{16}",'
                            r'rank="0"\} \S+', wall[0]), wall[0]
        # Stable from one scrape to the next while the job is attached.
        again = [line for line in scrape(port).splitlines()
                 if line.startswith("gpufeed_consumer_wall_seconds_total{")]
        assert again and again[0].split("}")[0] == wall[0].split("}")[0], (wall, again)
    finally:
        victim.kill()
        victim.communicate()


def test_15_metrics_job_labels_are_an_opt_in(node: Node, fresh) -> None:
    port = free_port()
    daemon = fresh(f"--metrics_listen=127.0.0.1:{port}", "--metrics_job_labels")
    victim = victim_streaming(node, daemon)
    try:
        text = scrape(port)
        assert (f'gpufeed_consumer_wall_seconds_total{{job="{VICTIM_JOB}",rank="0",'
                f'uid="{VICTIM_UID}"}}') in text, text[-2000:]
    finally:
        victim.kill()
        victim.communicate()


# ---- 9c: idle partial HTTP requests do not stop scrapes ----

def test_15_idle_partial_requests_do_not_block_a_scrape(node: Node, fresh) -> None:
    port = free_port()
    daemon = fresh(f"--metrics_listen=127.0.0.1:{port}")
    held = idle_partial_requests(port, 8)
    try:
        start = time.monotonic()
        text = scrape(port, timeout=15)
        took = time.monotonic() - start
        assert "gpufeed_build_info" in text and took < 3, (
            f"8 idle partial requests held the scrape {took:.1f} s")
    finally:
        for s in held:
            s.close()
    # More than the workers: the scrape waits at most about one request timeout, and the idle
    # connections are closed by the daemon.
    held = idle_partial_requests(port, HTTP_THREADS + 8)
    try:
        start = time.monotonic()
        text = scrape(port, timeout=30)
        took = time.monotonic() - start
        assert "gpufeed_build_info" in text and took < REQUEST_TIMEOUT_S + 5, (
            f"{len(held)} idle partial requests held the scrape {took:.1f} s")
        held[0].settimeout(REQUEST_TIMEOUT_S + 10)
        assert held[0].recv(1024) is not None  # returns (b"" or an error reply): closed
    finally:
        for s in held:
            s.close()
    assert daemon.alive()


# ---- 8: root is an admin only as configured ----

def test_15_root_is_not_an_admin_when_configured_so(node: Node, fresh) -> None:
    # As the shipped Kubernetes config: a root pod is uid 0 on the hostPath socket.
    daemon = fresh("--noroot_is_admin", "--nodaemon_uid_is_admin",
                   f"--admin_uids={VICTIM_UID}")
    as_root = daemon.admin.run("drain", "--timeout", "1ms")
    assert as_root.returncode != 0 and error_code(as_root) == "PERMISSION_DENIED", (
        f"root drained a daemon with root_is_admin false: {as_root.stdout} {as_root.stderr}")
    assert "only an admin may drain gpufeedd (admin_uids/admin_gids)" in as_root.stderr
    assert daemon.alive()
    # The admin the config names may.
    named = attacks.Ctl(daemon.socket, VICTIM_UID, node.victim_home).run("drain", "--timeout",
                                                                          "1ms")
    assert named.returncode == 0, named.stderr
    assert daemon.process.wait(10) == 0


# ---- 9e: the client hands its descriptors only to a server it trusts ----

class RogueDaemon:
    """gpufeedd run by the attacker (uid ATTACKER_UID, group SOCKET_GID, which it is a member
    of) in a world-writable sticky directory (as /tmp): the path a victim may be pointed at."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True)
        run_dir.chmod(0o1777)
        self.socket = str(run_dir / "gf.sock")
        self.log = run_dir / "rogue.log"
        argv = ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={SOCKET_GID}", "--clear-groups",
                "--inh-caps=-all", "--", "/bin/sh", "-c", 'umask 0007 && exec "$@"', "-",
                GPUFEEDD, f"--listen=unix://{self.socket}", f"--staging_bytes={64 << 20}",
                f"--staging_slab_bytes={64 << 20}", "--threads=1"]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        mem = str(run_dir / "gf.mem.sock")
        deadline = time.monotonic() + 20
        while not (os.path.exists(mem) and os.path.exists(self.socket)):
            assert self.process.poll() is None, self.log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the rogue gpufeedd did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def victim_consume(node: Node, socket_path: str, dataset: Path,
                   extra_env: dict) -> subprocess.CompletedProcess:
    env = {**user_env(node.victim_home), **extra_env}
    return subprocess.run([*as_uid(VICTIM_UID), GPUFEEDCTL, "--socket", socket_path, "consume",
                           "--dataset", str(dataset), "--token-dtype", "uint16", "--seq-len",
                           "16", "--batch-size", "4", "--max-batches", "2"],
                          capture_output=True, text=True, timeout=60, env=env,
                          cwd=node.victim_home)


def test_15_client_refuses_a_memory_socket_served_by_another_uid(node: Node) -> None:
    rogue = RogueDaemon(node.base / "rogue")
    try:
        # The victim's file only it may read: through the rogue daemon, the attacker would
        # hold a descriptor of it.
        run = victim_consume(node, rogue.socket, node.victim_secret, {})
        assert run.returncode != 0, (
            "the victim's client handed its dataset to a gpufeedd of uid "
            f"{ATTACKER_UID}: {run.stdout} {run.stderr}")
        assert error_code(run) == "PERMISSION_DENIED", run.stderr
        assert f"is served by uid {ATTACKER_UID}" in run.stderr, run.stderr
        assert f"set GPUFEED_DAEMON_UID={ATTACKER_UID}" in run.stderr, run.stderr
        assert "attach: session" not in rogue.log.read_text(errors="replace"), (
            "the rogue daemon made a session of the victim's dataset")
        # Trusted explicitly, the same client goes on (the refusal above was the check's).
        trusted = victim_consume(node, rogue.socket, node.victim_tokens,
                                 {"GPUFEED_DAEMON_UID": str(ATTACKER_UID)})
        assert trusted.returncode == 0, trusted.stderr
        # A GPUFEED_DAEMON_UID that names another uid trusts only root and that uid.
        other = victim_consume(node, rogue.socket, node.victim_tokens,
                               {"GPUFEED_DAEMON_UID": "998"})
        assert error_code(other) == "PERMISSION_DENIED", other.stderr
        assert "GPUFEED_DAEMON_UID (998)" in other.stderr, other.stderr
    finally:
        rogue.stop()
