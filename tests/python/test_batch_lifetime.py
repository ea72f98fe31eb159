"""A batch the user still holds is never recycled (gpufeed.torch.Loader, host and device).

Every test compares each batch it holds with the file, byte for byte, after the loader has
gone on: the slot of a batch still referenced is never refilled. When the ring is full of
held batches the loader moves one whose tensors only its dict reaches into owned memory, or
raises ResourceExhausted when every held batch has tensors referenced outside its dict.
Device variants skip without a CUDA device, saying so."""

from __future__ import annotations

import collections
import gc
import os
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
import reference  # noqa: E402

_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(
    not _CUDA, reason="no CUDA device visible to torch: device delivery not tested"))]

N = 157  # rows of datasets.records; batches of 10: 15 a epoch


def _loader(daemon, datasets, job, device, **kw):
    kw.setdefault("batch_size", 10)
    kw.setdefault("timeout", 20)
    kw.setdefault("seed", 3)
    return gpufeed.torch.Loader(datasets.records, kind="records", socket=daemon.socket,
                                job=job, device=device, **kw)


def _host(x):
    return x.cpu().numpy() if x.device.type == "cuda" else x.numpy()


def _assert_exact(batch, expected):
    """The batch's ids are the reference sampler's and its data the file's rows."""
    want_ids, valid = reference.rank_slice(N, 3, batch.epoch, batch.step, 0, 1, 10)
    assert (batch.ids.tolist(), batch.valid_count) == (want_ids, valid)
    assert _host(batch["data"]).tobytes() == expected[batch.ids].tobytes()


def _slow_stream(device):
    """Device: a kernel that keeps the current stream busy for a while, so that work queued
    after it (the loader's copies, the consumer's reads) runs late: a slot refilled before
    that work ran would show."""
    if device != "cpu":
        torch.cuda._sleep(20_000_000)


def _held_message(steps, ring):
    listed = ", ".join(str(s) for s in steps)
    many = len(steps) > 1
    return (f"gpufeed.torch.Loader: every slot of the ring ({ring}) holds a batch you still "
            f"reference through tensors or views taken out of it ({len(steps)} "
            f"batch{'es' if many else ''}: epoch 0 step{'s' if many else ''} {listed}), so "
            "the next batch has nowhere to go; drop those references (del, batch.release(), "
            "'with batch:'), keep .clone()s, or pass copy=True or more ring_slots")


