"""Token datasets in shards through the client, as users point gpufeed at nanoGPT/llm.c/.npy
shards (issue 16): a directory or a glob, passed by this process as a directory descriptor;
three ranks see every window of every shard exactly once per epoch, byte-exact."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gpufeed
import reference

SEQ = 8


def write_llmc(path, tokens: np.ndarray, version: int = 1) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = 20240520, version, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16 if version == 1 else np.uint32).tobytes())


@pytest.fixture
def shards(tmp_path):
    """A directory of a raw nanoGPT-style .bin, a .npy and an llm.c shard (uint16), and the
    windows each should give, in shard-name order."""
    rng = np.random.default_rng(5)
    parts = {name: rng.integers(0, 50257, size=n, dtype=np.uint16)
             for name, n in (("train_000.bin", 101), ("train_001.npy", 57), ("train_002.bin", 80))}
    parts["train_000.bin"].tofile(tmp_path / "train_000.bin")
    np.save(tmp_path / "train_001.npy", parts["train_001.npy"])
    write_llmc(tmp_path / "train_002.bin", parts["train_002.bin"])
    (tmp_path / "val_000.bin").write_bytes(np.arange(40, dtype=np.uint16).tobytes())
    windows = []
    for name in sorted(parts):
        t = parts[name]
        windows += [t[i * SEQ: i * SEQ + SEQ + 1] for i in range((len(t) - 1) // SEQ)]
    return tmp_path, np.stack(windows)


@pytest.mark.parametrize("pattern", [False, True], ids=["directory", "glob"])
def test_three_ranks_read_every_window_of_every_shard_once(daemon, job, shards, pattern):
    root, windows = shards
    path = str(root / "train_*") if pattern else str(root)
    if not pattern:
        os.remove(root / "val_000.bin")  # the directory form takes every file
    n = len(windows)  # 12 + 7 + 9 = 28
    assert n == 28
    seen = []
    for rank in range(3):
        with gpufeed.Client(daemon.socket).attach(path, kind="tokens", seq_len=SEQ, batch_size=3,
                                                  seed=11, rank=rank, world_size=3, job=job,
                                                  stop_epoch=1, drop_last=False) as s:
            assert s.info.num_samples == n
            for step, batch in enumerate(s):
                ids, valid = reference.rank_slice(n, 11, 0, step, rank, 3, 3)
                assert batch.ids.tolist() == ids and batch.valid_count == valid
                tokens = batch.numpy()["tokens"]
                assert tokens.dtype == np.uint16 and tokens.shape == (3, SEQ + 1)
                assert np.array_equal(tokens, windows[ids])
                seen += ids[:valid]
    assert sorted(seen) == list(range(n))


def test_a_shard_set_that_changed_does_not_resume(daemon, job, shards):
    root, _ = shards
    os.remove(root / "val_000.bin")
    with gpufeed.Client(daemon.socket).attach(str(root), kind="tokens", seq_len=SEQ, batch_size=4,
                                              job=job) as s:
        next(iter(s))
        fingerprint = s.fingerprint
    np.arange(30, dtype=np.uint16).tofile(root / "train_003.bin")
    with pytest.raises(gpufeed.FailedPrecondition, match="shards"):
        gpufeed.Client(daemon.socket).attach(str(root), kind="tokens", seq_len=SEQ, batch_size=4,
                                             job=job + "-2", start=(0, 1),
                                             start_fingerprint=fingerprint)
