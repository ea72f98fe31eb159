"""Hostile tenants, round two: the attacks on leases, directories, a WebDataset's
index, a Megatron .idx scan and the sample-id heap, each against the real binaries with real
uids (conftest.py, attacks.py). Each test failed on the code before its defence (noted per test).
"""

from __future__ import annotations

import io
import os
import signal
import struct
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

import attacks
from attacks import (PIPELINE, Node, as_uid, assert_serving, checksum_of, error_code,
                     png, sparse_file)


def victim_open_for_write(node: Node, path: Path, timeout: float = 10) -> float:
    """Seconds the victim's own open of its file for writing took (inf past `timeout`)."""
    code = ("import os, time; t = time.monotonic(); fd = os.open(%r, os.O_WRONLY); "
            "print(time.monotonic() - t)" % str(path))
    try:
        run = subprocess.run([*as_uid(attacks.VICTIM_UID), attacks.PYTHON, "-c", code],
                             capture_output=True, text=True, timeout=timeout,
                             env=attacks.user_env(node.victim_home))
    except subprocess.TimeoutExpired:
        return float("inf")
    assert run.returncode == 0, run.stderr
    return float(run.stdout.strip())


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ('T' stopped, 'Z' zombie, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# ---- 8. the read lease: a client's F_SETSIG must not reach the daemon ----

@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGURG],
                         ids=["SIGKILL", "SIGSTOP", "SIGTERM", "ignored_SIGURG"])
def test_8_a_clients_lease_signal_cannot_reach_the_daemon(node: Node, fresh, expected: int,
                                                          sig: int) -> None:
    # Before the defence the lease was taken on the description the client shares: SIGKILL and
    # SIGTERM ended the daemon, SIGSTOP froze it, and with SIGURG (ignored) the victim's open
    # for writing waited out lease-break-time (45 s).
    daemon = fresh()
    target = node.victim_file(f"lease-{int(sig)}.bin", bytes(64 << 10), 0o644)
    agent = node.agent(daemon, "lease", dataset=str(target), signal=int(sig), seq_len=16,
                       batch_size=4, job=f"lease-{int(sig)}", kind="tokens",
                       token_dtype="uint16")
    try:
        armed = agent.next(timeout=60)
        assert armed.get("step") == "armed" and armed["streamed"], armed
        took = victim_open_for_write(node, target)
        state = process_state(daemon.process.pid) if daemon.alive() else "gone"
        assert daemon.alive() and state not in ("T", "t", "Z"), (
            f"signal {int(sig)} reached gpufeedd (state {state}, exit "
            f"{daemon.process.returncode})")
        assert took < 1.0, f"the victim's open for writing took {took:.2f} s"
        agent.go()
        agent.finish()
    finally:
        agent.kill()
        if daemon.alive():
            os.kill(daemon.process.pid, signal.SIGCONT)
    assert_serving(node, daemon, expected)


# ---- 9. files beneath a passed directory: the caller's search right on the way ----

def shard_dir(node: Node, name: str, mode: int) -> Path:
    """A directory of the victim holding one tokens shard with its marker, of `mode`."""
    d = node.victim_home / name
    d.mkdir()
    node.victim_file(f"{name}/a.bin", (attacks.MARKER + b"\0\0\0\0") * 512, 0o644)
    d.chmod(mode)
    os.chown(d, attacks.VICTIM_UID, attacks.VICTIM_UID)
    return d


def test_9_a_directory_the_attacker_may_list_but_not_search_serves_nothing(
        node: Node, daemon, expected: int) -> None:
    # Before the defence: a 0744 directory's 0644 file was read with the daemon's rights and its
    # bytes served (exit 0) though the kernel refuses the attacker's own open of it.
    d = shard_dir(node, "listable", 0o744)
    run = node.attacker(daemon).consume(d, "--dump", str(node.attacker_home / "dump-744"))
    assert run.returncode != 0, f"served a file the kernel refuses the attacker: {run.stdout}"
    assert error_code(run) == "PERMISSION_DENIED", run.stderr
    assert "do not let uid 10002 search it" in run.stderr, run.stderr
    assert not list(node.attacker_home.glob("dump-744*")), "something was dumped"
    # The victim itself reads it.
    own = node.victim(daemon).consume(d)
    assert own.returncode == 0, own.stderr
    assert_serving(node, daemon, expected)


def test_9_a_directory_descriptor_kept_across_a_chmod_serves_nothing_written_after(
        node: Node, daemon, expected: int) -> None:
    # Before the defence: the descriptor opened while the folder was 0755 kept serving it, and the
    # file the victim wrote after its chmod 0700 was attached (OK, its samples counted).
    d = shard_dir(node, "closed-later", 0o755)
    agent = node.agent(daemon, "attach_held", dataset=str(d), kind="tokens",
                       token_dtype="uint16", seq_len=16, job="kept-dirfd")
    try:
        assert agent.next(timeout=60).get("step") == "opened"
        d.chmod(0o700)
        node.victim_file("closed-later/b.bin", (attacks.MARKER + b"\0\0\0\0") * 512, 0o644)
        agent.go()
        result = agent.finish()
    finally:
        agent.kill()
    assert result["code"] == "PERMISSION_DENIED", result
    assert "do not let uid 10002 search it" in result["message"], result
    assert_serving(node, daemon, expected)


