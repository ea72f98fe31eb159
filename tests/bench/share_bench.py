#!/usr/bin/env python3
"""Sharing groups on the CPU machine (docs/howto/share-groups.md): four consumers at full speed
on one image folder, each with its own augmentation seed, first independent (four feeds, four
decodes of every image), then in one sharing group, in one run of one gpufeedd; then three at
full speed beside a fourth that holds each batch 50 ms (a slow job must not slow the others).
Then the same jobs a quarter epoch apart, and the cache's hit rate against its size (an
eighth of the decoded dataset to all of it). Prints tables and a JSON line.

    tests/bench/share_bench.py [--images 1500] [--threads 2] [--batch 32]

Starts its own gpufeedd (build/server/gpufeedd, or $GPUFEEDD) and runs build/client/ctl/
gpufeedctl (or $GPUFEEDCTL) as the consumers; the dataset is tests/bench/image/make_dataset.py's
(ImageNet-like JPEGs, about 500x375), made once in /tmp/gpufeed-share-bench.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

REPO = Path(__file__).resolve().parents[2]
GPUFEEDD = os.environ.get("GPUFEEDD", str(REPO / "build/server/gpufeedd"))
GPUFEEDCTL = os.environ.get("GPUFEEDCTL", str(REPO / "build/client/ctl/gpufeedctl"))
PIPELINE = REPO / "deploy/pipelines/imagenet_train.json"


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, family: str, label: str = "") -> float:
    """The sum of a family's samples on /metrics (those with `label` in their labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = re.findall(rf"^{family}\{{([^}}]*)\}} (\S+)$", text, re.M)
    return sum(float(v) for labels, v in samples if label in labels)


@contextlib.contextmanager
def daemon(threads: int, cache_bytes: int) -> Iterator[Tuple[str, int]]:
    """gpufeedd on a temporary socket: (socket, metrics port)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpufeed-share-bench-") as tmp:
        sock = f"{tmp}/gf.sock"
        with open(f"{tmp}/gpufeedd.log", "w") as log:
            p = subprocess.Popen(
                [GPUFEEDD, f"--listen=unix://{sock}", f"--threads={threads}",
                 f"--staging_bytes={2 << 30}", f"--share_cache_bytes={cache_bytes}",
                 f"--metrics_listen=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=log)
        try:
            for _ in range(200):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            yield sock, port
        finally:
            p.terminate()
            p.wait(30)


def run(sock: str, data: Path, batch: int, group: str, step_ms: List[int],
        start_steps: List[int]) -> List[float]:
    """Consumers side by side, one epoch's worth of batches each (from its start step): each
    one's images/s over its own wall time."""
    steps = sum(1 for _ in data.rglob("*.jpg")) // batch
    procs = []
    for i, (ms, start) in enumerate(zip(step_ms, start_steps)):
        args = [GPUFEEDCTL, "--socket", sock, "consume", "--job", f"bench-{group or 'own'}-{i}",
                "--kind", "image_folder", "--dataset", str(data), "--pipeline", str(PIPELINE),
                "--batch-size", str(batch), "--seed", str(100 + i), "--epochs", "2",
                "--start-step", str(start), "--max-batches", str(steps),
                "--step-ms", str(ms), "--timeout-ms", "600000"]
        if group:
            args += ["--share-group", group]
        procs.append((subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True), time.monotonic()))
    rates = []
    for p, start in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"gpufeedctl consume failed: {err}")
        rates.append(steps * batch / (time.monotonic() - start))
    return rates


def measure(port: int, sock: str, data: Path, batch: int, group: str, step_ms: List[int],
            start_steps: List[int]) -> Dict[str, float]:
    before = {f: scrape(port, f) for f in ("gpufeed_decodes_total",)}
    hits0 = scrape(port, "gpufeed_share_lookups_total", 'result="hit"')
    looked0 = scrape(port, "gpufeed_share_lookups_total")
    start = time.monotonic()
    rates = run(sock, data, batch, group, step_ms, start_steps)
    wall = time.monotonic() - start
    delivered = sum(1 for _ in data.rglob("*.jpg")) // batch * batch * len(step_ms)
    looked = scrape(port, "gpufeed_share_lookups_total") - looked0
    return {"aggregate": delivered / wall, "fast_mean": sum(rates[:3]) / 3,
            "decodes_per_image":
                (scrape(port, "gpufeed_decodes_total") - before["gpufeed_decodes_total"])
                / delivered,
            "hit_rate": (scrape(port, "gpufeed_share_lookups_total", 'result="hit"') - hits0)
                        / looked if looked else 0.0}


