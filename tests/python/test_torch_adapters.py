"""gpufeed.torch.Loader's adapters: one lazy attach, pickling and spawn, fork
safety, the IterableDataset adapter, and image_folder class names."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
import reference  # noqa: E402

N = 157  # rows of the records dataset
OPTS = dict(kind="records", batch_size=10, seed=5)


def _loader(daemon, datasets, job, **kw):
    kw = dict(OPTS, **kw)
    kw.setdefault("device", "cpu")
    kw.setdefault("timeout", 20)
    return gpufeed.torch.Loader(datasets.records, socket=daemon.socket, job=job, **kw)


def _ids(epoch, steps=range(15)):
    return [reference.rank_slice(N, 5, epoch, s, 0, 1, 10)[0] for s in steps]


def _attaches(daemon, job):
    """The daemon's attach lines for `job`: [(epoch, step) it started at]."""
    pattern = re.compile(r"attach: session \d+ uid \d+ job '" + re.escape(job)
                         + r"' rank .* start \((\d+), (\d+)\)")
    return [(int(m[1]), int(m[2])) for m in pattern.finditer(daemon.log.read_text())]


def _wait(pid, seconds=10):
    """The exit code of child `pid`; fails (after killing it) if it runs longer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child ran over {seconds} s")


# ---- lazy attach ----


def test_load_state_dict_before_iterating_attaches_once_at_the_loaded_position(
        daemon, job, datasets):
    with _loader(daemon, datasets, job + "-saver") as saver:
        list(saver)  # epoch 0, then 4 steps of epoch 1
        it = iter(saver)
        for _ in range(4):
            next(it)
        state = saver.state_dict()
    assert (state["epoch"], state["step"]) == (1, 4)
    loader = _loader(daemon, datasets, job)
    assert _attaches(daemon, job) == []  # making a loader contacts nothing
    assert repr(loader).endswith("position=(0, 0), not attached)")
    loader.load_state_dict(state)
    loader.set_epoch(1)  # the usual loop's call keeps the loaded step
    with loader:
        assert [b.ids.tolist() for b in loader] == _ids(1, range(4, 15))
        assert len(loader) == 15
        assert [b.ids.tolist() for b in loader] == _ids(2)  # the next epoch, same session
    assert _attaches(daemon, job) == [(1, 4)]


def test_len_attaches_once_and_iterating_after_uses_that_session(daemon, job, datasets):
    with _loader(daemon, datasets, job) as loader:
        assert len(loader) == 15 and loader.info.num_samples == N
        assert loader.state_dict()["fingerprint"].startswith("kind=")
        assert [b.ids.tolist() for b in loader] == _ids(0)
    assert _attaches(daemon, job) == [(0, 0)]


# ---- pickling ----


def _iterate_in_child(loader, queue):
    """A spawned child: the ids of the rest of the loader's epoch."""
    try:
        with loader:
            queue.put([b.ids.tolist() for b in loader])
    except BaseException as e:  # the parent shows it
        queue.put(repr(e))


def test_a_pickle_carries_the_configuration_and_position_only(daemon, job, datasets):
    loader = _loader(daemon, datasets, job, ring_slots=2)
    it = iter(loader)
    head = [next(it).ids.tolist() for _ in range(3)]
    data = pickle.dumps(loader)  # attached: the pickle still holds no session
    assert b"libgpufeed_c" not in data
    del it
    loader.close()
    copy = pickle.loads(data)
    assert (copy.position, copy.job, copy.device) == ((0, 3), job, torch.device("cpu"))
    assert repr(copy).endswith("not attached)")
    with copy:
        assert head + [b.ids.tolist() for b in copy] == _ids(0)
    assert _attaches(daemon, job) == [(0, 0), (0, 3)]