# ---- 10. a WebDataset's index: hard links, long names, the index budget ----

def wds_tar(samples: int, name_bytes: int = 0) -> bytes:
    """A WebDataset tar of `samples` keys, each a 4x4 PNG and a .cls; with `name_bytes`, each
    key that long (a pax path)."""
    out = io.BytesIO()
    image = png(4, 4)
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(samples):
            key = f"s{i:07d}" if not name_bytes else f"s{i}" + "x" * name_bytes
            for ext, data in ((".png", image), (".cls", b"%d" % (i % 3))):
                info = tarfile.TarInfo(key + ext)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def consume_wds(node: Node, daemon, path: Path):
    pipeline = node.attacker_file("pipeline.json", PIPELINE.encode())
    return node.attacker(daemon).run("-o", "json", "consume", "--kind", "webdataset",
                                     "--dataset", str(path), "--pipeline", str(pipeline),
                                     "--batch-size", "1", "--max-batches", "2", timeout=60)


def test_10_hard_links_of_one_shard_are_refused_before_indexing(node: Node, daemon,
                                                                expected: int) -> None:
    # Before the defence: 700 links of one 40 MB tar were indexed 700 times (~7.6 GB).
    d = node.attacker_path("links/x")
    d.parent.mkdir(exist_ok=True)
    os.chown(d.parent, attacks.ATTACKER_UID, attacks.ATTACKER_UID)
    first = node.attacker_file("links/s000.tar", wds_tar(4))
    for i in range(1, 50):
        os.link(first, d.parent / f"s{i:03d}.tar")
    run = consume_wds(node, daemon, d.parent)
    assert run.returncode != 0 and error_code(run) == "INVALID_ARGUMENT", run.stderr
    assert "is the same file as" in run.stderr and "hard links" in run.stderr, run.stderr
    assert_serving(node, daemon, expected)


def test_10_a_member_path_longer_than_path_max_is_refused(node: Node, daemon,
                                                         expected: int) -> None:
    # Before the defence: pax paths up to 1 MiB were kept for every sample.
    tar = node.attacker_file("long-names.tar", wds_tar(2, name_bytes=100_000))
    run = consume_wds(node, daemon, tar)
    assert run.returncode != 0 and error_code(run) == "INVALID_ARGUMENT", run.stderr
    assert "a member path of 100" in run.stderr and "more than 4096" in run.stderr, run.stderr
    assert_serving(node, daemon, expected)


def test_10_one_uids_indexes_stay_within_its_share_of_max_index_bytes(node: Node, fresh,
                                                                     expected: int) -> None:
    # Before the defence there was no bound on the indexes' memory at all.
    daemon = fresh("--max_index_bytes=1048576")
    tar = node.attacker_file("many.tar", wds_tar(12000))  # > 512 KiB of index
    run = consume_wds(node, daemon, tar)
    assert run.returncode != 0 and error_code(run) == "RESOURCE_EXHAUSTED", run.stderr
    assert "max_index_bytes_per_uid 524288" in run.stderr, run.stderr
    small = node.attacker_file("few.tar", wds_tar(8))
    assert consume_wds(node, daemon, small).returncode == 0, "the budget was not returned"
    assert_serving(node, daemon, expected)


# ---- 12. a Megatron .idx summed under the walk's deadline ----

def test_12_a_sparse_megatron_index_is_cut_at_the_walk_timeout(node: Node, fresh,
                                                               expected: int) -> None:
    # Before the defence: the .idx's 2^36 sizes were summed with no deadline (minutes; the
    # attach threads busy, other attaches queued behind).
    config = node.base / "walk-2s.textproto"
    config.write_text("folder_walk_timeout_ms: 2000\n")
    daemon = fresh(f"--config={config}", "--read_mode=pread")  # no 825 GB mapping
    d = sparse_megatron(node, "megatron")
    started = time.monotonic()
    run = node.attacker(daemon).consume(d, timeout=60)
    took = time.monotonic() - started
    assert run.returncode != 0 and error_code(run) == "DEADLINE_EXCEEDED", run.stderr
    assert "folder_walk_timeout" in run.stderr, run.stderr
    assert took < 20, f"the attach took {took:.1f} s"
    assert_serving(node, daemon, expected)


def sparse_megatron(node: Node, name: str) -> Path:
    """A directory of the attacker's holding x.bin and a sparse x.idx of 2^36 sequences."""
    d = node.attacker_path(f"{name}/x").parent
    d.mkdir(exist_ok=True)
    os.chown(d, attacks.ATTACKER_UID, attacks.ATTACKER_UID)
    sequences = 1 << 36
    head = b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, 8, sequences, 1)
    node.chown_attacker(sparse_file(d / "x.idx", len(head) + sequences * 12 + 8, head))
    node.chown_attacker(sparse_file(d / "x.bin", 1 << 30))
    return d


