"""Weighted blends of token sources and document packing, end to end against gpufeedd
(docs/howto/blends-and-packing.md), through Client.attach, gpufeed.torch.Loader and gpufeedctl.

Blends: three sources (a directory of raw nanoGPT .bin files, a glob of .npy files, one .npy)
weighted 0.5 / 0.3 / 0.2, each source's tokens in a range of its own, so the source of every
row shows in its tokens as well as in its union id (source k's sample s is offset_k + s,
offset_k the windows of the sources before it). One epoch of the feed is every source's windows
together (20,000 rows here). Checked: the source of each row is Megatron-Core's
build_blending_indices (a transcription of helpers.cpp), so the realised shares are within 1 %
of the weights at every prefix of 1,000 rows; each source's rows go through its own windows once
per own epoch, cycling; a resume at random places equals the uninterrupted stream; a resume with
other weights (twice) starts a segment there, the rule restarted within it, and repeats or skips
no sample of any source; a re-attach after the daemon restarted keeps the blend.

Packing, documents split at eos_id: best_fit puts every token of every document in exactly one
row, cutting only documents longer than a row; concat's rows are the documents end to end cut
every seq_len tokens (consecutive rows sharing one); position_ids restart at each piece,
loss_mask is 1 on document tokens and 0 on padding (token 0), cu_seqlens are the pieces' ends
within the first seq_len tokens.

The daemon side lands separately: where gpufeedd refuses the new fields, or attaches but serves
no blend (no segments reported) or no packed tensors, each test skips saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket as socketlib
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np
import pytest

import gpufeed
from conftest import Daemon, gpufeedctl

DATA = Path(__file__).resolve().parents[1] / "data" / "blend"
sys.path.insert(0, str(DATA))
import make_megatron_vector as megatron  # noqa: E402

SEQ = 4
WEIGHTS = (0.5, 0.3, 0.2)
BASES = (1000, 3000, 5000)  # source k's tokens lie in [BASES[k], BASES[k] + 1000)
WINDOWS = (9000, 6000, 5000)  # per source: one epoch of the feed is 20,000 rows
OFFSETS = (0, 9000, 15000)
BATCH = 100
SEED = 7

# Words of a daemon that does not take a field of the request.
_REFUSALS = ("unknown", "unsupported", "not supported", "unimplemented", "not implemented",
             "not yet")


class Sources(NamedTuple):
    names: List[str]  # as the blend names them: a directory, a glob, a file
    windows: List[np.ndarray]  # per source: [WINDOWS[k], SEQ + 1] in file then place order


def _windows(parts: Sequence[np.ndarray]) -> np.ndarray:
    out = [np.lib.stride_tricks.sliding_window_view(p, SEQ + 1)[::SEQ][:(len(p) - 1) // SEQ]
           for p in parts]
    return np.concatenate(out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Sources:
    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(35)

    def tokens(k: int, windows: int) -> np.ndarray:
        return rng.integers(BASES[k], BASES[k] + 1000, size=windows * SEQ + 1, dtype=np.uint16)

    web = root / "web"
    web.mkdir()
    web_parts = [tokens(0, 4500), tokens(0, 4500)]
    for i, p in enumerate(web_parts):
        p.tofile(web / f"web_{i:03d}.bin")
    code = root / "code"
    code.mkdir()
    code_parts = [tokens(1, 3000), tokens(1, 3000)]
    for i, p in enumerate(code_parts):
        np.save(code / f"code_{i:03d}.npy", p)
    (code / "README.txt").write_text("no tokens: the glob leaves it out")
    math_part = tokens(2, 5000)
    np.save(root / "math.npy", math_part)
    return Sources([f"{web}/", f"{code}/*.npy", f"{root}/math.npy"],
                   [_windows(web_parts), _windows(code_parts), _windows([math_part])])


def _skip_if_refused(error: gpufeed.Error, what: str) -> None:
    if isinstance(error, gpufeed.Unimplemented) or any(
            w in error.message.lower() for w in _REFUSALS):
        pytest.skip(f"gpufeedd does not serve {what} yet (the daemon side of issue 35): "
                    f"{error.message}")


def attach_blend(socket: str, sources: Sources, weights=WEIGHTS, **options) -> gpufeed.Session:
    """A session of the blend, or the test skipped where gpufeedd does not serve blends."""
    options = {"kind": "tokens", "seq_len": SEQ, "batch_size": BATCH, "seed": SEED, **options}
    try:
        session = gpufeed.Client(socket).attach(blend=dict(zip(sources.names, weights)), **options)
    except gpufeed.Error as e:
        _skip_if_refused(e, "blends")
        raise
    if not session.blend_segments:
        session.close()
        pytest.skip("gpufeedd attached a blend but reported no blend segments: it does not "
                    "serve blends yet (the daemon side of issue 35)")
    return session


class Row(NamedTuple):
    id: int
    tokens: np.ndarray


def read(session: gpufeed.Session, batches: int) -> List[Row]:
    rows = []
    for _ in range(batches):
        with session.next(timeout=30) as batch:
            tokens = batch.numpy()["tokens"]
            rows += [Row(int(i), tokens[r].copy()) for r, i in enumerate(batch.ids)]
    return rows


def source_of(row: Row) -> int:
    """The source a row's tokens come from (each source's values lie in a range of its own),
    checked against its union id and against that sample's window."""
    k = int((row.tokens[0] - BASES[0]) // 2000)
    assert 0 <= k < 3 and np.all((row.tokens >= BASES[k]) & (row.tokens < BASES[k] + 1000)), row
    assert OFFSETS[k] <= row.id < OFFSETS[k] + WINDOWS[k], (row.id, k)
    return k


def check_rows(rows: List[Row], sources: Sources) -> None:
    for row in rows:
        k = source_of(row)
        assert np.array_equal(row.tokens, sources.windows[k][row.id - OFFSETS[k]]), row.id


def per_source(rows: List[Row]) -> List[List[int]]:
    """Each source's samples (its own numbering) in the order delivered."""
    out: List[List[int]] = [[], [], []]
    for row in rows:
        k = source_of(row)
        out[k].append(row.id - OFFSETS[k])
    return out


def assert_each_own_epoch_once(samples: List[int], n: int, k: int) -> None:
    """A source's samples, in order: each whole own epoch (n of them) is every window once, the
    partial last one has none twice: 0 repeats, 0 skips within the source's epochs."""
    for start in range(0, len(samples), n):
        chunk = samples[start:start + n]
        assert len(set(chunk)) == len(chunk), f"source {k}: a sample repeated in own epoch " \
                                              f"{start // n}"
        if len(chunk) == n:
            assert sorted(chunk) == list(range(n)), f"source {k}: own epoch {start // n} skips"


def normalized(weights) -> List[float]:
    return [float(w) for w in megatron.normalize(list(weights))]


# ---- blends ---------------------------------------------------------------------------------

def test_a_blend_follows_megatrons_rule_and_holds_its_shares_at_every_prefix(daemon, job,
                                                                              sources):
    with attach_blend(daemon.socket, sources, job=job, stop_epoch=1) as s:
        # The nominal epoch: every source's windows together.
        assert s.info.num_samples == sum(WINDOWS)
        assert s.info.steps_per_epoch == sum(WINDOWS) // BATCH
        assert s.blend_segments[0]["start"] == 0
        assert s.blend_segments[0]["ledger"] == [0, 0, 0]
        assert normalized(s.blend_segments[0]["weights"]) == pytest.approx(normalized(WEIGHTS))
        rows = read(s, sum(WINDOWS) // BATCH)
        with pytest.raises(gpufeed.OutOfRange):
            s.next(timeout=30)
    check_rows(rows, sources)
    chosen = np.array([source_of(r) for r in rows])
    want, _ = megatron.transcription(megatron.normalize(list(WEIGHTS)), len(rows))
    assert np.array_equal(chosen, want), "the source sequence is not build_blending_indices'"
    counts = np.zeros(3)
    for n, k in enumerate(chosen, start=1):
        counts[k] += 1
        if n % 1000 == 0:
            assert np.all(np.abs(counts / n - WEIGHTS) <= 0.01), (n, counts / n)
    # Source 0 (0.5 of 20,000 rows, 9,000 windows) cycles into its second own epoch; each keeps
    # an order of its own (shuffled, not the windows' order).
    for k, samples in enumerate(per_source(rows)):
        assert len(samples) == round(WEIGHTS[k] * len(rows))
        assert_each_own_epoch_once(samples, WINDOWS[k], k)
        assert samples[:WINDOWS[k]] != sorted(samples[:WINDOWS[k]])


def test_a_resume_at_random_places_equals_the_uninterrupted_stream(daemon, job, sources):
    total = 60
    with attach_blend(daemon.socket, sources, job=job) as s:
        rows, positions = [], []
        for _ in range(total):
            rows += read(s, 1)
            positions.append(s.position())
        fingerprint, segments = s.fingerprint, s.blend_segments
    rng = np.random.default_rng(3)
    for stop in sorted(rng.choice(np.arange(1, total - 1), size=3, replace=False)):
        at = positions[stop - 1]
        with attach_blend(daemon.socket, sources, job=f"{job}-{stop}", start=at,
                          start_fingerprint=fingerprint, blend_history=segments) as r:
            assert r.blend_segments == segments  # the same weights: no new segment
            resumed = read(r, total - stop)
        assert [x.id for x in resumed] == [x.id for x in rows[stop * BATCH:]], stop
        assert all(np.array_equal(a.tokens, b.tokens)
                   for a, b in zip(resumed, rows[stop * BATCH:])), stop


def test_weights_changed_at_resumes_repeat_and_skip_no_sample_of_any_source(daemon, job,
                                                                            sources):
    plans = [(WEIGHTS, 9), ((0.1, 0.6, 0.3), 8), ((0.3, 0.2, 0.5), 13)]  # (weights, batches)
    rows: List[Row] = []
    history, start, fingerprint = None, None, None
    for n, (weights, batches) in enumerate(plans):
        with attach_blend(daemon.socket, sources, weights, job=f"{job}-{n}", start=start,
                          start_fingerprint=fingerprint, blend_history=history) as s:
            segments = s.blend_segments
            # A new segment where the weights changed: at the resume's place, with each
            # source's count before it (the rows delivered so far).
            assert len(segments) == n + 1
            last = segments[-1]
            assert last["start"] == len(rows)
            assert last["ledger"] == [len(x) for x in per_source(rows)]
            assert normalized(last["weights"]) == pytest.approx(normalized(weights))
            if history:
                assert segments[:-1] == history
            segment_rows = read(s, batches)
            start, fingerprint, history = s.position(), s.fingerprint, s.blend_segments
        # Within a segment the rule restarts at its start.
        want, _ = megatron.transcription(megatron.normalize(list(weights)), len(segment_rows))
        assert np.array_equal([source_of(r) for r in segment_rows], want), n
        rows += segment_rows
    check_rows(rows, sources)
    # Each source goes on from its ledger: its samples are those an uninterrupted run of the
    # source gives, in order, whatever the weights (a run of equal weights, long enough).
    with attach_blend(daemon.socket, sources, (1, 1, 1), job=f"{job}-ref") as s:
        reference = per_source(read(s, 40))
    for k, samples in enumerate(per_source(rows)):
        assert len(reference[k]) >= len(samples)
        assert samples == reference[k][:len(samples)], f"source {k} repeated or skipped a sample"
        assert_each_own_epoch_once(samples, WINDOWS[k], k)


def test_the_loader_keeps_the_blend_in_its_state_dict(daemon, job, sources):
    torch = pytest.importorskip("torch")
    import gpufeed.torch

    blend = dict(zip(sources.names, WEIGHTS))

    def make(weights=WEIGHTS):
        return gpufeed.torch.Loader(blend=dict(zip(sources.names, weights)), kind="tokens",
                                    seq_len=SEQ, batch_size=50, seed=SEED, device="cpu",
                                    socket=daemon.socket, job=job)

    first = make()
    try:
        it = iter(first)
        for _ in range(7):
            next(it)
    except gpufeed.Error as e:
        _skip_if_refused(e, "blends")
        raise
    state = first.state_dict()
    if not state.get("blend"):
        pytest.skip("gpufeedd reported no blend segments: it does not serve blends yet")
    assert state["blend"][0]["start"] == 0 and len(state["blend"]) == 1
    expected = [next(it)["tokens"].clone() for _ in range(5)]
    first.close()

    again = make()
    again.load_state_dict(state)
    got = [b["tokens"].clone() for b, _ in zip(again, range(5))]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    again.close()
    assert blend  # the loader took the mapping as given

    changed = make((0.2, 0.2, 0.6))
    changed.load_state_dict(state)
    next(iter(changed))
    after = changed.state_dict()["blend"]
    assert len(after) == 2 and after[0] == state["blend"][0]
    assert after[1]["start"] == state["samples"]
    assert normalized(after[1]["weights"]) == pytest.approx([0.2, 0.2, 0.6])
    changed.close()


def test_a_reattach_after_the_daemon_restarted_keeps_the_blend(fresh_daemon, sources):
    d = fresh_daemon
    # A ring of 2: at least 3 of the 5 batches after the kill come from the new daemon.
    with attach_blend(d.socket, sources, job="reattach", seed=SEED, ring_slots=2) as s:
        rows = read(s, 5)
        segments = s.blend_segments
        d = d.kill_and_restart()
        rows += read(s, 5)  # re-attached inside next(), blend_history the segments
        assert s.blend_segments == segments
    with attach_blend(d.socket, sources, job="reattach-ref", seed=SEED) as r:
        reference = read(r, 10)
    d.stop()
    assert [x.id for x in rows] == [x.id for x in reference]


def test_gpufeedctl_feeds_shows_a_blends_sources_weights_and_pack_mode(daemon, job, sources,
                                                                        documents):
    def feeds() -> List[dict]:
        out = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "-o", "json", "feeds"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return json.loads(out)

    with attach_blend(daemon.socket, sources, job=job) as s:
        read(s, 1)
        # (The module's daemon may still run other tests' feeds.)
        blends = [([(b["source"], b["weight"]) for b in f["blend"]], f["pack"]) for f in feeds()]
        table = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "feeds"],
                               capture_output=True, text=True, timeout=30, check=True).stdout
    assert (list(zip(sources.names, WEIGHTS)), "") in blends
    assert "blend " + ",".join(f"{n}={w:g}" for n, w in zip(sources.names, WEIGHTS)) in table
    # A source named with a comma and an '=' is quoted in the table, so the column reads one
    # way; the JSON carries it as it is.
    odd = Path(sources.names[2]).parent / "odd,name=1"
    odd.mkdir(exist_ok=True)
    shutil.copy(sources.names[2], odd / "math.npy")
    with attach_blend(daemon.socket, Sources([sources.names[0], f"{odd}/"], sources.windows[:2]),
                      job=f"{job}-odd", weights=[0.5, 0.5]) as s:
        read(s, 1)
        table = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "feeds"],
                               capture_output=True, text=True, timeout=30, check=True).stdout
        blends = [[b["source"] for b in f["blend"]] for f in feeds()]
    assert f'blend {sources.names[0]}=0.5,"{odd}/"=0.5' in table, table
    assert [sources.names[0], f"{odd}/"] in blends
    with attach_packed(daemon.socket, documents, "concat", job=f"{job}-packed") as s:
        read_packed(s, 1)
        packed = [(f["dataset"], f["blend"]) for f in feeds() if f["pack"] == "concat"]
    assert (documents.path, []) in packed