def test_a_spawned_child_iterates_the_loader_it_was_given(daemon, job, datasets):
    loader = _loader(daemon, datasets, job)
    loader.load_state_dict({"epoch": 2, "step": 10})
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_iterate_in_child, args=(loader, queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(30)
    assert child.exitcode == 0
    assert got == _ids(2, range(10, 15))
    assert _attaches(daemon, job) == [(2, 10)]  # the child's; the parent never attached


# ---- fork ----


def test_a_forked_child_cannot_use_the_parents_session(daemon, job, datasets):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, ring_slots=2) as loader:
        it = iter(loader)
        first = next(it)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                messages = []
                # The running iterator first: a new iter() would end it.
                for attempt in (lambda: next(it), lambda: next(iter(loader)),
                                lambda: next(iter(loader.as_dataset()))):
                    try:
                        attempt()
                    except gpufeed.FailedPrecondition as e:
                        messages.append(str(e))
                first.release()  # a no-op: the slot is the parent's
                loader.close()  # forgets the parent's session without detaching it
                os.write(write, json.dumps(messages).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        assert _wait(pid) == 0
        with os.fdopen(read) as f:
            messages = json.load(f)
        assert messages == [
            f"gpufeed.torch.Loader: the session belongs to process {os.getpid()}, which "
            f"attached it; this process ({pid}) is a fork of it and cannot use it: make a new "
            "Loader in the child, or give the child one that has not attached yet (or a "
            "pickled one: a pickle carries no session)"] * 3
        # The parent's session goes on, its held batch untouched.
        assert first.in_place and not first.released
        assert np.array_equal(first["data"].numpy(), expected[first.ids])
        assert [b.ids.tolist() for b in it] == _ids(0, range(1, 15))


_FORK_SCRIPT = r"""
import json, os, sys, time
import gpufeed, gpufeed.torch

def make(job):
    return gpufeed.torch.Loader(sys.argv[1], kind="records", batch_size=10, seed=5,
                                device="cpu", socket=sys.argv[2], job=job, timeout=20)

def in_child(loader):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                out = [b.ids.tolist() for b in loader]
                loader.close()
            except gpufeed.Error as e:
                out = f"{type(e).__name__}: {e}"
            os.write(write, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    deadline = time.monotonic() + 10
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            return "the child hung"
        time.sleep(0.02)
    with os.fdopen(read) as f:
        return json.load(f)

first = make(sys.argv[3])  # never attached here: the child attaches it itself
result = {"child": in_child(first), "parent_repr": repr(first)}
with make(sys.argv[3] + "-parent") as parent:
    len(parent)  # this process talks to gpufeedd now; a fork of it may not
    result["after"] = in_child(make(sys.argv[3] + "-late"))
    result["pid"] = os.getpid()
print(json.dumps(result))
"""


def test_a_forked_child_attaches_a_loader_the_parent_did_not(daemon, job, datasets, tmp_path):
    """In a fresh process (pytest's own already talks to gpufeedd): a child forked before the
    parent's first attach iterates an unattached loader; one forked after is refused at once,
    never left hanging in gRPC."""
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script), str(datasets.records), daemon.socket,
                          job], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["child"] == _ids(0)
    assert result["parent_repr"].endswith("not attached)")
    assert re.fullmatch(
        r"FailedPrecondition: attach: this process \(\d+\) was forked from process "
        + str(result["pid"]) + r", which had already connected to gpufeedd; gRPC cannot "
        r"connect again in a forked child \(it would hang\): fork before the first "
        r"connection, or start the child with the spawn method "
        r"\(multiprocessing.get_context\('spawn'\); a gpufeed.torch.Loader pickles as its "
        r"configuration\)", result["after"])
    assert _attaches(daemon, job) == [(0, 0)]  # the child's
    assert _attaches(daemon, job + "-late") == []


# ---- IterableDataset ----


def test_iterable_dataset_yields_the_loaders_batches(daemon, job, datasets):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, ring_slots=2) as loader:
        data = torch.utils.data.DataLoader(loader.as_dataset(), batch_size=None,
                                           collate_fn=gpufeed.torch.IterableDataset.collate)
        assert len(data) == 15
        held = []
        for b in data:
            assert type(b) is gpufeed.torch.Batch and b.in_place
            held.append(b)  # the loader moves older ones out of its 2-slot ring, as usual
        assert [b.ids.tolist() for b in held] == _ids(0)
        assert [b.in_place for b in held] == [False] * 13 + [True] * 2
        for b in held:
            assert np.array_equal(b["data"].numpy(), expected[b.ids])
        # The loader goes on with the next epoch, through the dataset as by itself.
        assert [b.ids.tolist() for b in loader] == _ids(1)


AS_DATALOADER = ("use DataLoader(loader.as_dataset(), batch_size=None, "
                 "collate_fn=gpufeed.torch.IterableDataset.collate)")


def test_iterable_dataset_refuses_a_dataloader_that_batches_again(daemon, job, datasets):
    """DataLoader(loader.as_dataset()) (batch_size 1 by default) stacked whole
    batches into [1, 10, ...] tensors; now iter() refuses it before the loader attaches,
    naming the call that works, as it does batch_size=None without the collate_fn (torch's
    default_convert iterates a mapping, and a batch iterates its tensors)."""
    loader = _loader(daemon, datasets, job)
    ds = loader.as_dataset()
    refusals = {
        "default": (torch.utils.data.DataLoader(ds),
                    "gpufeed.torch.IterableDataset: DataLoader(batch_size=1): each item is "
                    "already a whole batch of the loader's batch_size, so torch would stack "
                    "batches into [n, batch_size, ...] tensors; " + AS_DATALOADER),
        "batch_size=4 with our collate": (
            torch.utils.data.DataLoader(ds, batch_size=4,
                                        collate_fn=gpufeed.torch.IterableDataset.collate),
            "gpufeed.torch.IterableDataset: DataLoader(batch_size=4): each item is already"),
        "no collate_fn": (torch.utils.data.DataLoader(ds, batch_size=None),
                          "gpufeed.torch.IterableDataset: DataLoader(batch_size=None) without a "
                          "collate_fn: torch's default_convert would rebuild each batch by "
                          "iterating it as a mapping (a batch iterates its tensors: images, "
                          "labels = batch); " + AS_DATALOADER),
    }
    for name, (data, message) in refusals.items():
        with pytest.raises(gpufeed.InvalidArgument) as e:
            next(iter(data))
        assert str(e.value).startswith(message), (name, str(e.value))
        assert isinstance(e.value, ValueError)  # InvalidArgument is a ValueError
    assert _attaches(daemon, job) == []  # refused before the loader attached
    # Batched again some other way (torch's default_collate called on our batches, the
    # collate_fn handed a list): the same message, never stacked tensors.
    with loader:
        it = iter(loader)
        two = [next(it), next(it)]
        with pytest.raises(gpufeed.InvalidArgument,
                           match=re.escape("default_collate of 2 gpufeed.torch.Batch items (a "
                                           "DataLoader with a batch_size): each item is "
                                           "already a whole batch")):
            torch.utils.data.default_collate(two)
        with pytest.raises(gpufeed.InvalidArgument,
                           match=re.escape("collate got a list of 2 batches")):
            gpufeed.torch.IterableDataset.collate(two)
        # Looking a batch up by what it iterates (as default_convert does): a TypeError
        # that says why, not a KeyError on a tensor.
        with pytest.raises(TypeError, match=re.escape(
                "gpufeed.torch.Batch: looked up by a tensor: iterating a batch yields its "
                "tensors (images, labels = batch), not its names; use batch.keys()")):
            torch.utils.data.default_convert(two[0])


