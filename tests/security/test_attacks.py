"""The attacks, each against the real binaries with real uids (attacks.py), asserting
the refusal or the bounded outcome docs/SECURITY.md promises, the victim's bytes unchanged and
the daemon still serving. README.md here has the table attack -> before -> after."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import attacks
from attacks import (MARKER, PIPELINE, SESSION_QUOTA, STAGING_QUOTA, Daemon, Node,
                     assert_serving, checksum_of, error_code, new_flag, npy_header, png,
                     sparse_file)

PAGE = 4096


def without_paths(message: str, *paths: Path) -> str:
    """`message` with the paths taken out (their random temp names could hold any digits)."""
    for p in sorted(map(str, paths), key=len, reverse=True):
        message = message.replace(p, "PATH")
    return message


def tokens_args(path: Path, seq_len: int) -> list:
    return ["consume", "--dataset", str(path), "--token-dtype", "uint16", "--seq-len",
            str(seq_len), "--batch-size", "1", "--no-shuffle", "--max-batches", "1"]


# ---- 1. reading files the attacker cannot read ----

@pytest.mark.parametrize("target", ["victim_0600", "etc_shadow"])
def test_1_unreadable_file_is_refused_without_its_size(node: Node, daemon: Daemon, expected: int,
                                                       target: str) -> None:
    path = node.victim_secret if target == "victim_0600" else Path("/etc/shadow")
    if not path.exists():
        pytest.skip(f"no {path} here")
    size = path.stat().st_size
    dump = node.attacker_path(f"dump-{target}")
    # One sample covering the whole file, as the attacker chose.
    seq_len = max(1, size // 2 - 1)
    run = node.attacker(daemon).run(*tokens_args(path, seq_len), "--dump", str(dump))
    dumped = sorted(p.name for p in dump.parent.glob(dump.name + "*"))
    assert run.returncode == 1 and not dumped, (
        f"the attacker read {path} through the daemon: exit {run.returncode}, dumped {dumped}")
    assert error_code(run) in ("PERMISSION_DENIED", "NOT_FOUND"), run.stderr
    message = without_paths(run.stderr, path, node.base)
    assert str(size) not in message and "bytes" not in message, (
        f"the message tells the file's size: {run.stderr}")
    assert_serving(node, daemon, expected)


def test_1_python_package_cannot_read_shadow(node: Node, daemon: Daemon) -> None:
    if not Path("/etc/shadow").exists():
        pytest.skip("no /etc/shadow here")
    size = Path("/etc/shadow").stat().st_size
    result = attacks.python_client(attacks.ATTACKER_UID, node.attacker_home, daemon.socket,
                                   Path("/etc/shadow"), max(1, size // 2 - 1))
    assert result.get("code") in ("PERMISSION_DENIED", "NOT_FOUND"), (
        f"the attacker's Python client read /etc/shadow through the daemon: {result}")
    assert str(size) not in without_paths(result["message"], node.base), result


def test_1_existing_and_missing_files_answer_alike(node: Node, daemon: Daemon) -> None:
    """In the victim's 0700 directory, an existing 0600 file and a missing one are refused with
    the same code and the same message (but for the path): no existence oracle."""
    ctl = node.attacker(daemon)
    existing = ctl.run(*tokens_args(node.victim_private, 1))
    missing = ctl.run(*tokens_args(node.victim_private_missing, 1))
    assert existing.returncode == 1 and missing.returncode == 1, (existing.stderr, missing.stderr)
    assert error_code(existing) == error_code(missing) and error_code(missing) in (
        "PERMISSION_DENIED", "NOT_FOUND"), (existing.stderr, missing.stderr)
    assert (existing.stderr.replace(str(node.victim_private), "PATH")
            == missing.stderr.replace(str(node.victim_private_missing), "PATH")), (
        existing.stderr, missing.stderr)
    assert str(node.victim_private.stat().st_size) not in without_paths(existing.stderr,
                                                                        node.base)


def test_1_attach_by_path_is_admin_only(node: Node, daemon: Daemon) -> None:
    """A client of the attacker's own that names /etc/shadow by path (no descriptor, so the
    daemon would open it with its own rights): PERMISSION_DENIED, no size."""
    if not Path("/etc/shadow").exists():
        pytest.skip("no /etc/shadow here")
    size = Path("/etc/shadow").stat().st_size
    result = node.run_agent(daemon, "attach", by_path=True, dataset="/etc/shadow", kind="tokens",
                            token_dtype="uint16", seq_len=max(1, size // 2 - 1), job="by-path")
    assert result["code"] == "PERMISSION_DENIED", result
    assert str(size) not in without_paths(result["message"], node.base), result


# ---- 2. the memory socket hands out only the caller's own ring ----

def test_2_memory_socket_hands_only_the_own_ring(node: Node, daemon: Daemon,
                                                 expected: int) -> None:
    agent = node.agent(daemon, "mem", dataset=str(node.attacker_tokens), kind="tokens",
                       token_dtype="uint16", seq_len=16, batch_size=1, ring_slots=1,
                       job="attacker-mem", marker=MARKER.decode(), write_for_s=3.0)
    try:
        first = agent.next()
        assert "step" in first, f"the attacker could not attach: {first}"
        # The victim streams, slowly, while the attacker reads and overwrites all it mapped.
        victim = node.victim(daemon).popen("-o", "json", "consume", "--dataset",
                                           str(node.victim_tokens), "--token-dtype", "uint16",
                                           "--seq-len", "16", "--batch-size", "4", "--checksum",
                                           "--step-ms", "50", *attacks.VICTIM_RUN)
        daemon.wait_for(lambda: any(s["job"] == "victim-job-7f3a" for s in daemon.sessions()),
                        20, "the victim's session")
        agent.go()
        detached = agent.next(timeout=30)
        out, err = victim.communicate(timeout=60)
        victim_sum = checksum_of(subprocess.CompletedProcess([], victim.returncode, out, err))
        # The victim's next session, while the attacker keeps its old mapping.
        assert "step" in detached, detached
        assert attacks.victim_checksum(node, daemon) == expected
        agent.go()
        result = agent.finish()
    finally:
        agent.kill()
    assert result["code"] == "OK", result
    ring = result["ring_bytes"]
    handed = (f"ring {ring} bytes; handed an fd of {result['fd_size']} bytes, map_offset "
              f"{result['map_offset']}, map_bytes {result['map_bytes']}")
    # Every way the attack worked, not just the first.
    problems = []
    if result["fd_size"] > -(-ring // PAGE) * PAGE:
        problems.append(f"more than its ring: {handed}")
    if not (ring <= result["map_bytes"]
            and result["map_offset"] + result["map_bytes"] <= result["fd_size"]):
        problems.append(f"a map range outside the descriptor: {handed}")
    if result["found_marker_while_attached"]:
        problems.append("the attacker read the victim's samples")
    if victim_sum != expected:
        problems.append(f"the victim's bytes changed under the attacker's writes "
                        f"({result['overwrite_passes']} passes): {victim_sum} != {expected} "
                        f"{err.strip()[-300:]}")
    if result["after_detach"]["code"] != "NOT_FOUND" or result["after_detach"]["got_fd"]:
        problems.append(f"after Detach the memory socket answered {result['after_detach']}")
    if result["found_marker_after_detach"]:
        problems.append("the attacker's old mapping showed the victim's next session")
    assert not problems, "; ".join(problems)
    assert_serving(node, daemon, expected)


def test_2_another_uids_session_answers_as_a_missing_one(node: Node, daemon: Daemon,
                                                        expected: int) -> None:
    """The attacker names the victim's live session (ids are small numbers) with a guessed
    token on the memory socket, GetPosition, Detach and Stream: each answers exactly as for a
    session that does not exist (NOT_FOUND), and the victim's run goes on unharmed."""
    victim = node.victim(daemon).popen("-o", "json", "consume", "--dataset",
                                       str(node.victim_tokens), "--token-dtype", "uint16",
                                       "--seq-len", "16", "--batch-size", "4", "--checksum",
                                       "--step-ms", "25", *attacks.VICTIM_RUN)
    try:
        ids = []
        daemon.wait_for(lambda: ids.extend(s["session_id"] for s in daemon.sessions()
                                           if s["job"] == "victim-job-7f3a") or ids,
                        20, "the victim's session")
        missing = 987654321
        answers = node.run_agent(daemon, "probe", ids=[ids[0], missing])
        out, err = victim.communicate(timeout=60)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.communicate()
    live, gone = answers[str(ids[0])], answers[str(missing)]
    problems = []
    for method in ("mem", "GetPosition", "Detach", "Stream"):
        code, message = live[method]
        if code != "NOT_FOUND" or code != gone[method][0]:
            problems.append(f"{method}: the victim's session {code}, a missing one "
                            f"{gone[method][0]}")
        elif message.replace(str(ids[0]), "ID") != gone[method][1].replace(str(missing), "ID"):
            problems.append(f"{method}: messages differ: {message!r} / {gone[method][1]!r}")
    if live["mem_fd"] or live["stream_batches"]:
        problems.append("the victim's ring or batches were handed over")
    run = subprocess.CompletedProcess([], victim.returncode, out, err)
    if checksum_of(run) != expected:
        problems.append(f"the victim's run was harmed: {err.strip()[-300:]}")
    assert not problems, "; ".join(problems)


