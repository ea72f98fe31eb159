"""gpufeed's core (numpy only, no torch) against a real gpufeedd: batches in place, error
mapping, slot lifetime, library lookup."""

from __future__ import annotations

import os
import pickle
import re
import socket as socketlib

import numpy as np
import pytest

import gpufeed
import reference
from gpufeed import _capi


def test_package_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; import gpufeed; "
            "print(gpufeed.Client('/x').socket)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "/x\n"


# ---- no daemon ----


HOW = ("is gpufeedd running? Start it, or pass socket= the path it listens on "
       "(gpufeed.Client(socket=...), gpufeed.torch.Loader(..., socket=...)) or set "
       "GPUFEED_SOCKET; the default is /run/gpufeed/gpufeed.sock (or "
       "$XDG_RUNTIME_DIR/gpufeed/gpufeed.sock for a gpufeedd run without root)")


def test_no_daemon_names_the_socket(tmp_path, monkeypatch):
    """Python's "no socket" error names socket= (gpufeedctl's names --socket) and
    where the path came from: the argument, GPUFEED_SOCKET or the default."""
    path = str(tmp_path / "absent.sock")
    with pytest.raises(gpufeed.Unavailable) as e:
        gpufeed.Client(path).attach("/tmp/whatever.bin", kind="tokens", batch_size=1)
    assert type(e.value) is gpufeed.Unavailable
    assert e.value.code == 14 and e.value.code_name == "UNAVAILABLE"
    assert str(e.value) == (f"no gpufeedd listening at {path} (the socket= argument): no socket there; "
                            f"{HOW}")
    monkeypatch.setenv("GPUFEED_SOCKET", path)
    with pytest.raises(gpufeed.Unavailable) as e:
        gpufeed.Client().attach("/x.bin", kind="tokens", batch_size=1)
    assert str(e.value) == (f"no gpufeedd listening at {path} (from GPUFEED_SOCKET): no socket there; "
                            f"{HOW}")
    (tmp_path / "file").write_text("")
    with pytest.raises(gpufeed.Unavailable) as e:
        gpufeed.Client(tmp_path / "file").attach("/x.bin", kind="tokens", batch_size=1)
    assert str(e.value) == (f"no gpufeedd listening at {tmp_path / 'file'} (the socket= argument): "
                            f"not a socket; {HOW}")
    monkeypatch.delenv("GPUFEED_SOCKET")
    if not os.path.exists(gpufeed.DEFAULT_SOCKET):
        with pytest.raises(gpufeed.Unavailable) as e:
            gpufeed.Client().attach("/x.bin", kind="tokens", batch_size=1)
        assert str(e.value) == (f"no gpufeedd listening at {gpufeed.DEFAULT_SOCKET} (the "
                                f"default): no socket there; {HOW}")


