#!/usr/bin/env python3
"""The torchvision baselines of the image benchmark: images/s into GPU memory and busy CPU cores.

Contenders, run one after another in one process (choose with --contenders):
  float  ImageFolder + v2 RandomResizedCrop(224), RandomHorizontalFlip, ToImage,
         ToDtype(float32, scale=True), Normalize(ImageNet) in the DataLoader workers;
         DataLoader(num_workers, pin_memory=True, persistent_workers=True);
         .cuda(non_blocking=True), then .half(): float16 NCHW in GPU memory.
  uint8  the same crop and flip, ToImage only (uint8 batches); the cast to float16 and the
         normalisation are done on the GPU (the stronger baseline).
  nvjpeg torchvision.io.decode_jpeg(list of 'batch' files, device='cuda'): nvJPEG batched
         decode alone, no augmentation, from file bytes preloaded into memory.

Every contender is warmed up (--warmup batches not counted), then timed over --seconds of wall
time ending with torch.cuda.synchronize(). Busy CPU cores = the machine's busy jiffies in
/proc/stat (all but idle and iowait) over that window / its wall time: every process counts,
so run it on an otherwise idle machine. Before the contenders every file is read once, so that
the dataset is in the page cache for all of them. The DataLoader's sampler draws permutations
back to back (RandomSampler with num_samples > len), so no epoch boundary drains the workers
inside the window.

Prints progress and a markdown table; writes --json and the table beside it (OUT.md).
Example: torchvision_bench.py --data /tmp/imagenet_like --json /tmp/out/torchvision.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torchvision
from torch.utils.data import DataLoader, RandomSampler
from torchvision import datasets
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP = 224
PROGRESS_EVERY_S = 5.0
CONTENDERS = ("float", "uint8", "nvjpeg")
T = TypeVar("T")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--data", type=Path, required=True, help="ImageFolder root")
    parser.add_argument("--batch", type=int, default=256, help="images per batch (256)")
    parser.add_argument("--workers", type=int, default=15, help="DataLoader workers (15)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="timed window per contender, seconds (20)")
    parser.add_argument("--warmup", type=int, default=30,
                        help="batches per contender not counted (30: the workers' prefetch)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated subset of {','.join(CONTENDERS)} (all)")
    parser.add_argument("--json", type=Path, required=True,
                        help="results file; the markdown table goes beside it as .md")
    parser.add_argument("--device", default="cuda",
                        help="cuda (the benchmark) or cpu (a smoke test of this script only)")
    args = parser.parse_args()
    chosen = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(chosen) - set(CONTENDERS))
    if unknown or not chosen:
        parser.error(f"--contenders: unknown {unknown}; choose from {CONTENDERS}")
    args.contenders = chosen
    if args.batch < 1 or args.workers < 1 or args.seconds <= 0 or args.warmup < 0:
        parser.error("need --batch >= 1, --workers >= 1, --seconds > 0, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device")
    return args


def log(message: str) -> None:
    print(message, flush=True)


# ---- measuring -----------------------------------------------------------------------------

def busy_jiffies() -> int:
    """Busy time of all CPUs since boot, in clock ticks: everything but idle and iowait."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal


def cpu_cores_busy(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the number of CPU cores busy (machine-wide) while it ran."""
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    busy, start = busy_jiffies(), time.perf_counter()
    result = fn()
    wall = time.perf_counter() - start
    return result, (busy_jiffies() - busy) / ticks_per_s / wall


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(step: Callable[[], int], seconds: float, device: torch.device,
               name: str) -> tuple[int, float]:
    """Calls step (which returns the images it delivered) until `seconds` have passed; returns
    the images and the wall time, synchronised with the device at both ends."""
    synchronize(device)
    images = 0
    start = last_print = time.perf_counter()
    while True:
        images += step()
        now = time.perf_counter()
        if now - start >= seconds:
            break
        if now - last_print >= PROGRESS_EVERY_S:
            log(f"  {name}: {images} images in {now - start:.0f} s, "
                f"{images / (now - start):.0f} images/s")
            last_print = now
    synchronize(device)
    return images, time.perf_counter() - start


# ---- contenders ----------------------------------------------------------------------------

def make_loader(root: Path, transform: v2.Transform, batch: int, workers: int,
                pin: bool) -> DataLoader:
    dataset = datasets.ImageFolder(str(root), transform=transform)
    # Permutations back to back: far more samples than any window consumes.
    sampler = RandomSampler(dataset, replacement=False, num_samples=len(dataset) * 10_000)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers,
                      pin_memory=pin, persistent_workers=True, drop_last=True)


def float_transform() -> v2.Transform:
    return v2.Compose([
        v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])


def uint8_transform() -> v2.Transform:
    return v2.Compose([v2.RandomResizedCrop(CROP, antialias=True), v2.RandomHorizontalFlip(),
                       v2.ToImage()])


def gpu_normalizer(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """uint8 NCHW on the device → normalised float16: x * (1 / (255 std)) − mean / std."""
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    scale = (1 / (255 * std)).half()
    shift = (mean / std).half()
    return lambda x: x.half().mul_(scale).sub_(shift)


def run_loader(args: argparse.Namespace, name: str, transform: v2.Transform,
               on_device: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """One DataLoader contender: batches to the device, then on_device, until the window ends."""
    device = torch.device(args.device)
    loader = make_loader(args.data, transform, args.batch, args.workers,
                         pin=device.type == "cuda")
    batches = iter(loader)

    def step() -> int:
        images, labels = next(batches)
        out = on_device(images.to(device, non_blocking=True))
        labels.to(device, non_blocking=True)
        return out.shape[0]

    log(f"{name}: starting {args.workers} workers, {args.warmup} warm-up batches")
    start = time.perf_counter()
    images, labels = next(batches)
    first = on_device(images.to(device, non_blocking=True))
    expected = (args.batch, 3, CROP, CROP)
    if tuple(first.shape) != expected or first.dtype != torch.float16:
        raise RuntimeError(f"{name}: batch is {first.dtype} {tuple(first.shape)}, "
                           f"not float16 {expected}")
    for _ in range(args.warmup - 1):
        step()
    synchronize(device)
    log(f"{name}: warm-up done in {time.perf_counter() - start:.1f} s; timing {args.seconds} s")
    (count, wall), cores = cpu_cores_busy(lambda: timed_loop(step, args.seconds, device, name))
    return {"images": count, "seconds": wall, "images_per_s": count / wall, "busy_cores": cores}


def read_dataset(root: Path) -> list[torch.Tensor]:
    """Every file's bytes, in ImageFolder's order; this also fills the page cache."""
    paths = [path for path, _ in datasets.ImageFolder(str(root)).samples]
    log(f"reading {len(paths)} files under {root} (page cache, nvJPEG input)")
    start = time.perf_counter()
    data = []
    for i, path in enumerate(paths, 1):
        data.append(torchvision.io.read_file(path))
        if i % 5000 == 0:
            log(f"  {i}/{len(paths)} files")
    total = sum(d.numel() for d in data)
    log(f"read {total / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s, "
        f"{total / len(data) / 1024:.1f} KiB mean")
    return data


def run_nvjpeg(args: argparse.Namespace, data: list[torch.Tensor]) -> dict:
    """Batched decode_jpeg on the device over the preloaded files, cycling through them."""
    device = torch.device(args.device)
    batches = [data[i:i + args.batch] for i in range(0, len(data) - args.batch + 1, args.batch)]
    if not batches:
        raise RuntimeError(f"nvjpeg: fewer than --batch {args.batch} files")
    position = 0

    def step() -> int:
        nonlocal position
        batch = batches[position % len(batches)]
        position += 1
        decode_jpeg(batch, mode=ImageReadMode.RGB, device=device)
        return len(batch)

    log(f"nvjpeg: {len(batches)} batches of {args.batch}, {args.warmup} warm-up batches")
    for _ in range(args.warmup):
        step()
    synchronize(device)
    (count, wall), cores = cpu_cores_busy(
        lambda: timed_loop(step, args.seconds, device, "nvjpeg"))
    return {"images": count, "seconds": wall, "images_per_s": count / wall, "busy_cores": cores}


LABELS = {  # as the "label" of image_bench's JSON lines
    "float": "torchvision DataLoader, float32 normalise in workers, .cuda() then .half()",
    "uint8": "torchvision DataLoader, uint8 batches, cast + normalise on the GPU",
    "nvjpeg": "torchvision.io.decode_jpeg(device='cuda'), batched, decode only",
}


def run_contender(args: argparse.Namespace, name: str, files: list[torch.Tensor]) -> dict:
    device = torch.device(args.device)
    if name == "float":
        return run_loader(args, name, float_transform(), lambda x: x.half())
    if name == "uint8":
        return run_loader(args, name, uint8_transform(), gpu_normalizer(device))
    return run_nvjpeg(args, files)


# ---- report --------------------------------------------------------------------------------

def markdown_table(results: list[dict]) -> str:
    lines = ["| contender | images/s | busy CPU cores | images/s per busy core |",
             "| --- | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error']} | | |")
            continue
        per_core = r["images_per_s"] / r["busy_cores"] if r["busy_cores"] > 0 else float("nan")
        lines.append(f"| {r['label']} | {r['images_per_s']:,.0f} | "
                     f"{r['busy_cores']:.1f} | {per_core:,.0f} |")
    return "\n".join(lines)


def environment(args: argparse.Namespace, dataset_files: int) -> dict:
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none"
    return {"torch": torch.__version__, "torchvision": torchvision.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(), "gpu": gpu,
            "dataset": str(args.data), "dataset_files": dataset_files, "batch": args.batch,
            "workers": args.workers, "seconds": args.seconds, "warmup_batches": args.warmup,
            "device": args.device}


def main() -> int:
    args = parse_args()
    if args.device == "cuda":
        torch.cuda.init()
        log(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, "
            f"torchvision {torchvision.__version__}, {os.cpu_count()} CPUs")
    files = read_dataset(args.data)
    results = []
    for name in args.contenders:
        result: dict = {"name": name, "label": LABELS[name]}
        try:
            result |= run_contender(args, name, files)
            log(f"{name}: {result['images_per_s']:,.0f} images/s, "
                f"{result['busy_cores']:.1f} busy cores")
        except Exception as error:  # one failed contender must not lose the others
            traceback.print_exc()
            result["error"] = f"{type(error).__name__}: {error}"
        results.append(result)
        gc.collect()  # ends the contender's persistent DataLoader workers
    table = markdown_table(results)
    log("\n" + table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"bench": "torchvision_image", "environment": environment(args, len(files)),
              "results": results}
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    args.json.with_suffix(".md").write_text(table + "\n")
    log(f"wrote {args.json} and {args.json.with_suffix('.md')}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
