#!/usr/bin/env python3
"""Compare gpufeed's image outputs with torchvision's, for the image path's acceptance checks.

--ours OURS.npy (uint8 HWC, size x size x 3): gpufeed's output for one fixed crop (no flip, no
normalisation, DCT scaling off), against
  resized_crop(decode_jpeg(read_file(IMAGE)), TOP, LEFT, H, W, [size, size], antialias=True).
  Fails when the mean absolute difference exceeds --max-mad (1.5, of 255).
--ref-decode OURS_DECODE.npy (uint8 HWC, the whole image): gpufeed's decode (libjpeg-turbo),
  against torchvision's CPU decode_jpeg. Fails when the MAD exceeds --max-decode-mad (1.0).

Prints one line per check and a JSON line; exits 1 if a check fails, 2 on bad input.
Example: compare_torchvision.py --image img.jpg --ours crop.npy --crop 10,20,300,280
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms.v2 import functional as F


def parse_crop(text: str) -> tuple[int, int, int, int]:
    try:
        top, left, height, width = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected TOP,LEFT,H,W (four integers)") from None
    if min(top, left) < 0 or min(height, width) < 1:
        raise argparse.ArgumentTypeError("need TOP, LEFT >= 0 and H, W >= 1")
    return top, left, height, width


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--image", type=Path, required=True, help="the JPEG file")
    parser.add_argument("--ours", type=Path, help="gpufeed's crop, uint8 HWC .npy")
    parser.add_argument("--crop", type=parse_crop, help="TOP,LEFT,H,W of that crop, in pixels")
    parser.add_argument("--size", type=int, default=224, help="output side (224)")
    parser.add_argument("--max-mad", type=float, default=1.5, help="crop MAD limit (1.5)")
    parser.add_argument("--ref-decode", type=Path, help="gpufeed's full decode, uint8 HWC .npy")
    parser.add_argument("--max-decode-mad", type=float, default=1.0,
                        help="decode MAD limit (1.0)")
    args = parser.parse_args()
    if args.ours is None and args.ref_decode is None:
        parser.error("give --ours (with --crop) or --ref-decode, or both")
    if args.ours is not None and args.crop is None:
        parser.error("--ours needs --crop")
    return args


def torchvision_decode(image: Path) -> torch.Tensor:
    """uint8 CHW RGB, decoded on the CPU."""
    return decode_jpeg(read_file(str(image)), mode=ImageReadMode.RGB)


def load_hwc(path: Path, shape: tuple[int, int, int]) -> np.ndarray:
    array = np.load(path)
    if array.dtype != np.uint8 or array.shape != shape:
        raise ValueError(f"{path}: {array.dtype} {array.shape}, expected uint8 {shape} (HWC)")
    return array


def difference(ours: np.ndarray, reference: np.ndarray) -> tuple[float, int]:
    """Mean and max absolute difference, in 8-bit levels."""
    delta = np.abs(ours.astype(np.int16) - reference.astype(np.int16))
    return float(delta.mean()), int(delta.max())


def check(name: str, ours: np.ndarray, reference: np.ndarray, limit: float) -> dict:
    mad, worst = difference(ours, reference)
    passed = mad <= limit
    print(f"{name}: MAD {mad:.3f} (limit {limit}), max {worst}: {'PASS' if passed else 'FAIL'}",
          flush=True)
    return {"check": name, "mad": mad, "max": worst, "limit": limit, "pass": passed}


def main() -> int:
    args = parse_args()
    decoded = torchvision_decode(args.image)
    _, height, width = decoded.shape
    results = []
    try:
        if args.ref_decode is not None:
            ours = load_hwc(args.ref_decode, (height, width, 3))
            reference = decoded.permute(1, 2, 0).numpy()
            results.append(check("decode", ours, reference, args.max_decode_mad))
        if args.ours is not None:
            ours = load_hwc(args.ours, (args.size, args.size, 3))
            top, left, crop_h, crop_w = args.crop
            crop = F.resized_crop(decoded, top, left, crop_h, crop_w, [args.size, args.size],
                                  antialias=True)
            reference = crop.permute(1, 2, 0).numpy()
            results.append(check(f"resized_crop {args.crop}", ours, reference, args.max_mad))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps({"image": str(args.image), "results": results}), flush=True)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
