#!/usr/bin/env python3
"""Generate the image benchmark's dataset: an ImageFolder tree of JPEGs like ImageNet's.

DIR/class_000/img_00000.jpg ...: image i belongs to class i % classes. Every image is a random
crop of one of scikit-image's bundled sample photos (read straight from the installed package,
never fetched), scaled, sometimes rotated and mirrored, sharpened, colour-shifted, overlaid
with a bundled grey texture (grass, gravel) for fine detail, plus sensor-like noise (mostly
luminance, stronger in bright areas) whose strength is searched per image so that the file
lands in [--min-kb, --max-kb] (KB = 1024 bytes). Files are baseline (non-progressive) JPEG,
4:2:0, RGB, quality --quality, about 500x375.

These photos give only 2-2.6 bits/pixel at quality 90, and 100-130 KiB at 500x375 is about 5,
so at quality 90 the noise is strong (sigma around 40 levels before the brightness scaling):
the files have ImageNet's bytes and pixels per image, which set the decode cost, and a grainy
look. A higher --quality needs less noise.

Image i depends only on (--seed, i), so a run is resumable and idempotent: files already there
are kept, missing ones are made (written under a temporary name, then renamed), and a complete
tree is left alone. Without scikit-image, procedural sources are used instead (a warning says so).

Example: make_dataset.py --out /tmp/imagenet_like --images 20000 --classes 100
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

# (width, height) of the outputs and their relative frequency: ImageNet's common shapes of
# about 500x375. Smaller ones (400x300) cannot hold 100 KiB at quality 90 even with strong noise.
SIZES: list[tuple[tuple[int, int], int]] = [
    ((500, 375), 6), ((375, 500), 2), ((500, 333), 3), ((333, 500), 1),
    ((500, 400), 1), ((400, 500), 1), ((480, 360), 1),
]
# Colour photos bundled with scikit-image (skimage/data/), with their relative weights.
PHOTOS: dict[str, int] = {
    "astronaut.png": 2, "chelsea.png": 2, "coffee.png": 2, "motorcycle_left.png": 2,
    "motorcycle_right.png": 1, "rocket.jpg": 2, "ihc.png": 1, "retina.jpg": 1,
    "hubble_deep_field.jpg": 1,
}
# Fine-grained grey textures bundled with scikit-image, mirror-tiled and overlaid for detail
# (textures with visible structure, such as brick or coins, would show as patterns).
TEXTURES: list[str] = ["grass.png", "gravel.png"]
MIN_SOURCE_SIDE = 256
NOISE_POOL_SIDE = 1024   # unit noise drawn once per worker; each image takes a random window
MAX_ENCODES = 8          # encodes per view while searching the noise strength
MAX_VIEWS = 4            # views of the sources tried per image before keeping the closest
SIGMA_RANGE = (0.0, 64.0)  # noise standard deviation, in 8-bit levels
START_SIGMA = 30.0       # the search's first try (the median answer at quality 90 is ~40)


@dataclass(frozen=True)
class Config:
    out: Path
    images: int
    classes: int
    seed: int
    quality: int
    min_bytes: int
    max_bytes: int


@dataclass(frozen=True)
class Result:
    sigma: float   # the noise strength of the file written
    encodes: int   # JPEG encodes it took


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--out", type=Path, required=True, help="root of the ImageFolder tree")
    parser.add_argument("--images", type=int, default=20000, help="number of images (20000)")
    parser.add_argument("--classes", type=int, default=100, help="number of classes (100)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="generator processes (default: one per core)")
    parser.add_argument("--seed", type=int, default=0, help="seed; image i depends on (seed, i)")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality (90)")
    parser.add_argument("--min-kb", type=float, default=100.0, help="smallest file, KiB (100)")
    parser.add_argument("--max-kb", type=float, default=130.0, help="largest file, KiB (130)")
    args = parser.parse_args()
    if args.images < 1 or args.classes < 1 or args.classes > args.images:
        parser.error("need 1 <= --classes <= --images")
    if not 0 < args.min_kb < args.max_kb:
        parser.error("need 0 < --min-kb < --max-kb")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def image_path(config: Config, index: int) -> Path:
    width = max(5, len(str(config.images - 1)))
    return config.out / f"class_{index % config.classes:03d}" / f"img_{index:0{width}d}.jpg"


# ---- sources -------------------------------------------------------------------------------

def skimage_data_dir() -> Path | None:
    """The folder of scikit-image's bundled samples, found without importing scikit-image."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "data"
    return folder if folder.is_dir() else None


