"""The security attacks as small reusable functions, against the real binaries with real uids.

The test process runs as root. It starts gpufeedd as root with the socket group SOCKET_GID (as
in a pod: the daemon can read every file), and runs the victim (VICTIM_UID) and the attacker
(ATTACKER_UID) with setpriv, each with its own uid and gid and SOCKET_GID as a supplementary
group, which is what lets them reach the 0660 sockets. Neither is an admin.

The victim and the attacker drive the daemon with gpufeedctl (and so the client library), and
the attacker also with agent.py, a client of its own (gRPC and the memory socket by hand).

Names of flags and config fields that the defences add live in NEW_FLAGS, one line each, so the
integrator can adjust one line if a branch spelled one otherwise.
"""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import struct
import subprocess
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("GPUFEED_BUILD_DIR", ROOT / "build"))
GPUFEEDD = os.environ.get("GPUFEEDD") or str(BUILD / "server" / "gpufeedd")
GPUFEEDCTL = os.environ.get("GPUFEEDCTL") or str(BUILD / "client" / "ctl" / "gpufeedctl")
GPUFEED_LIBRARY = os.environ.get("GPUFEED_LIBRARY") or str(BUILD / "client" / "c" /
                                                          "libgpufeed_c.so")
PROTOC = os.environ.get("GPUFEED_PROTOC") or shutil.which("protoc") or "protoc"
PYTHON = "/usr/bin/python3"  # Debian's: python3-grpcio and python3-protobuf for agent.py
# What the victim and the attacker run besides gpufeedctl (reachable_by_users may move them).
AGENT = HERE / "agent.py"
PYCLIENT = HERE / "pyclient.py"
PYTHON_SRC = ROOT / "client" / "python" / "src"

SOCKET_GID = 10000   # the sockets' group (the "gpufeed" group of a node)
VICTIM_UID = 10001
ATTACKER_UID = 10002

# Flags of gpufeedd that the defences add (docs/SECURITY.md, config fields *_ms map to duration
# flags as attach_timeout_ms -> --attach_timeout). A daemon that does not know one (the code
# before the defences) is started without it, so the test then fails on the behaviour the flag
# asks for, not on start-up.
NEW_FLAGS = {
    "idle_lease_timeout": "--idle_lease_timeout",  # idle_lease_timeout_ms (26)
    "stream_open_timeout": "--stream_open_timeout",  # stream_open_timeout_ms (39)
    "connection_idle_timeout": "--connection_idle_timeout",  # connection_idle_timeout_ms (40)
}
# What RESOURCE_EXHAUSTED must name past a quota ("naming the quota", docs/SECURITY.md §4).
SESSION_QUOTA = "max_sessions_per_uid"       # (24)
STAGING_QUOTA = "max_staging_bytes_per_uid"  # (25)

# Bounds the tests hold the daemon to.
RSS_LIMIT_BYTES = 1 << 30          # the daemon's peak RSS in a crash attempt
RSS_GROWTH_LIMIT_BYTES = 256 << 20  # its peak RSS growth from one attacker request
# The daemon's address space in these tests: a daemon that tries to materialise 16 GiB fails
# its allocation (std::bad_alloc) instead of taking a shared CI machine's memory.
DAEMON_ADDRESS_SPACE = 8 << 30
STAGING_BYTES = 64 << 20

MARKER = b"VICTIMSECRET"  # in every sample of the victim's dataset


def skip_reason() -> Optional[str]:
    """Why these tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (to act as the victim and attacker uids with setpriv)"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    if os.environ.get("GPUFEED_SANITIZE", "") in ("address", "thread"):
        return "not under sanitizers (the Python agent would load an instrumented library)"
    for binary in (GPUFEEDD, GPUFEEDCTL):
        if not os.access(binary, os.X_OK):
            return f"no binary at {binary} (build gpufeedd and gpufeedctl)"
    try:
        subprocess.run([PYTHON, "-c", "import grpc, google.protobuf"], check=True,
                       capture_output=True, timeout=60)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "needs python3-grpcio and python3-protobuf (deploy/install-deps.sh)"
    return None


# ---- acting as a uid ----

def as_uid(uid: int) -> List[str]:
    """setpriv prefix: uid and gid `uid`, supplementary group SOCKET_GID, no capabilities."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", f"--groups={SOCKET_GID}",
            "--inh-caps=-all", "--"]


def user_env(home: Path, pb_dir: Optional[Path] = None) -> Dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
           "GPUFEED_LIBRARY": GPUFEED_LIBRARY}
    if pb_dir is not None:
        env["PYTHONPATH"] = str(pb_dir)
    return env


