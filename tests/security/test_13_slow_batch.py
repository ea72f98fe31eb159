"""One user's batch of expensive work must not restart the daemon for everyone.

The audit: 700 hard links of a 7000 x 7000 JPEG in one image-folder batch kept a fill worker in
one work item past --stall_timeout (60 s): liveness went NOT_SERVING and systemd or the kubelet
restarted the daemon, every user's session with it. Here, scaled down to run in seconds: a
daemon with a short stall window, and a batch of hard links to one large JPEG that takes several
windows to fill, each sample well inside one.

docs/SECURITY.md section 4 ("A slow request is its session's problem") is what is asserted:
- liveness means the daemon is stuck (a thread that has finished no sample for the stall
  window), not that a user asked for much work: health stays SERVING while the batch fills;
- a batch longer than max_batch_time ends that session alone, DEADLINE_EXCEEDED naming the
  budget, while the victim's run beside it gets its fault-free bytes;
- a progressive JPEG of more than 500 scans (a scan bomb) is a bad sample, too_slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import List

import attacks
from attacks import PIPELINE, Node, assert_serving, error_code

STALL = "2s"            # the daemon's stall window in these tests (60 s by default)
SIDE = 7000             # the audit's image: 7000 x 7000 pixels (49 M, under the 64 M cap)
LINKS = 40              # hard links to it in the attacker's folder: one batch


def uniform_jpeg(width: int, height: int) -> bytes:
    """A baseline grayscale JPEG of `width` x `height`, every pixel the same grey: each 8 x 8
    block is two one-bit Huffman codes (DC difference 0, end of block), so the file is small
    (2 bits a block) while its decode still converts every pixel (RGB out, 3 bytes a pixel)."""

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    dqt = segment(0xDB, bytes([0]) + bytes([1] * 64))
    sof = segment(0xC0, bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big")
                  + bytes([1, 1, 0x11, 0]))
    one_code = bytes([1] + [0] * 15 + [0])  # one code of length 1, for symbol 0
    dht = segment(0xC4, bytes([0x00]) + one_code) + segment(0xC4, bytes([0x10]) + one_code)
    sos = segment(0xDA, bytes([1, 1, 0x00, 0, 63, 0]))
    blocks = ((width + 7) // 8) * ((height + 7) // 8)
    bits = 2 * blocks
    data = bytearray(bits // 8)
    if bits % 8:
        data.append(0xFF >> (bits % 8))  # the last codes, then ones to the byte's end
    return b"\xff\xd8" + dqt + sof + dht + sos + bytes(data) + b"\xff\xd9"


def progressive_bomb(scans: int, width: int = 64, height: int = 64) -> bytes:
    """A grayscale progressive JPEG of `scans` scans (at most 694) in a valid progression (the
    DC scan, then per AC coefficient a first scan from bit 10 and ten refinements), every
    coefficient zero: the shape of a scan bomb."""

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    out = bytearray(b"\xff\xd8")
    out += segment(0xDB, bytes([0]) + bytes([1] * 64))
    out += segment(0xC2, bytes([8]) + height.to_bytes(2, "big") + width.to_bytes(2, "big")
                   + bytes([1, 1, 0x11, 0]))
    one_code = bytes([1] + [0] * 15 + [0])
    out += segment(0xC4, bytes([0x00]) + one_code) + segment(0xC4, bytes([0x10]) + one_code)
    progression = [(0, 0, 0, 0)]
    for k in range(1, 64):
        progression.append((k, k, 0, 10))
        progression += [(k, k, bit, bit - 1) for bit in range(10, 0, -1)]
    blocks = ((width + 7) // 8) * ((height + 7) // 8)
    data = bytes(blocks // 8) + (bytes([0xFF >> (blocks % 8)]) if blocks % 8 else b"")
    for ss, se, ah, al in progression[:scans]:
        out += segment(0xDA, bytes([1, 1, 0x00, ss, se, ah << 4 | al]))
        out += data  # one "0" a block (DC difference 0, or an end of band), then ones
    return bytes(out + b"\xff\xd9")


def big_folder(node: Node, name: str, links: int) -> Path:
    """The attacker's image folder: one class, `links` hard links to one SIDE x SIDE JPEG."""
    first = node.attacker_path(f"{name}/cls/0000.jpg")
    node.attacker_file(f"{name}/cls/0000.jpg", uniform_jpeg(SIDE, SIDE))
    for i in range(1, links):
        os.link(first, first.parent / f"{i:04d}.jpg")
    return first.parent.parent


