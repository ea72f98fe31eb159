"""WebDataset tar shards through the client: shards written by Python's tarfile in
its GNU, PAX and USTAR formats (long names included), named by a directory, a glob or a brace
pattern; three ranks see every sample once per epoch with the ids of the independent sampler
(reference.py), the same bytes as the same images served as an ImageFolder, labels from cls,
exact resume, and bad shards refused naming the shard and the member."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

import gpufeed
from gpufeed import pipeline as P
import reference

N = 17
SHARDS = [(0, 6, tarfile.GNU_FORMAT), (6, 11, tarfile.PAX_FORMAT), (11, 17, tarfile.USTAR_FORMAT)]
OPS = P.Pipeline([P.random_resized_crop(6), P.flip(0.5)])


def label_of(i: int) -> int:
    return i * 3 // N  # rising with the id, so the folder's ids are the shards' ids


def png_bytes(tmp_path, i: int) -> bytes:
    rng = np.random.default_rng(i)
    rgb = rng.integers(0, 256, size=(9 + i % 4, 11 + i % 3, 3), dtype=np.uint8)
    path = tmp_path / f"img{i}.png"
    reference.write_png(path, rgb)
    return path.read_bytes()


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def key_of(i: int, fmt: int) -> str:
    # USTAR cannot hold a long name; the others put this one in a GNU 'L' or a pax header.
    deep = "a-rather-long-directory-name-that-takes-space/" * 3 if fmt != tarfile.USTAR_FORMAT else ""
    return f"{deep}sample{i:06d}"


@pytest.fixture
def webdataset(tmp_path):
    """(shard directory, image folder of the same images, their bytes by id)."""
    shards, folder = tmp_path / "shards", tmp_path / "folder"
    shards.mkdir()
    images = [png_bytes(tmp_path, i) for i in range(N)]
    for k, (first, end, fmt) in enumerate(SHARDS):
        with tarfile.open(shards / f"train-{k:06d}.tar", "w", format=fmt) as tar:
            for i in range(first, end):
                key = key_of(i, fmt)
                add(tar, f"{key}.cls", f"{label_of(i)}\n".encode())
                add(tar, f"{key}.png", images[i])
                add(tar, f"{key}.json", b'{"caption": "ignored"}')
    for i in range(N):
        d = folder / f"c{label_of(i)}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:04d}.png").write_bytes(images[i])
    return shards, folder, images


def epoch_batches(daemon, job, path, kind, rank, world=3, batch=2, **kw):
    dataset = [str(p) for p in path] if isinstance(path, list) else str(path)
    with gpufeed.Client(daemon.socket).attach(dataset, kind=kind, batch_size=batch, seed=5,
                                              rank=rank, world_size=world, job=job,
                                              pipeline=OPS, stop_epoch=1, drop_last=False,
                                              **kw) as s:
        assert s.info.num_samples == N
        return [(b.ids.tolist(), b.valid_count, {k: v.copy() for k, v in b.numpy().items()})
                for b in s]


@pytest.mark.parametrize("form", ["directory", "glob", "braces", "list"])
def test_three_ranks_see_every_sample_once_as_the_image_folder_does(daemon, job, webdataset,
                                                                     form):
    shards, folder, _ = webdataset
    path = {"directory": shards, "glob": shards / "train-*.tar",
            "braces": shards / "train-{000000..000002}.tar",
            "list": [shards / f"train-{k:06d}.tar" for k in range(3)]}[form]
    seen = []
    for rank in range(3):
        got = epoch_batches(daemon, f"{job}-wds", path, "webdataset", rank)
        want = epoch_batches(daemon, f"{job}-folder", folder, "image_folder", rank)
        assert len(got) == len(want) == reference.steps_per_epoch(N, 2, 3, False)
        for step, ((ids, valid, tensors), (fids, _, ftensors)) in enumerate(zip(got, want)):
            assert (ids, valid) == reference.rank_slice(N, 5, 0, step, rank, 3, 2)
            assert ids == fids
            assert tensors["label"].tolist() == [label_of(i) for i in ids]
            assert np.array_equal(tensors["image"], ftensors["image"])  # byte-exact, CPU path
            seen += ids[:valid]
    assert sorted(seen) == list(range(N))


def test_a_position_resumes_exactly(daemon, job, webdataset):
    shards, _, _ = webdataset
    client = gpufeed.Client(daemon.socket)
    opts = dict(kind="webdataset", batch_size=3, seed=8, pipeline=OPS, stop_epoch=3)
    with client.attach(str(shards), job=job, **opts) as s:
        batches = [(b.ids.tolist(), b.numpy()["image"].copy()) for b in s]
    with client.attach(str(shards), job=job + "-a", **opts) as s:
        for _ in range(7):  # into the second epoch
            s.next(timeout=20).release()
        position, fingerprint = s.position(), s.fingerprint
    assert "shards=3 files, fnv1a64 " in fingerprint
    with client.attach(str(shards), job=job + "-b", start=tuple(position),
                       start_fingerprint=fingerprint, **opts) as s:
        resumed = [(b.ids.tolist(), b.numpy()["image"].copy()) for b in s]
    assert len(resumed) == len(batches) - 7
    for (ids, image), (rids, rimage) in zip(batches[7:], resumed):
        assert ids == rids and np.array_equal(image, rimage)


def test_a_changed_shard_set_does_not_resume(daemon, job, webdataset):
    shards, _, images = webdataset
    client = gpufeed.Client(daemon.socket)
    with client.attach(str(shards), kind="webdataset", batch_size=4, job=job, pipeline=OPS) as s:
        s.next(timeout=20).release()
        fingerprint = s.fingerprint
    with tarfile.open(shards / "train-000003.tar", "w") as tar:
        add(tar, "x.cls", b"1")
        add(tar, "x.png", images[0])
    with pytest.raises(gpufeed.FailedPrecondition, match="shards"):
        client.attach(str(shards), kind="webdataset", batch_size=4, job=job + "-2", pipeline=OPS,
                      start=(0, 1), start_fingerprint=fingerprint)


def write_tar(path, members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            add(tar, name, data)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def test_bad_shards_are_refused_naming_the_shard_and_member(daemon, job, webdataset, tmp_path):
    _, _, images = webdataset
    bad = tmp_path / "bad"
    bad.mkdir()
    client = gpufeed.Client(daemon.socket)

    def refusal(error, match):
        with pytest.raises(error) as e:
            client.attach(str(bad / "s.tar"), kind="webdataset", batch_size=1, job=job,
                          pipeline=OPS)
        assert match in str(e.value), str(e.value)

    good = write_tar(bad / "s.tar", [("a.cls", b"0"), ("a.png", images[0]),
                                     ("b.cls", b"1"), ("b.png", images[1])])
    spoiled = bytearray(good)
    spoiled[1536 + -(-len(images[0]) // 512) * 512 + 148] ^= 1  # b.cls's header checksum
    (bad / "s.tar").write_bytes(bytes(spoiled))
    refusal(gpufeed.InvalidArgument, f"{bad / 's.tar'}: the tar header at byte")
    (bad / "s.tar").write_bytes(good[:1536 + 200])  # a.png cut short
    refusal(gpufeed.DataLoss, f"{bad / 's.tar'}: member a.png (header at byte 1024)")
    write_tar(bad / "s.tar", [("a.png", images[0])])
    refusal(gpufeed.InvalidArgument, f"{bad / 's.tar'}: key a (a.png) has no label")
    write_tar(bad / "s.tar", [("a.cls", b"cat"), ("a.png", images[0])])
    refusal(gpufeed.InvalidArgument, "key a has a .cls of 'cat', not an integer")


def test_an_image_that_does_not_decode_follows_the_policy(daemon, job, webdataset, tmp_path):
    _, _, images = webdataset
    write_tar(tmp_path / "s.tar", [("a.cls", b"0"), ("a.png", b"no png"),
                                   ("b.cls", b"1"), ("b.png", images[1])])
    client = gpufeed.Client(daemon.socket)
    with client.attach(str(tmp_path / "s.tar"), kind="webdataset", batch_size=2, job=job,
                       pipeline=OPS, shuffle=False, stop_epoch=1) as s:
        batch = s.next(timeout=20)
        assert batch.numpy()["label"].tolist() == [1, 1]  # a replaced by b
        batch.release()
    with client.attach(str(tmp_path / "s.tar"), kind="webdataset", batch_size=2, job=job + "-f",
                       pipeline=OPS, bad_sample="fail", stop_epoch=1) as s:
        with pytest.raises(gpufeed.DataLoss, match=r"s\.tar:a\.png"):
            s.next(timeout=20)


def test_a_list_of_shards_is_read_in_its_order(daemon, job, webdataset):
    """The list's order, not the names': the last shard's samples come first."""
    shards, _, _ = webdataset
    listed = [shards / f"train-{k:06d}.tar" for k in (2, 1, 0)]
    batches = epoch_batches(daemon, job, listed, "webdataset", 0, world=1, batch=17,
                            shuffle=False)
    (ids, valid, tensors), = batches
    assert ids == list(range(N)) and valid == N
    images = list(range(11, 17)) + list(range(6, 11)) + list(range(0, 6))
    assert tensors["label"].tolist() == [label_of(i) for i in images]
