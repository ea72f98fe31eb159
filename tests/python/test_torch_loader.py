"""gpufeed.torch.Loader against a real gpufeedd, host delivery: exact ids across ranks, exact
resume, byte-exact tensors, slot lifetime, images through a pipeline, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
import reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:gpufeed. torch .* has no uint")


def _loader(daemon, dataset, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("timeout", 20)
    return gpufeed.torch.Loader(dataset, socket=daemon.socket, **kw)


def _expected_rows(datasets, kind, token_dtype, ids):
    if kind == "tokens":
        return datasets.token_rows(token_dtype, ids).astype(np.int64)
    return reference.records_rows(datasets.records, ids)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("drop_last", [True, False], ids=["drop_last", "pad"])
@pytest.mark.parametrize("kind, token_dtype", [("records", None), ("tokens", "uint16"),
                                               ("tokens", "uint32")])
def test_exactly_once_across_ranks(daemon, job, datasets, world, drop_last, kind, token_dtype):
    batch, seed = 7, 1234
    if kind == "tokens":
        dataset, n = datasets.tokens(token_dtype)[0], 203
        extra = dict(seq_len=datasets.seq_len, token_dtype=token_dtype)
        name = "tokens"
    else:
        dataset, n, extra, name = datasets.records, 157, {}, "data"
    loaders = [_loader(daemon, dataset, kind=kind, batch_size=batch, seed=seed, rank=r,
                       world_size=world, job=job, drop_last=drop_last, **extra)
               for r in range(world)]
    expected = reference.expected_epoch(n, seed, 0, world, batch, drop_last)
    steps = reference.steps_per_epoch(n, batch, world, drop_last)
    seen = []
    try:
        for rank, loader in enumerate(loaders):
            assert len(loader) == steps
            got = 0
            for step, b in enumerate(loader):
                ids, valid = expected[rank][step]
                assert (b.epoch, b.step, b.valid_count) == (0, step, valid)
                assert b.ids.tolist() == ids
                want = sorted([name] if drop_last else [name, "valid"])
                assert sorted(b.keys()) == want
                x = b[name]
                assert x.shape[0] == batch and x.device.type == "cpu"
                # Byte-exact against numpy on the same file (tokens: the unsigned values).
                assert np.array_equal(x.numpy().astype(np.int64),
                                      _expected_rows(datasets, kind, token_dtype, ids))
                if not drop_last:
                    assert b["valid"].dtype == torch.bool
                    assert b["valid"].tolist() == [i < valid for i in range(batch)]
                seen.extend(ids[:valid])
                got += 1
            assert got == steps
            assert loader.position == (1, 0)
    finally:
        for loader in loaders:
            loader.close()
    # Every sample at most once; with padding every sample exactly once.
    assert len(seen) == len(set(seen))
    perm = reference.permutation(n, seed, 0)
    if drop_last:
        assert seen and sorted(seen) == sorted(perm[:steps * world * batch])
    else:
        assert sorted(seen) == list(range(n))


def test_rank_and_world_from_torchrun_environment(daemon, datasets, tmp_path):
    """Two processes as torchrun starts them: RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, sys\n"
        "import gpufeed.torch\n"
        f"loader = gpufeed.torch.Loader({str(datasets.records)!r}, kind='records', "
        f"batch_size=5, seed=9, socket={daemon.socket!r}, timeout=20)\n"
        "ids = [b.ids.tolist() for b in loader]\n"
        "print(json.dumps({'rank': loader.rank, 'world': loader.world_size, "
        "'job': loader.job, 'device': str(loader.device), 'ids': ids}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), WORLD_SIZE="2",
               TORCHELASTIC_RUN_ID="py-torchrun-env")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    expected = reference.expected_epoch(157, 9, 0, 2, 5, True)
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"], result["job"]) == (rank, 2, "py-torchrun-env")
        assert result["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
        assert result["ids"] == [ids for ids, _ in expected[rank]]


def test_state_dict_resumes_exactly(daemon, job, datasets):
    opts = dict(kind="tokens", seq_len=datasets.seq_len, token_dtype="uint16", batch_size=6,
                seed=77, rank=1, world_size=2, job=job)

    def run(loader, epochs, stop_after=None):
        out = []
        for epoch in epochs:
            loader.set_epoch(epoch)
            for b in loader:
                out.append((b.epoch, b.step, b.ids.tolist(), b["tokens"].clone()))
                if stop_after is not None and len(out) == stop_after:
                    return out
        return out

    with _loader(daemon, datasets.tokens_u16, **opts) as loader:
        assert len(loader) == 16  # 203 // (6 * 2)
        full = run(loader, [0, 1, 2])
    assert len(full) == 48
    for cut in (5, 16, 21):  # mid-epoch, at an epoch's end, mid second epoch
        with _loader(daemon, datasets.tokens_u16, **opts) as first:
            head = run(first, [0, 1, 2], stop_after=cut)
            state = first.state_dict()
        fingerprint = state.pop("fingerprint")
        # samples: the job's global cursor, step x the global batch of 6 x 2.
        assert state == {"epoch": cut // 16, "step": cut % 16, "samples": cut % 16 * 12,
                         "world_size": 2, "batch_size": 6, "seed": 77}
        assert f"path={datasets.tokens_u16};" in fingerprint
        assert f";seq_len={datasets.seq_len};" in fingerprint
        state["fingerprint"] = fingerprint
        state = json.loads(json.dumps(state))  # as a checkpoint stores it
        with _loader(daemon, datasets.tokens_u16, **opts) as second:
            second.load_state_dict(state)
            tail = []
            while len(head) + len(tail) < 48:  # the rest of this epoch, then the next ones
                tail.extend((b.epoch, b.step, b.ids.tolist(), b["tokens"].clone())
                            for b in second)
        resumed = head + tail
        assert [r[:3] for r in resumed] == [f[:3] for f in full]
        assert all(torch.equal(r[3], f[3]) for r, f in zip(resumed, full))


def test_a_state_resumes_only_the_feed_it_came_from(daemon, job, datasets, tmp_path):
    """seq_len 32's position does not load into a seq_len 16 loader;
    neither does one saved before the dataset changed. The message names each difference."""
    opts = dict(kind="tokens", token_dtype="uint16", batch_size=2, seed=3, job=job)
    with _loader(daemon, datasets.tokens_u16, seq_len=32, **opts) as loader:
        next(iter(loader))
        state = json.loads(json.dumps(loader.state_dict()))
    assert ";seq_len=32;" in state["fingerprint"]
    with _loader(daemon, datasets.tokens_u16, seq_len=16, **opts) as other:
        len(other)  # attached: it knows its feed's fingerprint, so loading checks at once
        with pytest.raises(gpufeed.FailedPrecondition) as e:
            other.load_state_dict(state)
        message = str(e.value)
        assert message.startswith("state_dict: the position was saved from another feed: ")
        assert "seq_len was 32, is 16" in message
        assert "tensors was tokens:uint16[33], is tokens:uint16[17]" in message
        assert other.position == (0, 1) or other.position == (0, 0)
    with _loader(daemon, datasets.tokens_u16, seq_len=16, **opts) as fresh:
        fresh.load_state_dict(state)  # not attached yet: the daemon checks at the attach
        with pytest.raises(gpufeed.FailedPrecondition) as e:
            next(iter(fresh))
        assert "start.fingerprint: the position was saved from another feed: " in str(e.value)
        assert "seq_len was 32, is 16" in str(e.value)
        assert fresh.position == (0, 1)
    # The same feed resumes, at the step after the saved one.
    with _loader(daemon, datasets.tokens_u16, seq_len=32, **opts) as same:
        same.load_state_dict(state)
        assert next(iter(same)).step == 1
    # The daemon checks it too: a position handed to attach with another feed's fingerprint.
    client = gpufeed.Client(daemon.socket)
    with pytest.raises(gpufeed.FailedPrecondition) as e:
        client.attach(datasets.tokens_u16, kind="tokens", seq_len=16, batch_size=2, seed=3,
                      job=job + "-raw", start=(0, 1), start_fingerprint=state["fingerprint"])
    assert "start.fingerprint: the position was saved from another feed: " in str(e.value)
    assert "seq_len was 32, is 16" in str(e.value)
    # A dataset rewritten since (other bytes): refused as well.
    path = tmp_path / "tokens.bin"
    path.write_bytes(np.arange(4000, dtype=np.uint16).tobytes())
    with _loader(daemon, path, seq_len=32, **opts) as loader:
        next(iter(loader))
        saved = loader.state_dict()
    path.write_bytes(np.arange(4002, dtype=np.uint16).tobytes())
    with _loader(daemon, path, seq_len=32, **opts) as loader:
        loader.load_state_dict(saved)
        with pytest.raises(gpufeed.FailedPrecondition, match=r"bytes was 8000, is 8004"):
            next(iter(loader))


def test_npy_tokens_and_vocab_size(daemon, job, tmp_path):
    """A .npy token file is read through its header; vocab_size catches a
    uint16 file read as uint32."""
    values = (np.arange(1002, dtype=np.uint32) * 7919 % 50257).astype(np.uint16)
    npy = tmp_path / "tokens.npy"
    np.save(npy, values)
    with _loader(daemon, npy, kind="tokens", seq_len=10, batch_size=4, shuffle=False,
                 job=job) as loader:
        b = next(iter(loader))
        want = np.stack([values[i * 10:i * 10 + 11] for i in range(4)]).astype(np.int64)
        assert np.array_equal(b["tokens"].numpy().astype(np.int64), want)
    with pytest.raises(gpufeed.InvalidArgument) as e:
        len(_loader(daemon, npy, kind="tokens", seq_len=10, batch_size=4, token_dtype="uint32",
                    job=job + "-u32"))
    assert "is a .npy array of uint16" in str(e.value)
    raw = tmp_path / "tokens.bin"
    raw.write_bytes(values.tobytes())
    with pytest.raises(gpufeed.InvalidArgument) as e:
        len(_loader(daemon, raw, kind="tokens", seq_len=10, batch_size=4, token_dtype="uint32",
                    vocab_size=50257, job=job + "-vocab"))
    assert "dataset.vocab_size: " in str(e.value) and "not below vocab_size 50257" in str(e.value)


def test_epochs_follow_each_other_and_set_epoch_jumps(daemon, job, datasets):
    with _loader(daemon, datasets.records, kind="records", batch_size=10, seed=5, job=job,
                 ring_slots=3) as loader:
        assert len(loader) == 15
        first = [b.ids.tolist() for b in loader]
        second = [b.ids.tolist() for b in loader]  # no set_epoch: the next epoch follows
        assert first == [ids for ids, _ in reference.expected_epoch(157, 5, 0, 1, 10, True)[0]]
        assert second == [ids for ids, _ in reference.expected_epoch(157, 5, 1, 1, 10, True)[0]]
        loader.set_epoch(7)
        it = iter(loader)
        b = next(it)
        assert (b.epoch, b.step) == (7, 0)
        assert b.ids.tolist() == reference.rank_slice(157, 5, 7, 0, 0, 1, 10)[0]
        state = loader.state_dict()
        assert (state["epoch"], state["step"]) == (7, 1)
        # A new iterator does not resume the broken-off epoch 7: it starts epoch 8, as a
        # DataLoader's iter() starts a new epoch. A loaded state resumes mid-epoch.
        assert [(x.epoch, x.step) for x in loader] == [(8, s) for s in range(15)]
        loader.load_state_dict(state)
        assert [x.ids.tolist() for x in loader] == [
            reference.rank_slice(157, 5, 7, s, 0, 1, 10)[0] for s in range(1, 15)]
        assert loader.position == (8, 0)


def test_load_state_dict_refuses_another_feed(daemon, job, datasets):
    with _loader(daemon, datasets.records, kind="records", batch_size=10, job=job) as loader:
        with pytest.raises(gpufeed.InvalidArgument) as e:
            loader.load_state_dict({"epoch": 1, "step": 2, "world_size": 4, "batch_size": 10})
        # Without a fingerprint (a state saved by an older gpufeed) the saved layout is
        # unknown: only the loader's own resumes.
        assert str(e.value) == (
            "state_dict: world_size 4 differs from this loader's 1, and the state has no "
            "fingerprint (saved by an older gpufeed), which a resume at another layout needs; "
            "resume with the settings it was saved with")
        with pytest.raises(gpufeed.InvalidArgument, match=r"state_dict: no 'step' in"):
            loader.load_state_dict({"epoch": 1})
        assert loader.position == (0, 0)


# ---- lifetime ----


def test_referenced_batch_stays_valid_while_others_are_collected(daemon, job, datasets):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets.records, kind="records", batch_size=4, job=job,
                 ring_slots=4) as loader:
        it = iter(loader)
        b0 = next(it)
        ids0 = b0.ids.copy()
        keep = b0["data"][1:]  # a view: keeps the whole batch's slot
        del b0
        for _ in range(30):  # far past the ring; each batch is garbage once replaced
            b = next(it)
            assert np.array_equal(b["data"].numpy(), expected[b.ids])
        # Had the other batches not gone back when collected, they would have filled the
        # ring around b0's slot and the loader would have stopped (ResourceExhausted).
        assert np.array_equal(keep.numpy(), expected[ids0[1:]])


