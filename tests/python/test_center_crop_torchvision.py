"""center_crop is torchvision's, bit for bit: the daemon's CPU path against
torchvision.transforms.functional.center_crop itself on the same decoded images, for crops
smaller than, equal to and larger than the image on each axis, odd and even paddings both.

Where torchvision is not installed (Debian: python3-torchvision, which deploy/install-deps.sh
installs), the comparison skips, saying so; the arithmetic itself is also a C++ unit test
(tests/unit/server/augment/crop_test.cc, CenterCropTest)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpufeed
import reference

torch = pytest.importorskip("torch")
F = pytest.importorskip("torchvision.transforms.functional",
                        reason="torchvision is not installed (apt-get install python3-torchvision)")

# Image sides x crops: every parity of padding (crop - image = 1, 2, 3, 4, 5, 7, ...) on each
# axis, one axis padded while the other is cropped, and crops of the image's own size.
SIDES = (1, 2, 3, 6, 9, 10, 13)
CROPS = (1, 4, 7, 8, 10, 13, 16, 17)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    """One class folder of PNGs, every height x width of SIDES, in name (= sample id) order;
    returns the folder and each image as decoded (PIL, as torchvision's ImageFolder does)."""
    root = tmp_path_factory.mktemp("center_crop")
    (root / "c").mkdir()
    rng = np.random.default_rng(31)
    images = []
    for h in SIDES:
        for w in SIDES:
            # 1..255: a zero of torchvision's padding never equals an image pixel by chance.
            rgb = rng.integers(1, 256, size=(h, w, 3), dtype=np.uint8)
            path = root / "c" / f"{len(images):03d}.png"
            reference.write_png(path, rgb)
            try:
                from PIL import Image

                with Image.open(path) as im:
                    decoded = np.asarray(im.convert("RGB"))
                assert np.array_equal(decoded, rgb)  # PNG is lossless
            except ImportError:
                decoded = rgb
            images.append(decoded)
    return root, images


@pytest.mark.parametrize("crop", CROPS)
def test_center_crop_is_torchvisions_bit_for_bit(daemon, job, folder, crop):
    root, images = folder
    with gpufeed.Client(daemon.socket).attach(
            str(root), kind="image_folder", job=job, batch_size=len(images), shuffle=False,
            drop_last=False, stop_epoch=1, pipeline=[{"center_crop": crop}]) as session:
        batch = session.next(timeout=30)
        got = batch.numpy()["image"].copy()
        ids = list(batch.ids)
        batch.release()
    assert got.dtype == np.uint8 and got.shape == (len(images), 3, crop, crop)
    assert ids == list(range(len(images)))
    wrong = []
    for i, rgb in enumerate(images):
        chw = torch.from_numpy(rgb.transpose(2, 0, 1).copy())
        want = F.center_crop(chw, [crop, crop]).numpy()
        if not np.array_equal(got[i], want):
            h, w = rgb.shape[:2]
            wrong.append(f"{h}x{w}")
    assert not wrong, f"center_crop({crop}) differs from torchvision's for images {wrong}"