def test_gpufeedctl_consume_takes_a_blend_and_prints_its_segments(daemon, job, sources, tmp_path):
    ctl = gpufeedctl()
    command = [ctl, "--socket", daemon.socket, "-o", "json", "consume", "--job", job,
               "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--max-batches", "10",
               "--ids", str(tmp_path / "ids.jsonl")]
    for name, weight in zip(sources.names, WEIGHTS):
        command += ["--blend", f"{name}={weight}"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        if any(w in out.stderr.lower() for w in _REFUSALS):
            pytest.skip(f"gpufeedd does not serve blends yet: {out.stderr.strip()}")
        raise AssertionError(out.stderr)
    result = json.loads(out.stdout)
    if not result.get("blend"):
        pytest.skip("gpufeedd reported no blend segments: it does not serve blends yet")
    assert result["blend"][0]["start"] == 0
    ids = [i for line in (tmp_path / "ids.jsonl").read_text().splitlines()
           for i in json.loads(line)["ids"]]
    chosen = [next(k for k in range(3) if OFFSETS[k] <= i < OFFSETS[k] + WINDOWS[k])
              for i in ids]
    want, _ = megatron.transcription(megatron.normalize(list(WEIGHTS)), len(ids))
    assert chosen == want.tolist()


# ---- packing --------------------------------------------------------------------------------

EOS = 1
PACK_SEQ = 16  # rows of 17 tokens


class Documents(NamedTuple):
    path: str
    docs: List[np.ndarray]  # in file order; doc d's tokens 100 + 100 d + i, then EOS


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Documents:
    rng = np.random.default_rng(11)
    # At least 2 tokens: a document's first token names it (an EOS alone would not).
    lengths = np.clip(np.ceil(rng.lognormal(np.log(10), 0.9, size=300)), 2, 90).astype(int)
    assert lengths.max() > PACK_SEQ + 1  # some documents must be cut
    docs = [np.concatenate([100 + 100 * d + np.arange(n - 1), [EOS]]).astype(np.uint16)
            for d, n in enumerate(lengths)]
    path = tmp_path_factory.mktemp("docs") / "docs.npy"
    np.save(path, np.concatenate(docs))
    return Documents(str(path), docs)


def attach_packed(socket: str, documents: Documents, pack: str, **options) -> gpufeed.Session:
    options = {"kind": "tokens", "seq_len": PACK_SEQ, "batch_size": 8, "seed": SEED,
               "eos_id": EOS, **options}
    try:
        return gpufeed.Client(socket).attach(documents.path, pack=pack, **options)
    except gpufeed.Error as e:
        _skip_if_refused(e, "packing")
        raise


class Packed(NamedTuple):
    id: int
    tokens: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    cu_seqlens: np.ndarray


def read_packed(session: gpufeed.Session, batches: int = -1) -> List[Packed]:
    rows: List[Packed] = []
    n = 0
    while batches < 0 or n < batches:
        try:
            batch = session.next(timeout=30)
        except gpufeed.OutOfRange:
            break
        n += 1
        with batch:
            t = batch.numpy()
            if "position_ids" not in t:
                pytest.skip("gpufeedd served no position_ids beside the tokens: it does not pack "
                            "yet (the daemon side of issue 35)")
            assert set(t) == {"tokens", "position_ids", "loss_mask", "cu_seqlens"}, set(t)
            assert t["tokens"].dtype == np.uint16 and t["position_ids"].dtype == np.int32
            assert t["loss_mask"].dtype == np.uint8 and t["cu_seqlens"].dtype == np.int32
            for name in ("tokens", "position_ids", "loss_mask"):
                assert t[name].shape[1:] == (PACK_SEQ + 1,), (name, t[name].shape)
            # cu_seqlens: as wide as the most pieces a row can hold needs, at most the row.
            assert 2 <= t["cu_seqlens"].shape[1] <= PACK_SEQ + 1, t["cu_seqlens"].shape
            for r in range(batch.valid_count):
                rows.append(Packed(int(batch.ids[r]), *(t[x][r].copy() for x in
                                   ("tokens", "position_ids", "loss_mask", "cu_seqlens"))))
    return rows


def pieces(row: Packed) -> List[Tuple[int, int]]:
    """[start, end) of each piece of a row: position_ids restart at 0 where one begins and
    count up within it."""
    starts = [i for i in range(len(row.position_ids)) if row.position_ids[i] == 0]
    assert starts and starts[0] == 0, row
    out = list(zip(starts, starts[1:] + [len(row.position_ids)]))
    for a, b in out:
        assert row.position_ids[a:b].tolist() == list(range(b - a)), row
    return out


def check_row(row: Packed) -> List[Tuple[int, int]]:
    """The invariants of any packed row; its document pieces."""
    parts = pieces(row)
    document = []
    for a, b in parts:
        mask = row.loss_mask[a:b]
        assert np.all(mask == mask[0]), row  # a piece is a document's or padding, whole
        if mask[0] == 0:  # padding: token 0, the row's last piece
            assert np.all(row.tokens[a:b] == 0) and b == len(row.tokens), row
            continue
        t = row.tokens[a:b].astype(np.int64)
        # One document's consecutive tokens; an EOS only last: position_ids restart after it.
        body = t[:-1] if t[-1] == EOS else t
        assert EOS not in body.tolist(), row
        assert np.all(np.diff(body) == 1) and (len(body) == 0 or len(set(body // 100)) == 1), row
        document.append((a, b))
    # cu_seqlens: 0, each piece's end clipped to seq_len, then seq_len to fill its width.
    ends = [0] + [min(b, PACK_SEQ) for _, b in parts]
    ends = ends[:ends.index(PACK_SEQ) + 1] if PACK_SEQ in ends else ends + [PACK_SEQ]
    width = len(row.cu_seqlens)
    assert len(ends) <= width, (row.cu_seqlens.tolist(), ends)
    want = ends + [PACK_SEQ] * (width - len(ends))
    assert row.cu_seqlens.tolist() == want, (row.cu_seqlens.tolist(), want)
    return document


def most_pieces(sources: Sequence[Sequence[int]], pack: str, width: int, group: int) -> int:
    """The most pieces a row can hold (a bound): the shortest pieces that fit the width, each
    document counted as often as a row may repeat it (its source wraps into the next epoch
    within best_fit's group of picks or concat's window), best_fit's long documents as their
    chunks; concat adds the two documents a window cuts."""
    pieces: List[int] = []
    for lengths in sources:
        lengths = [n for n in lengths if n > 0]
        span, per_epoch = (group, len(lengths)) if pack == "best_fit" else (width, sum(lengths))
        copies = 2 + -(-span // per_epoch)
        for n in lengths:
            if pack == "best_fit" and n > width:
                pieces += [width] * (n // width) * copies + [n % width] * copies
            else:
                pieces += [n] * copies
    room, count = width, 0
    for n in sorted(p for p in pieces if p > 0):
        if n > room:
            break
        room -= n
        count += 1
    return min(width, count + (2 if pack == "concat" else 0))


@pytest.mark.parametrize("pack", ["best_fit", "concat"])
def test_cu_seqlens_is_as_wide_as_the_most_pieces_a_row_can_hold(daemon, job, tmp_path, pack):
    # Documents of 20 to 60 tokens in rows of 65: a few pieces a row, so cu_seqlens is far
    # narrower than the row; its width is the bound's, and every row of two epochs fits it.
    # (Longer documents would cut into chunks whose rests can be a token long.)
    rng = np.random.default_rng(5)
    lengths = rng.integers(20, 60, size=120)
    docs = [np.concatenate([100 + np.arange(n - 1), [EOS]]).astype(np.uint16) for n in lengths]
    path = tmp_path / "long.npy"
    np.save(path, np.concatenate(docs))
    seq_len = 64
    want = most_pieces([lengths.tolist()], pack, seq_len + 1, 32) + 2
    assert want <= 7
    try:
        session = gpufeed.Client(daemon.socket).attach(
            str(path), kind="tokens", seq_len=seq_len, batch_size=8, seed=SEED, eos_id=EOS,
            pack=pack, pack_lookahead=32 if pack == "best_fit" else None, job=job,
            stop_epoch=2, drop_last=False)
    except gpufeed.Error as e:
        _skip_if_refused(e, "packing")
        raise
    used = 0
    with session:
        for batch in session:
            with batch:
                cu = batch.numpy()["cu_seqlens"]
                assert cu.shape == (8, want), cu.shape
                for r in range(batch.valid_count):
                    row = cu[r].tolist()
                    assert row[0] == 0 and row[-1] == seq_len, row
                    assert row == sorted(row), row
                    used = max(used, row.index(seq_len) + 1)
    assert 3 <= used <= want


def test_best_fit_delivers_every_token_of_every_document_once(daemon, job, documents):
    # Groups of 100 documents: the first three are the documents' first own epoch.
    with attach_packed(daemon.socket, documents, "best_fit", job=job, stop_epoch=2,
                       drop_last=False, pack_lookahead=100) as s:
        rows = sorted(read_packed(s), key=lambda r: r.id)
        n = s.info.num_samples
    total = sum(len(d) for d in documents.docs)
    assert n == total // (PACK_SEQ + 1)  # a nominal epoch: the tokens over the row width
    assert [r.id for r in rows] == list(range(2 * n))  # ids: stream row numbers
    wanted: Counter = Counter()
    for d in documents.docs:
        wanted.update(d.tolist())
    # The rows up to the one that completes the documents' first own epoch hold every token
    # of every document once, and nothing else but padding.
    delivered: Counter = Counter()
    missing = sum(wanted.values())
    first_of: Dict[int, List[int]] = {}  # document -> the offsets its pieces start at
    for used, row in enumerate(rows, start=1):
        for a, b in check_row(row):
            t = row.tokens[a:b].tolist()
            for token in t:
                assert delivered[token] < wanted[token], f"token {token} delivered twice"
                delivered[token] += 1
            missing -= len(t)
            if t[0] != EOS:
                first_of.setdefault((t[0] - 100) // 100, []).append((t[0] - 100) % 100)
        if missing == 0:
            break
    assert delivered == wanted
    padding = sum(int((r.loss_mask == 0).sum()) for r in rows[:used])
    assert padding == used * (PACK_SEQ + 1) - total
    # Only documents longer than a row are cut: another's pieces all start at its first token.
    for d, offsets in first_of.items():
        if len(documents.docs[d]) <= PACK_SEQ + 1:
            assert offsets == [0], (d, offsets)
        else:  # cut into rows' widths and a rest (one of only the EOS is not seen here)
            size = len(documents.docs[d])
            want = [o for o in range(0, size, PACK_SEQ + 1) if o != size - 1]
            assert sorted(offsets) == want, (d, offsets)


def test_concat_is_the_documents_end_to_end_cut_every_seq_len(daemon, job, documents):
    with attach_packed(daemon.socket, documents, "concat", job=job, stop_epoch=2,
                       drop_last=False) as s:
        rows = sorted(read_packed(s), key=lambda r: r.id)
        n = s.info.num_samples
    total = sum(len(d) for d in documents.docs)
    assert n == (total - 1) // PACK_SEQ
    assert [r.id for r in rows] == list(range(2 * n))
    for i, row in enumerate(rows):
        assert np.all(row.loss_mask == 1), i  # no padding in concat
        check_row(row)
        # A piece begins at the row's start and after each EOS.
        for j in range(1, PACK_SEQ + 1):
            assert (row.position_ids[j] == 0) == (row.tokens[j - 1] == EOS), (i, j)
        if i + 1 < len(rows):  # consecutive rows share one token
            assert row.tokens[PACK_SEQ] == rows[i + 1].tokens[0], i
    # The rows are one stream cut every seq_len tokens: the documents end to end, each
    # document once in each of their own epochs (the last one cut short).
    stream = np.concatenate([r.tokens[:PACK_SEQ] for r in rows] + [rows[-1].tokens[PACK_SEQ:]])
    order, at = [], 0
    while at < len(stream):
        d = (int(stream[at]) - 100) // 100
        doc = documents.docs[d]
        piece = stream[at:at + len(doc)]
        assert np.array_equal(piece, doc[:len(piece)]), at
        order.append(d)
        at += len(doc)
    docs = len(documents.docs)
    assert len(order) > docs
    assert sorted(order[:docs]) == list(range(docs))
    assert len(set(order[docs:])) == len(order[docs:])


def test_a_packed_feed_resumes_exactly(daemon, job, documents):
    with attach_packed(daemon.socket, documents, "best_fit", job=job) as s:
        rows, positions = [], []
        for _ in range(12):
            rows += read_packed(s, 1)
            positions.append(s.position())
        fingerprint = s.fingerprint
    with attach_packed(daemon.socket, documents, "best_fit", job=f"{job}-resumed",
                       start=positions[4], start_fingerprint=fingerprint) as r:
        resumed = read_packed(r, 7)
    assert [x.id for x in resumed] == [x.id for x in rows[5 * 8:]]
    for a, b in zip(resumed, rows[5 * 8:]):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in Packed._fields[1:])


@pytest.mark.parametrize("pack", ["best_fit", "concat"])
def test_a_packed_feed_rides_through_a_daemon_sigkill_exactly(fresh_daemon, documents, pack):
    # Killed mid-stream: the session re-attaches inside next() to a daemon that has packed
    # nothing yet (it packs the groups up to its position again), and every tensor of every
    # row after equals an uninterrupted reading's (best_fit: across group edges, lookahead 20).
    # A ring of 2: at most 2 of the 10 batches after the kill were delivered before it.
    d = fresh_daemon
    extra = {"pack_lookahead": 20} if pack == "best_fit" else {}
    try:
        with attach_packed(d.socket, documents, pack, job=f"kill-{pack}", ring_slots=2,
                           **extra) as s:
            rows = read_packed(s, 6)
            d = d.kill_and_restart()
            rows += read_packed(s, 10)
            # The new daemon serves the session: it re-attached there...
            listed = json.loads(subprocess.run(
                [gpufeedctl(), "--socket", d.socket, "-o", "json", "sessions"],
                capture_output=True, text=True, check=True).stdout)
            mine = [x for x in listed if x["job"] == f"kill-{pack}"]
            # ...and delivered it at least the 8 batches the old ring could not have held
            assert len(mine) == 1 and mine[0]["batches_delivered"] >= 8, listed
        with attach_packed(d.socket, documents, pack, job=f"kill-{pack}-ref", **extra) as r:
            reference = read_packed(r, 16)
    finally:
        d.stop()
    assert [x.id for x in rows] == [x.id for x in reference] == list(range(16 * 8))
    for a, b in zip(rows, reference):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in Packed._fields[1:]), a.id


def test_a_packed_feeds_metrics_count_its_groups_documents_and_padding(tmp_path, documents):
    """gpufeed_pack_*: what the stream placed so far (whole groups of pack_lookahead
    documents, some ahead of the rows read), each group once for one reader; the padding the
    rows read carry is within it."""
    with socketlib.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = Daemon(tmp_path, f"--metrics_listen=127.0.0.1:{port}")
    try:
        with attach_packed(d.socket, documents, "best_fit", job="metrics", stop_epoch=1,
                           drop_last=False, pack_lookahead=50) as s:
            rows = read_packed(s)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                          timeout=10).read().decode()
    finally:
        d.stop()

    def metric(name: str, **labels: str) -> int:
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m[1] for k, v in labels.items()):
                total += float(m[2])
        return int(total)

    groups = metric("gpufeed_pack_groups_total", packing="first")
    assert metric("gpufeed_pack_groups_total", packing="again") == 0
    assert metric("gpufeed_pack_documents_total") == groups * 50
    document = metric("gpufeed_pack_tokens_total", kind="document")
    padding = metric("gpufeed_pack_tokens_total", kind="padding")
    width = PACK_SEQ + 1
    assert (document + padding) % width == 0
    placed = (document + padding) // width
    assert placed >= len(rows), (placed, len(rows))
    # The rows read are the stream's first: their padding is the placed rows' at most.
    read_padding = sum(int((r.loss_mask == 0).sum()) for r in rows)
    assert read_padding <= padding <= read_padding + (placed - len(rows)) * width


def test_the_loader_yields_the_packed_tensors(daemon, job, documents):
    torch = pytest.importorskip("torch")
    import gpufeed.torch

    loader = gpufeed.torch.Loader(documents.path, kind="tokens", seq_len=PACK_SEQ, batch_size=4,
                                  pack="best_fit", eos_id=EOS, pack_lookahead=64, device="cpu",
                                  socket=daemon.socket, job=job)
    try:
        batch = next(iter(loader))
    except gpufeed.Error as e:
        _skip_if_refused(e, "packing")
        raise
    if "position_ids" not in batch:
        pytest.skip("gpufeedd served no position_ids: it does not pack yet")
    assert set(batch.keys()) == {"tokens", "position_ids", "loss_mask", "cu_seqlens"}
    assert batch["position_ids"].dtype == torch.int32 and batch["loss_mask"].dtype == torch.uint8
    lengths = [len(d) for d in documents.docs]
    cu_width = most_pieces([lengths], "best_fit", PACK_SEQ + 1, 64) + 2
    assert batch["cu_seqlens"].shape == (4, min(cu_width, PACK_SEQ + 1))
    loader.close()


def test_gpufeedctl_consume_packs(daemon, job, documents, tmp_path):
    out = subprocess.run(
        [gpufeedctl(), "--socket", daemon.socket, "consume", "--job", job, "--dataset",
         documents.path, "--seq-len", str(PACK_SEQ), "--batch-size", "4", "--max-batches", "2",
         "--pack", "best_fit", "--eos-id", str(EOS), "--pack-lookahead", "32",
         "--dump", str(tmp_path / "first")], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        if any(w in out.stderr.lower() for w in _REFUSALS):
            pytest.skip(f"gpufeedd does not pack yet: {out.stderr.strip()}")
        raise AssertionError(out.stderr)
    if not os.path.exists(tmp_path / "first.position_ids.npy"):
        pytest.skip("gpufeedd served no position_ids: it does not pack yet")
    positions = np.load(tmp_path / "first.position_ids.npy")
    assert positions.shape == (4, PACK_SEQ + 1) and np.all(positions[:, 0] == 0)


def test_an_offsets_file_gives_the_documents_an_eos_scan_would(daemon, job, documents, tmp_path):
    # The same documents as a .npy with its offsets file beside it (S.offsets.npy, CSR form)
    # and no eos_id: every row equal to the eos-split feed's, through a blend of one source.
    lengths = [len(d) for d in documents.docs]
    np.save(tmp_path / "docs.npy", np.concatenate(documents.docs))
    np.save(tmp_path / "docs.offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    by_offsets = Documents(str(tmp_path / "docs.npy"), documents.docs)
    rows = {}
    for pack in ("best_fit", "concat"):
        extra = {"pack_lookahead": 100} if pack == "best_fit" else {}
        with attach_packed(daemon.socket, documents, pack, job=f"{job}-{pack}-eos",
                           stop_epoch=1, drop_last=False, **extra) as s:
            want = read_packed(s)
        with attach_packed(daemon.socket, by_offsets, pack, job=f"{job}-{pack}-offsets",
                           eos_id=None, stop_epoch=1, drop_last=False, **extra) as s:
            got = read_packed(s)
        rows[pack] = got
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert g.id == w.id
            for name in ("tokens", "position_ids", "loss_mask", "cu_seqlens"):
                assert np.array_equal(getattr(g, name), getattr(w, name)), (pack, g.id, name)
    # A directory of the two files reads the same: the offsets file is no shard of its own.
    with attach_packed(daemon.socket, by_offsets._replace(path=str(tmp_path)), "best_fit",
                       job=f"{job}-dir", eos_id=None, stop_epoch=1, drop_last=False,
                       pack_lookahead=100) as s:
        assert [r.tokens.tolist() for r in read_packed(s)] == \
            [r.tokens.tolist() for r in rows["best_fit"]]
