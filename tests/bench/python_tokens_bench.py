#!/usr/bin/env python3
"""Python consumer batches/s for tokens: gpufeed.torch.Loader with host delivery
against torch's DataLoader(num_workers=2) over a map-style dataset on the same memory-mapped
file, both yielding shuffled [B, L+1] integer batches as torch tensors. Prints a table and a
JSON line.

    tests/bench/python_tokens_bench.py [--batch 32] [--seq-len 512] [--seconds 10]

Starts its own gpufeedd (build/server/gpufeedd, or $GPUFEEDD) on a temporary socket and
loads the C library from build/client/c (or $GPUFEED_LIBRARY).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "client/python/src"))
os.environ.setdefault("GPUFEED_LIBRARY", str(REPO / "build/client/c/libgpufeed_c.so"))

import gpufeed.torch  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Sample i: tokens [i*L, i*L + L] of the memory-mapped file, as int64 (as a training
    loop needs them)."""

    def __init__(self, path: str, seq_len: int):
        self.path, self.seq_len = path, seq_len
        self.tokens = None
        self.n = (os.path.getsize(path) // 2 - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.tokens is None:  # opened in the worker, after the fork
            self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))


def measure(name: str, batches, seconds: float, warmup: int = 20) -> dict:
    it = iter(batches)
    for _ in range(warmup):
        next(it)
    count, checksum, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(it)
        checksum += int(batch[0, 0])  # the consumer reads the batch
        count += 1
    elapsed = time.perf_counter() - start
    print(f"{name}: {count} batches in {elapsed:.1f} s: {count / elapsed:,.0f} batches/s",
          file=sys.stderr)
    return {"name": name, "batches": count, "seconds": elapsed, "batches_per_s": count / elapsed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64 << 20, help="file size in tokens")
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gpufeed-tokens-bench-"))
    data = work / "tokens.bin"
    np.random.default_rng(0).integers(0, 50257, args.tokens, dtype=np.uint16).tofile(data)
    sock = work / "gf.sock"
    daemon = subprocess.Popen([os.environ.get("GPUFEEDD", str(REPO / "build/server/gpufeedd")),
                               f"--listen=unix://{sock}", "--threads=2"],
                              stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.05)
        results = []
        loader = gpufeed.torch.Loader(str(data), kind="tokens", token_dtype="uint16",
                                      seq_len=args.seq_len, batch_size=args.batch, seed=1,
                                      device="cpu", socket=str(sock), job="bench")

        def gpufeed_batches():
            while True:
                for batch in loader:
                    yield batch["tokens"].long()  # int64, as the DataLoader's
        results.append(measure("gpufeed.torch.Loader (host delivery)", gpufeed_batches(),
                               args.seconds))
        loader.close()

        dl = torch.utils.data.DataLoader(Windows(str(data), args.seq_len), batch_size=args.batch,
                                         shuffle=True, num_workers=2, drop_last=True,
                                         persistent_workers=True)

        def torch_batches():
            while True:
                yield from dl
        results.append(measure("torch DataLoader(num_workers=2), map-style memmap",
                               torch_batches(), args.seconds))
    finally:
        daemon.terminate()
        daemon.wait()
        for f in work.iterdir():
            f.unlink()
        work.rmdir()

    ratio = results[0]["batches_per_s"] / results[1]["batches_per_s"]
    print(f"\nB={args.batch}, seq_len={args.seq_len}, {os.cpu_count()} cores, torch {torch.__version__}")
    print("| consumer | batches/s |")
    print("|---|---:|")
    for r in results:
        print(f"| {r['name']} | {r['batches_per_s']:,.0f} |")
    print(f"| gpufeed / DataLoader | {ratio:.1f}x |")
    print(json.dumps({"bench": "python_tokens", "batch": args.batch, "seq_len": args.seq_len,
                      "results": results, "ratio": ratio}))


if __name__ == "__main__":
    main()