def liveness(daemon: attacks.Daemon) -> str:
    """grpc.health.v1 Check of service "" (liveness) on the Unix socket, as root: SERVING,
    NOT_SERVING, or the error."""
    import grpc  # the tests' interpreter has python3-grpcio (attacks.skip_reason)

    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
        try:
            reply = check(b"", timeout=5)  # HealthCheckRequest{service: ""}
        except grpc.RpcError as e:
            return f"error {e.code().name}"
    # HealthCheckResponse{status: 1 SERVING, 2 NOT_SERVING} is field 1, a varint.
    return {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(reply, f"? {reply!r}")


class HealthWatch:
    """Checks liveness every 0.2 s on a thread until stopped; keeps what it saw."""

    def __init__(self, daemon: attacks.Daemon) -> None:
        self.daemon, self.seen = daemon, []  # type: attacks.Daemon, List[str]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.append(liveness(self.daemon))
            self._stop.wait(0.2)

    def stop(self) -> List[str]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def consume_folder(node: Node, daemon: attacks.Daemon, folder: Path, batch: int,
                   *extra: str) -> subprocess.Popen:
    pipeline = node.attacker_file("pipeline.json", PIPELINE.encode())
    return node.attacker(daemon).popen("consume", "--kind", "image_folder", "--dataset",
                                       str(folder), "--pipeline", str(pipeline), "--batch-size",
                                       str(batch), "--no-shuffle", "--ring-slots", "2", *extra)


def test_13_a_slow_batch_is_progress_not_a_stall(node: Node, fresh, expected: int) -> None:
    # No batch budget here: the batch runs to its end, several stall windows long.
    daemon = fresh(f"--stall_timeout={STALL}",
                   *(["--max_batch_time=0"] if attacks.daemon_knows("--max_batch_time") else []))
    folder = big_folder(node, "slow", LINKS)
    watch = HealthWatch(daemon)
    started = time.monotonic()
    attacker = consume_folder(node, daemon, folder, LINKS, "--max-batches", "1")
    try:
        out, err = attacker.communicate(timeout=75)
    finally:
        seen = watch.stop()
    took = time.monotonic() - started
    assert daemon.alive(), f"gpufeedd died: {daemon.log_text()[-3000:]}"
    assert attacker.returncode == 0, f"the attacker's batch failed: {err}"
    # The test means something only if the batch outlasted the stall window (2 s) by far.
    assert took > 4, f"the batch took only {took:.1f} s: not slow enough to test liveness"
    assert seen and all(s == "SERVING" for s in seen), (
        f"liveness while one batch of {LINKS} {SIDE}x{SIDE} images filled for {took:.1f} s "
        f"(stall window {STALL}): {seen}\n{daemon.log_text()[-2000:]}")
    assert "stalled" not in daemon.log_text(), daemon.log_text()[-2000:]
    assert_serving(node, daemon, expected)


def test_13_a_batch_past_max_batch_time_ends_its_own_session(node: Node, fresh,
                                                             expected: int) -> None:
    assert attacks.daemon_knows("--max_batch_time"), "gpufeedd has no --max_batch_time"
    daemon = fresh(f"--stall_timeout={STALL}", "--max_batch_time=2s")
    folder = big_folder(node, "budget", 4 * LINKS)
    watch = HealthWatch(daemon)
    started = time.monotonic()
    attacker = consume_folder(node, daemon, folder, 4 * LINKS)
    try:
        # The victim's run beside it: its bytes are the fault-free ones.
        victim = node.victim(daemon).consume(node.victim_tokens, *attacks.VICTIM_RUN, timeout=60)
        out, err = attacker.communicate(timeout=60)
    finally:
        seen = watch.stop()
    took = time.monotonic() - started
    assert daemon.alive(), f"gpufeedd died: {daemon.log_text()[-3000:]}"
    assert victim.returncode == 0, f"the victim's consume failed: {victim.stderr}"
    assert attacks.checksum_of(victim) == expected, "the victim's bytes changed"
    run = subprocess.CompletedProcess(attacker.args, attacker.returncode, out, err)
    assert error_code(run) == "DEADLINE_EXCEEDED", f"exit {attacker.returncode}: {err}"
    assert "max_batch_time" in err, err
    # 2 s of budget, then at most the samples in flight (each well under a second here); the
    # margin is for a loaded CI machine.
    assert took < 20, f"the attacker's session ended only after {took:.1f} s"
    assert seen and all(s == "SERVING" for s in seen), f"liveness: {seen}"
    assert "stalled" not in daemon.log_text(), daemon.log_text()[-2000:]
    assert_serving(node, daemon, expected)


def test_13_scan_bomb_is_a_bad_sample_too_slow(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    node.attacker_path("bomb/cls/a.png")  # its directories
    node.attacker_file("bomb/cls/a.png", attacks.png(16, 16))
    node.attacker_file("bomb/cls/b.jpg", progressive_bomb(694))
    folder = node.attacker_home / "bomb"
    run = node.attacker(daemon).run("consume", "--kind", "image_folder", "--dataset", str(folder),
                                    "--pipeline", str(node.attacker_file(
                                        "pipeline.json", PIPELINE.encode())),
                                    "--batch-size", "2", "--no-shuffle", "--max-batches", "2",
                                    timeout=60)
    assert run.returncode == 0, f"a scan bomb is a bad sample (skipped): {run.stderr}"
    assert "more than 500 scans" in daemon.log_text(), daemon.log_text()[-2000:]
    assert "(too_slow)" in daemon.log_text(), daemon.log_text()[-2000:]
    assert_serving(node, daemon, expected)
