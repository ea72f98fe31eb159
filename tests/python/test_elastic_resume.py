"""Elastic exact resume (docs/howto/checkpoint-resume.md, "Elastic resume"): a job checkpointed
at one world size resumes at another, with the daemon SIGKILLed in between, against the real
gpufeedd, host delivery.

Each job here is one process that drives its ranks' sessions in turn, a step at a time (every
rank's batch of a step before the next step's): a rank's session is what a training process
holds, and the daemon serves each rank on its own. The stop steps are drawn at random from a
generator seeded in the test, so a failure replays.

drop_last=False throughout: the resumed runs change the global batch (16 at four ranks of 4,
12 at three), and no dataset size divides every global batch, so with drop_last an epoch's
tail would be dropped by one layout and kept by another. Padding keeps every sample, and the
padded rows (past valid_count) are left out of the exactly-once count.

- Keeping the global batch, 4 -> 2 -> 4 ranks: every global batch (the ranks' rows in rank
  order, every tensor's bytes) hashes as the uninterrupted run's, and each epoch holds every
  sample once.
- 4 -> 2 (global batch) -> 3 -> 4 (per-rank batch): each epoch holds every sample once, none
  repeated, none skipped.
- Image folder (augmented: the bytes depend on epoch and sample), tokens, records and
  WebDataset.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import pytest

import gpufeed
import reference
from conftest import Daemon

SEED = 5
EPOCHS = 2
BATCH = 4  # per rank at four ranks: a global batch of 16


# ---- datasets: (path, attach settings, sample count) ----

def image_folder(root: Path):
    d = root / "images"
    for i in range(100):
        rgb = np.random.default_rng(i).integers(0, 256, size=(9 + i % 5, 11, 3), dtype=np.uint8)
        (d / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        reference.write_png(d / f"c{i % 3}" / f"{i:03d}.png", rgb)
    pipeline = {"ops": [{"random_resized_crop": {"size": 6}}, {"flip": {"p": 0.5}}]}
    return str(d), dict(kind="image_folder", pipeline=pipeline), 100


def tokens(root: Path):
    n, seq_len = 203, 7
    values = (np.arange(n * seq_len + 1, dtype=np.uint32) * 7919 % 65521).astype(np.uint16)
    (root / "tokens.bin").write_bytes(values.tobytes())
    return str(root / "tokens.bin"), dict(kind="tokens", seq_len=seq_len, token_dtype="uint16"), n


def records(root: Path):
    np.save(root / "rows.npy", np.arange(150 * 3, dtype=np.float32).reshape(150, 3) / 3)
    return str(root / "rows.npy"), dict(kind="records"), 150


def webdataset(root: Path):
    d = root / "wds"
    d.mkdir()
    for k in range(3):
        with tarfile.open(d / f"train-{k:06d}.tar", "w", format=tarfile.GNU_FORMAT) as tar:
            for i in range(26):
                png = root / "img.png"
                rgb = np.random.default_rng(k * 100 + i).integers(0, 256, size=(7, 9, 3),
                                                                  dtype=np.uint8)
                reference.write_png(png, rgb)
                for name, data in ((f"s{k}_{i:03d}.png", png.read_bytes()),
                                   (f"s{k}_{i:03d}.cls", f"{(k + i) % 4}".encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return str(d / "train-{000000..000002}.tar"), dict(
        kind="webdataset", pipeline={"ops": [{"random_resized_crop": {"size": 5}},
                                             {"flip": {"p": 0.5}}]}), 78


DATASETS = [image_folder, tokens, records, webdataset]
DATASET_IDS = ["image_folder", "tokens", "records", "webdataset"]


# ---- a job: its ranks' sessions, stepped together ----

class Step(NamedTuple):
    epoch: int
    digest: str      # of the global batch: the ranks' rows in rank order, every tensor
    valid: List[int]  # the real samples' ids, all ranks


class Job:
    """Rank 0..world-1 of job `name`, attached at `start` (a Position and its fingerprint)."""

    def __init__(self, daemon: Daemon, dataset: str, settings: Dict[str, Any], name: str,
                 world: int, batch: int, start: Optional[Tuple[gpufeed.Position, str]] = None,
                 elastic: Optional[str] = None) -> None:
        client = gpufeed.Client(daemon.socket)
        self.sessions = []
        for rank in range(world):
            self.sessions.append(client.attach(
                dataset, rank=rank, world_size=world, batch_size=batch, job=name, seed=SEED,
                drop_last=False, ring_slots=2, stop_epoch=EPOCHS, reconnect_timeout=30,
                start=None if start is None else start[0],
                start_fingerprint=None if start is None else start[1], elastic=elastic,
                **settings))

    def step(self) -> Optional[Step]:
        """The next global batch; None after the last epoch."""
        rows: Dict[str, List[bytes]] = {}
        valid: List[int] = []
        where = set()
        for session in self.sessions:
            try:
                b = session.next(timeout=30)
            except gpufeed.OutOfRange:
                return None
            with b:
                where.add((b.epoch, b.step, b.after))
                valid += b.ids[: b.valid_count].tolist()
                for name, tensor in sorted(b.tensors.items()):
                    rows.setdefault(name, []).append(tensor.numpy().tobytes())
        assert len(where) == 1, f"the ranks' batches are at different places: {where}"
        digest = hashlib.sha256()
        for name, parts in sorted(rows.items()):
            digest.update(name.encode())
            for part in parts:
                digest.update(part)
        return Step(next(iter(where))[0], digest.hexdigest(), valid)

    def run(self, steps: Optional[int] = None) -> List[Step]:
        out: List[Step] = []
        while steps is None or len(out) < steps:
            s = self.step()
            if s is None:
                break
            out.append(s)
        return out

    def checkpoint(self) -> Tuple[gpufeed.Position, str]:
        """Rank 0's position and fingerprint, after checking every rank is at the same one:
        the global cursor describes the whole job."""
        positions = {(p.epoch, p.step, p.samples) for p in (s.position() for s in self.sessions)}
        assert len(positions) == 1, f"the ranks' positions differ: {positions}"
        return self.sessions[0].position(), self.sessions[0].fingerprint

    @property
    def batch_sizes(self) -> List[int]:
        return [s.info.batch_size for s in self.sessions]

    def close(self) -> None:
        for s in self.sessions:
            s.close()


def assert_each_sample_once_per_epoch(steps: List[Step], n: int) -> None:
    for epoch in range(EPOCHS):
        seen = Counter(i for s in steps if s.epoch == epoch for i in s.valid)
        repeated = sorted(i for i, c in seen.items() if c > 1)
        skipped = sorted(set(range(n)) - set(seen))
        assert not repeated and not skipped, (
            f"epoch {epoch}: repeated {repeated[:10]} ({len(repeated)}), skipped "
            f"{skipped[:10]} ({len(skipped)})")


def draws(test_seed: int, n: int, steps_per_epoch: int) -> List[int]:
    """`n` stop counts (global batches of each phase but the last), small enough that the
    last phase still has batches to read within the two epochs."""
    rng = random.Random(test_seed)
    return [rng.randint(1, (EPOCHS * steps_per_epoch - 1) // n) for _ in range(n)]


@pytest.mark.parametrize("draw", [1, 2], ids=["draw1", "draw2"])
@pytest.mark.parametrize("make", DATASETS, ids=DATASET_IDS)
def test_keeping_the_global_batch_4_2_4_gives_the_uninterrupted_global_batches(
        tmp_path, make, draw):
    dataset, settings, n = make(tmp_path)
    daemon = Daemon(tmp_path)
    steps_per_epoch = -(-n // (4 * BATCH))
    first, second, third = draws(draw, 3, steps_per_epoch)
    try:
        clean = Job(daemon, dataset, settings, "clean", 4, BATCH)
        want = clean.run()
        clean.close()
        assert len(want) == EPOCHS * steps_per_epoch

        job = Job(daemon, dataset, settings, "elastic", 4, BATCH)
        got = job.run(first)
        at = job.checkpoint()
        job.close()
        # Two ranks, asking for the saved per-rank batch: each gets the saved global batch / 2.
        job = Job(daemon, dataset, settings, "elastic", 2, BATCH, start=at)
        assert job.batch_sizes == [2 * BATCH] * 2
        got += job.run(second)
        daemon = daemon.kill_and_restart()  # the sessions re-attach at their next batch
        got += job.run(third)
        at = job.checkpoint()
        job.close()
        # Four again, asking for saved global batch / 4 (the saved per-rank batch is 8).
        job = Job(daemon, dataset, settings, "elastic", 4, BATCH, start=at)
        assert job.batch_sizes == [BATCH] * 4
        got += job.run()
        job.close()
    finally:
        daemon.stop()
    assert [(s.epoch, s.digest) for s in got] == [(s.epoch, s.digest) for s in want], (
        f"stops after {first}, {first + second} (+ a daemon kill) and {first + second + third} "
        "global batches")
    assert_each_sample_once_per_epoch(got, n)


@pytest.mark.parametrize("make", DATASETS, ids=DATASET_IDS)
def test_4_2_3_4_with_the_per_rank_batch_delivers_each_sample_once_per_epoch(tmp_path, make):
    dataset, settings, n = make(tmp_path)
    daemon = Daemon(tmp_path)
    steps_per_epoch = -(-n // (4 * BATCH))
    first, second, third, fourth = draws(7, 4, steps_per_epoch)
    try:
        job = Job(daemon, dataset, settings, "elastic", 4, BATCH)
        got = job.run(first)
        at = job.checkpoint()
        job.close()
        job = Job(daemon, dataset, settings, "elastic", 2, BATCH, start=at)
        got += job.run(second)
        at = job.checkpoint()
        job.close()
        daemon = daemon.kill_and_restart()
        # Three ranks of 4: a global batch of 12, which 16 never divides into.
        job = Job(daemon, dataset, settings, "elastic", 3, BATCH, start=at, elastic="rank_batch")
        assert job.batch_sizes == [BATCH] * 3
        got += job.run(third)
        daemon = daemon.kill_and_restart()  # mid-epoch of a resumed layout: re-attach
        got += job.run(fourth)
        at = job.checkpoint()
        job.close()
        job = Job(daemon, dataset, settings, "elastic", 4, BATCH, start=at, elastic="rank_batch")
        assert job.batch_sizes == [BATCH] * 4
        got += job.run()
        job.close()
    finally:
        daemon.stop()
    assert {s.epoch for s in got} == set(range(EPOCHS))
    assert_each_sample_once_per_epoch(got, n)


def test_a_global_batch_the_new_world_size_does_not_divide_is_refused(tmp_path):
    dataset, settings, n = records(tmp_path)
    daemon = Daemon(tmp_path)
    try:
        job = Job(daemon, dataset, settings, "big", 4, 64)  # a global batch of 256
        at = job.checkpoint()
        job.close()
        with pytest.raises(gpufeed.InvalidArgument) as refused:
            Job(daemon, dataset, settings, "big", 3, 64, start=at)
    finally:
        daemon.stop()
    message = str(refused.value)
    assert "\n" not in message
    assert message == ELASTIC_REFUSAL, message


# What the daemon says when the saved global batch (256) does not divide among 3 ranks.
ELASTIC_REFUSAL = (
    "attach: world_size: the saved position's global batch of 256 samples (64 x 4 ranks) does "
    "not split over 3 ranks; resume at a world size that divides it (1, 2, 4, 8, 16, 32, 64, "
    "128, 256), or with elastic=rank_batch to keep 64 samples per rank")


# ---- torchrun: the Loader's state_dict from rank 0 of 4 resumes 2 ranks ----

TORCHRUN_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import gpufeed.torch

phase, dataset, socket, out, state_path, stop = sys.argv[1:7]
dist.init_process_group("gloo")
loader = gpufeed.torch.Loader(dataset, kind="records", batch_size=4, seed=3, drop_last=False,
                              device="cpu", socket=socket, timeout=30, job="elastic-torchrun")
if phase == "resume":
    loader.load_state_dict(torch.load(state_path))
seen = []
for epoch in range(loader.position.epoch, 2):
    loader.set_epoch(epoch)
    for b in loader:
        seen.append([b.epoch, b.ids[: b.valid_count].tolist()])
        if phase == "first" and len(seen) == int(stop):
            break
    if phase == "first" and len(seen) == int(stop):
        break
dist.barrier()
if phase == "first" and dist.get_rank() == 0:
    torch.save(loader.state_dict(), state_path)
with open(f"{out}.{dist.get_rank()}", "w") as f:
    json.dump({"world": loader.world_size, "batch_size": loader.batch_size, "seen": seen}, f)
loader.close()
dist.destroy_process_group()
"""