class Ctl:
    """gpufeedctl, run as `uid` (None: as root, an admin)."""

    def __init__(self, socket: str, uid: Optional[int], home: Path) -> None:
        self.socket, self.uid, self.home = socket, uid, home

    def argv(self, *args: str) -> List[str]:
        prefix = as_uid(self.uid) if self.uid is not None else []
        return [*prefix, GPUFEEDCTL, "--socket", self.socket, *args]

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(self.argv(*args), capture_output=True, text=True,
                                  timeout=timeout, env=user_env(self.home), cwd=self.home)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, 124, _text(e.stdout),
                                               _text(e.stderr) + f"\n(timed out after {timeout} s)")

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=user_env(self.home), cwd=self.home)

    def consume(self, dataset: Path, *extra: str, timeout: float = 30,
                seq_len: int = 16, batch: int = 4) -> subprocess.CompletedProcess:
        return self.run("-o", "json", "consume", "--dataset", str(dataset), "--token-dtype",
                        "uint16", "--seq-len", str(seq_len), "--batch-size", str(batch),
                        "--checksum", *extra, timeout=timeout)


def _text(data: Any) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def checksum_of(run: subprocess.CompletedProcess) -> Optional[int]:
    """The checksum of a `consume -o json --checksum` run, or None when it failed."""
    if run.returncode != 0:
        return None
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            return json.loads(line).get("checksum")
    return None


def error_code(run: subprocess.CompletedProcess) -> str:
    """CODE of gpufeedctl's "error: CODE: message" line ("" when none)."""
    for line in run.stderr.splitlines():
        if line.startswith("error: "):
            return line[len("error: "):].split(":", 1)[0]
    return ""


