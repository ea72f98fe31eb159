#!/usr/bin/env python3
"""Sharing groups on the CPU machine (docs/howto/share-groups.md): four consumers at full speed
on one image folder, each with its own augmentation seed, first independent (four feeds, four
decodes of every image), then in one sharing group, in one run of one gpufeedd; then three at
full speed beside a fourth that holds each batch 50 ms (a slow job must not slow the others).
Prints a table and a JSON line.

    tests/bench/share_bench.py [--images 1500] [--threads 2] [--batch 32]

Starts its own gpufeedd (build/server/gpufeedd, or $GPUFEEDD) and runs build/client/ctl/
gpufeedctl (or $GPUFEEDCTL) as the consumers; the dataset is tests/bench/image/make_dataset.py's
(ImageNet-like JPEGs, about 500x375), made once in /tmp/gpufeed-share-bench.
"""

from __future__ import annotations

import argparse
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
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
GPUFEEDD = os.environ.get("GPUFEEDD", str(REPO / "build/server/gpufeedd"))
GPUFEEDCTL = os.environ.get("GPUFEEDCTL", str(REPO / "build/client/ctl/gpufeedctl"))
PIPELINE = REPO / "deploy/pipelines/imagenet_train.json"


def free_port() -> int:
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decodes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^gpufeed_decodes_total\{[^}]*\} (\S+)$", text, re.M))


def run(sock: str, data: Path, batch: int, group: str, step_ms: List[int]) -> List[float]:
    """Consumers side by side, one epoch each: each one's images/s (its own wall time)."""
    procs = []
    for i, ms in enumerate(step_ms):
        args = [GPUFEEDCTL, "--socket", sock, "consume", "--job", f"bench-{group or 'solo'}-{i}",
                "--kind", "image_folder", "--dataset", str(data), "--pipeline", str(PIPELINE),
                "--batch-size", str(batch), "--seed", str(100 + i), "--epochs", "1",
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
        rates.append(time.monotonic() - start)
    n = sum(1 for _ in data.rglob("*.jpg"))
    images = n // batch * batch
    return [images / wall for wall in rates]


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
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="gpufeed-share-bench-") as tmp:
        sock = f"{tmp}/gf.sock"
        daemon = subprocess.Popen(
            [GPUFEEDD, f"--listen=unix://{sock}", f"--threads={args.threads}",
             f"--staging_bytes={2 << 30}", f"--share_cache_bytes={4 << 30}",
             f"--metrics_listen=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/gpufeedd.log", "w"))
        try:
            for _ in range(200):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            rows: Dict[str, Dict[str, float]] = {}
            for name, group, step_ms in (("independent", "", [0] * 4),
                                         ("sharing group", "bench", [0] * 4),
                                         ("group, one job 50 ms/batch", "bench2", [0, 0, 0, 50])):
                before = decodes(port)
                start = time.monotonic()
                rates = run(sock, data, args.batch, group, step_ms)
                wall = time.monotonic() - start
                delivered = args.images // args.batch * args.batch * len(step_ms)
                rows[name] = {"aggregate": delivered / wall, "fast_mean": sum(rates[:3]) / 3,
                              "decodes_per_image": (decodes(port) - before) / delivered}
        finally:
            daemon.terminate()
            daemon.wait(30)
    base = rows["independent"]["aggregate"]
    shared = rows["sharing group"]
    slow = rows["group, one job 50 ms/batch"]
    print(f"4 consumers, {args.images} ImageNet-like JPEGs, imagenet_train pipeline, "
          f"B={args.batch}, --threads {args.threads}")
    print(f"| run | aggregate images/s | vs independent | decodes per image |")
    print(f"|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['aggregate']:,.0f} | {r['aggregate'] / base:.2f}x | "
              f"{r['decodes_per_image']:.2f} |")
    change = slow["fast_mean"] / shared["fast_mean"] - 1
    print(f"the three full-speed jobs beside one at 50 ms/batch: {slow['fast_mean']:,.0f} "
          f"images/s each vs {shared['fast_mean']:,.0f} with four at full speed "
          f"({change:+.1%})")
    print(json.dumps({"bench": "share", "images": args.images, "threads": args.threads,
                      "independent_ips": round(base, 1),
                      "shared_ips": round(shared["aggregate"], 1),
                      "speedup": round(shared["aggregate"] / base, 2),
                      "shared_decodes_per_image": round(shared["decodes_per_image"], 3),
                      "independent_decodes_per_image": round(
                          rows["independent"]["decodes_per_image"], 3),
                      "slow_neighbour_change": round(change, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
