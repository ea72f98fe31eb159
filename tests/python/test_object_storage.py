"""s3:// datasets against a real S3 server on loopback (issue 36): moto in server mode with its
signature checks on (tests/testing/moto_s3_server.py, from the venv tests/run.sh makes, or
$GPUFEED_S3_PYTHON), a gpufeedd started with --s3_endpoint, and the caller's credentials from
its environment as the AWS SDKs read them. Each stream is compared, ids and bytes, with the
same data read from local files by the same daemon; with 5 % injected faults
(tests/testing/s3_fault_proxy.py) the streams stay exact.

Skips, saying so, where moto is not installed.
"""
from __future__ import annotations

import io
import json
import os
import re
import socket as socketlib
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest

import gpufeed
import reference
from conftest import Daemon, gpufeedctl

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GPUFEEDD", REPO / "build/server/gpufeedd")).resolve().parents[1]
MOTO_PYTHON = os.environ.get("GPUFEED_S3_PYTHON", str(BUILD / "s3-venv/bin/python3"))
BUCKET = "train-data"
SEQ = 16


class Moto:
    """moto's S3 on loopback, driven over stdin (moto_s3_server.py's commands)."""

    def __init__(self) -> None:
        if not os.access(MOTO_PYTHON, os.X_OK) or subprocess.run(
                [MOTO_PYTHON, "-c", "import moto.server"], capture_output=True).returncode:
            pytest.skip(f"no moto at {MOTO_PYTHON} (tests/run.sh installs it from PyPI into "
                        "build/s3-venv; set GPUFEED_S3_PYTHON): the S3 tests need a real server")
        self.process = subprocess.Popen(
            [MOTO_PYTHON, str(REPO / "tests/testing/moto_s3_server.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.process.stdout.readline())
        self.endpoint = f"http://127.0.0.1:{hello['port']}"
        self.key, self.secret = hello["access_key"], hello["secret"]

    def command(self, **op) -> str:
        self.process.stdin.write(json.dumps(op) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        assert answer.startswith("ok"), answer
        return answer

    def upload(self, directory: Path, prefix: str) -> None:
        for f in sorted(directory.iterdir()):
            self.command(op="put", bucket=BUCKET, key=f"{prefix}{f.name}", file=str(f))

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(10)


class FaultProxy:
    """s3_fault_proxy.py between gpufeedd and moto: a share of requests fail (500/503) or have
    their bodies cut short."""

    def __init__(self, upstream: str, rate: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "tests/testing/s3_fault_proxy.py"), "--upstream",
             upstream.removeprefix("http://"), "--error_rate", str(rate), "--truncate_rate",
             str(rate), "--seed", "36"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.endpoint = f"http://127.0.0.1:{json.loads(self.process.stdout.readline())['port']}"

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(10)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Local token shards and WebDataset tars, the reference the S3 copies are read against."""
    root = tmp_path_factory.mktemp("s3data")
    tokens = root / "tokens"
    tokens.mkdir()
    rng = np.random.default_rng(36)
    for k in range(3):
        rng.integers(0, 50000, size=SEQ * (40 + 7 * k) + 3, dtype=np.uint16).tofile(
            tokens / f"shard_{k:03d}.bin")
    shards = root / "wds"
    shards.mkdir()
    i = 0
    for k in range(3):
        with tarfile.open(shards / f"train-{k:04d}.tar", "w") as tar:
            for _ in range(5):
                rgb = rng.integers(0, 256, size=(10 + i % 3, 12, 3), dtype=np.uint8)
                png = root / "img.png"
                reference.write_png(png, rgb)
                for name, body in ((f"s{i:05d}.png", png.read_bytes()),
                                   (f"s{i:05d}.cls", f"{i % 4}\n".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
                i += 1
    return root


@pytest.fixture(scope="module")
def moto(data) -> Iterator[Moto]:
    m = Moto()
    m.command(op="create_bucket", bucket=BUCKET)
    m.upload(data / "tokens", "corpus/tokens/")
    m.upload(data / "wds", "corpus/wds/")
    yield m
    m.close()


@pytest.fixture
def caller(moto, monkeypatch):
    """This process's AWS environment, as a training job would have it (the client library
    reads it; the daemon never sees the caller's environment)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto.secret)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto.endpoint)
    monkeypatch.setenv("HOME", "/nonexistent")
    return moto


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_daemon(tmp_path: Path, endpoint: str, *flags: str) -> Daemon:
    d = Daemon(tmp_path, f"--s3_endpoint={endpoint}", f"--metrics_listen=127.0.0.1:{free_port()}",
               *flags)
    d.metrics_port = int(re.search(r"--metrics_listen=127.0.0.1:(\d+)", " ".join(d.flags))[1])
    return d


def metric(d: Daemon, name: str, **labels: str) -> float:
    """The sum of `name`'s series with these labels, from the daemon's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics",
                                  timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:{{(.*)}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m[1] or "") for k, v in labels.items()):
            total += float(m[2])
    return total


def stream(socket: str, path: str, kind: str, rank: int = 0, world: int = 1, epochs: int = 2,
           **kw) -> List[tuple]:
    """Every batch of `epochs` epochs: (epoch, ids, {tensor: bytes})."""
    options = dict(kind=kind, batch_size=4, seed=9, rank=rank, world_size=world,
                   job=kw.pop("job"), stop_epoch=epochs, drop_last=False, **kw)
    if kind == "tokens":
        options.update(seq_len=SEQ, token_dtype="uint16")
    else:
        options.update(pipeline=[{"random_resized_crop": {"size": 8}}, {"flip": {"p": 0.5}}])
    with gpufeed.Client(socket).attach(path, **options) as s:
        return [(b.epoch, b.ids[: b.valid_count].tolist(),
                 {k: v[: b.valid_count].tobytes() for k, v in b.numpy().items()}) for b in s]


@pytest.mark.parametrize("kind,local,remote", [
    ("tokens", "tokens", "s3://train-data/corpus/tokens/"),
    ("tokens", "tokens/shard_*.bin", "s3://train-data/corpus/tokens/shard_*.bin"),
    ("webdataset", "wds", "s3://train-data/corpus/wds/"),
    ("webdataset", "wds/train-{0000..0002}.tar", "s3://train-data/corpus/wds/train-{0000..0002}.tar"),
])
def test_an_s3_dataset_streams_as_its_local_copy(tmp_path, data, caller, kind, local, remote):
    d = s3_daemon(tmp_path, caller.endpoint, "--cache_bytes=67108864")
    try:
        for rank in (0, 1):
            want = stream(d.socket, str(data / local), kind, rank, 2, job=f"local-{rank}")
            got = stream(d.socket, remote, kind, rank, 2, job=f"s3-{rank}")
            assert got == want
            assert {e for e, _, _ in got} == {0, 1} and len(got) >= 4
    finally:
        d.stop()


def test_a_second_epoch_of_a_set_that_fits_reads_nothing_from_the_store(tmp_path, data,
                                                                          caller):
    d = s3_daemon(tmp_path, caller.endpoint, "--cache_bytes=67108864", "--cache_dir",
                  str(tmp_path / "cache"))
    try:
        path = "s3://train-data/corpus/tokens/"
        options = dict(kind="tokens", seq_len=SEQ, token_dtype="uint16", batch_size=4, seed=9,
                       drop_last=False)
        with gpufeed.Client(d.socket).attach(path, job="epochs", stop_epoch=2, **options) as s:
            received, fetched = [], []
            for b in s:
                if b.step == 0:  # each epoch's first batch: what came before it
                    received.append(metric(d, "gpufeed_s3_received_bytes_total"))
                    fetched.append(metric(d, "gpufeed_object_cache_fetched_bytes_total"))
            received.append(metric(d, "gpufeed_s3_received_bytes_total"))
        tokens_bytes = sum(f.stat().st_size for f in (data / "tokens").iterdir())
        # Epoch 0 fetched the whole set once; epoch 1 nothing.
        assert fetched[1] == tokens_bytes, (fetched, tokens_bytes)
        assert received[2] == received[1] and received[1] >= tokens_bytes, received
        assert metric(d, "gpufeed_object_cache_lookups_total", result="hit") > 0
        assert len(list((tmp_path / "cache").glob("gpufeed-cache-*.blk"))) == 3
    finally:
        d.stop()


def test_a_resume_from_s3_equals_the_uninterrupted_stream(tmp_path, caller):
    d = s3_daemon(tmp_path, caller.endpoint)
    path = "s3://train-data/corpus/tokens/"
    try:
        straight = stream(d.socket, path, "tokens", job="straight")
        with gpufeed.Client(d.socket).attach(path, kind="tokens", seq_len=SEQ,
                                             token_dtype="uint16", batch_size=4, seed=9,
                                             stop_epoch=2, drop_last=False, job="first") as s:
            for _ in range(7):
                s.next(timeout=30).release()
            position, fingerprint = s.position(), s.fingerprint
        resumed = stream(d.socket, path, "tokens", job="resumed", start=position,
                         start_fingerprint=fingerprint)
        assert resumed == straight[7:]
    finally:
        d.stop()


def test_five_percent_faults_leave_the_streams_exact(tmp_path, data, caller):
    proxy = FaultProxy(caller.endpoint, 0.05)
    try:
        # The daemon talks to the proxy; the caller names the same endpoint.
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.endpoint
        d = s3_daemon(tmp_path, proxy.endpoint, "--cache_bytes=65536")
        try:
            for kind, local, remote in (("tokens", "tokens", "s3://train-data/corpus/tokens/"),
                                        ("webdataset", "wds", "s3://train-data/corpus/wds/")):
                want = stream(d.socket, str(data / local), kind, job=f"local-{kind}")
                got = stream(d.socket, remote, kind, job=f"s3-{kind}")
                assert got == want
            # The faults were there, and were ridden through: retries, no failed call.
            assert metric(d, "gpufeed_s3_retries_total") > 0
            assert metric(d, "gpufeed_s3_errors_total", kind="server") + \
                metric(d, "gpufeed_s3_errors_total", kind="throttled") > 0
            assert metric(d, "gpufeed_s3_errors_total", kind="truncated") > 0
            assert metric(d, "gpufeed_s3_failed_calls_total") == 0
        finally:
            d.stop()
    finally:
        proxy.close()


def test_what_cannot_be_read_is_refused_naming_it(tmp_path, caller, monkeypatch):
    d = s3_daemon(tmp_path, caller.endpoint)
    client = gpufeed.Client(d.socket)
    try:
        with pytest.raises(gpufeed.NotFound, match="s3://train-data/corpus/no/such.bin"):
            client.attach("s3://train-data/corpus/no/such.bin", kind="tokens", seq_len=SEQ,
                          batch_size=4, job="missing")
        with pytest.raises(gpufeed.NotFound, match="end the path with '/'"):
            client.attach("s3://train-data/corpus/tokens", kind="tokens", seq_len=SEQ,
                          batch_size=4, job="no-slash")
        with pytest.raises(gpufeed.Error, match="no objects in that directory|no object"):
            client.attach("s3://train-data/corpus/empty/", kind="tokens", seq_len=SEQ,
                          batch_size=4, job="empty")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(gpufeed.PermissionDenied, match="s3://train-data"):
            client.attach("s3://train-data/corpus/tokens/", kind="tokens", seq_len=SEQ,
                          batch_size=4, job="wrong-secret")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://169.254.169.254")
        with pytest.raises(gpufeed.InvalidArgument, match="reads objects from .* only"):
            client.attach("s3://train-data/corpus/tokens/", kind="tokens", seq_len=SEQ,
                          batch_size=4, job="elsewhere")
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        with pytest.raises(gpufeed.NotFound, match="no object store credentials"):
            client.attach("s3://train-data/corpus/tokens/", kind="tokens", seq_len=SEQ,
                          batch_size=4, job="no-credentials")
    finally:
        d.stop()
    # The secret reached neither the daemon's log nor any message.
    assert caller.secret not in d.log.read_text()


def test_a_daemon_without_an_object_store_refuses_s3_paths(fresh_daemon, caller):
    with pytest.raises(gpufeed.FailedPrecondition, match="--s3_endpoint"):
        gpufeed.Client(fresh_daemon.socket).attach(
            "s3://train-data/corpus/tokens/", kind="tokens", seq_len=SEQ, batch_size=4,
            job="off")


def test_temporary_credentials_and_a_joiner_with_other_credentials(tmp_path, caller, monkeypatch):
    # STS temporary credentials (a session token of several hundred bytes, as AWS's are) pass
    # the memory socket and sign every request; a second attach of the same uid and dataset
    # with another secret does not ride on the first one's feed: its own access is tried,
    # and refused.
    temporary = json.loads(caller.command(op="temporary_credentials")[3:])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", temporary["access_key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", temporary["secret"])
    monkeypatch.setenv("AWS_SESSION_TOKEN", temporary["token"])
    assert len(temporary["token"]) > 200
    d = s3_daemon(tmp_path, caller.endpoint, "--cache_bytes=67108864")
    path = "s3://train-data/corpus/tokens/"
    options = dict(kind="tokens", seq_len=SEQ, token_dtype="uint16", batch_size=4, seed=9)
    try:
        client = gpufeed.Client(d.socket)
        with client.attach(path, job="temporary", **options) as s:
            s.next(timeout=30).release()
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
            with pytest.raises(gpufeed.PermissionDenied, match="s3://train-data/corpus/tokens/"):
                client.attach(path, job="temporary-joiner", **options)
            # Without the token the key pair is not valid either.
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", temporary["secret"])
            monkeypatch.delenv("AWS_SESSION_TOKEN")
            with pytest.raises(gpufeed.PermissionDenied):
                client.attach(path, job="temporary-no-token", **options)
            # A control byte in a credential never reaches a request's headers.
            monkeypatch.setenv("AWS_SESSION_TOKEN", temporary["token"] + "\r\nX-Injected: 1")
            with pytest.raises(gpufeed.InvalidArgument, match="object_store.session_token"):
                client.attach(path, job="temporary-crlf", **options)
            # Nothing of the credentials shows where other users look.
            shown = "".join(subprocess.run([gpufeedctl(), "--socket", d.socket, "-o", "json",
                                            what], capture_output=True, text=True).stdout
                            for what in ("feeds", "sessions", "status"))
            shown += urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics",
                                            timeout=10).read().decode()
            for secret in (temporary["secret"], temporary["token"][:40]):
                assert secret not in shown
    finally:
        d.stop()
    for secret in (temporary["secret"], temporary["token"][:40], caller.secret):
        assert secret not in d.log.read_text()


def test_a_resume_of_one_object_rewritten_since_is_refused(tmp_path, data, caller):
    # One object named alone: its ETag is in the feed's fingerprint, so a position saved
    # before the object was rewritten (same size, other bytes) does not resume onto it.
    key = "corpus/one/tokens.bin"
    body = data / "tokens" / "shard_000.bin"
    caller.command(op="put", bucket=BUCKET, key=key, file=str(body))
    d = s3_daemon(tmp_path, caller.endpoint)
    path = f"s3://{BUCKET}/{key}"
    options = dict(kind="tokens", seq_len=SEQ, token_dtype="uint16", batch_size=4, seed=9)
    try:
        client = gpufeed.Client(d.socket)
        with client.attach(path, job="one", **options) as s:
            s.next(timeout=30).release()
            position, fingerprint = s.position(), s.fingerprint
        # The feed ends with its last session (a live feed keeps what it opened).
        deadline = time.monotonic() + 10
        while json.loads(subprocess.run([gpufeedctl(), "--socket", d.socket, "-o", "json",
                                         "feeds"], capture_output=True, text=True).stdout
                         or "[]"):
            assert time.monotonic() < deadline, "the feed outlived its session"
            time.sleep(0.05)
        rewritten = tmp_path / "rewritten.bin"
        rewritten.write_bytes(bytes(reversed(body.read_bytes())))
        caller.command(op="put", bucket=BUCKET, key=key, file=str(rewritten))
        with pytest.raises(gpufeed.FailedPrecondition, match="fingerprint"):
            client.attach(path, job="one-resumed", start=position, start_fingerprint=fingerprint,
                          **options)
    finally:
        d.stop()
