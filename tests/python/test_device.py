"""Device delivery through gpufeed.torch (needs a GPU that gpufeedd sees; skips otherwise):
tensors on cuda:0 that are views of the session's device ring, with the expected values,
ordered on the consumer's stream."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch: device delivery not tested",
                allow_module_level=True)

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:gpufeed. torch .* has no uint")


def _loader(daemon, dataset, **kw):
    kw.setdefault("timeout", 20)
    return gpufeed.torch.Loader(dataset, socket=daemon.socket, **kw)


def test_core_batches_lie_in_the_device_ring(daemon, job, datasets):
    expected = np.load(datasets.records)
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=4,
                                              delivery="device", gpu="cuda:0", ring_slots=3,
                                              job=job) as s:
        slots = {}
        for _ in range(12):
            batch = s.next(timeout=20)
            t = batch.tensors["data"]
            assert (t.device, t.device_id) == ("cuda", 0)
            batch.wait_ready(torch.cuda.current_stream(0).cuda_stream)
            x = torch.as_tensor(t, device="cuda:0")
            assert x.data_ptr() == t.data_ptr  # a view of the slot, no copy
            assert np.array_equal(x.cpu().numpy(), expected[batch.ids])
            slots.setdefault(batch.slot, t.data_ptr)
            assert slots[batch.slot] == t.data_ptr  # a slot is always the same memory
            batch.release(torch.cuda.current_stream(0).cuda_stream)
        assert sorted(slots) == [0, 1, 2]
        # One ring: the slots are equally spaced in one allocation.
        base = slots[0]
        stride = slots[1] - base
        assert stride >= 4 * 15 * 8 and slots[2] - base == 2 * stride


@pytest.mark.parametrize("on_side_stream", [False, True], ids=["current", "side_stream"])
def test_loader_device_tensors_are_views_with_expected_values(daemon, job, datasets,
                                                              on_side_stream):
    expected = np.load(datasets.records)
    stream = torch.cuda.Stream(0) if on_side_stream else torch.cuda.current_stream(0)
    before = torch.cuda.memory_allocated(0)
    with torch.cuda.stream(stream), _loader(daemon, datasets.records, kind="records",
                                            batch_size=4, ring_slots=3, job=job) as loader:
        assert loader.device == torch.device("cuda", 0)
        pointers = set()
        for i, b in zip(range(30), loader):
            x = b["data"]
            assert x.device == torch.device("cuda", 0) and x.dtype == torch.int64
            assert torch.cuda.memory_allocated(0) == before  # nothing allocated by torch
            pointers.add(x.data_ptr())
            # A kernel queued on `stream`, after the loader's wait for the batch.
            assert x.sum().item() == int(expected[b.ids].sum())
            assert np.array_equal(x.cpu().numpy(), expected[b.ids])
        assert len(pointers) == 3  # the ring's three slots, over and over


def test_loader_device_tokens(daemon, job, datasets):
    with _loader(daemon, datasets.tokens_u16, kind="tokens", token_dtype="uint16",
                 seq_len=datasets.seq_len, batch_size=8, job=job, drop_last=False) as loader:
        rows = []
        for b in loader:
            tokens = b["tokens"]
            assert tokens.device == torch.device("cuda", 0)
            assert tokens.shape == (b.valid_count, datasets.seq_len + 1) == (len(b.ids),
                                                                               tokens.shape[1])
            want = datasets.token_rows("uint16", b.ids).astype(np.int64)
            assert np.array_equal(tokens.long().cpu().numpy(), want)
            assert b["valid"].device == tokens.device
            assert b["valid"].tolist() == [True] * b.valid_count
            rows.append(b.valid_count)
        # One rank: the last batch is short (203 windows = 25 x 8 + 3), as a DataLoader's.
        assert rows == [8] * 25 + [3] and len(loader) == 26


def test_loader_device_copy(daemon, job, datasets):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets.records, kind="records", batch_size=4, ring_slots=2,
                 job=job, copy=True) as loader:
        held = [b for _, b in zip(range(10), loader)]
    for b in held:
        assert np.array_equal(b["data"].cpu().numpy(), expected[b.ids])


def test_records_of_several_arrays_land_on_the_device_byte_exact(daemon, job, tmp_path):
    """x float32 [N, 3, 4] and y int64 [N] in one feed, delivered to cuda:0; every
    tensor of every batch equals the arrays' rows of its ids."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, 3, 4)).astype(np.float32)
    y = rng.integers(-(1 << 40), 1 << 40, size=37, dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    with _loader(daemon, {"x": str(tmp_path / "x.npy"), "y": str(tmp_path / "y.npy")},
                 kind="records", batch_size=5, seed=2, ring_slots=3, job=job) as loader:
        assert loader.device == torch.device("cuda", 0)
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen = []
            for b in loader:
                assert sorted(b.keys()) == ["x", "y"]
                bx, by = b  # unpacks in the mapping's order
                assert bx is b["x"] and by is b["y"]
                assert b["x"].device == torch.device("cuda", 0) and b["x"].shape == (5, 3, 4)
                ids = b.ids.tolist()
                assert torch.equal(b["x"].cpu(), torch.from_numpy(x[ids]))
                assert torch.equal(b["y"].cpu(), torch.from_numpy(y[ids]))
                seen += ids
            assert len(set(seen)) == len(seen) == 35