# ---- 3. crashing the daemon ----

def test_3_huge_sparse_tokens_file_with_seq_len_1(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    path = node.chown_attacker(sparse_file(node.attacker_path("huge.bin"), 4 << 30))
    run = node.attacker(daemon).run("consume", "--dataset", str(path), "--token-dtype", "uint16",
                                    "--seq-len", "1", "--batch-size", "1", "--max-batches", "2",
                                    timeout=60)
    assert daemon.alive(), f"gpufeedd died: {daemon.log_text()[-3000:]}"
    assert run.returncode == 0 or error_code(run) in (
        "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION"), run.stderr
    assert daemon.peak_rss() < attacks.RSS_LIMIT_BYTES, f"peak RSS {daemon.peak_rss()}"
    assert_serving(node, daemon, expected)


def test_3_huge_sparse_jpeg_in_an_image_folder(node: Node, fresh, expected: int) -> None:
    # pread: a read_mode=mmap daemon maps the file first, which the test's address-space limit
    # refuses (ENOMEM, a bad sample) before the whole-file read is tried.
    daemon = fresh("--read_mode=pread")
    folder = node.attacker_path("bigjpg/cls/a.png").parent
    node.attacker_file("bigjpg/cls/a.png", png(16, 16))
    node.chown_attacker(sparse_file(folder / "b.jpg", 16 << 30, b"\xff\xd8\xff\xe0"))
    pipeline = node.attacker_file("pipeline.json", PIPELINE.encode())
    run = node.attacker(daemon).run("consume", "--kind", "image_folder", "--dataset",
                                    str(folder.parent), "--pipeline", str(pipeline),
                                    "--batch-size", "2", "--no-shuffle", "--max-batches", "2",
                                    timeout=60)
    assert daemon.alive(), f"gpufeedd died: {daemon.log_text()[-3000:]}"
    assert run.returncode == 0, f"a too-large image is a bad sample (skipped): {run.stderr}"
    assert daemon.peak_rss() < attacks.RSS_LIMIT_BYTES, f"peak RSS {daemon.peak_rss()}"
    assert_serving(node, daemon, expected)


def test_3_npy_with_a_million_rows_a_batch_and_64_slots(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    rows = 2_000_000
    head = npy_header("|u1", (rows,))
    path = node.chown_attacker(sparse_file(node.attacker_path("wide.npy"), len(head) + rows, head))
    before = daemon.peak_rss()
    run = node.attacker(daemon).run("consume", "--kind", "records", "--dataset", str(path),
                                    "--batch-size", "1000000", "--ring-slots", "64",
                                    "--max-batches", "1", timeout=60)
    assert daemon.alive(), f"gpufeedd died: {daemon.log_text()[-3000:]}"
    assert run.returncode == 0 or error_code(run) == "RESOURCE_EXHAUSTED", run.stderr
    growth = daemon.peak_rss() - before
    assert growth < attacks.RSS_GROWTH_LIMIT_BYTES, (
        f"the daemon's RSS grew by {growth >> 20} MiB for one attach: {run.stderr}")
    assert_serving(node, daemon, expected)


# ---- 4. admin operations and other users' jobs ----

def test_4_drain_is_admin_only(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    run = node.attacker(daemon).run("drain", "--timeout", "1ms", timeout=20)
    assert error_code(run) == "PERMISSION_DENIED", (
        f"exit {run.returncode}: {run.stderr}; daemon alive: {daemon.alive()}")
    status = node.attacker(daemon).run("-o", "json", "status")
    assert status.returncode == 0 and json.loads(status.stdout)["health"] == "SERVING", (
        status.stdout, status.stderr)
    assert_serving(node, daemon, expected)


def test_4_sessions_and_feeds_show_none_of_the_victim(node: Node, daemon: Daemon) -> None:
    victim = node.victim(daemon).popen("consume", "--dataset", str(node.victim_tokens),
                                       "--token-dtype", "uint16", "--seq-len", "16",
                                       "--batch-size", "4", "--step-ms", "100",
                                       *attacks.VICTIM_RUN)
    try:
        daemon.wait_for(lambda: any(s["job"] == "victim-job-7f3a" for s in daemon.sessions()),
                        20, "the victim's session")
        secrets = ["victim-job-7f3a", str(node.victim_tokens), "424242"]
        leaks = []
        for args in (("-o", "json", "sessions"), ("-o", "json", "feeds"), ("sessions",),
                     ("feeds",)):
            out = node.attacker(daemon).run(*args)
            assert out.returncode == 0, out.stderr
            leaked = [s for s in secrets if s in out.stdout]
            if leaked:
                leaks.append(f"gpufeedctl {' '.join(args)} shows {leaked}")
        assert not leaks, "as the attacker: " + "; ".join(leaks)
    finally:
        victim.kill()
        victim.communicate()


def test_4_attacker_cannot_squat_the_victims_job_name(node: Node, daemon: Daemon) -> None:
    squatter = node.agent(daemon, "sessions", count=1, job="train", world_size=2,
                          dataset=str(node.attacker_tokens), kind="tokens", token_dtype="uint16",
                          seq_len=16, stream=True)
    try:
        held = squatter.next()
        assert held.get("codes") == {"OK": 1}, f"the attacker could not attach: {held}"
        run = node.victim(daemon).consume(node.victim_tokens, "--job", "train", "--world-size",
                                          "2", "--rank", "0", "--max-batches", "2")
        assert run.returncode == 0, (
            f"the attacker's job 'train' locked the victim out: {run.stderr}")
        squatter.go()
        squatter.finish()
    finally:
        squatter.kill()


def test_4_job_name_with_a_newline_is_refused_and_forges_no_log_line(node: Node,
                                                                    daemon: Daemon) -> None:
    forged = "FORGED-LOG-LINE [info] attach: session 1 job 'train'"
    run = node.attacker(daemon).consume(node.attacker_tokens, "--job", f"x\n{forged}",
                                        "--max-batches", "1")
    lines = [line for line in daemon.log_text().splitlines() if line.startswith("FORGED")]
    problems = []
    if error_code(run) != "INVALID_ARGUMENT" or "job" not in run.stderr:
        problems.append(f"the job name was not refused naming the field: exit {run.returncode} "
                        f"{run.stderr}")
    if lines:
        problems.append(f"the daemon's log has a forged line: {lines}")
    assert not problems, "; ".join(problems)


def test_4_start_epoch_near_int64_max_is_refused(node: Node, daemon: Daemon) -> None:
    run = node.attacker(daemon).consume(node.attacker_tokens, "--start-epoch",
                                        str((1 << 63) - 10), "--epochs", "0",
                                        "--max-batches", "1")
    assert error_code(run) == "INVALID_ARGUMENT" and "epoch" in run.stderr, (
        f"exit {run.returncode}: {run.stderr}")


def test_4_huge_seq_len_message_does_not_overflow(node: Node, daemon: Daemon) -> None:
    run = node.attacker(daemon).consume(node.attacker_tokens, "--max-batches", "1",
                                        seq_len=(1 << 63) - 1)
    assert run.returncode == 1, run.stderr
    assert "-9223372036854775808" not in run.stderr, f"seq_len + 1 overflowed: {run.stderr}"


# ---- 5. wedging Attach ----

def test_5_fifos_are_refused_quickly_and_sigterm_still_stops(node: Node, fresh) -> None:
    daemon = fresh()
    fifos = []
    for name in ("fifo1", "fifo2"):
        path = node.attacker_path(name)
        os.mkfifo(path, 0o644)
        fifos.append(node.chown_attacker(path))
    started = time.monotonic()
    attempts = [node.attacker(daemon).popen(*tokens_args(f, 16)) for f in fifos]
    problems = []
    try:
        for f, p in zip(fifos, attempts):
            try:
                _, err = p.communicate(timeout=max(0.1, started + 5 - time.monotonic()))
                if "INVALID_ARGUMENT" not in err:
                    problems.append(f"{f.name}: not INVALID_ARGUMENT: {err.strip()}")
            except subprocess.TimeoutExpired:
                problems.append(f"the attach naming {f.name} still hangs after 5 s")
        run = node.victim(daemon).consume(node.victim_tokens, "--max-batches", "2", timeout=10)
        if run.returncode != 0:
            problems.append(f"the victim's attach after the FIFOs: {run.stderr.strip()}")
    finally:
        for p in attempts:
            if p.poll() is None:
                p.kill()
                p.communicate()
    stopping = time.monotonic()
    code = daemon.stop(timeout=5)
    if code != 0 or time.monotonic() - stopping >= 5:
        problems.append(f"SIGTERM did not stop gpufeedd within 5 s (exit {code}, SIGKILLed)")
    assert not problems, "; ".join(problems)


def test_5_fifo_descriptor_is_refused_by_the_daemon(node: Node, fresh, expected: int) -> None:
    """The attacker's own client opens a FIFO (without blocking) and hands the daemon the
    descriptor: the daemon checks its type before reading."""
    daemon = fresh()
    path = node.attacker_path("fifo3")
    if not path.exists():
        os.mkfifo(path, 0o644)
        node.chown_attacker(path)
    result = node.run_agent(daemon, "attach", dataset=str(path), kind="tokens",
                            token_dtype="uint16", seq_len=16, job="fifo-fd", timeout=10)
    assert result["code"] == "INVALID_ARGUMENT", result
    assert_serving(node, daemon, expected)


def test_5_class_folder_of_links_to_itself_finishes_quickly(node: Node, fresh,
                                                            expected: int) -> None:
    daemon = fresh()
    folder = node.attacker_path("loop/cls/a.png").parent
    node.attacker_file("loop/cls/a.png", png(16, 16))
    for name in "bcdefgh":
        os.symlink(".", folder / name)
        node.chown_attacker(folder / name)
    pipeline = node.attacker_file("pipeline.json", PIPELINE.encode())
    started = time.monotonic()
    run = node.attacker(daemon).run("consume", "--kind", "image_folder", "--dataset",
                                    str(folder.parent), "--pipeline", str(pipeline),
                                    "--batch-size", "1", "--max-batches", "1", timeout=15)
    took = time.monotonic() - started
    assert run.returncode != 124 and took < 10, f"the attach ran {took:.1f} s: {run.stderr}"
    assert run.returncode == 0 or error_code(run) in (
        "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT"), run.stderr
    assert_serving(node, daemon, expected)


# ---- 6. a slow client on the memory socket ----

def test_6_dribbling_client_delays_nobody_and_is_cut_off(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    dribbler = node.agent(daemon, "dribble", mem_socket=daemon.mem_socket, interval_s=0.9,
                          max_s=12)
    try:
        assert dribbler.next().get("step") == "connected"
        dribbler.go()
        started = time.monotonic()
        run = node.victim(daemon).consume(node.victim_tokens, "--max-batches", "2", timeout=15)
        took = time.monotonic() - started
        result = dribbler.finish(timeout=30)
    finally:
        dribbler.kill()
    assert run.returncode == 0 and took < 5, f"the victim's consume took {took:.1f} s: {run.stderr}"
    assert result["cut_after_s"] is not None and result["cut_after_s"] < 5, (
        f"the dribbler was not cut off at the deadline: {result}")
    assert_serving(node, daemon, expected)


# ---- 7. quotas ----

def test_7_attach_flood_leaves_room_for_the_victim(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    flood = node.agent(daemon, "sessions", count=256, job="flood",
                       dataset=str(node.attacker_tokens), kind="tokens", token_dtype="uint16",
                       seq_len=16, ring_slots=1)
    try:
        held = flood.next(timeout=60)
        assert "codes" in held, held
        run = node.victim(daemon).consume(node.victim_tokens, "--max-batches", "2")
        flood.go()
        flood.finish()
    finally:
        flood.kill()
    assert run.returncode == 0, f"after 256 attaches the victim gets: {run.stderr} ({held})"
    assert held["codes"].get("OK", 0) == 64, held  # max_sessions_per_uid, default 64
    assert SESSION_QUOTA in held["messages"].get("RESOURCE_EXHAUSTED", ""), held
    assert_serving(node, daemon, expected)


def test_7_a_session_that_never_releases_is_ended(node: Node, fresh, expected: int) -> None:
    daemon = fresh(*new_flag("idle_lease_timeout", "2s"))
    result = node.run_agent(daemon, "hold", dataset=str(node.attacker_tokens), kind="tokens",
                            token_dtype="uint16", seq_len=16, ring_slots=2, job="holder",
                            wait_s=10, timeout=40)
    assert result["ended"] and result["end_code"] == "DEADLINE_EXCEEDED", result
    assert 1.5 <= result["ended_after_s"] < 8, result
    assert_serving(node, daemon, expected)


def test_7_one_uid_cannot_take_the_whole_staging_pool(node: Node, fresh, expected: int) -> None:
    daemon = fresh()
    row = 1 << 20
    head = npy_header("|u1", (64, row))
    attacker_npy = node.chown_attacker(
        sparse_file(node.attacker_path("rows.npy"), len(head) + 64 * row, head))
    victim_npy = node.victim_home / "rows.npy"
    sparse_file(victim_npy, len(head) + 64 * row, head)
    os.chown(victim_npy, attacks.VICTIM_UID, attacks.VICTIM_UID)
    hog = node.agent(daemon, "sessions", count=8, job="hog", dataset=str(attacker_npy),
                     kind="records", batch_size=1, ring_slots=8, stream=True)
    try:
        held = hog.next(timeout=60)
        assert "codes" in held, held
        run = node.victim(daemon).run("consume", "--kind", "records", "--dataset",
                                      str(victim_npy), "--batch-size", "1", "--ring-slots", "16",
                                      "--max-batches", "2")
        hog.go()
        hog.finish()
    finally:
        hog.kill()
    assert run.returncode == 0, (
        f"the attacker's rings left the victim no room: {run.stderr} ({held})")
    assert held["codes"].get("OK", 0) >= 1, held
    assert sum(held["ring_bytes"]) <= attacks.STAGING_BYTES // 2, held
    assert STAGING_QUOTA in held["messages"].get("RESOURCE_EXHAUSTED", ""), held
    assert_serving(node, daemon, expected)