def test_stale_socket_names_the_socket(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socketlib.socket(socketlib.AF_UNIX)
    s.bind(path)  # a socket file nobody listens on, as a killed daemon leaves it
    s.close()
    with pytest.raises(gpufeed.Unavailable) as e:
        gpufeed.Client(path).attach("/tmp/whatever.bin", kind="tokens", batch_size=1)
    assert str(e.value) == (f"no gpufeedd listening at {path}: a stale socket file (gpufeedd "
                            "stopped or crashed?); start gpufeedd, or pass socket= the path it "
                            "listens on or set GPUFEED_SOCKET")


def test_default_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("GPUFEED_SOCKET", raising=False)
    assert gpufeed.Client().socket == "/run/gpufeed/gpufeed.sock"
    path = str(tmp_path / "env.sock")
    monkeypatch.setenv("GPUFEED_SOCKET", path)
    assert gpufeed.Client().socket == path
    with pytest.raises(gpufeed.Unavailable, match="no gpufeedd listening at " + re.escape(path)):
        gpufeed.Client().attach("/tmp/whatever.bin", kind="tokens", batch_size=1)
    assert gpufeed.Client(tmp_path / "arg.sock").socket == str(tmp_path / "arg.sock")
    # The address as gpufeedd logs it ("serving on unix:///...") names the same path.
    monkeypatch.setenv("GPUFEED_SOCKET", "unix://" + path)
    assert gpufeed.Client().socket == path
    assert gpufeed.Client("unix:" + path).socket == path


# ---- errors ----


def test_every_code_has_its_class():
    names = {1: "Cancelled", 2: "Unknown", 3: "InvalidArgument", 4: "DeadlineExceeded",
             5: "NotFound", 6: "AlreadyExists", 7: "PermissionDenied", 8: "ResourceExhausted",
             9: "FailedPrecondition", 10: "Aborted", 11: "OutOfRange", 12: "Unimplemented",
             13: "Internal", 14: "Unavailable", 15: "DataLoss", 16: "Unauthenticated"}
    for code, name in names.items():
        e = gpufeed.errors.error_for(code, "why")
        assert type(e) is getattr(gpufeed, name)
        assert isinstance(e, gpufeed.Error)
        assert (e.code, e.message, str(e)) == (code, "why", "why")
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and again.message == "why"
    odd = gpufeed.errors.error_for(99, "what")
    assert type(odd) is gpufeed.Unknown and str(odd) == "status 99: what"
    # A bad argument is also Python's ValueError (and only that one is).
    assert [name for name in names.values()
            if issubclass(getattr(gpufeed, name), ValueError)] == ["InvalidArgument"]
    with pytest.raises(ValueError, match="attach: batch_size: must be >= 1, got 0"):
        raise gpufeed.errors.error_for(3, "attach: batch_size: must be >= 1, got 0")


def _attach_error(daemon, job, dataset, **kw):
    with pytest.raises(gpufeed.Error) as e:
        gpufeed.Client(daemon.socket).attach(dataset, job=job, **kw)
    return e.value


@pytest.mark.parametrize("kw, cls, message", [
    (dict(batch_size=0), gpufeed.InvalidArgument, "attach: batch_size: must be >= 1, got 0"),
    (dict(batch_size=1, world_size=0), gpufeed.InvalidArgument,
     "attach: world_size: must be >= 1, got 0"),
    (dict(batch_size=1, rank=2, world_size=2), gpufeed.InvalidArgument,
     "attach: rank: must be in [0, world_size=2), got 2"),
    (dict(batch_size=1, ring_slots=65), gpufeed.InvalidArgument,
     "attach: ring_slots: must be in [1, 64] (0 for the default), got 65"),
    (dict(batch_size=1, start=(0, 157)), gpufeed.InvalidArgument,
     "attach: start.step: 157 is past the epoch's last step (steps_per_epoch = 157)"),
    (dict(batch_size=1, kind="parquet"), gpufeed.InvalidArgument,
     "kind: unknown dataset kind 'parquet' (want tokens, records, image_folder or webdataset)"),
    (dict(batch_size=1, kind=None), gpufeed.InvalidArgument,
     "kind: want tokens, records, image_folder or webdataset, got None"),
    (dict(batch_size=1, seed=-1), gpufeed.InvalidArgument,
     "seed: want 0 <= seed < 2**64, got -1"),
    (dict(batch_size="8"), gpufeed.InvalidArgument, "batch_size: want an integer, got '8'"),
    (dict(batch_size=1, delivery="disk"), gpufeed.InvalidArgument,
     "delivery: unknown kind 'disk' (want host or device)"),
    (dict(batch_size=1, job=""), gpufeed.InvalidArgument,
     "attach: job: must be 1 to 128 bytes, got 0"),
])
def test_invalid_options_name_the_field(daemon, job, datasets, kw, cls, message):
    kw.setdefault("kind", "records")
    if kw.get("job") == "":
        job = kw.pop("job")
    e = _attach_error(daemon, job, datasets.records, **kw)
    assert type(e) is cls
    assert str(e) == message


@pytest.mark.parametrize("key", ["decode", "augment"])
def test_decode_and_augment_reach_the_library(daemon, job, datasets, key):
    # Passed only when not "auto"; for a records dataset the library or daemon refuses them
    # (older libraries: "unknown string option"; newer: "only image datasets are decoded").
    e = _attach_error(daemon, job, datasets.records, kind="records", batch_size=1,
                      **{key: "cpu"})
    assert type(e) is gpufeed.InvalidArgument
    assert key in str(e)
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=1,
                                              job=job, **{key: "auto"}) as s:
        assert s.info.num_samples == 157


def test_token_options_name_the_field(daemon, job, datasets):
    e = _attach_error(daemon, job, datasets.tokens_u16, kind="tokens", batch_size=1, seq_len=0)
    assert type(e) is gpufeed.InvalidArgument
    assert str(e) == ("attach: dataset.seq_len: required for kind tokens (tokens per sample: "
                      "each row holds seq_len + 1 tokens, the inputs and the shifted targets)")
    e = _attach_error(daemon, job, datasets.tokens_u16, kind="tokens", batch_size=1, seq_len=4,
                      token_dtype="uint8")
    assert type(e) is gpufeed.InvalidArgument
    assert str(e) == ("token_dtype: must be uint16 or uint32 (or empty: the .npy header's, "
                      "else uint16), got 'uint8'")