def test_tensor_kept_past_close_stays_exact(daemon, datasets, tmp_path):
    """A tensor still referenced after its loader closed and was collected keeps its slot (the
    session stays attached until it is garbage): it reads its own batch, never a crash
    (own process: a crash must not take pytest down)."""
    script = tmp_path / "kept.py"
    script.write_text(
        "import gc\n"
        "import numpy as np\n"
        "import gpufeed.torch\n"
        f"loader = gpufeed.torch.Loader({str(datasets.records)!r}, kind='records', "
        f"batch_size=4, ring_slots=2, device='cpu', socket={daemon.socket!r}, job='py-kept')\n"
        "it = iter(loader)\n"
        "first = next(it)\n"
        "keep, ids = first['data'], first.ids\n"
        "del first\n"
        "next(it)\n"
        "del it\n"
        "loader.close()\n"
        "del loader\n"
        "gc.collect()\n"
        f"other = gpufeed.torch.Loader({str(datasets.records)!r}, kind='records', "
        f"batch_size=4, ring_slots=2, device='cpu', socket={daemon.socket!r}, job='py-kept2')\n"
        "for b in other:\n"  # a session of the same shape: it must not get keep's slot
        "    pass\n"
        f"exact = keep.numpy().tobytes() == np.load({str(datasets.records)!r})[ids].tobytes()\n"
        "print(keep.shape[0], exact)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert (out.returncode, out.stdout) == (0, "4 True\n"), out.stderr


def test_copy_true_yields_owned_tensors(daemon, job, datasets):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets.records, kind="records", batch_size=4, job=job,
                 ring_slots=2, copy=True) as loader:
        held = [b for _, b in zip(range(20), loader)]
    for b in held:  # all 20 exact after a 2-slot ring went round ten times and closed
        assert np.array_equal(b["data"].numpy(), expected[b.ids])


