"""Token datasets in shards through the client, as users point gpufeed at nanoGPT/llm.c/.npy
shards: a directory or a glob, passed by this process as a directory descriptor;
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


# ---- Each peer's own writer, served exactly or refused naming the format ----

import gzip  # noqa: E402
import importlib  # noqa: E402
import pickle  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402


def write_datafile(filename, toks, model_desc="gpt-2"):
    """llm.c's dev/data/data_common.py `write_datafile`, byte for byte (llm.c is not on PyPI):
    a header of 256 int32 (magic, version, token count), then the tokens: "gpt-2" magic
    20240520 version 1 uint16, "llama-3" magic 20240801 version 7 uint32."""
    info = {"gpt-2": (20240520, 1, np.uint16), "llama-3": (20240801, 7, np.uint32)}[model_desc]
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = info[0], info[1], len(toks)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=info[2]).tobytes())


MEGATRON_CORE = "megatron-core==0.16.1"


@pytest.fixture(scope="session")
def megatron_indexed_dataset():
    """megatron-core's own `megatron.core.datasets.indexed_dataset` (its IndexedDatasetBuilder
    writes the .bin/.idx pairs Megatron-LM trains on), pip-installed without dependencies into
    a cached directory (17 MB, ~2 s); skipped, saying so, where PyPI cannot be reached. Its
    package __init__ pulls in the whole of Megatron (parallel state, distributed optimizers,
    newer torch than Debian's 1.13): the module is loaded alone, with `megatron.core.utils`
    stood in by its one function the module uses (log_single_rank)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    target = cache / "gpufeed-tests" / MEGATRON_CORE.replace("==", "-")
    if not (target / "megatron" / "core" / "datasets" / "indexed_dataset.py").exists():
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                               "--disable-pip-version-check", "--target", str(target),
                               MEGATRON_CORE], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            pytest.skip(f"{MEGATRON_CORE} could not be installed from PyPI: "
                        f"{done.stderr.strip().splitlines()[-1:]}")
    saved = {k: v for k, v in sys.modules.items() if k == "megatron" or k.startswith("megatron.")}
    for name, sub in (("megatron", "megatron"), ("megatron.core", "megatron/core")):
        package = types.ModuleType(name)
        package.__path__ = [str(target / sub)]
        sys.modules[name] = package
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda logger, *args, rank=0, **kwargs: logger.log(*args, **kwargs)
    sys.modules["megatron.core.utils"] = utils
    try:
        yield importlib.import_module("megatron.core.datasets.indexed_dataset")
    finally:
        for k in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def megatron_bytes(prefix, documents, dtype):
    """Megatron-LM's .bin/.idx pair laid out as IndexedDatasetBuilder writes it (the format
    read by megatron/core/datasets/indexed_dataset.py), for where megatron-core cannot be
    installed: "MMIDIDX\\0\\0", version 1, dtype code, counts, sizes, pointers, doc index."""
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[np.dtype(dtype)]
    sizes = np.array([len(d) for d in documents], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(f"{prefix}.bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + bytes([code]))
        f.write(np.uint64(len(sizes)).tobytes() + np.uint64(len(sizes) + 1).tobytes())
        f.write(sizes.tobytes() + pointers.tobytes())
        f.write(np.arange(len(sizes) + 1, dtype=np.int64).tobytes())


def served(daemon, job, path, **options):
    """Every window the daemon serves for `path`, in id order (one rank, no shuffle)."""
    rows = {}
    dataset = [str(p) for p in path] if isinstance(path, list) else str(path)
    with gpufeed.Client(daemon.socket).attach(dataset, kind="tokens", seq_len=SEQ,
                                              batch_size=4, shuffle=False, job=job,
                                              stop_epoch=1, drop_last=False, **options) as s:
        for batch in s:
            tokens = batch.numpy()["tokens"]
            for i, sample in enumerate(batch.ids.tolist()[:batch.valid_count]):
                rows[sample] = tokens[i].copy()
        assert sorted(rows) == list(range(s.info.num_samples))
    return np.stack([rows[i] for i in sorted(rows)])


def windows_of(*shards):
    return np.stack([t[i * SEQ: i * SEQ + SEQ + 1]
                     for t in shards for i in range((len(t) - 1) // SEQ)])


@pytest.mark.parametrize("model_desc", ["gpt-2", "llama-3"])
def test_llmc_write_datafile_shards_are_served_exactly(daemon, job, tmp_path, model_desc):
    rng = np.random.default_rng(31)
    high = 50257 if model_desc == "gpt-2" else 128256  # llama-3 ids past 65535
    parts = [rng.integers(0, high, size=n) for n in (75, 42)]
    for k, t in enumerate(parts):
        write_datafile(tmp_path / f"fineweb_train_{k:06d}.bin", t, model_desc)
    got = served(daemon, job, tmp_path / "fineweb_train_*.bin")
    assert got.dtype == (np.uint16 if model_desc == "gpt-2" else np.uint32)
    assert np.array_equal(got, windows_of(*parts))


@pytest.mark.parametrize("writer", ["megatron-core", "bytes"])
def test_a_megatron_pair_is_served_exactly_however_the_path_names_it(
        daemon, job, tmp_path, writer, request):
    """int32 ids past 65535 (read as uint16 pairs, as a glob or a single .bin once were, each
    would show as two ids); a directory, a glob and the .bin alone give the same windows."""
    rng = np.random.default_rng(7)
    documents = [rng.integers(0, 128256, size=n).astype(np.int32) for n in (23, 40, 18)]
    prefix = tmp_path / "corpus_text_document"
    if writer == "megatron-core":
        indexed_dataset = request.getfixturevalue("megatron_indexed_dataset")
        import torch
        builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
        for d in documents:
            builder.add_item(torch.from_numpy(d))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
        # Megatron reads back what it wrote.
        reread = indexed_dataset.IndexedDataset(str(prefix))
        assert [list(reread[i]) for i in range(len(reread))] == [list(d) for d in documents]
    else:
        megatron_bytes(prefix, documents, np.int32)
    want = windows_of(np.concatenate(documents).astype(np.uint32))
    for k, path in enumerate([tmp_path, tmp_path / "*.bin", f"{prefix}.bin"]):
        got = served(daemon, f"{job}-{k}", path)
        assert got.dtype == np.uint32, path
        assert np.array_equal(got, want), path
    # The .idx named instead is refused, saying what to name.
    with pytest.raises(gpufeed.InvalidArgument,
                       match=r"corpus_text_document\.idx is a Megatron-LM index .*name its "
                             r"\.bin \(.*corpus_text_document\.bin\) or their directory"):
        served(daemon, f"{job}-idx", f"{prefix}.idx")


def test_np_save_shards_and_a_plain_nanogpt_bin_are_served_exactly(daemon, job, tmp_path):
    rng = np.random.default_rng(3)
    a = rng.integers(0, 128256, size=61).astype(np.uint32)
    np.save(tmp_path / "a.npy", a)
    assert np.array_equal(served(daemon, job, tmp_path / "a.npy"), windows_of(a))
    # nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile("train.bin").
    b = rng.integers(0, 50257, size=70).astype(np.uint16)
    b.tofile(tmp_path / "train.bin")
    assert np.array_equal(served(daemon, job + "-b", tmp_path / "train.bin"), windows_of(b))


# An Apache Arrow IPC stream as pyarrow 17.0.0 writes it (ipc.new_stream, as Hugging Face
# `datasets` writes its .arrow cache files: a `text` column with `huggingface` schema
# metadata, two rows), captured byte for byte: pyarrow is no Debian package and its wheel
# is 170 MB.
ARROW_STREAM = bytes.fromhex(
    "fffffffff00000001000000000000a000e000600050008000a000000000104001000000000000a000c00000004000800"
    "0a0000008000000004000000010000000c00000008000c0004000800080000005400000004000000470000007b22696e"
    "666f223a207b226665617475726573223a207b2274657874223a207b226474797065223a2022737472696e67222c2022"
    "5f74797065223a202256616c7565227d7d7d7d000b00000068756767696e676661636500010000001400000010001400"
    "0800060007000c00000010001000000000000105100000001c0000000400000000000000040000007465787400000000"
    "0400040004000000ffffffff9800000014000000000000000c0016000600050008000c000c0000000003040018000000"
    "300000000000000000000a0018000c00040008000a0000004c0000001000000002000000000000000000000003000000"
    "0000000000000000000000000000000000000000000000000c0000000000000010000000000000001f00000000000000"
    "000000000100000002000000000000000000000000000000000000000e0000001f000000000000004669727374204369"
    "74697a656e3a4265666f72652077652070726f6365656400ffffffff00000000")


def _arrow_files(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.ipc as ipc
    except ImportError:
        (tmp_path / "data-00000-of-00001.arrow").write_bytes(ARROW_STREAM)
        # The IPC file format: "ARROW1", two pad bytes, the stream's messages, a footer.
        (tmp_path / "table.arrow").write_bytes(b"ARROW1\0\0" + ARROW_STREAM[:-8] + b"ARROW1")
        return
    table = pa.table({"text": ["First Citizen:", "Before we proceed"]})
    with ipc.new_stream(str(tmp_path / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    with ipc.new_file(str(tmp_path / "table.arrow"), table.schema) as w:
        w.write_table(table)


def _foreign_files(tmp_path):
    """Files a first hour points kind="tokens" at by mistake, each by its own writer, and the
    format the refusal must name."""
    tokens = np.arange(2000, dtype=np.uint16)
    with tarfile.open(tmp_path / "shard-000000.tar", "w") as tar:  # a WebDataset shard
        (tmp_path / "0.cls").write_text("3")
        tar.add(tmp_path / "0.cls", arcname="000000.cls")
    np.savez(tmp_path / "tokens.npz", tokens=tokens)
    import torch
    torch.save(torch.from_numpy(tokens.astype(np.int64)), tmp_path / "tokens.pt")
    with gzip.open(tmp_path / "train.bin.gz", "wb") as f:
        f.write(tokens.tobytes())
    with open(tmp_path / "meta.pkl", "wb") as f:  # nanoGPT's meta.pkl
        pickle.dump({"vocab_size": 65, "itos": {i: chr(32 + i) for i in range(65)}}, f)
    (tmp_path / "input.txt").write_text("First Citizen:\nBefore we proceed any further.\n" * 30)
    _arrow_files(tmp_path)
    (tmp_path / "part-0.parquet").write_bytes(b"PAR1" + bytes(100) + b"PAR1")
    return {
        "shard-000000.tar": "a tar archive",
        "tokens.npz": "a zip archive",
        "tokens.pt": "a zip archive",
        "train.bin.gz": "a gzip-compressed file",
        "meta.pkl": "a Python pickle",
        "input.txt": "a text file",
        "data-00000-of-00001.arrow": "an Apache Arrow IPC stream",
        "table.arrow": "an Apache Arrow IPC file",
        "part-0.parquet": "an Apache Parquet file",
    }


def test_files_of_other_formats_are_refused_naming_the_format(daemon, job, tmp_path):
    for name, format_name in _foreign_files(tmp_path).items():
        with pytest.raises(gpufeed.InvalidArgument) as refused:
            served(daemon, job, tmp_path / name)
        assert f"dataset.path: {tmp_path / name} is {format_name}" in str(refused.value), name
        assert "not token ids" in str(refused.value)


def test_the_loader_refuses_an_arrow_file_at_its_first_use(daemon, job, tmp_path):
    _arrow_files(tmp_path)
    from gpufeed.torch import Loader
    loader = Loader(tmp_path / "data-00000-of-00001.arrow", kind="tokens", seq_len=SEQ,
                    batch_size=2, device="cpu", socket=daemon.socket, job=job)
    with pytest.raises(gpufeed.InvalidArgument,
                       match=r"is an Apache Arrow IPC stream \(Hugging Face datasets' \.arrow "
                             r"files are\), not token ids: tokenize its text"):
        len(loader)


# ---- An explicit list of shard files ----


@pytest.fixture
def three(tmp_path):
    """A raw nanoGPT .bin, an np.save .npy and an llm.c shard (uint16) in one directory, and
    their tokens by name."""
    rng = np.random.default_rng(17)
    parts = {name: rng.integers(0, 50257, size=n).astype(np.uint16)
             for name, n in (("a.bin", 51), ("b.npy", 34), ("c.bin", 43))}
    parts["a.bin"].tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", parts["b.npy"])
    write_datafile(tmp_path / "c.bin", parts["c.bin"])
    return tmp_path, parts


def test_a_list_equals_its_directory_and_follows_its_own_order(daemon, job, three):
    root, parts = three
    whole = served(daemon, job, root)
    listed = served(daemon, job + "-l", [root / "a.bin", root / "b.npy", root / "c.bin"])
    assert np.array_equal(listed, whole)
    reordered = served(daemon, job + "-r", [root / "c.bin", root / "a.bin", root / "b.npy"])
    assert np.array_equal(reordered, windows_of(parts["c.bin"], parts["a.bin"], parts["b.npy"]))
    # Files of several directories, one named through a link (resolved by the client).
    (root / "x").mkdir()
    (root / "y").mkdir()
    parts["a.bin"].tofile(root / "x" / "0.bin")
    parts["c.bin"].tofile(root / "y" / "0.bin")
    os.symlink(root / "y" / "0.bin", root / "link.bin")
    spread = served(daemon, job + "-s", [root / "link.bin", root / "x" / "0.bin"])
    assert np.array_equal(spread, windows_of(parts["c.bin"], parts["a.bin"]))


def test_the_loader_takes_a_list(daemon, job, three):
    from gpufeed.torch import Loader
    root, parts = three
    loader = Loader([root / "c.bin", root / "a.bin"], kind="tokens", seq_len=SEQ, batch_size=2,
                    shuffle=False, drop_last=False, device="cpu", socket=daemon.socket, job=job)
    rows = [b["tokens"][b["valid"]].numpy() for b in loader]
    assert np.array_equal(np.concatenate(rows), windows_of(parts["c.bin"], parts["a.bin"]))


def test_a_list_set_in_another_order_does_not_resume(daemon, job, three):
    root, _ = three
    files = [str(root / "a.bin"), str(root / "c.bin")]
    with gpufeed.Client(daemon.socket).attach(files, kind="tokens", seq_len=SEQ, batch_size=2,
                                              job=job) as s:
        next(iter(s))
        fingerprint = s.fingerprint
    assert "paths=2 files" in fingerprint
    with pytest.raises(gpufeed.FailedPrecondition, match="paths was 2 files, fnv1a64 "):
        gpufeed.Client(daemon.socket).attach(files[::-1], kind="tokens", seq_len=SEQ,
                                             batch_size=2, job=job + "-2", start=(0, 1),
                                             start_fingerprint=fingerprint)


def test_bad_lists_are_refused_naming_the_entry(daemon, job, three):
    root, _ = three
    a, b = root / "a.bin", root / "b.npy"
    uid = os.geteuid()
    os.symlink(a, root / "again.bin")
    (root / "sub").mkdir()
    cases = [
        ([a, b, a], gpufeed.InvalidArgument,
         f"attach: dataset.paths[2]: {a} is dataset.paths[0] again; each file may appear once"),
        ([a, root / "again.bin"], gpufeed.InvalidArgument,  # the link resolves to a
         f"attach: dataset.paths[1]: {a} is dataset.paths[0] again; each file may appear once"),
        ([a, root / "gone.bin"], gpufeed.NotFound,
         f"attach: dataset.paths[1]: this process (uid {uid}) cannot open {root / 'gone.bin'} "
         f"(errno 2): No such file or directory"),
        ([a, root / "sub"], gpufeed.InvalidArgument,
         f"attach: dataset.paths[1]: {root / 'sub'} is a directory, not a regular file"),
        ([a] * 16385, gpufeed.InvalidArgument,
         "dataset.paths: 16385 files, at most 16384; name their directory or a glob instead"),
    ]
    for paths, error, message in cases:
        with pytest.raises(error) as refused:
            served(daemon, job, paths)
        assert str(refused.value) == message
    with pytest.raises(gpufeed.InvalidArgument,
                       match="dataset: a list of shard files is for kind tokens and webdataset, "
                             "not 'records'"):
        gpufeed.Client(daemon.socket).attach([b], kind="records", batch_size=2, job=job)
    with pytest.raises(gpufeed.InvalidArgument, match="the list of shard files is empty"):
        gpufeed.Client(daemon.socket).attach([], kind="tokens", seq_len=SEQ, batch_size=2, job=job)


def test_gpufeedctl_consume_takes_several_datasets_as_a_list(daemon, job, three, tmp_path_factory):
    from conftest import gpufeedctl
    root, parts = three
    out = tmp_path_factory.mktemp("dump") / "b"
    run = subprocess.run([gpufeedctl(), "--socket", daemon.socket, "consume", "--job", job,
                          "--seq-len", str(SEQ), "--batch-size", "3", "--no-shuffle",
                          "--max-batches", "1", "--dump", str(out),
                          "--dataset", str(root / "c.bin"), str(root / "a.bin")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = np.load(f"{out}.tokens.npy")
    assert np.array_equal(got, windows_of(parts["c.bin"], parts["a.bin"])[:3])
