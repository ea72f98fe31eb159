"""Samples left out at attach reach the user (never silently): WebDataset keys
without an image (names with a second dot, `img.001.jpg`, are key `img`, as webdataset itself
splits them) are counted with the first, warned once in Python (GpufeedWarning), printed by
`gpufeedctl consume` (and in its -o json), and counted in the feed's bad_samples
(`gpufeedctl feeds`). webdataset's own ShardWriter and reader, installed from PyPI into a
cached directory, agree on the keys (skipped, saying why, without the network)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import gpufeed
import reference
from conftest import gpufeedctl

OPS = [{"center_crop": 4}]
# Members in tar order: keys good0, img (img.001.* and img.002.*: one key, as consecutive
# members with one key are one sample), good1, photo (photo.a.*), meta0, good2.
MEMBERS = [("good0.cls", b"0"), ("good0.png", None), ("img.001.cls", b"1"), ("img.001.jpg", None),
           ("img.002.cls", b"2"), ("img.002.jpg", None), ("good1.cls", b"1"), ("good1.png", None),
           ("photo.a.png", None), ("photo.a.cls", b"0"), ("meta0.json", b"{}"),
           ("good2.cls", b"2"), ("good2.png", None)]


def message(shard: str) -> str:
    return (f"3 WebDataset keys have no image (.jpg, .jpeg or .png) and are left out (first: "
            f"{shard}:img); 2 of them hold 3 images whose names have more than one dot: in "
            f"{shard}, img.001.jpg is key img with extension 001.jpg; WebDataset (and gpufeed) "
            f"split a member's name at the first dot of its last component: name keys without "
            f"dots (img_001.jpg)")


def png(tmp_path: Path, seed: int) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(6, 7, 3), dtype=np.uint8)
    path = tmp_path / f"{seed}.png"
    reference.write_png(path, rgb)
    return path.read_bytes()


@pytest.fixture
def dotted(tmp_path):
    """A shard directory of one tar (Python's tarfile) with the MEMBERS; its shard's path."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shard = shards / "train-000000.tar"
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        for i, (name, data) in enumerate(MEMBERS):
            data = png(tmp_path, i) if data is None else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return shards, str(shard)


def attach(daemon, job, path, **kw):
    return gpufeed.Client(daemon.socket).attach(str(path), kind="webdataset", job=job,
                                                batch_size=2, pipeline=OPS, **kw)


def test_python_warns_once_with_the_count_and_the_first_example(daemon, job, dotted):
    shards, shard = dotted
    with pytest.warns(gpufeed.GpufeedWarning) as caught:
        session = attach(daemon, job, shards, stop_epoch=1, drop_last=False)
    with session:
        assert len(caught) == 1
        assert str(caught[0].message) == "gpufeed: " + message(shard)
        assert caught[0].filename == __file__  # at the caller's attach, not inside gpufeed
        assert issubclass(caught[0].category, UserWarning)
        assert session.notices == (gpufeed.Notice("no_image", 3, f"{shard}:img", message(shard)),)
        assert session.info.num_samples == 3  # good0, good1, good2
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # reading the batches warns no more
            assert sum(b.valid_count for b in session) == 3


def test_a_clean_dataset_warns_nothing(daemon, job, tmp_path):
    shards = tmp_path / "clean"
    shards.mkdir()
    with tarfile.open(shards / "a.tar", "w") as tar:
        for name, data in [("k.cls", b"1"), ("k.png", png(tmp_path, 0))]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with attach(daemon, job, shards, drop_last=False) as session:
            assert session.notices == ()


def test_a_program_may_filter_them(daemon, job, dotted):
    shards, _ = dotted
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpufeed.GpufeedWarning)
        with pytest.raises(gpufeed.GpufeedWarning, match="3 WebDataset keys have no image"):
            attach(daemon, job, shards)


def test_feeds_count_them_in_bad_samples(daemon, job, dotted):
    shards, _ = dotted
    with pytest.warns(gpufeed.GpufeedWarning):
        session = attach(daemon, job, shards)
    with session:
        run = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "-o", "json", "feeds"],
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr
        mine = [f for f in json.loads(run.stdout) if f["dataset"] == str(shards)]
        assert len(mine) == 1, run.stdout
        assert mine[0]["bad_samples"]["no_image"] == 3


