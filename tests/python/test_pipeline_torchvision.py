"""gpufeed.torch.pipeline_from_torchvision: torchvision's ImageNet stacks (v2, and v1 where the
same) convert to deploy/pipelines/imagenet_{train,eval}.json; what gpufeed cannot do is
refused naming the transform and why; a converted pipeline attaches and its pixels are
torchvision's.

Per feature, against the torchvision that is installed: v1 cases run on any torchvision
(deploy/install-deps.sh installs Debian 12's 0.14); the v2 cases skip, naming the version,
where torchvision has no transforms.v2 (before 0.15). Where torchvision is not installed,
tests/python/tv_standin/ stands in: classes with torchvision's names, modules, arguments and
stored attributes (the real package is used whenever it imports); the pixel comparison with
torchvision's own output then skips."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

try:
    import torchvision

    STANDIN = False
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "tv_standin"))
    import torchvision

    STANDIN = True
import torchvision.transforms as T1  # noqa: E402

try:
    from torchvision.transforms import v2 as T  # noqa: E402
except ImportError:
    T = None

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
import reference  # noqa: E402
from gpufeed.pipeline import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from test_pipeline import deployed, same_pipeline  # noqa: E402

from_tv = gpufeed.torch.pipeline_from_torchvision
BILINEAR = T1.InterpolationMode.BILINEAR
VERSION = getattr(torchvision, "__version__", "?")
v2_only = pytest.mark.skipif(
    T is None, reason=f"torchvision {VERSION} has no transforms.v2 (it came in 0.15; gpufeed "
                      "reads it from 0.16): v2 not tested, v1 tested")


def test_report_which_torchvision():
    # Not a check: says in -v output whether the real package or the stand-in ran.
    print("torchvision:", "stand-in (tests/python/tv_standin)" if STANDIN else VERSION,
          "with transforms.v2" if T is not None else "without transforms.v2")


TRAIN_STACKS = {
    "v2": lambda: T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(),
                             T.ToImage(), T.ToDtype(torch.float16, scale=True),
                             T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
    "v2 float32 then half": lambda: T.Compose([
        T.ToImage(), T.RandomResizedCrop((224, 224), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                                         interpolation=BILINEAR, antialias=True),
        T.RandomHorizontalFlip(p=0.5), T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD), T.ToDtype(torch.float16)]),
    # The default antialias (None before 0.17) on the PIL image: PIL always antialiases.
    "v1": lambda: T1.Compose([T1.RandomResizedCrop(224), T1.RandomHorizontalFlip(),
                              T1.ToTensor(), T1.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                              T1.ConvertImageDtype(torch.float16)]),
}
EVAL_STACKS = {
    "v2": lambda: T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), T.PILToTensor(),
                             T.ToDtype(torch.float16, scale=True),
                             T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
    "v2 nested, list size": lambda: T.Compose([
        T.Compose([T.Resize([256], antialias=True), T.CenterCrop([224])]), T.ToImage(),
        T.ToDtype(torch.float32, scale=True), T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        T.ToDtype(torch.float16), T.ToPureTensor()]),
    "v1": lambda: T1.Compose([T1.Resize(256), T1.CenterCrop(224), T1.PILToTensor(),
                              T1.ConvertImageDtype(torch.float16),
                              T1.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
    "v1 antialias=True": lambda: T1.Compose([
        T1.Resize(256, antialias=True), T1.CenterCrop(224), T1.ToTensor(),
        T1.Normalize(IMAGENET_MEAN, IMAGENET_STD), T1.ConvertImageDtype(torch.float16)]),
}


def _by_api(stacks):
    return [pytest.param(name, marks=v2_only if name.startswith("v2") else (), id=name)
            for name in stacks]


@pytest.mark.parametrize("stack", _by_api(TRAIN_STACKS))
def test_imagenet_train_stacks_are_the_deployed_train_pipeline(stack):
    got = from_tv(TRAIN_STACKS[stack]())
    assert same_pipeline(got.to_dict(), deployed("imagenet_train.json")), got


@pytest.mark.parametrize("stack", _by_api(EVAL_STACKS))
def test_imagenet_eval_stacks_are_the_deployed_eval_pipeline(stack):
    got = from_tv(EVAL_STACKS[stack]())
    assert same_pipeline(got.to_dict(), deployed("imagenet_eval.json")), got


def test_dtypes_and_no_dtype_v1():
    crop = [T1.CenterCrop(8)]
    assert from_tv(T1.Compose([*crop, T1.PILToTensor()]))[-2] == {
        "cast": {"dtype": "DTYPE_UINT8"}}
    got = from_tv(T1.Compose([*crop, T1.PILToTensor(), T1.ConvertImageDtype(torch.bfloat16)]))
    assert [dict(op) for op in got] == [{"center_crop": {"size": 8}},
                                        {"cast": {"dtype": "DTYPE_BFLOAT16"}},
                                        {"layout": {"layout": "IMAGE_LAYOUT_NCHW"}}]


@v2_only
def test_dtypes_and_no_dtype_v2():
    crop = [T.CenterCrop(8)]
    assert from_tv(T.Compose([*crop, T.ToImage()]))[-2] == {"cast": {"dtype": "DTYPE_UINT8"}}
    assert from_tv(T.Compose([*crop, T.ToDtype(torch.uint8, scale=True)]))[-2] == {
        "cast": {"dtype": "DTYPE_UINT8"}}
    got = from_tv(T.Compose([*crop, T.ToDtype(torch.bfloat16, scale=True)]))
    assert [dict(op) for op in got] == [{"center_crop": {"size": 8}},
                                        {"cast": {"dtype": "DTYPE_BFLOAT16"}},
                                        {"layout": {"layout": "IMAGE_LAYOUT_NCHW"}}]
    # v2's per-type dict: the entry for images.
    image_type = type("Image", (), {})
    got = from_tv([*crop, T.ToDtype({image_type: torch.float32, "others": None}, scale=True)])
    assert got[-2] == {"cast": {"dtype": "DTYPE_FLOAT32"}}


SUPPORTED = "supported: RandomResizedCrop (square size, bilinear, antialias=True), Resize"
NEAREST, BICUBIC = T1.InterpolationMode.NEAREST, T1.InterpolationMode.BICUBIC

# (the APIs it is written for, the transforms from one of them, the message's start)
REFUSALS = [
    ("v1 v2", lambda tv: [tv.RandomResizedCrop(224, interpolation=NEAREST)],
     "transform 0, RandomResizedCrop: interpolation=NEAREST: gpufeed resizes with bilinear "
     "interpolation only (InterpolationMode.BILINEAR)"),
    ("v1 v2", lambda tv: [tv.Resize(256, interpolation=BICUBIC), tv.CenterCrop(224)],
     "transform 0, Resize: interpolation=BICUBIC: gpufeed resizes with bilinear"),
    ("v1 v2", lambda tv: [tv.RandomResizedCrop(224, antialias=False)],
     "transform 0, RandomResizedCrop: antialias=False: gpufeed's resize is antialiased; want "
     "antialias=True"),
    ("v1", lambda tv: [tv.PILToTensor(), tv.Resize(256, antialias=None), tv.CenterCrop(224)],
     "transform 1, Resize: antialias=None after PILToTensor: torchvision resizes a tensor "
     "without antialiasing then, gpufeed's resize is antialiased; want antialias=True"),
    ("v1 v2", lambda tv: [tv.RandomResizedCrop((224, 192), antialias=True)],
     "transform 0, RandomResizedCrop: random_resized_crop: size: (224, 192) is not square"),
    ("v1 v2", lambda tv: [tv.CenterCrop((224, 192))],
     "transform 0, CenterCrop: center_crop: size: (224, 192) is not square"),
    ("v1 v2", lambda tv: [tv.Resize((256, 256)), tv.CenterCrop(224)],
     "transform 0, Resize: size=(256, 256): resizing to (h, w) does not keep the aspect ratio"),
    ("v1 v2", lambda tv: [tv.Resize(256, max_size=512), tv.CenterCrop(224)],
     "transform 0, Resize: max_size=512: not supported"),
    ("v2", lambda tv: [tv.CenterCrop(224), tv.ToImage(), tv.ToDtype(torch.float32),
                       tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)],
     "transform 2, ToDtype: to float32 without scale=True keeps values in 0..255"),
    ("v2", lambda tv: [tv.CenterCrop(224), tv.ToImage(), tv.ToDtype(torch.float64, scale=True)],
     "transform 2, ToDtype: dtype torch.float64: gpufeed outputs uint8, float16, bfloat16 or "
     "float32"),
    ("v1", lambda tv: [tv.CenterCrop(224), tv.PILToTensor(),
                       tv.ConvertImageDtype(torch.float64)],
     "transform 2, ConvertImageDtype: dtype torch.float64: gpufeed outputs uint8, float16, "
     "bfloat16 or float32"),
    ("v2", lambda tv: [tv.CenterCrop(224), tv.ToImage(),
                       tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)],
     "transform 2, Normalize: of a uint8 image: put ToDtype(torch.float32, scale=True) before "
     "it"),
    ("v1", lambda tv: [tv.CenterCrop(224), tv.PILToTensor(),
                       tv.Normalize(IMAGENET_MEAN, IMAGENET_STD)],
     "transform 2, Normalize: of a uint8 image: put ToDtype(torch.float32, scale=True) before "
     "it"),
    ("v2", lambda tv: [tv.CenterCrop(224), tv.ToDtype(torch.float32, scale=True),
                       tv.Normalize([0.5], [0.5])],
     "transform 2, Normalize: normalize: mean: want 3 finite numbers, got [0.5]"),
    ("v1", lambda tv: [tv.CenterCrop(224), tv.ToTensor(), tv.Normalize([0.5], [0.5])],
     "transform 2, Normalize: normalize: mean: want 3 finite numbers, got [0.5]"),
    ("v1 v2", lambda tv: [tv.RandomResizedCrop(224), tv.ColorJitter(0.4, 0.4, 0.4)],
     "transform 1, ColorJitter: not a transform gpufeed implements"),
    ("v1", lambda tv: [tv.CenterCrop(224), tv.RandomVerticalFlip()],
     "transform 1, RandomVerticalFlip: not a transform gpufeed implements"),
    ("v1 v2", lambda tv: [tv.CenterCrop(224), lambda image: image],
     "transform 1, function: not a torchvision transform"),
    ("v1 v2", lambda tv: [tv.RandomResizedCrop(224), tv.CenterCrop(192)],
     "transform 1, CenterCrop: after RandomResizedCrop: only one geometry"),
    ("v1 v2", lambda tv: [tv.Resize(256), tv.CenterCrop(300)],
     "transform 1, CenterCrop: size 300 is larger than the Resize's 256 (torchvision pads it; "
     "gpufeed does not)"),
    ("v1 v2", lambda tv: [tv.RandomResizedCrop(224), tv.RandomHorizontalFlip(),
                          tv.RandomHorizontalFlip()],
     "transform 2, RandomHorizontalFlip: a second flip"),
    ("v2", lambda tv: [tv.Resize(256), tv.ToImage()],
     "no RandomResizedCrop or CenterCrop: gpufeed's batches need one output size"),
    ("v1", lambda tv: [tv.Resize(256), tv.PILToTensor()],
     "no RandomResizedCrop or CenterCrop: gpufeed's batches need one output size"),
]


def _refusals():
    for apis, build, message in REFUSALS:
        for api in apis.split():
            yield pytest.param(api, build, message, marks=v2_only if api == "v2" else (),
                               id=f"{api}: {message.split(': ', 2)[1][:48]}")


@pytest.mark.parametrize("api, build, message", _refusals())
def test_what_gpufeed_cannot_do_is_refused_naming_the_transform(api, build, message):
    tv = T if api == "v2" else T1
    with pytest.raises(ValueError) as e:
        from_tv(tv.Compose(build(tv)))
    text = str(e.value)
    assert text.startswith("pipeline_from_torchvision: " + message), text
    assert SUPPORTED in text and "of torchvision 0.14 or later (v2: 0.16 or later)" in text


def test_a_torchvision_it_cannot_read_is_refused_naming_the_version(monkeypatch):
    monkeypatch.setattr(torchvision, "__version__", "0.13.1")
    with pytest.raises(ValueError) as e:
        from_tv([T1.CenterCrop(8)])
    assert str(e.value).startswith(
        "pipeline_from_torchvision: transform 0, CenterCrop: torchvision 0.13's v1 transforms "
        "are not supported: pipeline_from_torchvision reads those of torchvision 0.14 or "
        "later; supported: ")
    # 0.15's beta transforms.v2 (named and defaulted otherwise): refused, pointing to v1.
    monkeypatch.setattr(torchvision, "__version__", "0.15.2")
    beta = type("CenterCrop", (), {"__module__": "torchvision.transforms.v2._geometry",
                                   "size": (8, 8)})()
    with pytest.raises(ValueError) as e:
        from_tv([beta])
    assert str(e.value).startswith(
        "pipeline_from_torchvision: transform 0, CenterCrop: torchvision 0.15's v2 transforms "
        "are not supported: pipeline_from_torchvision reads those of torchvision 0.16 or "
        "later; use the v1 transforms (torchvision.transforms)")
    assert from_tv([T1.CenterCrop(8)])[0] == {"center_crop": {"size": 8}}  # v1 0.15: read
    # A later torchvision that stores a setting under another name: said, not a crash.
    monkeypatch.setattr(torchvision, "__version__", "0.99.0")
    resize = T1.Resize(16)
    del resize.size
    with pytest.raises(ValueError) as e:
        from_tv([resize, T1.CenterCrop(8)])
    assert str(e.value).startswith(
        "pipeline_from_torchvision: transform 0, Resize: cannot read its settings from "
        "torchvision 0.99 ('Resize' object has no attribute 'size'); pipeline_from_torchvision "
        "reads the transforms of the torchvision versions it was tested with")


def _pixels_case(api):
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    if api == "v2":
        return mean, std, T.Compose([T.Resize(4, antialias=True), T.CenterCrop(4), T.ToImage(),
                                     T.ToDtype(torch.float32, scale=True),
                                     T.Normalize(mean, std)])
    return mean, std, T1.Compose([T1.Resize(4), T1.CenterCrop(4), T1.ToTensor(),
                                  T1.Normalize(mean, std)])


@pytest.mark.parametrize("api", [pytest.param("v1"), pytest.param("v2", marks=v2_only)])
def test_a_converted_pipeline_delivers_torchvisions_pixels(daemon, job, datasets, api):
    # The 4 x 6 test images: Resize(4) keeps them (the shorter side is 4), CenterCrop(4) takes
    # the middle; then ToDtype(scale=True) and Normalize, as torchvision computes them.
    mean, std, stack = _pixels_case(api)
    with gpufeed.torch.Loader(datasets.images, kind="image_folder", batch_size=3, job=job,
                              socket=daemon.socket, device="cpu", timeout=20,
                              pipeline=from_tv(stack)) as loader:
        batch = next(iter(loader))
        image = batch["image"]
        assert image.dtype == torch.float32 and image.shape == (3, 3, 4, 4)
        for row, i in enumerate(batch.ids.tolist()):
            crop = reference.center_crop(datasets.image_pixels[i], 4).transpose(2, 0, 1)
            want = (crop.astype(np.float32) / 255 - np.float32(mean)[:, None, None]) / \
                np.float32(std)[:, None, None]
            np.testing.assert_allclose(image[row].numpy(), want, rtol=0, atol=1e-5)
            assert batch["label"][row].item() == datasets.image_labels[i]


@pytest.mark.skipif(STANDIN, reason="torchvision is not installed (the stand-in transforms "
                                    "nothing): not compared with torchvision's own output")
def test_v1_eval_stack_is_torchvisions_own_output(daemon, job, tmp_path):
    """The real torchvision applied to the PIL images of an image folder (its ImageFolder's
    loader) against gpufeed's batches of the converted stack: Resize downscales (antialiased,
    PIL's) to a shorter side of 16, CenterCrop(16), to uint8 and to normalised float32.
    gpufeed resizes in float32 and rounds once; PIL rounds its own way: one level of 255."""
    from PIL import Image

    rng = np.random.default_rng(31)
    root = tmp_path / "folder"
    (root / "a").mkdir(parents=True)
    sizes = [(23, 31), (40, 27), (16, 16), (33, 50), (61, 44)]  # (h, w)
    files = []
    for k, (h, w) in enumerate(sizes):
        # Smooth content, as photographs are (noise would measure rounding, not resizing).
        y, x = np.mgrid[0:h, 0:w]
        rgb = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                        ((x + y) * 97 + k * 50) % 256], axis=-1).astype(np.uint8)
        rgb = np.clip(rgb.astype(np.int16) + rng.integers(-3, 4, rgb.shape), 0, 255)
        files.append(root / "a" / f"{k}.png")
        reference.write_png(files[-1], rgb.astype(np.uint8))
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    stacks = {
        "uint8": T1.Compose([T1.Resize(16), T1.CenterCrop(16), T1.PILToTensor()]),
        "float32": T1.Compose([T1.Resize(16), T1.CenterCrop(16), T1.ToTensor(),
                               T1.Normalize(mean, std)]),
    }
    for name, stack in stacks.items():
        with gpufeed.torch.Loader(root, kind="image_folder", batch_size=len(files), job=job,
                                  shuffle=False, socket=daemon.socket, device="cpu",
                                  timeout=20, pipeline=from_tv(stack)) as loader:
            batch = next(iter(loader))
        assert batch.ids.tolist() == list(range(len(files)))
        for i, path in enumerate(files):
            want = stack(Image.open(path).convert("RGB")).float()
            got = batch["image"][i].float()
            assert got.shape == want.shape == (3, 16, 16), (name, path)
            step = 1.0 if name == "uint8" else 1 / 255 / min(std)
            worst = (got - want).abs().max().item()
            assert worst <= step * 1.01, (name, sizes[i], worst)
