#!/usr/bin/env python3
"""GPU soak: the image paths at speed for a long time, across several sessions, each
batch compared with the CPU path of the same sample and epoch.

One process per consumer; each runs its device-delivery Loader and, in lockstep, a reference
Loader of the same job settings on the CPU path (host delivery, decode=cpu, augment=cpu).
Every epoch, every batch: the ids must equal the reference's exactly, the labels too, and each
image must match its reference within the path's bound. An epoch that takes longer than
--epoch-timeout (the loaders' timeout) ends the run with a failure: never stuck.

Consumers (all on cuda:0 of one gpufeedd):
  nvjpeg-train   decode nvjpeg, augment gpu, random_resized_crop 224 + flip, uint8 NHWC
  cpudec-train   decode cpu, augment gpu, the same pipeline        (kernel vs CPU: max <= 2)
  nvjpeg-eval-r0 decode nvjpeg, augment gpu, resize 256 + centre crop 224, float16 NCHW,
  nvjpeg-eval-r1   normalised: two ranks of one job (world_size 2)

Bounds per image (in uint8 levels; float outputs are scaled back by 255 * std): nvJPEG paths
mean |diff| <= 1.5 (nvJPEG's IDCT differs from libjpeg-turbo's; a wrong image is tens of
levels off); the CPU-decode path max |diff| <= 2 (the kernel's rounding).

Usage: soak.py --data DIR --socket SOCK --minutes 10 [--out DIR]; prints one line per
consumer per minute, then a table and a JSON line; exit 1 on any mismatch or stall.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback

TRAIN = {"ops": [{"random_resized_crop": {"size": 224}}, {"flip": {"p": 0.5}},
                 {"cast": {"dtype": "uint8"}}, {"layout": {"layout": "nhwc"}}]}
EVAL = {"ops": [{"resize": {"shorter_side": 256}}, {"center_crop": {"size": 224}},
                {"normalize": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}},
                {"cast": {"dtype": "float16"}}, {"layout": {"layout": "nchw"}}]}
# name, decode, pipeline, rank, world, bound kind, bound
CONSUMERS = [
    ("nvjpeg-train", "nvjpeg", TRAIN, 0, 1, "mean", 1.5),
    ("cpudec-train", "cpu", TRAIN, 0, 1, "max", 2.0),
    ("nvjpeg-eval-r0", "nvjpeg", EVAL, 0, 2, "mean", 1.5),
    ("nvjpeg-eval-r1", "nvjpeg", EVAL, 1, 2, "mean", 1.5),
]


def consume(name, decode, pipeline, rank, world, bound_kind, bound, args, results):
    import torch
    import gpufeed.torch

    stats = {"consumer": name, "epochs": 0, "batches": 0, "images": 0, "mismatched_ids": 0,
             "bad_images": 0, "worst_mean": 0.0, "worst_max": 0.0, "error": None}
    scale = 255.0 * 0.229 if pipeline is EVAL else 1.0  # back to uint8 levels (smallest std)
    job = "soak-" + name.rsplit("-r", 1)[0] if world > 1 else "soak-" + name
    common = dict(kind="image_folder", batch_size=args.batch, pipeline=pipeline, seed=7,
                  rank=rank, world_size=world, socket=args.socket, timeout=args.epoch_timeout)
    try:
        if args.cpu_only:  # the script's own check, on a machine without a GPU
            gpu = gpufeed.torch.Loader(args.data, job=job, device="cpu", decode="cpu",
                                       augment="cpu", **common)
        else:
            gpu = gpufeed.torch.Loader(args.data, job=job, device="cuda:0", decode=decode,
                                       augment="gpu", **common)
        ref = gpufeed.torch.Loader(args.data, job=job + "-ref", device="cpu", decode="cpu",
                                   augment="cpu", **common)
        end = time.monotonic() + 60 * args.minutes
        next_report = time.monotonic() + 60
        epoch = 0
        while time.monotonic() < end:
            gpu.set_epoch(epoch)
            ref.set_epoch(epoch)
            started = time.monotonic()
            for got, want in zip(gpu, ref, strict=True):
                if got.ids.tolist() != want.ids.tolist():
                    stats["mismatched_ids"] += 1
                    raise AssertionError(f"epoch {epoch} step {got.step}: ids {got.ids[:8]}... "
                                         f"!= CPU path's {want.ids[:8]}...")
                if not torch.equal(got["label"].cpu(), want["label"]):
                    raise AssertionError(f"epoch {epoch} step {got.step}: labels differ")
                diff = (got["image"].float() - want["image"].to(got["image"].device).float()).abs() * scale
                per = diff.reshape(diff.shape[0], -1)
                means, maxes = per.mean(1), per.amax(1)
                worst = (means if bound_kind == "mean" else maxes)
                bad = int((worst > bound).sum())
                stats["worst_mean"] = max(stats["worst_mean"], float(means.max()))
                stats["worst_max"] = max(stats["worst_max"], float(maxes.max()))
                if bad:
                    stats["bad_images"] += bad
                    row = int(worst.argmax())
                    raise AssertionError(
                        f"epoch {epoch} step {got.step}: sample {int(got.ids[row])} differs from "
                        f"the CPU path by {bound_kind} {float(worst[row]):.2f} > {bound}")
                stats["batches"] += 1
                stats["images"] += per.shape[0]
                got.release()
                want.release()
            stats["epochs"] += 1
            epoch += 1
            if time.monotonic() - started > args.epoch_timeout:
                raise AssertionError(f"epoch {epoch - 1} took {time.monotonic() - started:.0f} s")
            if time.monotonic() >= next_report:
                next_report += 60
                print(f"{time.strftime('%T')} {name}: {stats['epochs']} epochs, "
                      f"{stats['images']} images compared, worst mean {stats['worst_mean']:.3f}, "
                      f"worst max {stats['worst_max']:.0f}", flush=True)
        gpu.close()
        ref.close()
    except Exception as e:  # reported, and the run fails
        stats["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    results.put(stats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epoch-timeout", type=float, default=120)
    p.add_argument("--cpu-only", action="store_true",
                   help="every consumer on the CPU path (tests this script without a GPU)")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    started = time.monotonic()
    procs = [ctx.Process(target=consume, args=(*c, args, results)) for c in CONSUMERS]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=60 * args.minutes + 2 * args.epoch_timeout + 120) for _ in procs]
    for proc in procs:
        proc.join(30)
    wall = time.monotonic() - started
    rows.sort(key=lambda r: r["consumer"])
    print(f"\n| soak, {wall / 60:.1f} min | epochs | images compared | images/s | worst per-image "
          "mean | worst per-image max | result |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        result = "ok" if r["error"] is None else r["error"][:120]
        print(f"| {r['consumer']} | {r['epochs']} | {r['images']:,} | {r['images'] / wall:,.0f} | "
              f"{r['worst_mean']:.3f} | {r['worst_max']:.0f} | {result} |")
    print(json.dumps({"bench": "gpu_soak", "minutes": round(wall / 60, 2), "consumers": rows}))
    return 0 if all(r["error"] is None and r["epochs"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