def load_bundled(names: list[str], mode: str) -> dict[str, Image.Image]:
    """Bundled samples that open offline and are large enough, by name; others are left out."""
    folder = skimage_data_dir()
    if folder is None:
        return {}
    images = {}
    for name in names:
        try:
            with Image.open(folder / name) as image:
                image = image.convert(mode)
        except OSError:
            continue
        if min(image.size) >= MIN_SOURCE_SIDE:
            images[name] = image
    return images


def unit_noise(rng: np.random.Generator, side: int) -> np.ndarray:
    """Sensor-like unit noise, HWC float32: mostly luminance, little chroma (as after a
    camera's chroma denoising; strong chroma noise would also exaggerate the differences
    between decoders' chroma upsampling)."""
    luma = rng.standard_normal((side, side, 1), dtype=np.float32)
    chroma = rng.standard_normal((side, side, 3), dtype=np.float32)
    return 0.97 * luma + 0.15 * chroma


def procedural_photo(rng: np.random.Generator, size: tuple[int, int] = (800, 600)) -> Image.Image:
    """A sharpened 1/f colour field: a stand-in photo when scikit-image is absent."""
    width, height = size
    field = np.zeros((height, width, 3), np.float32)
    for octave in range(2, 9):
        cells = 2 ** octave
        coarse = rng.standard_normal((cells * height // width + 1, cells, 3)).astype(np.float32)
        layer = [np.asarray(Image.fromarray(coarse[..., c]).resize(size, Image.BICUBIC))
                 for c in range(3)]
        field += np.stack(layer, axis=-1) / cells ** 0.8
    field = (field - field.min()) / (np.ptp(field) + 1e-6) * 255
    image = Image.fromarray(field.astype(np.uint8))
    return image.filter(ImageFilter.UnsharpMask(radius=2, percent=150))


def mirror_tile(image: Image.Image) -> Image.Image:
    """A seamless 2x2 tiling, so that textures can be zoomed out over a whole output."""
    pixels = np.asarray(image)
    row = np.concatenate([pixels, pixels[:, ::-1]], axis=1)
    return Image.fromarray(np.concatenate([row, row[::-1]], axis=0))


class Sources:
    """What one worker draws from: photos and textures (with box-reduced copies for zooming
    out) and a pool of unit sensor noise."""

    def __init__(self, seed: int) -> None:
        photos = load_bundled(list(PHOTOS), "RGB")
        self.photos = list(photos.values())
        weights = [PHOTOS[name] for name in photos]
        if not self.photos:
            rng = np.random.default_rng([seed, 1 << 40])
            self.photos = [procedural_photo(rng) for _ in range(6)]
            weights = [1] * len(self.photos)
        self.photo_weights = np.asarray(weights, np.float64) / sum(weights)
        self.textures = [mirror_tile(t) for t in load_bundled(TEXTURES, "L").values()]
        self.noise = unit_noise(np.random.default_rng([seed, 1 << 41]), NOISE_POOL_SIDE)
        self._reduced: dict[tuple[int, int, int], Image.Image] = {}

    def reduced(self, kind: int, which: int, factor: int) -> Image.Image:
        source = (self.photos if kind == 0 else self.textures)[which]
        if factor == 1:
            return source
        key = (kind, which, factor)
        if key not in self._reduced:
            self._reduced[key] = source.reduce(factor)
        return self._reduced[key]


def describe_sources() -> str:
    photos = load_bundled(list(PHOTOS), "RGB")
    textures = load_bundled(TEXTURES, "L")
    if not photos:
        return "WARNING: no scikit-image sample photos found; using procedural sources"
    names = ", ".join(Path(name).stem for name in photos)
    return f"sources: {len(photos)} scikit-image photos ({names}), {len(textures)} textures"


# ---- one image -----------------------------------------------------------------------------

def random_view(sources: Sources, kind: int, which: int, size: tuple[int, int],
                rng: np.random.Generator, min_zoom: float) -> Image.Image:
    """A random crop of a source, scaled, maybe rotated and mirrored, resampled once."""
    width, height = size
    source = sources.reduced(kind, which, 1)
    angle = math.radians(rng.uniform(-10, 10)) if rng.random() < 0.5 else 0.0
    cos, sin = abs(math.cos(angle)), abs(math.sin(angle))
    # s = source pixels per output pixel; the rotated output box must fit inside the source.
    s_max = min(source.width / (width * cos + height * sin),
                source.height / (width * sin + height * cos))
    s_min = min(s_max, min_zoom)
    s = math.exp(rng.uniform(math.log(s_min), math.log(s_max)))
    factor = max(1, int(s / 1.5))  # box-reduce first so that bilinear never skips pixels
    source = sources.reduced(kind, which, factor)
    s = min(s / factor, min(source.width / (width * cos + height * sin),
                            source.height / (width * sin + height * cos)))
    half_x = s * (width * cos + height * sin) / 2
    half_y = s * (width * sin + height * cos) / 2
    cx = rng.uniform(half_x, max(half_x, source.width - half_x))
    cy = rng.uniform(half_y, max(half_y, source.height - half_y))
    mirror = -1.0 if rng.random() < 0.5 else 1.0
    a, b = s * math.cos(angle) * mirror, -s * math.sin(angle)
    d, e = s * math.sin(angle) * mirror, s * math.cos(angle)
    affine = (a, b, cx - a * width / 2 - b * height / 2, d, e, cy - d * width / 2 - e * height / 2)
    return source.transform(size, Image.AFFINE, affine, resample=Image.BILINEAR)


def colour_shift(rgb: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """White balance, saturation, contrast, brightness and gamma, like different cameras."""
    rgb = rgb * rng.uniform(0.85, 1.15, size=3).astype(np.float32)
    luma = rgb @ np.asarray([0.299, 0.587, 0.114], np.float32)
    rgb = luma[..., None] + rng.uniform(0.6, 1.3) * (rgb - luma[..., None])
    mean = float(luma.mean())
    rgb = mean + rng.uniform(0.8, 1.2) * (rgb - mean) + rng.uniform(-20, 20)
    rgb = np.clip(rgb, 0, 255)
    return 255 * (rgb / 255) ** rng.uniform(0.8, 1.25)


def base_image(sources: Sources, size: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """The noise-free picture, float32 HWC in [0, 255]: a sharpened, colour-shifted view of a
    photo with a zoomed-out texture over it for the fine detail of real scenes."""
    which = int(rng.choice(len(sources.photos), p=sources.photo_weights))
    view = random_view(sources, 0, which, size, rng, min_zoom=0.75).filter(ImageFilter.SHARPEN)
    rgb = colour_shift(np.asarray(view, np.float32), rng)
    if sources.textures:
        texture = random_view(sources, 1, int(rng.integers(len(sources.textures))), size, rng,
                              min_zoom=1.0)
        detail = np.asarray(texture, np.float32)
        detail = (detail - detail.mean()) / 128
        rgb = rgb * (1 + rng.uniform(0.25, 0.6) * detail[..., None])
    return np.clip(rgb, 0, 255)


def sensor_noise(sources: Sources, rgb: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Unit-strength noise for this image, stronger in bright areas (shot noise)."""
    height, width, _ = rgb.shape
    top = int(rng.integers(NOISE_POOL_SIDE - height + 1))
    left = int(rng.integers(NOISE_POOL_SIDE - width + 1))
    window = sources.noise[top:top + height, left:left + width]
    return window * np.sqrt(0.25 + rgb * (0.75 / 255))


def encode(rgb: np.ndarray, quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "JPEG", quality=quality, subsampling=2,
                              progressive=False, optimize=False)
    return buffer.getvalue()


def next_sigma(tried: list[tuple[float, int]], target: int, lo: float, hi: float) -> float:
    """A secant step in log(1 + sigma) through the last two tries, kept inside (lo, hi)."""
    x = [math.log1p(sigma) for sigma, _ in tried[-2:]]
    y = [size for _, size in tried[-2:]]
    if len(tried) >= 2 and y[1] != y[0] and x[1] != x[0]:
        guess = x[1] + (target - y[1]) * (x[1] - x[0]) / (y[1] - y[0])
    else:  # one point: size grows about 25 % per unit of log(1 + sigma) near the target
        guess = x[-1] + math.log(target / y[-1]) / 0.25
    if not math.log1p(lo) < guess < math.log1p(hi):  # also keeps expm1 from overflowing
        return (lo + hi) / 2
    return math.expm1(guess)


def search_sigma(base: np.ndarray, noise: np.ndarray, quality: int, target: int, low: int,
                 high: int) -> tuple[bytes, float, int]:
    """Encodes base + sigma * noise for sigmas converging on a file of about `target` bytes;
    returns the file closest to it, its sigma and the number of encodes. Starts from the same
    sigma for every image (so the file depends on the image alone) and gives up early when the
    size stops growing (strong noise saturates at 0 and 255)."""
    lo, hi = SIGMA_RANGE
    tried: list[tuple[float, int]] = []
    best, best_sigma = b"", 0.0
    sigma = START_SIGMA
    for encodes in range(1, MAX_ENCODES + 1):
        data = encode(np.clip(base + sigma * noise, 0, 255).astype(np.uint8), quality)
        tried.append((sigma, len(data)))
        if not best or abs(len(data) - target) < abs(len(best) - target):
            best, best_sigma = data, sigma
        near = abs(len(data) - target) <= (high - low) // 8 or encodes >= 3
        if low <= len(data) <= high and near:
            return data, sigma, encodes
        if len(data) < target:
            lo = sigma
        else:
            hi = sigma
        saturated = len(tried) >= 2 and len(data) < low and len(data) < 1.01 * tried[-2][1]
        if saturated or hi - lo < 0.05:
            break
        sigma = next_sigma(tried, target, lo, hi)
    return best, best_sigma, len(tried)


_sources: Sources | None = None


def init_worker(seed: int) -> None:
    global _sources
    _sources = Sources(seed)


def make_image(config: Config, index: int) -> Result:
    """Draws views until one reaches the size window (at most MAX_VIEWS), writes the file."""
    assert _sources is not None
    rng = np.random.default_rng([config.seed, index])
    shapes, weights = zip(*SIZES)
    size = shapes[int(rng.choice(len(shapes), p=np.asarray(weights) / sum(weights)))]
    target = int(rng.uniform(config.min_bytes + 1024, config.max_bytes - 1024))
    total_encodes = 0
    for _ in range(MAX_VIEWS):
        base = base_image(_sources, size, rng)
        noise = sensor_noise(_sources, base, rng)
        data, sigma, encodes = search_sigma(base, noise, config.quality, target,
                                            config.min_bytes, config.max_bytes)
        total_encodes += encodes
        if config.min_bytes <= len(data) <= config.max_bytes:
            break
    path = image_path(config, index)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return Result(sigma, total_encodes)


# ---- the tree ------------------------------------------------------------------------------

def missing_images(config: Config) -> list[int]:
    """Indices whose file is absent; exits if the folder holds JPEGs of another layout."""
    expected = {image_path(config, i) for i in range(config.images)}
    present = set(config.out.glob("*/*.jpg"))
    foreign = present - expected
    if foreign:
        sys.exit(f"{config.out} holds {len(foreign)} JPEGs of another layout (e.g. "
                 f"{sorted(foreign)[0]}); use another --out or remove it")
    for stale in config.out.glob("*/*.jpg.tmp"):
        stale.unlink()
    return [i for i in range(config.images) if image_path(config, i) not in present]


def generate(config: Config, indices: list[int], workers: int) -> None:
    for c in range(config.classes):
        (config.out / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    print(f"generating {len(indices)} of {config.images} images with {workers} workers",
          flush=True)
    start = last_print = time.monotonic()
    done = encodes = 0
    sigmas = []
    with mp.get_context("fork").Pool(workers, init_worker, (config.seed,)) as pool:
        for result in pool.imap_unordered(partial(make_image, config), indices, chunksize=8):
            done += 1
            encodes += result.encodes
            sigmas.append(result.sigma)
            now = time.monotonic()
            if now - last_print >= 2 or done == len(indices):
                rate = done / (now - start)
                print(f"  {done}/{len(indices)} images, {rate:.0f} images/s, "
                      f"{encodes / done:.1f} encodes/image, noise sigma median "
                      f"{np.median(sigmas):.1f}, "
                      f"ETA {(len(indices) - done) / rate:.0f} s", flush=True)
                last_print = now


def print_stats(config: Config) -> None:
    sizes = np.empty(config.images, np.int64)
    dims = np.empty((config.images, 2), np.int64)
    for i in range(config.images):
        path = image_path(config, i)
        sizes[i] = path.stat().st_size
        with Image.open(path) as image:
            dims[i] = image.size
    kb = sizes / 1024
    inside = int(np.count_nonzero((sizes >= config.min_bytes) & (sizes <= config.max_bytes)))
    print(f"dataset {config.out}: {config.images} JPEGs in {config.classes} classes, "
          f"{kb.mean():.1f} KiB mean (min {kb.min():.1f}, max {kb.max():.1f}, "
          f"{inside} in [{config.min_bytes / 1024:.0f}, "
          f"{config.max_bytes / 1024:.0f}] KiB), mean size {dims[:, 0].mean():.0f}x"
          f"{dims[:, 1].mean():.0f}, {sizes.sum() / 2**30:.2f} GiB", flush=True)


def main() -> None:
    args = parse_args()
    config = Config(out=args.out, images=args.images, classes=args.classes, seed=args.seed,
                    quality=args.quality, min_bytes=int(args.min_kb * 1024),
                    max_bytes=int(args.max_kb * 1024))
    config.out.mkdir(parents=True, exist_ok=True)
    indices = missing_images(config)
    if indices:
        print(describe_sources(), flush=True)
        generate(config, indices, min(args.workers, len(indices)))
    else:
        print(f"{config.out} already holds all {config.images} images; nothing to do",
              flush=True)
    print_stats(config)


if __name__ == "__main__":
    main()