def test_12_one_uids_slow_attaches_leave_an_attach_thread_to_the_others(node: Node, fresh,
                                                                        expected: int) -> None:
    # Before the defence one FIFO fed both attach threads: two slow attaches of the attacker held
    # both until folder_walk_timeout and the victim's Attach waited behind them (~7 s here).
    config = node.base / "walk-8s.textproto"
    config.write_text("folder_walk_timeout_ms: 8000\n")
    daemon = fresh(f"--config={config}", "--read_mode=pread")
    d = sparse_megatron(node, "megatron-fair")
    slow = [node.attacker(daemon).popen("consume", "--dataset", str(d), "--seq-len", "16",
                                        "--batch-size", "4") for _ in range(2)]
    try:
        time.sleep(1.0)  # both attaches queued and one (or, before, both) running
        started = time.monotonic()
        run = node.victim(daemon).consume(node.victim_tokens, *attacks.VICTIM_RUN, timeout=30)
        took = time.monotonic() - started
    finally:
        for p in slow:
            p.wait(timeout=60)
    assert run.returncode == 0, run.stderr
    assert checksum_of(run) == expected
    assert took < 4, f"the victim's consume waited {took:.1f} s behind the attacker's attaches"
    assert_serving(node, daemon, expected)


# ---- 14. max_ids_bytes: one uid's share ----

def test_14_one_uid_cannot_take_the_whole_ids_heap(node: Node, fresh, expected: int) -> None:
    # Before the defence: max_ids_bytes was daemon-wide only; the attacker's 8 sessions took all
    # of it and the victim's Attach was RESOURCE_EXHAUSTED.
    daemon = fresh("--max_ids_bytes=131072")  # 8 sessions of 512 rows x 4 slots x 8 bytes
    hog = node.agent(daemon, "sessions", count=8, job="ids", dataset=str(node.attacker_tokens),
                     kind="tokens", token_dtype="uint16", seq_len=16, batch_size=512,
                     ring_slots=4)
    try:
        held = hog.next(timeout=60)
        assert "codes" in held, held
        run = node.victim(daemon).consume(node.victim_tokens, "--max-batches", "2",
                                          "--ring-slots", "4", batch=512)
        hog.go()
        hog.finish()
    finally:
        hog.kill()
    assert run.returncode == 0, f"the attacker's ids left the victim no room: {run.stderr}"
    assert held["codes"].get("OK", 0) == 4, held
    assert "max_ids_bytes_per_uid 65536" in held["messages"].get("RESOURCE_EXHAUSTED", ""), held
    assert_serving(node, daemon, expected)


# ---- 16. lm-ahead workers: one uid's packed feeds hold at most half ----

def test_16_one_uids_packed_feeds_leave_lm_ahead_workers_to_the_others(node: Node, fresh,
                                                                      expected: int) -> None:
    # Before the defence (2765610) the daemon's 64 lm-ahead threads went to the first 16 packed
    # feeds whoever opened them: the attacker's 16 feeds took all 64, and the victim's feed
    # logged "0 of 4 lm-ahead workers" (its rows packed on the fill threads, slower).
    daemon = fresh()
    victim_pack = ("--pack", "best_fit", "--eos-id", str(int.from_bytes(b"VI", "little")),
                   "--pack-lookahead", "4", "--job", "victim-packed", "--max-batches", "40")
    alone = node.victim(daemon).consume(node.victim_tokens, *victim_pack)
    assert alone.returncode == 0, alone.stderr
    hogs = [node.attacker(daemon).popen(
        "consume", "--dataset", str(node.attacker_tokens), "--token-dtype", "uint16",
        "--seq-len", "16", "--batch-size", "4", "--pack", "best_fit", "--eos-id", "250",
        "--pack-lookahead", "4", "--job", f"hog-{i}", "--seed", str(i), "--ring-slots", "2",
        "--max-batches", "2", "--step-ms", "120000") for i in range(16)]
    try:
        daemon.wait_for(lambda: len(daemon.sessions()) == 16, 60,
                        "the attacker's 16 packed sessions")
        run = node.victim(daemon).consume(node.victim_tokens, *victim_pack)
        log = daemon.log_text()
        assert all(p.poll() is None for p in hogs), "an attacker's consume ended early"
    finally:
        for p in hogs:
            p.kill()
            p.wait(timeout=10)
    assert run.returncode == 0, run.stderr
    assert checksum_of(run) == checksum_of(alone), "the victim's packed rows changed"
    starved = [line for line in log.splitlines() if "lm-ahead workers (" in line]
    assert not [line for line in starved if str(node.victim_home) in line], starved
    # The attacker's first 8 feeds have their 4 workers each (its share, 32); the other 8 none.
    assert len(starved) == 8, starved
    assert all(f"32 of uid {attacks.ATTACKER_UID}'s feeds, at most 32" in line
               for line in starved), starved
    assert_serving(node, daemon, expected)
