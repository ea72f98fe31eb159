"""Records of several arrays: a mapping of tensor names to .npy files of one row
count, as x/y datasets are stored; the client passes their directory, the daemon opens the
files beneath it. Three ranks see every sample once per epoch with reference.py's ids, every
tensor byte-exact against numpy; resume exact; a changed file refused; bad input named."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gpufeed
import reference
from conftest import gpufeedctl

N = 29


@pytest.fixture
def xy(tmp_path):
    """x: float32 [N, 3, 4]; y: int64 [N]; w: uint8 [N, 5] (odd row bytes), beside an
    unrelated file."""
    rng = np.random.default_rng(16)
    arrays = {
        "x": rng.standard_normal((N, 3, 4)).astype(np.float32),
        "y": rng.integers(-(1 << 40), 1 << 40, size=N, dtype=np.int64),
        "w": rng.integers(0, 256, size=(N, 5), dtype=np.uint8),
    }
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    (tmp_path / "notes.txt").write_text("not an array")
    return tmp_path, arrays


def paths(root, names=("x", "y", "w")):
    return {name: str(root / f"{name}.npy") for name in names}


def test_three_ranks_read_every_sample_once_with_every_tensor_byte_exact(daemon, job, xy):
    root, arrays = xy
    seen = []
    for rank in range(3):
        with gpufeed.Client(daemon.socket).attach(paths(root), kind="records", batch_size=4,
                                                  seed=5, rank=rank, world_size=3, job=job,
                                                  stop_epoch=1, drop_last=False) as s:
            assert s.info.num_samples == N
            assert s.info.num_tensors == 3
            steps = 0
            for step, batch in enumerate(s):
                ids, valid = reference.rank_slice(N, 5, 0, step, rank, 3, 4)
                assert batch.ids.tolist() == ids and batch.valid_count == valid
                got = batch.numpy()
                assert list(got) == ["x", "y", "w"]
                for name, a in arrays.items():
                    assert got[name].dtype == a.dtype
                    assert got[name].shape == (4,) + a.shape[1:]
                    assert got[name].tobytes() == a[ids].tobytes(), (name, step)
                seen += ids[:valid]
                steps += 1
            assert steps == reference.steps_per_epoch(N, 4, 3, drop_last=False)
    assert sorted(seen) == list(range(N))


def test_loader_yields_named_tensors_and_resumes_exactly(daemon, job, xy):
    torch = pytest.importorskip("torch")
    import gpufeed.torch  # noqa: F401  (after torch: the adapter needs it)

    root, arrays = xy
    opts = dict(kind="records", batch_size=3, seed=9, rank=1, world_size=2, job=job,
                socket=daemon.socket, device="cpu")

    def run(loader, epochs, stop_after=None):
        out = []
        for epoch in epochs:
            loader.set_epoch(epoch)
            for b in loader:
                out.append((b.epoch, b.step, b.ids.tolist(),
                            {k: v.clone() for k, v in b.items()}))
                if stop_after is not None and len(out) == stop_after:
                    return out
        return out

    with gpufeed.torch.Loader(paths(root, ("x", "y")), **opts) as loader:
        assert len(loader) == N // 6
        full = run(loader, [0, 1])
    for epoch, step, ids, tensors in full:
        assert sorted(tensors) == ["x", "y"]
        assert torch.equal(tensors["x"], torch.from_numpy(arrays["x"][ids]))
        assert torch.equal(tensors["y"], torch.from_numpy(arrays["y"][ids]))
        assert ids == reference.rank_slice(N, 9, epoch, step, 1, 2, 3)[0]
    for cut in (2, 6):  # mid-epoch, mid second epoch
        with gpufeed.torch.Loader(paths(root, ("x", "y")), **opts) as first:
            head = run(first, [0, 1], stop_after=cut)
            state = first.state_dict()
        assert "files=x:x.npy:" in state["fingerprint"]
        with gpufeed.torch.Loader(paths(root, ("x", "y")), **opts) as second:
            second.load_state_dict(state)
            tail = []
            while len(head) + len(tail) < len(full):
                tail.extend((b.epoch, b.step, b.ids.tolist(),
                             {k: v.clone() for k, v in b.items()}) for b in second)
        resumed = head + tail
        assert [r[:3] for r in resumed] == [f[:3] for f in full]
        assert all(torch.equal(r[3][k], f[3][k]) for r, f in zip(resumed, full) for k in "xy")


def test_a_changed_array_does_not_resume(daemon, job, xy):
    root, arrays = xy
    client = gpufeed.Client(daemon.socket)
    with client.attach(paths(root), kind="records", batch_size=4, job=job) as s:
        next(iter(s))
        fingerprint = s.fingerprint
    # The same shape and size, other values, a later time: only the file's identity says so.
    changed = arrays["y"] + 1
    np.save(root / "y.npy", changed)
    st = os.stat(root / "y.npy")
    os.utime(root / "y.npy", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(gpufeed.FailedPrecondition, match=r"files was .*y:y\.npy:") as e:
        client.attach(paths(root), kind="records", batch_size=4, job=job + "-2", start=(0, 1),
                      start_fingerprint=fingerprint)
    assert "x:x.npy" in str(e.value)
    # Another set of arrays over the same directory is another feed, refused too.
    with pytest.raises(gpufeed.FailedPrecondition, match=r"tensors was x:\S+ y:\S+ w:uint8\[5\]"):
        client.attach(paths(root, ("x", "y")), kind="records", batch_size=4, job=job + "-3",
                      start=(0, 1), start_fingerprint=fingerprint)
    # A file beside them that is not one of them changes nothing.
    with client.attach(paths(root), kind="records", batch_size=4, job=job + "-4") as s:
        fingerprint = s.fingerprint
    (root / "checkpoint.pt").write_bytes(b"\0" * 10)
    with client.attach(paths(root), kind="records", batch_size=4, job=job + "-5", start=(0, 1),
                       start_fingerprint=fingerprint) as s:
        assert s.fingerprint == fingerprint


def test_unequal_lengths_are_refused_naming_both_files(daemon, job, xy):
    root, arrays = xy
    np.save(root / "short.npy", arrays["y"][:-2])
    with pytest.raises(gpufeed.InvalidArgument) as e:
        gpufeed.Client(daemon.socket).attach({"x": root / "x.npy", "y": root / "short.npy"},
                                             kind="records", batch_size=4, job=job)
    message = str(e.value)
    assert f"{root}/x.npy (x) has {N} rows" in message
    assert f"{root}/short.npy (y) has {N - 2}" in message


@pytest.mark.parametrize("dataset, kind, error, match", [
    ({"x y": "x.npy"}, "records", gpufeed.InvalidArgument, r"dataset\.arrays\[0\]\.name: 'x y'"),
    ({"x": "x.npy", "0": "y.npy"}, "records", gpufeed.InvalidArgument,
     r"dataset\.arrays\[1\]\.name: '0'"),
    ({"x": "x.npy", "y": "missing.npy"}, "records", gpufeed.NotFound,
     r"dataset\.arrays\[1\] \(y\)"),
    ({"x": "x.npy", "y": "notes.txt"}, "records", gpufeed.InvalidArgument,
     r"dataset\.arrays\[1\] \(y\): .*notes\.txt"),
    ({"x": "x.npy", "y": "/tmp/elsewhere/y.npy"}, "records", gpufeed.InvalidArgument,
     r"arrays: 'x' .* and 'y' \(/tmp/elsewhere/y\.npy\) lie in different directories"),
    ({}, "records", gpufeed.InvalidArgument, "dataset: the mapping of names to .npy files is empty"),
    ({"x": "x.npy"}, "tokens", gpufeed.InvalidArgument,
     "dataset: a mapping of names to .npy files is for kind records"),
    ({"x": 3}, "records", gpufeed.InvalidArgument, r"dataset\['x'\]: want a path"),
])
def test_bad_inputs_are_refused_naming_the_field(daemon, job, xy, dataset, kind, error, match):
    root, _ = xy
    given = {name: (os.path.join(root, path) if isinstance(path, str) else path)
             for name, path in dataset.items()}
    with pytest.raises(error, match=match):
        gpufeed.Client(daemon.socket).attach(given, kind=kind, batch_size=4, job=job)


def test_too_many_arrays_are_refused(daemon, job, xy):
    root, _ = xy
    many = {f"a{i}": str(root / "y.npy") for i in range(33)}
    with pytest.raises(gpufeed.InvalidArgument, match="33 arrays, at most 32"):
        gpufeed.Client(daemon.socket).attach(many, kind="records", batch_size=4, job=job)


def test_the_single_file_form_is_unchanged(daemon, job, xy):
    root, arrays = xy
    with gpufeed.Client(daemon.socket).attach(str(root / "x.npy"), kind="records", batch_size=4,
                                              shuffle=False, job=job) as s:
        assert s.info.num_tensors == 1
        assert "arrays" not in s.fingerprint
        batch = next(iter(s))
        assert batch.numpy()["data"].tobytes() == arrays["x"][:4].tobytes()


@pytest.mark.parametrize("form", ["names", "paths"])
def test_gpufeedctl_consume_arrays_dumps_every_tensor(daemon, job, xy, tmp_path_factory, form):
    import subprocess

    root, arrays = xy
    out = tmp_path_factory.mktemp("dump") / "b"
    where = (["--dataset", str(root), "--arrays", "x=x.npy,y=y.npy"] if form == "names"
             else ["--arrays", f"x={root}/x.npy,y={root}/y.npy"])
    run = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "consume", "--kind", "records",
                          "--job", f"{job}-{form}", "--batch-size", "5", "--seed", "3",
                          "--max-batches", "1", "--dump", str(out)] + where,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    ids = np.load(f"{out}.ids.npy")
    assert ids.tolist() == reference.rank_slice(N, 3, 0, 0, 0, 1, 5)[0]
    for name in "xy":
        got = np.load(f"{out}.{name}.npy")
        assert got.dtype == arrays[name].dtype and got.tobytes() == arrays[name][ids].tobytes()
    bad = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "consume", "--kind", "records",
                          "--job", f"{job}-{form}-bad", "--batch-size", "5",
                          "--arrays", "x=x.npy,y"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--arrays: 'y' is not NAME=FILE" in bad.stderr


def _checksum(rows: np.ndarray) -> int:
    """gpufeedctl's checksum of `rows` (one sample a row): sum_j (j+1) * t_j over each row, t_j
    its j-th element read as an unsigned integer of its width, mod 2^64."""
    flat = rows.reshape(len(rows), -1)
    unsigned = flat.view(f"<u{flat.dtype.itemsize}") if flat.dtype.itemsize > 1 else flat.view("u1")
    weights = np.arange(1, unsigned.shape[1] + 1, dtype=object)
    return int(sum(int(np.dot(row.astype(object), weights)) for row in unsigned)) % (1 << 64)


def test_gpufeedctl_consume_checksums_every_tensor(daemon, job, xy, tmp_path_factory):
    """--checksum over a whole epoch of three arrays: "checksum" stays the first tensor's;
    "checksum.NAME" (and -o json's "checksums") gives each one's, equal to the sum computed
    here from the arrays and the ids the batches carried, so a wrong row of any array shows."""
    import json
    import subprocess

    root, arrays = xy
    ids_file = tmp_path_factory.mktemp("ids") / "ids.jsonl"
    base = [gpufeedctl(), "--socket", daemon.socket, "consume", "--kind", "records",
            "--batch-size", "4", "--seed", "5", "--epochs", "1", "--no-drop-last", "--checksum",
            "--dataset", str(root), "--arrays", "x=x.npy,y=y.npy,w=w.npy"]
    text = subprocess.run(base + ["--job", f"{job}-text", "--ids", str(ids_file)],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0, text.stderr
    valid = []
    for line in ids_file.read_text().splitlines():
        b = json.loads(line)
        valid += b["ids"][:b["valid"]]
    assert sorted(valid) == list(range(N))
    want = {name: _checksum(arrays[name][valid]) for name in "xyw"}
    lines = dict(line.split(" ", 1) for line in text.stdout.splitlines() if line.startswith("checksum"))
    assert lines == {"checksum": str(want["x"]), "checksum.x": str(want["x"]),
                     "checksum.y": str(want["y"]), "checksum.w": str(want["w"])}
    js = subprocess.run(base + ["--job", f"{job}-json", "-o", "json"], capture_output=True,
                        text=True, timeout=60)
    assert js.returncode == 0, js.stderr
    out = json.loads(js.stdout.strip().splitlines()[-1])
    assert out["checksum"] == want["x"] and out["checksums"] == want


def test_gpufeedctl_consume_json_is_json_for_any_dataset_path(daemon, job, tmp_path):
    """-o json's fingerprint is a JSON string whatever the path holds (a quote, a backslash,
    non-ASCII): json.loads reads it back, naming the path."""
    import json
    import subprocess

    odd = tmp_path / "it's \"odd\" \\ café"
    odd.mkdir()
    np.save(odd / "r.npy", np.arange(40, dtype=np.int32).reshape(20, 2))
    run = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "consume", "--kind", "records",
                          "--job", job, "--batch-size", "4", "--max-batches", "2", "--checksum",
                          "--dataset", str(odd / "r.npy"), "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert f"path={odd / 'r.npy'};" in out["position"]["fingerprint"]
    assert out["checksums"] == {"data": out["checksum"]}