def test_gpufeedctl_consume_prints_each_notice(daemon, job, dotted, tmp_path):
    shards, shard = dotted
    pipeline = tmp_path / "ops.json"
    pipeline.write_text(json.dumps({"ops": OPS}))
    base = [gpufeedctl(), "--socket", daemon.socket, "consume", "--kind", "webdataset",
            "--dataset", str(shards), "--batch-size", "2", "--pipeline", str(pipeline),
            "--max-batches", "1"]
    run = subprocess.run(base + ["--job", job], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0] == f"notice (no_image): {message(shard)}", run.stderr
    as_json = subprocess.run(base + ["--job", job + "-json", "-o", "json"], capture_output=True,
                             text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["notices"] == [{"reason": "no_image", "count": 3, "example": f"{shard}:img",
                               "message": message(shard)}]
    assert out["batches"] == 1


# ---- webdataset's own writer and reader (PyPI) ----

WEBDATASET = ["webdataset==1.0.2", "braceexpand==0.1.7"]  # numpy and PyYAML: Debian's


def webdataset_dir() -> Path:
    """webdataset, installed once (pip --target, no dependencies) into a cache directory."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path(tempfile.gettempdir()))) / \
        "gpufeed-test-pip" / "-".join(WEBDATASET).replace("==", "-")
    if (cache / "webdataset").is_dir():
        return cache
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--disable-pip-version-check", "--target", str(cache), *WEBDATASET],
                         capture_output=True, text=True, timeout=120)
    if pip.returncode != 0:
        pytest.skip(f"webdataset not installable from PyPI here (no network?): "
                    f"{pip.stderr.strip().splitlines()[-1:]}")
    return cache


WRITE_AND_READ = r"""
import json, sys
import webdataset as wds
pattern, images = sys.argv[1], json.loads(sys.argv[2])
with wds.ShardWriter(pattern, maxcount=1000) as w:
    for key, cls, image in images:
        sample = {"__key__": key, "cls": cls}
        sample[image[0]] = open(image[1], "rb").read()
        w.write(sample)
shard = pattern % 0
keys = [(s["__key__"], sorted(k for k in s if not k.startswith("__")))
        for s in wds.WebDataset(shard, shardshuffle=False)]
print("KEYS " + json.dumps({"shard": shard, "keys": keys}))
"""


def test_webdatasets_own_writer_and_reader_agree_on_the_keys(daemon, job, tmp_path):
    target = webdataset_dir()
    shards = tmp_path / "wds"
    shards.mkdir()
    images = []
    for i, key in enumerate(["good0", "img.001", "img.002", "good1", "photo.a", "good2"]):
        path = tmp_path / f"in{i}.png"
        path.write_bytes(png(tmp_path, 100 + i))
        images.append([key, i % 3, ["jpg" if key.startswith("img") else "png", str(path)]])
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, "-c", WRITE_AND_READ, str(shards / "train-%06d.tar"),
                          json.dumps(images)], capture_output=True, text=True, timeout=120,
                         env=env)
    if run.returncode != 0 and "ModuleNotFoundError" in run.stderr:
        pytest.skip(f"webdataset does not import here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr
    # (ShardWriter prints "# writing ..." itself.)
    written = json.loads(run.stdout.split("KEYS ", 1)[1])
    # webdataset's own view: `img.001` and `img.002` are one key `img` (fields 001.jpg, ...),
    # `photo.a` is `photo`; neither has a jpg, jpeg or png field.
    keys = [k for k, _ in written["keys"]]
    assert keys == ["good0", "img", "good1", "photo", "good2"]
    imageless = [k for k, fields in written["keys"] if not {"jpg", "jpeg", "png"} & set(fields)]
    assert imageless == ["img", "photo"]
    with pytest.warns(gpufeed.GpufeedWarning) as caught:
        session = attach(daemon, job, shards)
    with session:
        assert session.info.num_samples == len(keys) - len(imageless)
        (notice,) = session.notices
        assert (notice.reason, notice.count) == ("no_image", len(imageless))
        assert notice.example == f"{written['shard']}:{imageless[0]}"
        assert "2 of them hold 3 images whose names have more than one dot" in notice.message
        assert str(caught[0].message) == "gpufeed: " + notice.message
