#!/usr/bin/env python3
"""Elastic resume on the CPU machine: the time from Attach at a new world size to the first
batch of every rank. A job of 4 ranks reads part of an epoch and checkpoints (rank 0's
position and fingerprint); then the ranks of the new layout attach at that position, each
in its own thread, and each times its Attach and its first next(). The figure is the
slowest rank's, from the first Attach to its first batch (what the resumed training step
waits for). Resumes: 4 -> 4 (the same layout, for comparison), 4 -> 2 and 4 -> 8 keeping the
global batch, 4 -> 3 keeping the per-rank batch. Host delivery. Prints a table and a JSON line.

    tests/bench/elastic_resume_bench.py [--images 2000] [--tokens 50000000] [--repeats 5]

Starts its own gpufeedd (build/server/gpufeedd, or $GPUFEEDD) on a temporary socket and
loads the C library from build/client/c (or $GPUFEED_LIBRARY). The datasets (PNG images of
about 256x192 in 10 classes, resized and cropped to 224; a uint16 token file, seq_len 2048)
are made once in /tmp/gpufeed-elastic-bench.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client/python/src"))
sys.path.insert(0, str(REPO / "tests/python"))
os.environ.setdefault("GPUFEED_LIBRARY", str(REPO / "build/client/c/libgpufeed_c.so"))
GPUFEEDD = os.environ.get("GPUFEEDD", str(REPO / "build/server/gpufeedd"))
DATA = Path("/tmp/gpufeed-elastic-bench")

import gpufeed  # noqa: E402
import reference  # noqa: E402  (tests/python/reference.py: write_png)

PIPELINE = {"ops": [{"resize": {"shorter_side": 256}}, {"center_crop": {"size": 224}}]}
# (name, new world size, elastic mode)
RESUMES = [("4 -> 4 (same layout)", 4, None), ("4 -> 2, global batch", 2, None),
           ("4 -> 8, global batch", 8, None), ("4 -> 3, per-rank batch", 3, "rank_batch")]


def datasets(images: int, tokens: int) -> Dict[str, Tuple[str, Dict[str, Any], int]]:
    """name -> (path, attach settings, per-rank batch at 4 ranks)."""
    folder = DATA / f"images-{images}"
    if not (folder / "done").exists():
        for i in range(images):
            rgb = np.random.default_rng(i).integers(0, 256, size=(192, 256, 3), dtype=np.uint8)
            (folder / f"c{i % 10}").mkdir(parents=True, exist_ok=True)
            reference.write_png(folder / f"c{i % 10}" / f"{i:05d}.png", rgb)
        (folder / "done").write_text("")
    token_file = DATA / f"tokens-{tokens}.bin"
    if not token_file.exists():
        values = (np.arange(tokens, dtype=np.uint64) * 2654435761 % 50257).astype(np.uint16)
        token_file.write_bytes(values.tobytes())
    return {"image_folder (224x224)": (str(folder), dict(kind="image_folder", pipeline=PIPELINE), 8),
            "tokens (seq_len 2048)": (str(token_file), dict(kind="tokens", seq_len=2048,
                                                            token_dtype="uint16"), 8)}


def attach_ranks(client: gpufeed.Client, dataset: str, settings: Dict[str, Any], job: str,
                 world: int, batch: int, **more: Any) -> Tuple[List[gpufeed.Session], float]:
    """The ranks attached and each at its first batch, in threads: (sessions, seconds from
    the first Attach to the last rank's first batch)."""
    sessions: List[Any] = [None] * world
    errors: List[BaseException] = []
    start = time.monotonic()
    done = [0.0] * world

    def rank(r: int) -> None:
        try:
            s = client.attach(dataset, rank=r, world_size=world, batch_size=batch, job=job,
                              ring_slots=2, seed=1, **settings, **more)
            s.next(timeout=60).release()
            done[r] = time.monotonic()
            sessions[r] = s
        except BaseException as e:  # noqa: BLE001  (reported below, with the rank's)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sessions, max(done) - start


def one(client: gpufeed.Client, dataset: str, settings: Dict[str, Any], batch: int, job: str,
        world: int, elastic: Any) -> float:
    sessions, _ = attach_ranks(client, dataset, settings, job, 4, batch)
    for _ in range(5):  # a few steps into the epoch
        for s in sessions:
            s.next(timeout=60).release()
    at, fingerprint = sessions[0].position(), sessions[0].fingerprint
    for s in sessions:
        s.close()
    sessions, seconds = attach_ranks(client, dataset, settings, job, world, batch, start=at,
                                     start_fingerprint=fingerprint, elastic=elastic)
    for s in sessions:
        s.close()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="gpufeedd --threads")
    args = parser.parse_args()
    data = datasets(args.images, args.tokens)
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpufeed-elastic-bench-") as tmp:
        sock = f"{tmp}/gf.sock"
        with open(f"{tmp}/gpufeedd.log", "w") as log:
            daemon = subprocess.Popen(
                [GPUFEEDD, f"--listen=unix://{sock}", f"--threads={args.threads}",
                 f"--staging_bytes={1 << 30}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 10
            while not (os.path.exists(sock) and os.path.exists(f"{tmp}/gf.mem.sock")):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit(f"gpufeedd did not start: {Path(tmp, 'gpufeedd.log').read_text()}")
                time.sleep(0.02)
            client = gpufeed.Client(sock)
            for name, (path, settings, batch) in data.items():
                for label, world, elastic in RESUMES:
                    times = [one(client, path, settings, batch, f"bench-{len(results)}-{i}",
                                 world, elastic) for i in range(args.repeats)]
                    results.append({"dataset": name, "resume": label,
                                    "median_ms": statistics.median(times) * 1e3,
                                    "max_ms": max(times) * 1e3})
        finally:
            daemon.terminate()
            daemon.wait(30)
    print(f"\n{os.cpu_count()} cores, gpufeedd --threads {args.threads}, host delivery, "
          f"{args.repeats} resumes each; Attach of every rank to the last rank's first batch")
    print("| dataset | resume | median ms | max ms |")
    print("|---|---|---:|---:|")
    for r in results:
        print(f"| {r['dataset']} | {r['resume']} | {r['median_ms']:,.1f} | {r['max_ms']:,.1f} |")
    print(json.dumps({"bench": "elastic_resume", "images": args.images, "tokens": args.tokens,
                      "threads": args.threads, "repeats": args.repeats, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