def test_iterable_dataset_refuses_dataloader_workers(daemon, job, datasets):
    ds = _loader(daemon, datasets, job).as_dataset()
    it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    try:
        next(it)
        pytest.fail("DataLoader workers iterated a gpufeed.torch.IterableDataset")
    except gpufeed.InvalidArgument as e:  # re-raised from the worker, as its type
        message = str(e)
    # Now (torch's own teardown, private): a later garbage collection would wait 10 s.
    it._shutdown_workers()
    assert re.search(r"gpufeed.torch.IterableDataset: iterated in DataLoader worker [01] of 2; "
                     r"pass num_workers=0: gpufeedd already reads, decodes and batches in its "
                     r"own workers, and each DataLoader worker would be another consumer of "
                     r"this rank's stream", message)
    assert _attaches(daemon, job) == []  # no worker attached
    with pytest.raises(gpufeed.InvalidArgument,
                       match="IterableDataset: want a gpufeed.torch.Loader, got list"):
        gpufeed.torch.IterableDataset([])


# ---- image_folder classes ----


def test_classes_are_the_labels_the_daemon_delivers(daemon, job, tmp_path):
    """Class folders created out of order, in byte order Cat < ant < dog; a file and a link to
    a folder beside them are no class (a link sorting first would shift every label); a
    nested folder's images belong to its top-level class. Each image is one flat colour, so
    a delivered row names its file."""
    root = tmp_path / "tree"
    files = ["dog/a.png", "dog/sub/deep.png", "Cat/x.png", "Cat/y.png", "ant/q.png"]
    for value, name in enumerate(files, start=1):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        reference.write_png(root / name, np.full((4, 6, 3), value * 20, dtype=np.uint8))
    (root / "notes.txt").write_text("not a class")
    (root / "AAA_link").symlink_to(root / "ant", target_is_directory=True)
    ops = [{"center_crop": {"size": 4}}, {"cast": {"dtype": "DTYPE_UINT8"}},
           {"layout": {"layout": "IMAGE_LAYOUT_NCHW"}}]
    with gpufeed.torch.Loader(root, kind="image_folder", pipeline=ops, batch_size=2, seed=3,
                              drop_last=False, device="cpu", socket=daemon.socket, job=job,
                              timeout=20) as loader:
        assert loader.classes == ["Cat", "ant", "dog"]
        assert loader.class_to_idx == {"Cat": 0, "ant": 1, "dog": 2}
        seen = []
        for b in loader:
            for row in range(b.valid_count):
                name = files[int(b["image"][row, 0, 0, 0]) // 20 - 1]
                assert b["label"][row].item() == loader.class_to_idx[name.split("/")[0]], name
                seen.append(name)
    assert sorted(seen) == sorted(files)


def test_classes_need_an_image_folder(daemon, job, datasets, tmp_path):
    loader = _loader(daemon, datasets, job)
    assert not hasattr(loader, "classes")
    with pytest.raises(AttributeError,
                       match=re.escape("classes: a records dataset has no classes "
                                       "(image_folder only)")):
        loader.class_to_idx
    missing = gpufeed.torch.Loader(tmp_path / "none", kind="image_folder", batch_size=1,
                                   device="cpu", socket=daemon.socket, job=job)
    with pytest.raises(gpufeed.NotFound) as e:
        missing.classes
    assert str(e.value) == f"classes: cannot list {tmp_path / 'none'}: No such file or directory"


def test_classes_equal_torchvision_image_folder(daemon, job, datasets):
    torchvision = pytest.importorskip("torchvision")
    if "tv_standin" in (getattr(torchvision, "__file__", "") or ""):
        pytest.skip("torchvision is not installed (the pipeline tests' stand-in has no datasets)")
    loader = gpufeed.torch.Loader(datasets.images, kind="image_folder", batch_size=1,
                                  device="cpu", socket=daemon.socket, job=job)
    assert loader.class_to_idx == torchvision.datasets.ImageFolder(datasets.images).class_to_idx