# ---- list(loader) ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring", [1, 2, 3, None], ids=lambda r: f"ring{r}")
def test_list_of_a_loader_is_exact(daemon, job, datasets, device, ring):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=ring) as loader:
        slots = loader.info.ring_slots
        batches = list(loader)
        assert [(b.epoch, b.step) for b in batches] == [(0, s) for s in range(15)]
        for b in batches:
            assert not b.released
            _assert_exact(b, expected)
        # The loader moved the older batches into owned memory to make room; the last
        # `slots` are still views of the ring.
        assert [b.in_place for b in batches] == [i >= 15 - slots for i in range(15)]
    # Closing moved the rest out too: the ring is gone, every batch still exact.
    assert not any(b.in_place for b in batches)
    with _loader(daemon, datasets, job, device, ring_slots=ring) as again:
        for b in again:  # the same job, memory and shapes: had a batch stayed, it'd change
            _assert_exact(b, expected)
    for b in batches:
        _assert_exact(b, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_list_of_a_loader_that_is_garbage_at_once(daemon, job, datasets, device):
    expected = np.load(datasets.records)
    batches = list(_loader(daemon, datasets, job, device, ring_slots=2))
    assert len(batches) == 15 and not any(b.in_place for b in batches)
    # The loader was collected, its held batches copied and its session detached: the same
    # job attaches again, and its batches leave the first ones as they were.
    with _loader(daemon, datasets, job, device, ring_slots=2) as again:
        assert [b.step for b in again] == list(range(15))
    for b in batches:
        _assert_exact(b, expected)


# ---- holding every k-th batch ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_holding_every_kth_batch_keeps_it_exact(daemon, job, datasets, device, k):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=2) as loader:
        held = []
        for epoch in range(2):
            for b in loader:
                _slow_stream(device)
                if b.step % k == 0:
                    held.append(b)
                for h in held:  # every held batch, after the loader went on
                    _assert_exact(h, expected)
        assert len(held) == 2 * len(range(0, 15, k))
    for h in held:
        _assert_exact(h, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_holding_tensors_of_every_kth_batch_until_the_ring_is_full(daemon, job, datasets,
                                                                    device, k):
    """Tensors (or views) taken out of their batch cannot be moved: with 3 slots, the third
    one held fills the ring, and asking for one more batch raises instead of overwriting."""
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=3) as loader:
        kept = []  # (tensor or view, ids it holds)
        it = iter(loader)
        with pytest.raises(gpufeed.ResourceExhausted) as e:
            for b in it:
                _slow_stream(device)
                if b.step % k == 0:
                    x = b["data"] if b.step % 2 else b["data"][2:]  # a tensor, or a view
                    kept.append((x, b.ids if b.step % 2 else b.ids[2:], b.step))
                for x, ids, _ in kept:
                    assert _host(x).tobytes() == expected[ids].tobytes()
        assert type(e.value) is gpufeed.ResourceExhausted
        steps = [step for _, _, step in kept]
        assert steps == [0, k, 2 * k]
        assert str(e.value) == _held_message(steps, 3)
        # Raised before asking the daemon: the next batch is the one not yielded.
        assert loader.position == (0, 2 * k + 1)
        for x, ids, _ in kept:
            assert _host(x).tobytes() == expected[ids].tobytes()
        del kept, x, b, it
        rest = list(loader)  # dropped: the loader goes on where it stopped
        assert [r.step for r in rest] == list(range(2 * k + 1, 15))
        for r in rest:
            _assert_exact(r, expected)


# ---- prefetching ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring", [2, 3, None], ids=lambda r: f"ring{r}")
def test_prefetch_one_ahead_keeps_the_current_batch(daemon, job, datasets, device, ring):
    """Batch n's tensor is in use while n+1 is fetched: n stays exact, and nothing is
    copied (one batch held leaves a ring of 2 a slot to fill)."""
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=ring) as loader:
        it = iter(loader)
        current = next(it)
        x = current["data"]
        seen = 1
        for following in it:
            _slow_stream(device)
            assert current.in_place and following.in_place  # zero copy throughout
            assert _host(x).tobytes() == expected[current.ids].tobytes()
            _assert_exact(current, expected)
            current, x = following, following["data"]
            seen += 1
        assert seen == 15
        _assert_exact(current, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_two_ahead_in_a_two_slot_ring(daemon, job, datasets, device):
    """Two batches held (the oldest's tensor in use) while a third is fetched: the loader
    copies the batch only its dict holds, never the one in use."""
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=2) as loader:
        it = iter(loader)
        queue = collections.deque([next(it), next(it)])
        x = queue[0]["data"]
        steps = []
        for b in it:
            _slow_stream(device)
            queue.append(b)
            assert queue[0]["data"] is x  # its tensor is in use: never swapped for a copy
            assert _host(x).tobytes() == expected[queue[0].ids].tobytes()
            for q in queue:
                _assert_exact(q, expected)
            steps.append(queue.popleft().step)
            x = queue[0]["data"]
        assert steps == list(range(13))


# ---- release, close, attach anew ----


@pytest.mark.parametrize("device", DEVICES)
def test_release_and_with_return_the_slot(daemon, job, datasets, device):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=1) as loader:
        it = iter(loader)
        for step in range(4):  # a 1-slot ring: each slot back on leaving `with`, no copy
            with next(it) as b:
                x = b["data"]
                assert (b.step, b.in_place, b.released) == (step, True, False)
                _assert_exact(b, expected)
            assert b.released
        b = next(it)
        b.release()
        b.release()  # idempotent
        assert b.released
        b = next(it)
        x = b["data"]  # held outside the dict: a 1-slot ring cannot go on
        with pytest.raises(gpufeed.ResourceExhausted) as e:
            next(it)
        assert str(e.value) == _held_message([5], 1)
        _assert_exact(b, expected)
        b.release()
        del x, b
        assert next(iter(loader)).step == 6


def test_a_view_keeps_the_slot_and_garbage_returns_it(daemon, job, datasets):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, "cpu", ring_slots=2) as loader:
        it = iter(loader)
        b = next(it)
        lease = weakref.ref(b._lease)
        ids = b.ids.copy()
        view = b["data"][3:].view(torch.float64)[1]  # a view of a view, another dtype
        del b
        gc.collect()
        assert lease() is not None  # the view still reads the slot
        for _ in range(14):  # the rest of the epoch, in the other slot
            next(it)
        assert view.view(torch.int64).numpy().tobytes() == expected[ids[4]].tobytes()
        del view
        assert lease() is None  # the last view gone: the slot went back


# ---- batches of several tensors: one carrier a batch (host delivery) ----

M = 43  # rows of the xyw arrays; batches of 10: 5 a epoch, the last short (3 rows)