def decoded_bytes(data: Path) -> int:
    """What the dataset's images take decoded (RGB), from their headers."""
    try:
        from PIL import Image
    except ImportError:  # about 463 x 402 pixels an image (make_dataset.py's)
        return sum(1 for _ in data.rglob("*.jpg")) * 463 * 402 * 3
    total = 0
    for f in data.rglob("*.jpg"):
        with Image.open(f) as im:
            total += im.size[0] * im.size[1] * 3
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    data = Path("/tmp/gpufeed-share-bench")
    subprocess.run([sys.executable, str(REPO / "tests/bench/image/make_dataset.py"), "--out",
                    str(data), "--images", str(args.images), "--classes", "10", "--seed", "0",
                    "--workers", "2"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["sh", "-c", f"find {data} -name '*.jpg' -print0 | xargs -0 cat > /dev/null"])
    steps = args.images // args.batch
    together, apart = [0] * 4, [k * steps // 4 for k in range(4)]
    full = decoded_bytes(data)
    rows: Dict[str, Dict[str, float]] = {}
    with daemon(args.threads, 2 * full) as (sock, port):
        for name, group, step_ms, starts in (
                ("independent, started together", "", [0] * 4, together),
                ("one group, started together", "g1", [0] * 4, together),
                ("one group, a quarter epoch apart", "g2", [0] * 4, apart),
                ("one group, one job at 50 ms a batch", "g3", [0, 0, 0, 50], together)):
            rows[name] = measure(port, sock, data, args.batch, group, step_ms, starts)
    sizes: Dict[float, Dict[str, float]] = {}
    for fraction in (0.125, 0.25, 0.5, 1.0):
        with daemon(args.threads, int(fraction * full)) as (sock, port):
            sizes[fraction] = measure(port, sock, data, args.batch, "g", [0] * 4, apart)
    base = rows["independent, started together"]["aggregate"]
    shared = rows["one group, started together"]
    slow = rows["one group, one job at 50 ms a batch"]
    print(f"4 consumers, {args.images} ImageNet-like JPEGs ({full / 2**20:,.0f} MiB decoded), "
          f"imagenet_train pipeline, B={args.batch}, --threads {args.threads}, one epoch each")
    print("| run | aggregate images/s | vs independent | decodes per image | cache hits |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['aggregate']:,.0f} | {r['aggregate'] / base:.2f}x | "
              f"{r['decodes_per_image']:.2f} | {100 * r['hit_rate']:.0f} % |")
    change = slow["fast_mean"] / shared["fast_mean"] - 1
    print(f"\nthe three full-speed jobs beside one at 50 ms a batch: {slow['fast_mean']:,.0f} "
          f"images/s each, against {shared['fast_mean']:,.0f} with four at full speed "
          f"({change:+.1%})\n")
    print("| cache (of the decoded dataset), jobs a quarter epoch apart | hit rate | "
          "decodes per image | aggregate images/s |")
    print("|---|---:|---:|---:|")
    for fraction, r in sizes.items():
        print(f"| {fraction:.0%} ({fraction * full / 2**20:,.0f} MiB) | "
              f"{100 * r['hit_rate']:.0f} % | {r['decodes_per_image']:.2f} | "
              f"{r['aggregate']:,.0f} |")
    print(json.dumps({"bench": "share", "images": args.images, "threads": args.threads,
                      "independent_ips": round(base, 1),
                      "shared_ips": round(shared["aggregate"], 1),
                      "speedup": round(shared["aggregate"] / base, 2),
                      "apart_speedup": round(
                          rows["one group, a quarter epoch apart"]["aggregate"] / base, 2),
                      "shared_decodes_per_image": round(shared["decodes_per_image"], 3),
                      "slow_neighbour_change": round(change, 3),
                      "hit_rate_by_cache_fraction": {str(f): round(r["hit_rate"], 3)
                                                     for f, r in sizes.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