def test_holding_nothing_never_stalls_a_two_slot_ring(daemon, job, datasets):
    with _loader(daemon, datasets.records, kind="records", batch_size=16, job=job,
                 ring_slots=2, timeout=10) as loader:
        steps = [(b.epoch, b.step) for epoch in range(3) for b in loader]
    assert steps == [(e, s) for e in range(3) for s in range(9)]


# ---- images ----

CROP_UINT8 = [{"center_crop": {"size": 4}}, {"cast": {"dtype": "DTYPE_UINT8"}},
              {"layout": {"layout": "IMAGE_LAYOUT_NCHW"}}]


def test_image_folder_uint8_nchw(daemon, job, datasets):
    with _loader(daemon, datasets.images, kind="image_folder", batch_size=3, seed=2, job=job,
                 pipeline=CROP_UINT8, drop_last=False) as loader:
        assert len(loader) == 3
        seen = []
        for b in loader:
            assert sorted(b.keys()) == ["image", "label", "valid"]
            rows = 3 if b.step < 2 else 1  # one rank: the last batch is short
            assert b["image"].dtype == torch.uint8 and b["image"].shape == (rows, 3, 4, 4)
            assert b["label"].dtype == torch.int64 and b["label"].shape == (rows,)
            assert b["valid"].tolist() == [True] * rows and b.valid_count == rows
            for row, i in enumerate(b.ids.tolist()):
                want = reference.center_crop(datasets.image_pixels[i], 4).transpose(2, 0, 1)
                assert np.array_equal(b["image"][row].numpy(), want)
                assert b["label"][row].item() == datasets.image_labels[i]
            seen.extend(b.ids[:b.valid_count].tolist())
        assert sorted(seen) == list(range(7))


