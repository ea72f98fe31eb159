"""What the daemon must deliver, computed independently in Python: the epoch permutation of
the README's contract (a keyed 4-round Feistel bijection with cycle walking, "feistel1"), each rank's
slice of a global batch, and the datasets the tests create with their expected rows."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

_MASK = (1 << 64) - 1


def _fmix64(z: int) -> int:
    """SplitMix64's output function."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _splitmix64(state: int) -> Tuple[int, int]:
    """(next state, output) of one SplitMix64 step."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK
    return state, _fmix64(state)


class EpochOrder:
    """The order of one epoch ("feistel1", README and ARCHITECTURE section 6): a 4-round
    Feistel network keyed by (seed, epoch) over the smallest power-of-two domain of an even
    bit count >= n, restricted to [0, n) by cycle walking. Position -> sample id."""

    def __init__(self, n: int, seed: int, epoch: int, shuffle: bool = True):
        self.n = n
        self.identity = not shuffle or n < 2
        if self.identity:
            return
        bits = max(1, (n - 1).bit_length())
        if bits % 2:
            bits += 1
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        state, out = _splitmix64(seed & _MASK)
        state = out ^ (epoch & _MASK)
        self.keys = []
        for _ in range(4):
            state, key = _splitmix64(state)
            self.keys.append(key)

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_fmix64((right + key) & _MASK) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.identity:
            return i
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x


@lru_cache(maxsize=64)
def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> Tuple[int, ...]:
    """Epoch `epoch`'s order of the `n` sample ids, materialised (small n only)."""
    order = EpochOrder(n, seed, epoch, shuffle)
    return tuple(order[i] for i in range(n))


def steps_per_epoch(n: int, batch: int, world: int, drop_last: bool) -> int:
    g = batch * world
    return n // g if drop_last else (n + g - 1) // g


def rank_slice(n: int, seed: int, epoch: int, step: int, rank: int, world: int, batch: int,
               shuffle: bool = True, even: bool = False) -> Tuple[List[int], int]:
    """(ids, valid_count) of rank `rank`'s batch at (epoch, step). `even`: torch
    DistributedSampler's split (ceil(n / world) real samples a rank, at epoch positions
    rank, rank + world, ...)."""
    order = EpochOrder(n, seed, epoch, shuffle)
    if even:
        per_rank = (n + world - 1) // world
        ks = [step * batch + i for i in range(batch)]
        return ([order[(k * world + rank) % n] for k in ks], sum(1 for k in ks if k < per_rank))
    first = (step * world + rank) * batch
    ids = [order[(first + i) % n] for i in range(batch)]
    valid = sum(1 for i in range(batch) if first + i < n)
    return ids, valid


# ---- datasets ----


def write_png(path: Path, rgb: np.ndarray) -> None:
    """An 8-bit RGB PNG of `rgb` [H, W, 3] uint8 (no filter, zlib)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


@dataclass
class Datasets:
    """Paths and contents of the test datasets."""

    seq_len: int
    tokens_u16: Path
    tokens_u16_values: np.ndarray
    tokens_u32: Path
    tokens_u32_values: np.ndarray
    records: Path        # int64 [N, 3, 5], row i = i * 100 + 0..14
    records_f16: Path    # float16 [N, 7], arbitrary bits (incl. negative, subnormal)
    big_records: Path    # uint8 [16, 1 MiB]: rings of it exhaust the daemon's 64 MiB pool
    images: Path         # image folder: cat/ (3 PNGs), dog/ (4 PNGs), 4 x 6 pixels each
    image_pixels: List[np.ndarray] = field(default_factory=list)  # by id: [4, 6, 3] uint8
    image_labels: List[int] = field(default_factory=list)
    bad_images: Path = Path()  # as `images`, plus dog/zz_bad.png that is no image
    bad_image_path: Path = Path()

    def tokens(self, dtype: str) -> Tuple[Path, np.ndarray]:
        return ((self.tokens_u16, self.tokens_u16_values) if dtype == "uint16"
                else (self.tokens_u32, self.tokens_u32_values))

    def token_rows(self, dtype: str, ids) -> np.ndarray:
        """Expected rows [len(ids), seq_len + 1] of a tokens dataset."""
        _, values = self.tokens(dtype)
        return np.stack([values[i * self.seq_len: i * self.seq_len + self.seq_len + 1]
                         for i in ids])


def make_datasets(root: Path, seq_len: int, tokens_n: int) -> Datasets:
    count = seq_len * tokens_n + 1 + 5
    k = np.arange(count, dtype=np.uint64)
    # Values above 2^15 (2^31) catch a sign extension where the loader widens uint16 (uint32).
    u16 = ((k * 40503 + 7) % 65536).astype(np.uint16)
    u32 = ((k * 2654435761 + 11) % (1 << 32)).astype(np.uint32)
    (root / "tokens16.bin").write_bytes(u16.tobytes())
    (root / "tokens32.bin").write_bytes(u32.tobytes())

    records = (np.arange(157, dtype=np.int64)[:, None, None] * 100
               + np.arange(15, dtype=np.int64).reshape(1, 3, 5))
    np.save(root / "records.npy", records)
    rng = np.random.default_rng(5)
    f16 = rng.integers(0, 1 << 16, size=(101, 7), dtype=np.uint16).view(np.float16)
    f16[np.isnan(f16)] = 1.0  # keep every value comparable
    np.save(root / "records_f16.npy", f16)
    big = np.lib.format.open_memmap(root / "big.npy", mode="w+", dtype=np.uint8,
                                    shape=(16, 1 << 20))
    del big

    pixels: List[np.ndarray] = []
    labels: List[int] = []
    images = root / "images"
    bad = root / "bad_images"
    for label, (cls, n) in enumerate((("cat", 3), ("dog", 4))):
        for folder in (images, bad):
            (folder / cls).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            rgb = rng.integers(0, 256, size=(4, 6, 3), dtype=np.uint8)
            for folder in (images, bad):
                write_png(folder / cls / f"img{i}.png", rgb)
            pixels.append(rgb)
            labels.append(label)
    bad_path = bad / "dog" / "zz_bad.png"
    bad_path.write_bytes(b"this is not an image at all")

    return Datasets(seq_len=seq_len, tokens_u16=root / "tokens16.bin", tokens_u16_values=u16,
                    tokens_u32=root / "tokens32.bin", tokens_u32_values=u32,
                    records=root / "records.npy", records_f16=root / "records_f16.npy",
                    big_records=root / "big.npy", images=images, image_pixels=pixels,
                    image_labels=labels, bad_images=bad, bad_image_path=bad_path)


def records_rows(path: Path, ids) -> np.ndarray:
    """Rows `ids` of the .npy at `path`, read with numpy."""
    return np.load(path)[np.asarray(ids, dtype=np.int64)]


def center_crop(rgb: np.ndarray, size: int) -> np.ndarray:
    """torchvision's CenterCrop of [H, W, 3]."""
    h, w, _ = rgb.shape
    top = int(round((h - size) / 2.0))
    left = int(round((w - size) / 2.0))
    return rgb[top:top + size, left:left + size]


def expected_epoch(n: int, seed: int, epoch: int, world: int, batch: int,
                   drop_last: bool) -> Dict[int, List[Tuple[List[int], int]]]:
    """{rank: [(ids, valid) per step]} for one epoch."""
    steps = steps_per_epoch(n, batch, world, drop_last)
    return {r: [rank_slice(n, seed, epoch, s, r, world, batch) for s in range(steps)]
            for r in range(world)}