class Agent:
    """agent.py as `uid`: a session of one command, stepped by the test."""

    def __init__(self, pb_dir: Path, uid: int, home: Path, command: str,
                 args: Dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [*as_uid(uid), PYTHON, "-B", str(AGENT), command, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=user_env(home, pb_dir), cwd=home)
        self.result: Optional[Dict[str, Any]] = None

    def next(self, timeout: float = 60) -> Dict[str, Any]:
        """The agent's next line: {"step": ...} or {"result": ...}."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            _, err = self.process.communicate()
            raise AssertionError(f"agent gave no line within {timeout} s: {err[-2000:]}")
        message = json.loads(line)
        if "result" in message:
            self.result = message["result"]
            self.process.communicate(timeout=30)
        return message

    def go(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def finish(self, timeout: float = 60) -> Dict[str, Any]:
        """Cues every remaining step and returns the result."""
        while self.result is None:
            message = self.next(timeout)
            if "step" in message:
                self.go()
        assert "error" not in self.result, f"agent failed: {self.result['error']}"
        return self.result

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def python_client(uid: int, home: Path, socket: str, dataset: Path,
                  seq_len: int) -> Dict[str, Any]:
    """pyclient.py (the gpufeed Python package from client/python/src) as `uid`."""
    env = {**user_env(home), "PYTHONPATH": str(PYTHON_SRC)}
    run = subprocess.run([*as_uid(uid), PYTHON, "-B", str(PYCLIENT), socket,
                          str(dataset), str(seq_len)], capture_output=True, text=True,
                         timeout=60, env=env, cwd=home)
    assert run.returncode == 0 and run.stdout.strip(), f"pyclient.py failed: {run.stderr}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_agent(pb_dir: Path, uid: int, home: Path, command: str, args: Dict[str, Any],
              timeout: float = 60) -> Dict[str, Any]:
    agent = Agent(pb_dir, uid, home, command, args)
    try:
        return agent.finish(timeout)
    finally:
        agent.kill()


# The protocol agent.py speaks: this tree's proto/ (so new fields follow), or GPUFEED_PROTO_DIR
# (the proto/ of the build under test, when that is another tree's).
PROTO_DIR = Path(os.environ.get("GPUFEED_PROTO_DIR") or ROOT / "proto")


def generate_protos(out: Path) -> Path:
    """feed_pb2.py for agent.py, generated from PROTO_DIR."""
    subprocess.run([PROTOC, f"-I{PROTO_DIR}", f"--python_out={out}",
                    str(PROTO_DIR / "gpufeed" / "v1" / "feed.proto")], check=True)
    for d in (out / "gpufeed", out / "gpufeed" / "v1"):
        (d / "__init__.py").touch()
    for p in [out, *out.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return out


def reachable_by_users(tools: Path) -> None:
    """Makes what the users run reachable by them: where the attacker's uid cannot read the
    build or the source tree (a checkout under /root), copies gpufeedctl, libgpufeed_c.so,
    agent.py, pyclient.py and the Python package into `tools` (0755) and uses those."""
    global GPUFEEDCTL, GPUFEED_LIBRARY, AGENT, PYCLIENT, PYTHON_SRC
    probe = subprocess.run([*as_uid(ATTACKER_UID), "sh", "-c",
                            'test -x "$1" && test -r "$2" && test -r "$3" && test -r "$4"', "-",
                            GPUFEEDCTL, GPUFEED_LIBRARY, str(AGENT),
                            str(PYTHON_SRC / "gpufeed" / "__init__.py")], env=user_env(Path("/")))
    if probe.returncode == 0:
        return
    tools.mkdir(mode=0o755)
    GPUFEEDCTL = shutil.copy(GPUFEEDCTL, tools / "gpufeedctl")
    GPUFEED_LIBRARY = shutil.copy(GPUFEED_LIBRARY, tools / "libgpufeed_c.so")
    AGENT = Path(shutil.copy(AGENT, tools / "agent.py"))
    PYCLIENT = Path(shutil.copy(PYCLIENT, tools / "pyclient.py"))
    PYTHON_SRC = tools / "python"
    shutil.copytree(ROOT / "client" / "python" / "src", PYTHON_SRC)
    for p in [tools, *tools.rglob("*")]:
        p.chmod(0o755 if p.is_dir() or p.name == "gpufeedctl" else 0o644)


# ---- the daemon ----

_known_flags: Dict[str, bool] = {}


def daemon_knows(flag: str) -> bool:
    if flag not in _known_flags:
        out = subprocess.run([GPUFEEDD, "--helpfull"], capture_output=True, text=True, timeout=30)
        _known_flags[flag] = f"-{flag.lstrip('-')}" in (out.stdout + out.stderr)
    return _known_flags[flag]


def new_flag(name: str, value: str) -> List[str]:
    """[--flag=value] for a flag the defences add, or [] (noted in the log) where the daemon under
    test does not have it."""
    flag = NEW_FLAGS[name]
    if daemon_knows(flag):
        return [f"{flag}={value}"]
    print(f"note: {GPUFEEDD} has no {flag}; started without it")
    return []


class Daemon:
    """gpufeedd as root with socket group SOCKET_GID, its sockets in `run_dir`."""

    def __init__(self, run_dir: Path, *flags: str, nofile: Optional[int] = None) -> None:
        """`nofile`: the daemon's RLIMIT_NOFILE (default: the test process's)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        run_dir.chmod(0o755)
        self.socket = str(run_dir / "gf.sock")
        self.mem_socket = str(run_dir / "gf.mem.sock")
        self.log = run_dir / "gpufeedd.log"
        for stale in (self.socket, self.mem_socket):
            if os.path.exists(stale):
                os.unlink(stale)
        argv = ["setpriv", f"--regid={SOCKET_GID}", "--clear-groups", "--", GPUFEEDD,
                f"--listen=unix://{self.socket}", f"--staging_bytes={STAGING_BYTES}",
                f"--staging_slab_bytes={STAGING_BYTES}", "--threads=2", *flags]
        self.argv = argv

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (DAEMON_ADDRESS_SPACE, DAEMON_ADDRESS_SPACE))
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=limit)
        self.admin = Ctl(self.socket, None, run_dir)
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"gpufeedd exited with {self.process.returncode} at start:"
                                     f"\n{self.log_text()}")
            if (os.path.exists(self.mem_socket)
                    and self.admin.run("status", timeout=5).returncode == 0):
                break
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"gpufeedd did not answer within 20 s:\n{self.log_text()}")
            time.sleep(0.05)
        self.baseline_rss = self.rss()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def _status_field(self, field: str) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def rss(self) -> int:
        return self._status_field("VmRSS")

    def peak_rss(self) -> int:
        """VmHWM: the highest RSS the process has had."""
        return self._status_field("VmHWM")

    def sessions(self) -> List[Dict[str, Any]]:
        out = self.admin.run("-o", "json", "sessions", timeout=10)
        return json.loads(out.stdout) if out.returncode == 0 else []

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10) -> Optional[int]:
        """SIGTERM; the exit code, or None when it had to be killed."""
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# ---- the people ----