@pytest.fixture
def xyw(tmp_path):
    """Records of several arrays: x float32 [M, 3, 4], y int64 [M], w uint8 [M, 5] (rows of
    odd bytes), each row's values its own."""
    rng = np.random.default_rng(7)
    arrays = {"x": rng.standard_normal((M, 3, 4)).astype(np.float32),
              "y": rng.integers(-(1 << 40), 1 << 40, size=M, dtype=np.int64),
              "w": rng.integers(0, 256, size=(M, 5), dtype=np.uint8)}
    for name, a in arrays.items():
        np.save(tmp_path / f"{name}.npy", a)
    return {name: str(tmp_path / f"{name}.npy") for name in arrays}, arrays


def _xyw_loader(daemon, job, paths, device, **kw):
    return gpufeed.torch.Loader(paths, kind="records", socket=daemon.socket, job=job,
                                device=device, batch_size=10, seed=3, timeout=20, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_each_tensor_of_a_batch_of_several_is_its_rows_in_place(daemon, job, xyw, device,
                                                                monkeypatch):
    """Host delivery makes a batch's tensors as views of one carrier over the slot (never
    through gpufeed.Tensor.view, the per-tensor path, made to fail here; device delivery
    takes that path): each has its dtype, shape and strides, its file's rows byte for byte,
    the short last batch its first rows; copy=True gives the same values, owned."""
    paths, arrays = xyw

    def per_tensor(*args, **kwargs):
        raise AssertionError("the per-tensor path was taken")

    if device == "cpu":
        monkeypatch.setattr(gpufeed.client.Tensor, "view", per_tensor)
    for copy in (False, True):
        with _xyw_loader(daemon, job, paths, device, drop_last=False, copy=copy) as loader:
            batches = list(loader)
            assert [b.valid_count for b in batches] == [10, 10, 10, 10, 3]
            for b in batches:
                assert b.in_place != copy
                for name, a in arrays.items():
                    want = a[b.ids]
                    x = b[name]
                    assert x.device == torch.device(device)
                    assert x.dtype == torch.from_numpy(want).dtype
                    assert tuple(x.shape) == want.shape and x.is_contiguous()
                    assert _host(x).tobytes() == want.tobytes(), (name, b.step)
                assert b["valid"].tolist() == [True] * b.valid_count
            del batches, b, x  # the next loader attaches as the same job


@pytest.mark.parametrize("device", DEVICES)
def test_a_view_of_one_tensor_of_a_batch_of_several_keeps_the_slot(daemon, job, xyw, device,
                                                                   monkeypatch):
    """The batch's tensors share one carrier holding the slot's lease (host delivery; the
    per-tensor path, made to fail there, is device delivery's): a view of a view of one of
    them, the batch and its other tensors dropped, keeps the slot unrefilled while the rest
    of the epoch goes through the other slot; dropping it returns the slot."""
    paths, arrays = xyw
    if device == "cpu":
        def per_tensor(*args, **kwargs):
            raise AssertionError("the per-tensor path was taken")

        monkeypatch.setattr(gpufeed.client.Tensor, "view", per_tensor)
    with _xyw_loader(daemon, job, paths, device, ring_slots=2) as loader:
        it = iter(loader)
        b = next(it)
        lease = weakref.ref(b._lease)
        want = arrays["y"][b.ids][2:].view(np.int32)[1:].tobytes()
        view = b["y"][2:].view(torch.int32)[1:]  # a view of a view, another dtype
        w = b["w"][::2]
        want_w = arrays["w"][b.ids][::2].tobytes()
        del b
        gc.collect()
        assert lease() is not None  # the views still read the slot
        rest = [s.step for s in it]  # the rest of the epoch, in the other slot
        assert rest == [1, 2, 3]
        _slow_stream(device)  # device: reads queued behind a slow kernel, as a late refill's
        assert _host(view).tobytes() == want
        assert _host(w).tobytes() == want_w
        del w
        gc.collect()
        assert lease() is not None  # one view is enough
        assert _host(view).tobytes() == want
        del view
        gc.collect()
        assert lease() is None  # the last view gone: the slot went back


@pytest.mark.parametrize("device", DEVICES)
def test_close_keeps_a_referenced_batch_until_it_is_garbage(daemon, job, datasets, device):
    expected = np.load(datasets.records)
    loader = _loader(daemon, datasets, job, device, ring_slots=2)
    it = iter(loader)
    first = next(it)
    x, ids = first["data"][1:], first.ids[1:]
    second = next(it)
    del first, it
    loader.close()
    assert not second.in_place  # moved into owned memory
    # `x` still views the first slot: the session stays attached, so another session of the
    # same shape does not get that memory.
    with _loader(daemon, datasets, job + "-other", device, ring_slots=2) as other:
        for b in other:
            _assert_exact(b, expected)
    assert _host(x).tobytes() == expected[ids].tobytes()
    _assert_exact(second, expected)
    with pytest.raises(gpufeed.AlreadyExists) as e:
        len(_loader(daemon, datasets, job, device, ring_slots=2))  # len() attaches
    assert str(e.value) == (
        f"attach: job '{job}' rank 0 is already attached: by a closed gpufeed.torch.Loader "
        "of this process, which stays attached while you reference its batches through "
        "tensors or views taken out of them (1 batch: epoch 0 step 0); drop those references "
        "or keep .clone()s")
    del x
    with _loader(daemon, datasets, job, device, ring_slots=2) as again:  # detached now
        assert next(iter(again)).step == 0


@pytest.mark.parametrize("device", DEVICES)
def test_attaching_anew_moves_held_batches_or_refuses(daemon, job, datasets, device):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, device, ring_slots=3) as loader:
        it = iter(loader)
        kept = next(it)
        x = next(it)["data"][2:]  # a view: it keeps the slot, and torch cannot move it
        x_ids = reference.rank_slice(N, 3, 0, 1, 0, 1, 10)[0][2:]
        y = next(it)["data"]  # the batch's own tensor object, taken out: moved where it is
        y_ids = reference.rank_slice(N, 3, 0, 2, 0, 1, 10)[0]
        y_ptr = y.data_ptr()
        del it
        loader.set_epoch(2)  # another position: the next iter() attaches anew
        with pytest.raises(gpufeed.FailedPrecondition) as e:
            next(iter(loader))
        assert str(e.value) == (
            "gpufeed.torch.Loader: going to epoch 2 step 0 attaches anew and ends the "
            "session at epoch 0 step 3, whose ring still holds batches you reference through "
            "views taken of their tensors (1 batch: epoch 0 step 1; the tensors themselves "
            "were moved out); drop those views (del) or keep .clone()s, then iterate again")
        assert not kept.in_place  # the batch only its dict held was moved out already
        assert y.data_ptr() != y_ptr  # the same object, now owning a copy
        assert _host(y).tobytes() == expected[y_ids].tobytes()
        assert loader.position == (2, 0)
        assert _host(x).tobytes() == expected[x_ids].tobytes()
        del x
        batches = list(loader)
        assert [(b.epoch, b.step) for b in batches] == [(2, s) for s in range(15)]
        for b in batches:
            _assert_exact(b, expected)
        _assert_exact(kept, expected)
        assert _host(y).tobytes() == expected[y_ids].tobytes()


