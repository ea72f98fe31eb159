"""The sharded and multi-array dataset forms ride through a daemon restart (re-attach):
token shards, records of several arrays and WebDataset shards. gpufeedd is SIGKILLed
mid-epoch and started again on the same socket; the loader must then yield exactly the
batches of a fault-free run of the same settings (positions, ids and every tensor's bytes),
none twice and none lost."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpufeed.torch  # noqa: E402
import reference  # noqa: E402
from conftest import Daemon  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:gpufeed. torch .* has no uint")


def token_shards(root):
    d = root / "shards"
    d.mkdir()
    for k in range(5):  # uneven shards: windows are cut within each
        values = (np.arange(300 + 37 * k, dtype=np.uint32) * 7919 + k) % 65536
        (d / f"part-{k:03d}.bin").write_bytes(values.astype(np.uint16).tobytes())
    return str(d), dict(kind="tokens", seq_len=15, token_dtype="uint16")


def record_arrays(root):
    d = root / "arrays"
    d.mkdir()
    np.save(d / "x.npy", np.arange(83 * 6, dtype=np.float32).reshape(83, 2, 3) / 7)
    np.save(d / "y.npy", np.arange(83, dtype=np.int64) * 11)
    return {"x": str(d / "x.npy"), "y": str(d / "y.npy")}, dict(kind="records")


def webdataset(root):
    d = root / "wds"
    d.mkdir()
    rng = np.random.default_rng(3)
    for k in range(3):
        with tarfile.open(d / f"train-{k:06d}.tar", "w", format=tarfile.GNU_FORMAT) as tar:
            for i in range(12):
                png = root / "img.png"
                reference.write_png(png, rng.integers(0, 256, size=(7, 9, 3), dtype=np.uint8))
                for name, data in ((f"s{k}_{i:03d}.png", png.read_bytes()),
                                   (f"s{k}_{i:03d}.cls", f"{(k * 12 + i) % 4}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(d / "train-{000000..000002}.tar"), dict(
        kind="webdataset", pipeline={"ops": [{"random_resized_crop": {"size": 5}},
                                             {"flip": {"p": 0.5}}]})


def run(daemon_dir, dataset, settings, job, kill_at=None):
    """Two epochs through one loader: (epoch, step, ids, {tensor: bytes}) per batch; with
    kill_at, the daemon is SIGKILLed after that many batches and started again."""
    daemon_dir.mkdir()
    daemon = Daemon(daemon_dir)
    loader = gpufeed.torch.Loader(dataset, socket=daemon.socket, device="cpu", timeout=30,
                                  batch_size=4, seed=9, ring_slots=3, job=job, **settings)
    got = []
    try:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for b in loader:
                got.append((b.epoch, b.step, b.ids.tolist(),
                            {k: v.numpy().tobytes() for k, v in b.items()}))
                if kill_at is not None and len(got) == kill_at:
                    daemon = daemon.kill_and_restart()
    finally:
        loader.close()
        daemon.stop()
    return got


@pytest.mark.parametrize("make", [token_shards, record_arrays, webdataset],
                         ids=["token_shards", "record_arrays", "webdataset"])
def test_a_killed_daemon_leaves_the_stream_exactly_as_a_fault_free_run(tmp_path, make):
    dataset, settings = make(tmp_path)
    want = run(tmp_path / "d1", dataset, settings, "clean")
    assert len(want) > 12 and len({w[0] for w in want}) == 2
    got = run(tmp_path / "d2", dataset, settings, "killed", kill_at=7)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        assert g[3] == w[3], f"epoch {g[0]} step {g[1]}: tensors differ after the restart"