def test_image_folder_bfloat16_nhwc_pipeline_file(daemon, job, datasets, tmp_path):
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps({"ops": [{"center_crop": {"size": 4}},
                                        {"cast": {"dtype": "DTYPE_BFLOAT16"}},
                                        {"layout": {"layout": "IMAGE_LAYOUT_NHWC"}}]}))
    with _loader(daemon, datasets.images, kind="image_folder", batch_size=2, job=job,
                 pipeline=path) as loader:
        for b in loader:
            assert b["image"].dtype == torch.bfloat16 and b["image"].shape == (2, 4, 4, 3)
            for row, i in enumerate(b.ids.tolist()):
                crop = torch.from_numpy(reference.center_crop(datasets.image_pixels[i], 4).copy())
                want = (crop.float() / 255).to(torch.bfloat16)  # round to nearest even
                assert torch.equal(b["image"][row].view(torch.int16), want.view(torch.int16))


def test_bad_image_fails_with_data_loss_naming_the_file(daemon, job, datasets):
    with _loader(daemon, datasets.bad_images, kind="image_folder", batch_size=8, job=job,
                 pipeline=CROP_UINT8, shuffle=False, bad_sample="fail") as loader:
        with pytest.raises(gpufeed.DataLoss, match=re.escape(str(datasets.bad_image_path))):
            list(loader)


def test_bad_image_is_skipped(daemon, job, datasets):
    with _loader(daemon, datasets.bad_images, kind="image_folder", batch_size=8, job=job,
                 pipeline=CROP_UINT8, shuffle=False) as loader:
        (b,) = list(loader)
    # Ids 0-6 are the good images, 7 the bad one, replaced by the next good sample (0).
    assert b.ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 0]
    assert b["label"].tolist() == [0, 0, 0, 1, 1, 1, 1, 0]


# ---- errors ----


