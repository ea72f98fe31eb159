#!/usr/bin/env python3
"""A tiny GPT trained for a few steps on a tokens file through gpufeed.

    # a daemon already running (GPUFEED_SOCKET or /run/gpufeed/gpufeed.sock):
    python3 train_tokens.py --data /data/train.bin --steps 50
    # or self-contained on any machine: a synthetic file and a daemon of its own
    python3 train_tokens.py --make-data /tmp/tokens.bin --gpufeedd build/server/gpufeedd

Runs on the CPU or the current GPU (``--device``). Under torchrun every rank reads its own
slice of each global batch (RANK / WORLD_SIZE are picked up by the loader); this example does
not wrap the model in DDP, it only shows the data side.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpufeed
import gpufeed.torch


class TinyGPT(nn.Module):
    """Token and position embeddings, a few pre-norm causal self-attention blocks, a head."""

    def __init__(self, vocab: int, seq_len: int, dim: int = 128, layers: int = 2,
                 heads: int = 4) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq_len, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tokens(x) + self.positions(torch.arange(t, device=x.device))
        h = self.blocks(h, mask=self.causal[:t, :t])
        return self.head(self.norm(h))


def make_data(path: str, vocab: int, count: int = 1 << 20) -> None:
    """A learnable synthetic stream: each token is the previous one plus 1 or 2 (mod vocab)."""
    rng = np.random.default_rng(0)
    steps = rng.integers(1, 3, size=count, dtype=np.int64)
    np.cumsum(steps, out=steps)
    # Every torchrun rank writes the same bytes: each to its own file, renamed into place, so
    # no rank ever attaches to a half-written one.
    partial = f"{path}.{os.getpid()}.tmp"
    (steps % vocab).astype(np.uint16).tofile(partial)
    os.replace(partial, path)
    print(f"wrote {count} uint16 tokens to {path}")


@contextlib.contextmanager
def own_daemon(binary: str):
    """gpufeedd on a socket in a temp dir, for as long as the block runs."""
    with tempfile.TemporaryDirectory(prefix="gpufeed-example-") as d:
        socket = os.path.join(d, "gf.sock")
        log = open(os.path.join(d, "gpufeedd.log"), "wb")
        proc = subprocess.Popen([binary, f"--listen=unix://{socket}",
                                 "--staging_bytes=268435456"], stdout=log, stderr=log)
        try:
            for _ in range(200):
                if os.path.exists(socket[:-5] + ".mem.sock"):
                    break
                if proc.poll() is not None:
                    sys.exit(f"gpufeedd exited with {proc.returncode}")
                time.sleep(0.05)
            yield socket
        finally:
            proc.terminate()
            proc.wait()
            log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--data", help="tokens file (flat uint16 or uint32 token ids)")
    p.add_argument("--make-data", metavar="PATH", help="write a synthetic tokens file and use it")
    p.add_argument("--token-dtype", default="uint16", choices=["uint16", "uint32"])
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size (> every token id)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: CUDA if present)")
    p.add_argument("--socket", default=None, help="gpufeedd socket (default $GPUFEED_SOCKET)")
    p.add_argument("--gpufeedd", metavar="BINARY", help="start this gpufeedd for the run")
    args = p.parse_args()
    if args.make_data:
        make_data(args.make_data, args.vocab)
        args.data = args.make_data
    if not args.data:
        p.error("give --data or --make-data")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        # Under torchrun each rank takes its own GPU.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    with contextlib.ExitStack() as stack:
        socket = stack.enter_context(own_daemon(args.gpufeedd)) if args.gpufeedd else args.socket
        loader = stack.enter_context(gpufeed.torch.Loader(
            args.data, kind="tokens", token_dtype=args.token_dtype, seq_len=args.seq_len,
            vocab_size=args.vocab,  # refuses a file whose tokens reach it (a wrong dtype)
            batch_size=args.batch_size, seed=args.seed, device=device, socket=socket))
        print(f"rank {loader.rank}/{loader.world_size}: {loader.info.num_samples} windows of "
              f"{args.seq_len + 1} tokens, {len(loader)} batches per epoch, "
              f"{loader.info.ring_slots} ring slots, delivery to {loader.device}")

        torch.manual_seed(args.seed)
        model = TinyGPT(args.vocab, args.seq_len).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        step, wait, start = 0, 0.0, time.perf_counter()
        while step < args.steps:
            batches = iter(loader)  # one epoch (the next after one that ended)
            while step < args.steps:
                t0 = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                wait += time.perf_counter() - t0
                tokens = batch["tokens"].long()  # widen: the file holds unsigned ids
                x, y = tokens[:, :-1], tokens[:, 1:]
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if step == 1 or step % 10 == 0 or step == args.steps:
                    print(f"step {step:4d}  epoch {batch.epoch} batch {batch.step:4d}  "
                          f"loss {loss.item():.3f}  (uniform: {math.log(args.vocab):.3f})")
        elapsed = time.perf_counter() - start
        print(f"{step} steps in {elapsed:.2f} s, {step * args.batch_size / elapsed:.0f} "
              f"sequences/s, {100 * wait / elapsed:.1f} % of the time waiting for data; "
              f"resume state {loader.state_dict()}")


if __name__ == "__main__":
    try:
        main()
    except gpufeed.Error as e:
        sys.exit(f"gpufeed: {type(e).__name__}: {e}")
