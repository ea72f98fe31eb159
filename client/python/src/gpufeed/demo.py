"""The demo data set the README examples read: ``python3 -m gpufeed.demo [DIR]``.

Writes, into ``DIR`` (default :data:`DEFAULT_DIR`, ``/tmp/gpufeed-demo``), one small data set
of every kind, about 1 MB in all, made of numpy and the standard library only::

    tokens.bin              16,385 uint16 tokens of a vocabulary of 512 (each the one before
                            plus 1 or 2, mod 512: a tiny model learns it), 256 windows of
                            seq_len 64
    x.npy, y.npy            records: x float32 [256, 8] (row i = i + 0.125 * 0..7),
                            y int64 [256] (i mod 10); as {"x": ..., "y": ...} or x.npy alone
    images/cat, images/dog  an image folder: 16 PNGs of 48 x 64 pixels in each class
    shards/train-000000.tar, shards/train-000001.tar
                            WebDataset shards of the same 32 images (.png) and labels (.cls)

Running it again rewrites the same bytes. The README's examples read these paths; to try them
on your own data, change the paths.
"""

from __future__ import annotations

import io
import os
import struct
import sys
import tarfile
import zlib
from typing import List, Tuple

import numpy as np

DEFAULT_DIR = "/tmp/gpufeed-demo"
"""Where ``python3 -m gpufeed.demo`` writes the demo data set by default."""

VOCAB = 512
"""The demo tokens' vocabulary: every token is below it."""
_TOKENS = 16385
_ROWS = 256
_PER_CLASS = 16
_HEIGHT, _WIDTH = 48, 64


def _png(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` [H, W, 3] uint8 (no filter, zlib)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _images() -> List[Tuple[str, int, bytes]]:
    """(class, label, PNG bytes) of the demo images: smooth colour ramps, each its own."""
    y, x = np.mgrid[0:_HEIGHT, 0:_WIDTH]
    out = []
    for label, name in enumerate(("cat", "dog")):
        for k in range(_PER_CLASS):
            rgb = np.stack([(x * 4 + k * 9) % 256, (y * 5 + label * 128) % 256,
                            ((x + y) * 3 + k * 16) % 256], axis=-1).astype(np.uint8)
            out.append((name, label, _png(rgb)))
    return out


def _write(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary name, so a reader never sees half."""
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)


def write(directory: str = DEFAULT_DIR) -> str:
    """Writes the demo data set into ``directory`` (made if missing); returns its path."""
    os.makedirs(directory, exist_ok=True)
    steps = np.random.default_rng(0).integers(1, 3, size=_TOKENS, dtype=np.int64)
    tokens = np.cumsum(steps) % VOCAB
    _write(os.path.join(directory, "tokens.bin"), tokens.astype("<u2").tobytes())

    for name, array in (("x", np.arange(_ROWS, dtype=np.float32)[:, None]
                         + np.float32(0.125) * np.arange(8, dtype=np.float32)),
                        ("y", np.arange(_ROWS, dtype=np.int64) % 10)):
        buffer = io.BytesIO()
        np.save(buffer, array)
        _write(os.path.join(directory, f"{name}.npy"), buffer.getvalue())

    images = _images()
    counts = {}
    for name, _, png in images:
        folder = os.path.join(directory, "images", name)
        os.makedirs(folder, exist_ok=True)
        counts[name] = counts.get(name, 0) + 1
        _write(os.path.join(folder, f"{counts[name] - 1:03d}.png"), png)

    shards = os.path.join(directory, "shards")
    os.makedirs(shards, exist_ok=True)
    for shard in range(2):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            # Shuffled between the shards: each holds both classes.
            for i in range(shard, len(images), 2):
                key = f"{i:06d}"
                _, label, png = images[i]
                for suffix, data in (("png", png), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{key}.{suffix}")
                    info.size, info.mtime, info.mode = len(data), 0, 0o644
                    tar.addfile(info, io.BytesIO(data))
        _write(os.path.join(shards, f"train-{shard:06d}.tar"), buffer.getvalue())
    return directory


def main(argv: List[str]) -> int:
    if len(argv) > 2 or (len(argv) == 2 and argv[1] in ("-h", "--help")):
        print(__doc__)
        return 0 if len(argv) == 2 else 2
    directory = write(argv[1] if len(argv) == 2 else DEFAULT_DIR)
    print(f"gpufeed demo data set in {directory}: tokens.bin, x.npy, y.npy, images/, "
          f"shards/train-{{000000..000001}}.tar")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
