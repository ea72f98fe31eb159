#!/usr/bin/env python3
"""The CPU-path goal from one call's lines: each CPU-path rate against 16 cores times
the one-core libjpeg-turbo decode rate measured in the same call, and against torchvision's
DataLoader there.

    cpu_path_table.py CPU_JSONL TORCHVISION_JSON [--cores 16]

CPU_JSONL holds image_bench's JSON lines (`decode`: the one-core rate; `feed`: the paths);
TORCHVISION_JSON is torchvision_bench.py's report. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cpu_jsonl", type=pathlib.Path)
    parser.add_argument("torchvision_json", type=pathlib.Path)
    parser.add_argument("--cores", type=int, default=16)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.cpu_jsonl.read_text().splitlines()
            if line.startswith("{")]
    one = next((r["images_per_s"] for r in rows if r.get("tool") == "decode"), math.nan)
    try:
        report = json.loads(args.torchvision_json.read_text())
        loader = next(r["images_per_s"] for r in report["results"] if "images_per_s" in r)
    except (OSError, ValueError, KeyError, StopIteration):
        loader = math.nan
    cores = args.cores
    print(f"\n| CPU path, {cores} threads (one core decodes {one:,.0f} images/s) | images/s | "
          f"busy cores | vs {cores} x one core | vs DataLoader |")
    print("|---|---:|---:|---:|---:|")
    summary: dict = {"bench": "cpu_path", "one_core_decode": round(one) if one == one else None}
    for r in rows:
        if r.get("tool") != "feed":
            continue
        share = r["images_per_s"] / (cores * one)
        print(f"| {r['label']} | {r['images_per_s']:,.0f} | {r.get('busy_cores', 0):.1f} | "
              f"{100 * share:.1f} % | {r['images_per_s'] / loader:.2f}x |")
        summary[r["label"]] = {"images_per_s": round(r["images_per_s"]),
                               "vs_cores": round(share, 4)}
    print(f"| torchvision DataLoader, 15 workers | {loader:,.0f} | | "
          f"{100 * loader / (cores * one):.1f} % | 1.00x |")
    summary["dataloader"] = round(loader) if loader == loader else None
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
