#!/usr/bin/env python3
"""DDP training of a ResNet on an image_folder dataset, fed by gpufeed or by a torchvision
DataLoader (one flag), printing images/s and the share of each step spent waiting for data.

    torchrun --nproc_per_node=8 train_ddp.py --data /data/imagenet/train --loader gpufeed
    torchrun --nproc_per_node=8 train_ddp.py --data /data/imagenet/train --loader torch --workers 15
    torchrun --nproc_per_node=8 train_ddp.py --data /data/imagenet/train --loader synthetic

``--loader gpufeed`` attaches every rank to the node's gpufeedd (``--socket`` or
``$GPUFEED_SOCKET``): batches arrive decoded and augmented in each rank's GPU, ordered on its
current stream. ``--loader torch`` is the usual ``ImageFolder`` + ``DistributedSampler`` +
``DataLoader(pin_memory=True, persistent_workers=True)`` with the same augmentation.
``--loader synthetic`` trains on one batch already in GPU memory: the rate without any data
loading, the ceiling the other two are measured against.

Timing: each step waits for its batch (the data wait; the batch is ready in the GPU when it
ends), then runs forward, backward and the optimiser step, then synchronises the GPU so that
step times add up. The first ``--warmup`` steps are not counted. Runs on the CPU too (gloo,
``--device cpu``) for a smoke test with small images.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[3]
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="image_folder root (ROOT/CLASS/*.jpg)")
    p.add_argument("--loader", choices=["gpufeed", "torch", "synthetic"], default="gpufeed")
    p.add_argument("--arch", default="resnet50",
                   help="a torchvision.models name, or tiny (a small CNN defined here)")
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=100, help="measured steps")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--workers", type=int, default=8, help="--loader torch: DataLoader workers")
    p.add_argument("--pipeline", default=str(REPO / "deploy/pipelines/imagenet_train.json"),
                   help="--loader gpufeed: the daemon's pipeline (its crop size must equal "
                        "--image-size)")
    p.add_argument("--socket", default=None, help="gpufeedd socket")
    p.add_argument("--ring-slots", type=int, default=None)
    p.add_argument("--decode", choices=["auto", "nvjpeg", "cpu"], default="auto",
                   help="--loader gpufeed: who decodes the JPEGs (auto: the daemon picks)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--share-group", default=None,
                   help="--loader gpufeed: a sharing group (jobs of one group decode each image "
                        "once; --seed then keys only this job's augmentation)")
    p.add_argument("--device", default=None, help="cpu to run without a GPU")
    p.add_argument("--json", action="store_true", help="also print one JSON line (rank 0)")
    return p.parse_args()


def gpufeed_batches(args, device, info: Dict[str, int]) -> Iterator[Tuple]:
    import gpufeed.torch

    with open(args.pipeline, encoding="utf-8") as f:
        ops = json.load(f)["ops"]
    # The daemon casts to the training dtype and, for channels_last, writes NHWC rows: the
    # NCHW view of an NHWC tensor *is* channels_last, so nothing is converted on the GPU.
    ops = [op for op in ops if "cast" not in op and "layout" not in op]
    dtype = "DTYPE_BFLOAT16" if args.bf16 else "DTYPE_FLOAT32"
    ops.append({"cast": {"dtype": dtype}})
    nhwc = args.channels_last
    ops.append({"layout": {"layout": "IMAGE_LAYOUT_NHWC" if nhwc else "IMAGE_LAYOUT_NCHW"}})
    loader = gpufeed.torch.Loader(args.data, kind="image_folder", batch_size=args.batch_size,
                                  pipeline=ops, seed=args.seed, device=device,
                                  socket=args.socket, ring_slots=args.ring_slots,
                                  decode=args.decode, share_group=args.share_group,
                                  job=os.environ.get("TORCHELASTIC_RUN_ID", "train_ddp"))
    info["steps_per_epoch"] = len(loader)
    with loader:
        while True:
            for batch in loader:
                images = batch["image"]
                if nhwc:
                    images = images.permute(0, 3, 1, 2)  # channels_last NCHW view, no copy
                yield images, batch["label"]


def torch_batches(args, device, info: Dict[str, int]) -> Iterator[Tuple]:
    import torchvision
    from torchvision import transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(args.image_size),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize(MEAN, STD)])
    dataset = torchvision.datasets.ImageFolder(args.data, tf)
    sampler = torch.utils.data.DistributedSampler(dataset, seed=args.seed, drop_last=True)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
        pin_memory=device.type == "cuda", persistent_workers=args.workers > 0, drop_last=True)
    info["steps_per_epoch"] = len(loader)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for images, labels in loader:
            images = images.to(device, non_blocking=True).to(dtype=dtype, memory_format=fmt)
            yield images, labels.to(device, non_blocking=True)
        epoch += 1


def synthetic_batches(args, device, info: Dict[str, int]) -> Iterator[Tuple]:
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    images = images.to(dtype=dtype, memory_format=fmt)
    labels = torch.randint(0, 1000, (args.batch_size,), device=device)
    info["steps_per_epoch"] = 0
    while True:
        yield images, labels


def make_model(arch: str, num_classes: int) -> torch.nn.Module:
    """``tiny``: a small CNN defined here, for smoke tests; else ``torchvision.models.<arch>``.

    torchvision is imported only for such a model or for ``--loader torch``: ``import
    torchvision`` loads its transforms and datasets too, which ``--loader gpufeed`` never
    uses (the daemon decodes and augments), so ``--loader gpufeed --arch tiny`` runs without
    torchvision installed."""
    if arch == "tiny":
        nn = torch.nn
        return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(16, num_classes))
    import torchvision

    return getattr(torchvision.models, arch)(num_classes=num_classes)


def main() -> None:
    args = parse()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                            world_size=world)
    torch.manual_seed(args.seed)
    num_classes = len([d for d in os.scandir(args.data) if d.is_dir()])
    model = make_model(args.arch, num_classes).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    info: Dict[str, int] = {}
    make = {"gpufeed": gpufeed_batches, "torch": torch_batches,
            "synthetic": synthetic_batches}[args.loader]
    batches = make(args, device, info)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    waited = computed = 0.0
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        images, labels = next(batches)
        sync()  # the batch is in device memory now: what remains is training
        t1 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = F.cross_entropy(ddp(images), labels % num_classes)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sync()
        t2 = time.perf_counter()
        if step >= args.warmup:
            waited += t1 - t0
            computed += t2 - t1
        del images, labels  # return the batch's slot before waiting for the next one

    totals = torch.tensor([waited, computed], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    waited, computed = (totals / world).tolist()
    step_s = (waited + computed) / args.steps
    images_s = args.batch_size * world / step_s
    share = waited / (waited + computed)
    if rank == 0:
        print(f"{args.loader}: {args.arch}, {world} rank(s) x batch {args.batch_size}, "
              f"{args.steps} steps after {args.warmup} warm-up: {images_s:,.0f} images/s, "
              f"step {1000 * step_s:.1f} ms, waiting for data {100 * share:.1f} % "
              f"of each step (loss {loss.item():.3f})")
        if args.json:
            print(json.dumps({"loader": args.loader, "arch": args.arch, "world_size": world,
                              "batch_size": args.batch_size, "steps": args.steps,
                              "images_per_s": images_s, "step_ms": 1000 * step_s,
                              "data_wait_share": share}))
    dist.destroy_process_group()
    batches.close()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