class Node:
    """The directories, datasets and users of one test module: `base` (0755) holds run/ (the
    daemon's sockets), victim/ and attacker/ (each its user's own, 0755)."""

    def __init__(self, base: Path, pb_dir: Path) -> None:
        self.base, self.pb_dir = base, pb_dir
        self.victim_home = self._home("victim", VICTIM_UID)
        self.attacker_home = self._home("attacker", ATTACKER_UID)
        # The victim's dataset: MARKER in every 16 bytes, a counter in the rest.
        units = b"".join(MARKER + struct.pack("<I", i) for i in range(4096))
        self.victim_tokens = self.victim_file("tokens.bin", units, 0o644)
        # A file of the victim only the victim may read.
        self.victim_secret = self.victim_file("secret.bin", MARKER * 1000, 0o600)
        private = self.victim_home / "private"
        private.mkdir(mode=0o700)
        os.chown(private, VICTIM_UID, VICTIM_UID)
        # In its 0700 directory, of an odd size ("holds N bytes, not a whole number of tokens").
        self.victim_private = self.victim_file("private/secret.bin", MARKER * 500 + b"!!!",
                                               0o600)
        self.victim_private_missing = private / "missing.bin"
        # The attacker's own dataset: no marker.
        self.attacker_tokens = self.attacker_file(
            "tokens.bin", b"".join(struct.pack("<16H", *([i % 251] * 16)) for i in range(2048)))

    def _home(self, name: str, uid: int) -> Path:
        home = self.base / name
        home.mkdir(mode=0o755)
        os.chown(home, uid, uid)
        return home

    def _file(self, home: Path, uid: int, name: str, data: bytes, mode: int) -> Path:
        path = home / name
        path.write_bytes(data)
        path.chmod(mode)
        os.chown(path, uid, uid)
        return path

    def victim_file(self, name: str, data: bytes, mode: int = 0o644) -> Path:
        return self._file(self.victim_home, VICTIM_UID, name, data, mode)

    def attacker_file(self, name: str, data: bytes, mode: int = 0o644) -> Path:
        return self._file(self.attacker_home, ATTACKER_UID, name, data, mode)

    def attacker_path(self, name: str) -> Path:
        """A path in the attacker's directory, owned by the attacker (parents made)."""
        path = self.attacker_home / name
        for parent in reversed(path.relative_to(self.attacker_home).parents):
            d = self.attacker_home / parent
            if not d.exists():
                d.mkdir(mode=0o755)
                os.chown(d, ATTACKER_UID, ATTACKER_UID)
        return path

    def chown_attacker(self, path: Path) -> Path:
        os.lchown(path, ATTACKER_UID, ATTACKER_UID)
        return path

    def victim(self, daemon: Daemon) -> Ctl:
        return Ctl(daemon.socket, VICTIM_UID, self.victim_home)

    def attacker(self, daemon: Daemon) -> Ctl:
        return Ctl(daemon.socket, ATTACKER_UID, self.attacker_home)

    def agent(self, daemon: Daemon, command: str, **args: Any) -> Agent:
        return Agent(self.pb_dir, ATTACKER_UID, self.attacker_home, command,
                     {"socket": daemon.socket, **args})

    def run_agent(self, daemon: Daemon, command: str, timeout: float = 60,
                  **args: Any) -> Dict[str, Any]:
        return run_agent(self.pb_dir, ATTACKER_UID, self.attacker_home, command,
                         {"socket": daemon.socket, **args}, timeout)


# The victim's run whose bytes are compared, with and without the attacker.
VICTIM_RUN = ("--job", "victim-job-7f3a", "--seed", "424242", "--ring-slots", "4",
              "--max-batches", "40")


def victim_checksum(node: Node, daemon: Daemon, *extra: str, timeout: float = 60) -> int:
    run = node.victim(daemon).consume(node.victim_tokens, *VICTIM_RUN, *extra, timeout=timeout)
    assert run.returncode == 0, f"the victim's consume failed: {run.stderr}"
    return checksum_of(run)


def assert_serving(node: Node, daemon: Daemon, expected: Optional[int] = None) -> None:
    """The daemon is alive and a fresh consume of the victim succeeds, with the bytes of a run
    without the attacker when `expected` is given."""
    assert daemon.alive(), (f"gpufeedd died (exit {daemon.process.returncode}):\n"
                            f"{daemon.log_text()[-3000:]}")
    run = node.victim(daemon).consume(node.victim_tokens, *VICTIM_RUN, timeout=30)
    assert run.returncode == 0, f"a fresh consume of the victim failed: {run.stderr}"
    if expected is not None:
        assert checksum_of(run) == expected, "the victim's bytes changed"


# ---- datasets an attacker makes ----

def sparse_file(path: Path, size: int, head: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def npy_header(dtype: str, shape: Tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header (the bytes before the data)."""
    text = "{'descr': '%s', 'fortran_order': False, 'shape': %r, }" % (dtype, tuple(shape))
    pad = 64 - (10 + len(text) + 1) % 64
    text = text + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode()


def png(width: int, height: int, seed: int = 0) -> bytes:
    """An RGB PNG of `width` x `height`."""
    rows = b"".join(b"\0" + bytes(((x * 7 + y * 13 + seed) % 256) for x in range(width * 3))
                    for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                               0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


PIPELINE = '{"ops": [{"center_crop": {"size": 8}}]}'
