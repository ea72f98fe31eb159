#!/usr/bin/env python3
"""(c) of the device benchmark: the peer baseline on the same .npy file.

torch.utils.data.DataLoader(num_workers=8, pin_memory=True, shuffle=True) over the rows of a
uint8 (N, 3, 224, 224) .npy, batch 256, each batch moved with .cuda(non_blocking=True); prints
GB/s into GPU memory and one JSON line. Usage: torch_loader_bench.py FILE.npy [BATCHES]
"""
import json
import sys
import time

import numpy as np
import torch


class Rows(torch.utils.data.Dataset):
    def __init__(self, path):
        self.path = path
        self.array = None
        self.n = np.load(path, mmap_mode="r").shape[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.array is None:  # opened per worker
            self.array = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.array(self.array[i]))


def main():
    path = sys.argv[1]
    batches = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    loader = torch.utils.data.DataLoader(Rows(path), batch_size=256, shuffle=True, num_workers=8,
                                         pin_memory=True, drop_last=True, persistent_workers=True)
    it = iter(loader)
    for _ in range(5):  # warm-up: workers started, pages cached
        next(it).cuda(non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    moved = 0
    for _ in range(batches):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        gpu = batch.cuda(non_blocking=True)
        moved += gpu.numel()
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    print(f"| (c) torch DataLoader(num_workers=8, pin_memory=True) + .cuda(non_blocking=True) | "
          f"{moved / secs / 1e9:.2f} GB/s, {batches / secs:.1f} batches/s |")
    print(json.dumps({"bench": "torch_loader", "bytes_per_s": moved / secs,
                      "batches_per_s": batches / secs}))


if __name__ == "__main__":
    main()