def test_missing_dataset_is_not_found(daemon, job, tmp_path):
    path = tmp_path / "nope.npy"
    e = _attach_error(daemon, job, path, kind="records", batch_size=1)
    assert type(e) is gpufeed.NotFound and e.code == 5
    # The client library opens the dataset itself (docs/SECURITY.md section 2).
    assert str(e) == (f"attach: dataset.path: this process (uid {os.geteuid()}) cannot open "
                      f"{path} (errno 2): No such file or directory")


def test_relative_dataset_path_is_made_absolute(daemon, job, datasets, monkeypatch):
    monkeypatch.chdir(datasets.records.parent)
    with gpufeed.Client(daemon.socket).attach("records.npy", kind="records", batch_size=1,
                                              job=job) as s:
        assert s.info.num_samples == 157


def test_ring_larger_than_pool_is_resource_exhausted(daemon, job, datasets):
    e = _attach_error(daemon, job, datasets.big_records, kind="records", batch_size=16,
                      ring_slots=8)
    assert type(e) is gpufeed.ResourceExhausted
    assert str(e).startswith("attach: ring of 8 slots x 16777216 bytes: staging pool: asked "
                             "for 134217728 bytes")


def test_rank_twice_and_other_feed(daemon, job, datasets):
    client = gpufeed.Client(daemon.socket)
    with client.attach(datasets.records, kind="records", batch_size=2, world_size=2, job=job):
        e = _attach_error(daemon, job, datasets.records, kind="records", batch_size=2,
                          world_size=2)
        assert type(e) is gpufeed.AlreadyExists
        assert str(e) == (f"attach: job '{job}' rank 0 is already attached; to run another "
                          "job beside it, give that one another name (job=)")
        e = _attach_error(daemon, job, datasets.records, kind="records", batch_size=3,
                          world_size=2, rank=1)
        assert type(e) is gpufeed.FailedPrecondition
        assert str(e).startswith(f"attach: job '{job}' is attached with another feed: "
                                 "batch_size=3 (the job's: 2); rank 1 asked for {")
        assert str(e).endswith("every rank of a job must use the same dataset and sampling; "
                               "to run another job beside it, give that one another name (job=)")
    # Leaving the `with` detached rank 0: it can attach again.
    client.attach(datasets.records, kind="records", batch_size=2, world_size=2, job=job).close()


# ---- batches ----


def test_one_epoch_in_place_byte_exact(daemon, job, datasets):
    expected = np.load(datasets.records)
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=5,
                                              seed=42, stop_epoch=1, job=job) as s:
        assert s.info.num_samples == 157 and s.info.steps_per_epoch == 31
        assert s.info.num_tensors == 1
        assert s.position() == (0, 0)
        steps = 0
        for step, batch in enumerate(s):
            ids, valid = reference.rank_slice(157, 42, 0, step, 0, 1, 5)
            assert (batch.epoch, batch.step, batch.valid_count) == (0, step, valid)
            assert batch.ids.tolist() == ids
            t = batch.tensors["data"]
            assert (t.name, t.dtype, t.shape, t.device, t.nbytes) == ("data", "int64",
                                                                       (5, 3, 5), "cpu", 600)
            data = batch.numpy()["data"]
            assert data.dtype == np.int64 and data.shape == (5, 3, 5)
            assert np.array_equal(data, expected[ids])
            assert data.ctypes.data == t.data_ptr  # a view of the slot, no copy
            with pytest.raises(ValueError, match="read-only"):
                data[0, 0, 0] = 1
            assert s.position() == ((0, step + 1) if step < 30 else (1, 0))
            steps += 1
        assert steps == 31
        with pytest.raises(gpufeed.OutOfRange, match="end of data"):
            s.next()


@pytest.mark.parametrize("seed, shuffle", [(2**64 - 1, True), (2**63 + 12345, True), (5, False)])
def test_seed_and_shuffle(daemon, job, datasets, seed, shuffle):
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=50,
                                              seed=seed, shuffle=shuffle, stop_epoch=2,
                                              job=job) as s:
        got = [batch.ids.tolist() for batch in s]
    want = [reference.rank_slice(157, seed, e, step, 0, 1, 50, shuffle)[0]
            for e in range(2) for step in range(3)]
    assert got == want
    if not shuffle:
        assert got[0] == list(range(50))