def test_errors(daemon, job, datasets, tmp_path):
    # The daemon's checks come at the first attach (here len()); making a loader contacts
    # nothing.
    with pytest.raises(gpufeed.InvalidArgument) as e:
        len(_loader(daemon, datasets.records, kind="records", batch_size=0, job=job))
    assert type(e.value) is gpufeed.InvalidArgument
    assert str(e.value) == "attach: batch_size: must be >= 1, got 0"
    with pytest.raises(gpufeed.InvalidArgument) as e:
        next(iter(_loader(daemon, datasets.tokens_u16, kind="tokens", batch_size=1,
                          seq_len=10 ** 9, job=job)))
    assert str(e.value).startswith("attach: dataset.seq_len: ")
    with pytest.raises(gpufeed.NotFound) as e:
        len(_loader(daemon, tmp_path / "missing.bin", kind="tokens", seq_len=8, batch_size=1,
                    job=job))
    missing = tmp_path / "missing.bin"
    assert str(e.value) == (f"attach: dataset.path: this process (uid {os.geteuid()}) cannot "
                            f"open {missing} (errno 2): No such file or directory")
    with pytest.raises(gpufeed.InvalidArgument, match="device: want cpu or cuda"):
        _loader(daemon, datasets.records, kind="records", batch_size=1, device="meta")
    with pytest.raises(gpufeed.Unavailable, match="no gpufeedd listening at " +
                       re.escape(str(tmp_path / "none.sock"))):
        len(gpufeed.torch.Loader(datasets.records, kind="records", batch_size=1, device="cpu",
                                 socket=tmp_path / "none.sock"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_cuda_without_a_gpu_is_failed_precondition(daemon, datasets):
    with pytest.raises(gpufeed.FailedPrecondition) as e:
        _loader(daemon, datasets.records, kind="records", batch_size=1, device="cuda")
    assert str(e.value) == ("device: 'cuda' asked for, but torch sees no CUDA device "
                            "(device='cpu' delivers to host memory)")


def test_batches_pickle_as_owned_tensors(daemon, job, datasets, tmp_path):
    expected = np.load(datasets.records)
    with _loader(daemon, datasets.records, kind="records", batch_size=4, job=job,
                 drop_last=False) as loader:
        b = next(iter(loader))
        torch.save(b, tmp_path / "batch.pt")
    del b
    # Our own file: torch >= 2.6 loads only allow-listed globals by default.
    again = torch.load(tmp_path / "batch.pt", weights_only=False)
    assert type(again) is gpufeed.torch.Batch and not again.released
    assert (again.epoch, again.step, again.valid_count) == (0, 0, 4)
    assert sorted(again.keys()) == ["data", "valid"]
    assert np.array_equal(again["data"].numpy(), expected[again.ids])


def test_rank_env_must_be_an_integer(daemon, datasets, monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(gpufeed.InvalidArgument,
                       match="RANK: want an integer in the environment, got 'zero'"):
        _loader(daemon, datasets.records, kind="records", batch_size=1)


def test_context_manager_detaches(daemon, job, datasets):
    with _loader(daemon, datasets.records, kind="records", batch_size=4, job=job) as loader:
        next(iter(loader))
        with pytest.raises(gpufeed.AlreadyExists):
            len(_loader(daemon, datasets.records, kind="records", batch_size=4, job=job))
    with _loader(daemon, datasets.records, kind="records", batch_size=4, job=job) as again:
        assert next(iter(again)).step == 0


def test_set_epoch_after_load_state_dict_keeps_the_loaded_step(daemon, job, datasets):
    opts = dict(kind="records", batch_size=10, seed=5, job=job)
    with _loader(daemon, datasets.records, **opts) as loader:
        full = [b.ids.tolist() for b in loader]
    with _loader(daemon, datasets.records, **opts) as loader:
        loader.load_state_dict({"epoch": 0, "step": 5})
        loader.set_epoch(0)  # the usual loop calls it: it must not rewind to step 0
        assert [b.ids.tolist() for b in loader] == full[5:]
        loader.load_state_dict({"epoch": 0, "step": 5})
        loader.set_epoch(1)  # another epoch: from its start
        assert loader.position == gpufeed.Position(1, 0)


def test_default_job_names_never_collide_on_a_node(daemon, job, datasets, monkeypatch):
    """torchrun's run id, else its rendezvous address, else host:pid (one process); a second
    loader of the process adds .N. Two loaders at once with default names both attach."""
    import socket as socketlib

    import gpufeed.torch as gt
    monkeypatch.setattr(gt, "_DEFAULT_JOBS", __import__("itertools").count())
    for var in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without --rdzv-id
    with _loader(daemon, datasets.records, kind="records", batch_size=10) as first, \
            _loader(daemon, datasets.records, kind="records", batch_size=10) as second:
        host = f"{socketlib.gethostname()}:{os.getpid()}"
        assert (first.job, second.job) == (host, host + ".1")
        assert next(iter(first)).ids.shape == next(iter(second)).ids.shape == (10,)
    monkeypatch.setenv("MASTER_ADDR", "[fd00::1]")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with _loader(daemon, datasets.records, kind="records", batch_size=10) as loader:
        assert loader.job == "_fd00::1_:29500.2"  # brackets are no job-name characters
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    with _loader(daemon, datasets.records, kind="records", batch_size=10) as loader:
        assert loader.job == "run-7.3"
    with _loader(daemon, datasets.records, kind="records", batch_size=10, job=job) as loader:
        assert loader.job == job  # given: as it is, and no number spent


def test_set_epoch_ends_a_running_iterator(daemon, job, datasets):
    with _loader(daemon, datasets.records, kind="records", batch_size=10, seed=5, job=job) as loader:
        it = iter(loader)
        next(it)
        loader.set_epoch(3)
        assert list(it) == []  # the old iterator stops instead of moving the new position
        assert loader.position == gpufeed.Position(3, 0)
        first = next(iter(loader))
        assert (first.epoch, first.step) == (3, 0)


def test_even_gives_every_rank_the_same_real_count_as_distributed_sampler(daemon, job, datasets):
    # N=157, W=2, B=10 without drop_last: plain padding gives ranks 80 and 77 real
    # rows; even=True gives each ceil(157/2) = 79, as DistributedSampler does, every sample
    # at least once and one wrapped duplicate.
    counts, seen = [], []
    for rank in range(2):
        loader = gpufeed.torch.Loader(datasets.records, kind="records", batch_size=10,
                                      drop_last=False, even=True, seed=4, rank=rank,
                                      world_size=2, job=job, device="cpu",
                                      socket=daemon.socket)
        n = 0
        for step, batch in enumerate(loader):
            ids, valid = reference.rank_slice(157, 4, 0, step, rank, 2, 10, even=True)
            assert batch.ids.tolist() == ids
            assert int(batch["valid"].sum()) == valid == batch.valid_count
            seen += ids[:valid]
            n += valid
        counts.append(n)
    assert counts == [79, 79]
    assert sorted(set(seen)) == list(range(157)) and len(seen) == 158


def test_a_shard_directory_position_of_an_earlier_release_still_resumes(daemon, job, tmp_path):
    """A position saved by a gpufeedd from before 2026-12-02 for a directory of shards holds
    the directory's mtime_ns and a shards item without the shards' times. Loaded into an
    attached loader (len() attaches, so loading asks the daemon at once) it resumes the same
    shard set exactly; the same form with another shard set is refused, naming shards."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for k, n in enumerate((301, 157)):
        (shards / f"train_{k}.bin").write_bytes(
            (np.arange(n, dtype=np.uint16) + 1000 * k).tobytes())
    opts = dict(kind="tokens", seq_len=8, token_dtype="uint16", batch_size=4, seed=9, job=job)

    def ids(loader):
        return [b.ids.tolist() for b in loader]

    with _loader(daemon, str(shards), **opts) as loader:
        full = ids(loader)
    with _loader(daemon, str(shards), **opts) as first:
        it = iter(first)
        head = [next(it).ids.tolist() for _ in range(3)]
        state = first.state_dict()
    fp = state["fingerprint"]
    assert ";shards=2 files, fnv1a64 " in fp and ", mtimes fnv1a64 " in fp
    assert "mtime_ns=" not in fp
    shards_item = re.search(r";shards=([^;]*)", fp).group(1)
    old = fp.replace(shards_item, shards_item.split(", mtimes fnv1a64 ")[0]).replace(
        ";shards=", ";mtime_ns=1764633600000000000;shards=")
    with _loader(daemon, str(shards), **opts) as second:
        assert len(second) == len(full)
        second.load_state_dict(dict(state, fingerprint=old))
        assert head + ids(second) == full
    # A closed loader asks the daemon too, and stays closed until it iterates.
    with _loader(daemon, str(shards), **opts) as closed:
        len(closed)
        closed.close()
        closed.load_state_dict(dict(state, fingerprint=old))
        assert closed._session is None
        assert head + ids(closed) == full
    other = old.replace(shards_item.split(", mtimes")[0], "3 files, fnv1a64 0123456789abcdef")
    with _loader(daemon, str(shards), **opts) as third:
        len(third)
        with pytest.raises(gpufeed.FailedPrecondition,
                           match=r"^state_dict: the position was saved from another feed: "
                                 r"shards was 3 files, fnv1a64 0123456789abcdef, is 2 files"):
            third.load_state_dict(dict(state, fingerprint=other))


# ---- DataLoader conventions ----


def _ten(tmp_path):
    """A records dataset of 10 rows: row i holds i * 10 + 0..2."""
    path = tmp_path / "ten.npy"
    np.save(path, np.arange(10, dtype=np.int64)[:, None] * 10 + np.arange(3, dtype=np.int64))
    return path


def test_one_rank_last_batch_is_short_as_a_dataloaders(daemon, job, tmp_path):
    """10 samples, batch 4, drop_last=False, one rank: batches of 4, 4 and 2 rows, as
    DataLoader(drop_last=False) gives; valid is all True; ids name the rows."""
    path = _ten(tmp_path)
    with _loader(daemon, path, kind="records", batch_size=4, seed=3, drop_last=False,
                 job=job) as loader:
        assert len(loader) == 3
        for epoch in range(2):  # the short batch's slot is refilled with a full one after
            got = [(b["data"].shape, b.ids.tolist(), b["valid"].tolist(), b.valid_count)
                   for b in loader]
            want_ids = [reference.rank_slice(10, 3, epoch, s, 0, 1, 4)[0][:4 if s < 2 else 2]
                        for s in range(3)]
            assert got == [((4, 3), want_ids[0], [True] * 4, 4),
                           ((4, 3), want_ids[1], [True] * 4, 4),
                           ((2, 3), want_ids[2], [True] * 2, 2)]
            assert sorted(sum(want_ids, [])) == list(range(10))
    # Host copies and widened types are sliced alike.
    with _loader(daemon, path, kind="records", batch_size=4, seed=3, drop_last=False,
                 job=job, copy=True) as loader:
        last = list(loader)[-1]
        assert last["data"].shape == (2, 3) and not last.in_place
        assert np.array_equal(last["data"].numpy(), np.load(path)[last.ids])


def test_several_ranks_pad_the_last_batch_and_mark_it_valid(daemon, job, tmp_path):
    """With two ranks the epoch's last batch keeps its rows on every rank (the daemon pads
    by wrapping around, as DistributedSampler pads); valid marks the real ones."""
    path = _ten(tmp_path)
    loaders = [_loader(daemon, path, kind="records", batch_size=4, seed=3, drop_last=False,
                       rank=r, world_size=2, job=job) for r in range(2)]
    try:
        for rank, loader in enumerate(loaders):
            batches = list(loader)
            assert len(batches) == 2
            for step, b in enumerate(batches):
                ids, valid = reference.rank_slice(10, 3, 0, step, rank, 2, 4)
                assert b["data"].shape == (4, 3) and b.ids.tolist() == ids
                assert b["valid"].tolist() == [i < valid for i in range(4)]
            assert [b.valid_count for b in batches] == ([4, 2] if rank == 0 else [4, 0])
    finally:
        for loader in loaders:
            loader.close()


def test_iter_after_a_break_starts_the_next_epoch(daemon, job, tmp_path):
    """`next(iter(loader))` then `for batch in loader`: the loop gets all of epoch 1, as a
    DataLoader's new iterator starts a new epoch; the rest of epoch 0 is not fed to it. A
    loaded state_dict resumes mid-epoch."""
    path = _ten(tmp_path)

    def ids(epoch, steps):
        return [reference.rank_slice(10, 3, epoch, s, 0, 1, 3)[0] for s in steps]

    with _loader(daemon, path, kind="records", batch_size=3, seed=3, job=job) as loader:
        first = next(iter(loader))
        assert (first.epoch, first.step, first.ids.tolist()) == (0, 0, ids(0, [0])[0])
        assert loader.position == (0, 1)
        assert [(b.epoch, b.step) for b in loader] == [(1, 0), (1, 1), (1, 2)]
        assert loader.position == (2, 0)
        assert [b.ids.tolist() for b in loader] == ids(2, range(3))  # ran to its end: next
        for b in loader:  # epoch 3, broken off after its second batch
            if b.step == 1:
                break
        state = loader.state_dict()
        assert (state["epoch"], state["step"]) == (3, 2)
        assert [b.ids.tolist() for b in loader] == ids(4, range(3))
        loader.load_state_dict(state)  # the way to resume mid-epoch
        assert [(b.epoch, b.step, b.ids.tolist()) for b in loader] == [(3, 2, ids(3, [2])[0])]
        # set_epoch chooses the epoch, from its start, whatever was broken off.
        next(iter(loader))
        loader.set_epoch(4)
        assert [b.ids.tolist() for b in loader] == ids(4, range(3))


def test_a_failed_next_is_retried_by_the_next_iter(daemon, job, datasets):
    """The loader's own error (here a ring full of batches referenced outside their dicts)
    yields nothing: the next iter() retries that batch instead of starting a new epoch."""
    with _loader(daemon, datasets.records, kind="records", batch_size=10, seed=5, job=job,
                 ring_slots=2) as loader:
        it = iter(loader)
        a, b = next(it)["data"], next(it)["data"]  # views out of their dicts hold the ring
        with pytest.raises(gpufeed.ResourceExhausted):
            next(it)
        del a, b
        again = next(iter(loader))
        assert (again.epoch, again.step) == (0, 2)
        assert again.ids.tolist() == reference.rank_slice(157, 5, 0, 2, 0, 1, 10)[0]


def test_a_batch_that_failed_to_convert_is_not_skipped(daemon, job, datasets, monkeypatch):
    """A batch taken from the daemon but not made into tensors (out of memory in a copy, an
    interrupt) was not yielded: state_dict stays before it and the next iter() attaches anew
    and yields it, so a resume neither skips it nor a training loop loses it."""
    with _loader(daemon, datasets.records, kind="records", batch_size=10, seed=5, job=job,
                 ring_slots=2, copy=True) as loader:
        it = iter(loader)
        first = next(it)
        to_torch = gpufeed.torch.Loader._to_torch

        def out_of_memory(self, core):
            monkeypatch.setattr(gpufeed.torch.Loader, "_to_torch", to_torch)  # once
            raise MemoryError("a copy of the batch")

        monkeypatch.setattr(gpufeed.torch.Loader, "_to_torch", out_of_memory)
        with pytest.raises(MemoryError):
            next(it)
        assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (first.epoch, 1)
        again = next(iter(loader))
        assert (again.epoch, again.step) == (first.epoch, 1)
        assert again.ids.tolist() == reference.rank_slice(157, 5, 0, 1, 0, 1, 10)[0]


def test_image_batches_unpack_as_images_and_labels(daemon, job, datasets):
    """`for images, labels in loader` (torchvision's convention) while batch["image"] and
    the dict's keys work as before; valid is not part of the tuple."""
    with _loader(daemon, datasets.images, kind="image_folder", batch_size=3, seed=2, job=job,
                 pipeline=CROP_UINT8, drop_last=False) as loader:
        seen = []
        for images, labels in loader:
            assert images.shape[1:] == (3, 4, 4) and labels.shape == images.shape[:1]
            seen += labels.tolist()
        assert sorted(seen) == sorted(datasets.image_labels)
        batch = next(iter(loader))
        images, labels = batch
        assert images is batch["image"] and labels is batch["label"]
        assert list(batch.keys()) == ["image", "label", "valid"]
        assert sorted(dict(batch)) == ["image", "label", "valid"]  # dict() takes the names
        assert isinstance(batch, dict) and "image" in batch and len(batch) == 3


def test_records_batches_unpack_in_dataset_order_and_tokens_refuse(daemon, job, datasets,
                                                                    tmp_path):
    x, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10, dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    arrays = {"y": str(tmp_path / "y.npy"), "x": str(tmp_path / "x.npy")}
    with _loader(daemon, arrays, kind="records", batch_size=4, job=job) as loader:
        for first, second in loader:  # the mapping's order: y, then x
            assert first.dtype == torch.int64 and second.shape[1:] == (2,)
            assert np.array_equal(second.numpy(), x[first.numpy()])
    with _loader(daemon, datasets.records, kind="records", batch_size=4, job=job + "-one",
                 drop_last=False) as loader:
        (data,) = batch = next(iter(loader))  # as TensorDataset(data): a 1-tuple
        assert data is batch["data"]
    with _loader(daemon, datasets.tokens_u16, kind="tokens", seq_len=datasets.seq_len,
                 token_dtype="uint16", batch_size=2, job=job + "-tok") as loader:
        batch = next(iter(loader))
        with pytest.raises(TypeError) as e:
            x_, y_ = batch
        assert str(e.value) == (
            "a tokens batch does not unpack: each row holds seq_len + 1 tokens; take tokens = "
            "batch['tokens'], x = tokens[:, :-1], y = tokens[:, 1:] (add .long() for an "
            "embedding or a loss); the batch's names are batch.keys()")
        assert list(batch.keys()) == ["tokens"]


def test_a_peeked_batch_kept_unpacked_does_not_stop_the_next_epoch(daemon, job, datasets):
    """`images, labels = next(iter(loader))` kept while `for images, labels in loader` starts
    the next epoch on a new session: the kept tensors are moved out of the old ring where
    they stand (the same objects, their values unchanged) instead of refusing the attach."""
    with _loader(daemon, datasets.images, kind="image_folder", batch_size=3, seed=2, job=job,
                 pipeline=CROP_UINT8) as loader:
        batch = next(iter(loader))
        ids = batch.ids.tolist()
        images, labels = batch
        del batch
        peeked, pointer = images, images.data_ptr()
        steps = [(b.epoch, b.step) for b in loader]  # images, labels still bound meanwhile
        assert steps == [(1, 0), (1, 1)]
        assert peeked.data_ptr() != pointer
        for row, i in enumerate(ids):
            want = reference.center_crop(datasets.image_pixels[i], 4).transpose(2, 0, 1)
            assert np.array_equal(peeked[row].numpy(), want)
            assert labels[row].item() == datasets.image_labels[i]