def test_torchrun_4_then_2_resumes_rank_0s_state_dict_exactly_once(tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841  (skips visibly where torch is missing)
    dataset, _, n = records(tmp_path)
    daemon = Daemon(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    state = tmp_path / "loader.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    results = {}
    try:
        for phase, world in (("first", 4), ("resume", 2)):
            out = tmp_path / phase
            done = subprocess.run(
                # --redirects/--tee 1 (the workers' stdout also to files under --log_dir):
                # their default, 0, fails in some torch launchers under Python 3.12 (an
                # IntFlag's zero member is not iterated, so "0" parses to None).
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(world), "--redirects", "1", "--tee", "1",
                 "--log_dir", str(tmp_path / f"logs-{phase}"), str(script), phase, dataset,
                 daemon.socket,
                 str(out), str(state), "3"],
                env=env, capture_output=True, text=True, timeout=100)
            assert done.returncode == 0, done.stderr[-3000:]
            results[phase] = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    finally:
        daemon.stop()
    assert [r["world"] for r in results["resume"]] == [2, 2]
    # The global batch kept: 4 ranks x 4 -> 2 ranks x 8.
    assert [r["batch_size"] for r in results["resume"]] == [8, 8]
    for epoch in range(EPOCHS):
        seen = Counter(i for phase in results.values() for r in phase
                       for e, ids in r["seen"] if e == epoch for i in ids)
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, epoch