def test_float16_records_byte_exact(daemon, job, datasets):
    expected = np.load(datasets.records_f16)
    with gpufeed.Client(daemon.socket).attach(datasets.records_f16, kind="records",
                                              batch_size=10, stop_epoch=1, job=job) as s:
        n = 0
        for batch in s:
            data = batch.numpy()["data"]
            assert data.dtype == np.float16
            assert data.tobytes() == expected[batch.ids].tobytes()
            n += 1
        assert n == 10


@pytest.mark.parametrize("dtype", ["uint32", np.uint32, np.dtype("uint32")],
                         ids=["str", "numpy-type", "numpy-dtype"])
def test_tokens_uint32_rows(daemon, job, datasets, dtype):
    with gpufeed.Client(daemon.socket).attach(datasets.tokens_u32, kind="tokens",
                                              token_dtype=dtype, seq_len=16, batch_size=8,
                                              seed=3, stop_epoch=1, job=job) as s:
        for batch in s:
            tokens = batch.numpy()["tokens"]
            assert tokens.dtype == np.uint32 and tokens.shape == (8, 17)
            assert np.array_equal(tokens, datasets.token_rows("uint32", batch.ids))


def test_referenced_slots_are_not_reused_and_garbage_returns_them(daemon, job, datasets):
    expected = np.load(datasets.records)
    s = gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=4,
                                             ring_slots=2, job=job)
    with s:
        first = s.next(timeout=10)
        ids0 = first.ids.copy()
        view0 = first.numpy()["data"][1:3]  # a slice of an array still leases the slot
        del first
        second = s.next(timeout=10).numpy()["data"]
        # Both slots are referenced: the daemon has nowhere to put a third batch.
        with pytest.raises(gpufeed.DeadlineExceeded, match="no batch within 0.5 s"):
            s.next(timeout=0.5)
        assert np.array_equal(view0, expected[ids0[1:3]])
        del view0  # garbage: slot returned, the daemon refills it
        third = s.next(timeout=10)
        assert third.step == 2
        del second, third
        # Holding nothing, a 2-slot ring never runs dry.
        for step in range(3, 120):
            batch = s.next(timeout=10)
            assert (batch.epoch, batch.step) == divmod(step, 39)
            assert np.array_equal(batch.numpy()["data"], expected[batch.ids])


def test_explicit_release(daemon, job, datasets):
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=4,
                                              ring_slots=1, job=job) as s:
        for step in range(5):
            with s.next(timeout=10) as batch:  # leaving `with` releases
                assert batch.step == step and not batch.released
                arrays = batch.numpy()
            # Released although `arrays` still views the slot (it must not be read now): in a
            # 1-slot ring only that release makes room for the next batch.
            assert batch.released
            assert arrays["data"].shape == (4, 3, 5)  # metadata only: the bytes are gone
        batch = s.next(timeout=10)
        batch.release()
        batch.release()  # idempotent
        with pytest.raises(gpufeed.FailedPrecondition, match="the batch was released"):
            batch.wait_ready()
        assert s.next(timeout=10).step == 6


def test_closed_session_keeps_held_batches_readable(daemon, job, datasets):
    expected = np.load(datasets.records)
    s = gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=4,
                                             job=job)
    batch = s.next(timeout=10)
    data = batch.numpy()["data"]
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(gpufeed.FailedPrecondition, match="the session is closed"):
        s.next()
    assert np.array_equal(data, expected[batch.ids])
    del batch, data  # releasing into a detached session is harmless


def test_shutdown_ends_the_stream_with_unavailable(fresh_daemon, job, datasets):
    s = gpufeed.Client(fresh_daemon.socket).attach(datasets.records, kind="records",
                                                   batch_size=4, ring_slots=2, job=job,
                                                   reconnect_timeout=0)
    s.next(timeout=10)
    assert fresh_daemon.stop() == 0
    with pytest.raises(gpufeed.Unavailable):
        for _ in range(4):
            s.next(timeout=10)
    s.close()  # detaching from a daemon that is gone is not an error


# ---- pieces ----