# ---- fork ----


def test_a_forked_child_never_releases_the_parents_batches(daemon, job, datasets):
    """The child inherits held batches (a dict, a tensor), reads them, drops them, closes
    its copy of the loader and exits; the parent's session goes on, its batches exact."""
    expected = np.load(datasets.records)
    with _loader(daemon, datasets, job, "cpu", ring_slots=2) as loader:
        it = iter(loader)
        kept = next(it)
        x, x_ids = next(it)["data"], reference.rank_slice(N, 3, 0, 1, 0, 1, 10)[0]
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ok = (kept["data"].numpy().tobytes() == expected[kept.ids].tobytes()
                      and x.numpy().tobytes() == expected[x_ids].tobytes())
                kept.release()  # a no-op in the child
                del kept, x, it
                loader.close()  # forgets the parent's session without detaching it
                del loader
                gc.collect()
                code = 0 if ok else 3
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert kept.in_place and not kept.released
        held = [kept]
        for b in it:  # the parent's session still serves; a full ring moves `kept` out
            held.append(b)
            assert x.numpy().tobytes() == expected[x_ids].tobytes()
            for h in held:
                _assert_exact(h, expected)
        assert len(held) == 14 and not kept.in_place


@pytest.mark.skipif(not _CUDA, reason="no CUDA device visible to torch: device delivery "
                                      "not tested")
def test_device_slot_goes_back_after_the_work_queued_on_the_stream(daemon, job, datasets):
    """Each batch is read by a kernel queued behind a slow one, then dropped: its slot goes
    back only after that read ran, so every sum is its own batch's."""
    expected = np.load(datasets.records)
    stream = torch.cuda.Stream(0)
    with torch.cuda.stream(stream), _loader(daemon, datasets, job, "cuda:0",
                                            ring_slots=2) as loader:
        sums = []
        for b in loader:
            torch.cuda._sleep(50_000_000)  # the read below runs well after the loop moved on
            sums.append((b.ids, b["data"].sum()))
        stream.synchronize()
    assert [int(s.item()) for _, s in sums] == [int(expected[ids].sum()) for ids, _ in sums]