def test_pipeline_json(tmp_path):
    from gpufeed.client import pipeline_json

    ops = [{"center_crop": {"size": 4}}, {"cast": {"dtype": "DTYPE_UINT8"}}]
    want = '{"ops": [{"center_crop": {"size": 4}}, {"cast": {"dtype": "DTYPE_UINT8"}}]}'
    assert pipeline_json(ops) == want
    assert pipeline_json({"ops": ops}) == want
    (tmp_path / "p.json").write_text('{"ops": [{"center_crop": {"size": 4}},\n'
                                     '{"cast": {"dtype": "DTYPE_UINT8"}}]}')
    assert pipeline_json(tmp_path / "p.json") == want
    with pytest.raises(gpufeed.InvalidArgument, match="op 1 must be a dict with one key"):
        pipeline_json([{"flip": {"p": 1}}, "resize"])
    with pytest.raises(gpufeed.InvalidArgument, match="a dict must hold the op list under"):
        pipeline_json({"flip": {}})
    with pytest.raises(gpufeed.InvalidArgument, match="pipeline: cannot read .*missing.json"):
        pipeline_json(str(tmp_path / "missing.json"))


def test_library_lookup_order(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUFEED_LIBRARY", "/opt/x/libgpufeed_c.so")
    tried = _capi.candidates()
    assert tried[0] == os.path.join(os.path.dirname(_capi.__file__), "_lib", "libgpufeed_c.so")
    assert tried[1] == "/opt/x/libgpufeed_c.so"
    assert tried[-1] == "libgpufeed_c.so"
    monkeypatch.setenv("GPUFEED_LIBRARY", str(tmp_path / "missing.so"))
    if os.path.exists(tried[0]):  # an installed wheel: its own library wins over the variable
        assert _capi._open() is not None
        return
    with pytest.raises(ImportError, match="cannot load GPUFEED_LIBRARY=" +
                       re.escape(str(tmp_path / "missing.so"))) as raised:
        _capi._open()
    # The example's `except gpufeed.Error` catches it too.
    assert isinstance(raised.value, gpufeed.Error)
    assert type(raised.value) is gpufeed.LibraryNotFound
    assert gpufeed.library_api_version() == _capi.API_VERSION == 1


def test_iterating_a_one_slot_ring_returns_each_slot_on_del(daemon, job, datasets):
    # The session's iterator must not keep the last batch alive: with one slot, a `del`
    # of the caller's batch is all the daemon needs to fill the next one.
    expected = np.load(datasets.records)
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=10,
                                              ring_slots=1, stop_epoch=1, job=job) as s:
        seen = 0
        for batch in s:
            assert np.array_equal(batch.numpy()["data"], expected[batch.ids])
            seen += 1
            del batch
    assert seen == 157 // 10


def test_a_forked_child_does_not_release_the_parents_slots(daemon, job, datasets):
    # ring_slots=2: the child drops its inherited copy of a held batch (garbage collection
    # runs the lease's finalizer there); the parent's batch must still be held, so the
    # daemon cannot refill its slot: the parent's data stays as it was.
    expected = np.load(datasets.records)
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=10,
                                              ring_slots=2, job=job) as s:
        held = s.next(timeout=20)
        before = held.numpy()["data"].copy()
        pid = os.fork()
        if pid == 0:  # the child: let go of everything, then exit at once
            del held
            import gc
            gc.collect()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert not held.released
        for _ in range(6):  # the other slot cycles; the held one is never refilled
            b = s.next(timeout=20)
            b.release()
        assert np.array_equal(held.numpy()["data"], before)
        assert np.array_equal(before, expected[held.ids])


def test_a_forked_child_can_neither_read_nor_detach_the_parents_session(daemon, job, datasets):
    # The child's copy of the session is the parent's: next() says so instead of hanging on
    # the parent's connection, and close() forgets it without detaching the parent.
    expected = np.load(datasets.records)
    with gpufeed.Client(daemon.socket).attach(datasets.records, kind="records", batch_size=10,
                                              ring_slots=2, job=job) as s:
        first = s.next(timeout=20)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    s.next(timeout=1)
                except gpufeed.FailedPrecondition as e:
                    if str(e) == (f"the session belongs to process {os.getppid()}; a forked "
                                  "child cannot use it (attach in the child)"):
                        code = 2
                s.close()
                code = 0 if code == 2 and s.closed else 3
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert not s.closed
        assert np.array_equal(first.numpy()["data"], expected[first.ids])
        for step in range(1, 20):  # still attached: the parent's stream goes on
            batch = s.next(timeout=20)
            assert (batch.epoch, batch.step) == divmod(step, 15)
            assert np.array_equal(batch.numpy()["data"], expected[batch.ids])
            del batch
