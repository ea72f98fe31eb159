"""gpufeed.torch.pipeline_from_torchvision: torchvision's ImageNet stacks (v2, and v1 where the
same) convert to deploy/pipelines/imagenet_{train,eval}.json; what gpufeed cannot do is
refused naming the transform and why; a converted pipeline attaches and its pixels are
torchvision's.

Where torchvision is not installed, tests/python/tv_standin/ stands in: classes with
torchvision's names, modules, arguments and stored attributes (the real package is used
whenever it imports)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

try:
    import torchvision  # noqa: F401

    STANDIN = False
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "tv_standin"))
    STANDIN = True
import torchvision.transforms as T1  # noqa: E402
from torchvision.transforms import v2 as T  # noqa: E402

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
import reference  # noqa: E402
from gpufeed.pipeline import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from test_pipeline import deployed, same_pipeline  # noqa: E402

from_tv = gpufeed.torch.pipeline_from_torchvision
BILINEAR = T1.InterpolationMode.BILINEAR


def test_report_which_torchvision():
    # Not a check: says in -v output whether the real package or the stand-in ran.
    print("torchvision:", "stand-in (tests/python/tv_standin)" if STANDIN else
          torchvision.__version__)


TRAIN_STACKS = {
    "v2": T.Compose([T.RandomResizedCrop(224, antialias=True), T.RandomHorizontalFlip(),
                     T.ToImage(), T.ToDtype(torch.float16, scale=True),
                     T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
    "v2 float32 then half": T.Compose([
        T.ToImage(), T.RandomResizedCrop((224, 224), scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                                         interpolation=BILINEAR),
        T.RandomHorizontalFlip(p=0.5), T.ToDtype(torch.float32, scale=True),
        T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD), T.ToDtype(torch.float16)]),
    "v1": T1.Compose([T1.RandomResizedCrop(224), T1.RandomHorizontalFlip(), T1.ToTensor(),
                      T1.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                      T1.ConvertImageDtype(torch.float16)]),
}
EVAL_STACKS = {
    "v2": T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224), T.PILToTensor(),
                     T.ToDtype(torch.float16, scale=True),
                     T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
    "v2 nested, list size": T.Compose([T.Compose([T.Resize([256]), T.CenterCrop([224])]),
                                       T.ToImage(), T.ToDtype(torch.float32, scale=True),
                                       T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
                                       T.ToDtype(torch.float16), T.ToPureTensor()]),
    "v1": T1.Compose([T1.Resize(256), T1.CenterCrop(224), T1.PILToTensor(),
                      T1.ConvertImageDtype(torch.float16),
                      T1.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
}


@pytest.mark.parametrize("stack", TRAIN_STACKS)
def test_imagenet_train_stacks_are_the_deployed_train_pipeline(stack):
    got = from_tv(TRAIN_STACKS[stack])
    assert same_pipeline(got.to_dict(), deployed("imagenet_train.json")), got


@pytest.mark.parametrize("stack", EVAL_STACKS)
def test_imagenet_eval_stacks_are_the_deployed_eval_pipeline(stack):
    got = from_tv(EVAL_STACKS[stack])
    assert same_pipeline(got.to_dict(), deployed("imagenet_eval.json")), got


def test_dtypes_and_no_dtype():
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


@pytest.mark.parametrize("transforms, message", [
    ([T.RandomResizedCrop(224, interpolation=T1.InterpolationMode.NEAREST)],
     "transform 0, RandomResizedCrop: interpolation=NEAREST: gpufeed resizes with bilinear "
     "interpolation only (InterpolationMode.BILINEAR)"),
    ([T.Resize(256, interpolation=T1.InterpolationMode.BICUBIC), T.CenterCrop(224)],
     "transform 0, Resize: interpolation=BICUBIC: gpufeed resizes with bilinear"),
    ([T.RandomResizedCrop(224, antialias=False)],
     "transform 0, RandomResizedCrop: antialias=False: gpufeed's resize is antialiased; want "
     "antialias=True"),
    ([T1.Resize(256, antialias=None), T1.CenterCrop(224)],
     "transform 0, Resize: antialias=None"),
    ([T.RandomResizedCrop((224, 192))],
     "transform 0, RandomResizedCrop: random_resized_crop: size: (224, 192) is not square"),
    ([T.CenterCrop((224, 192))], "transform 0, CenterCrop: center_crop: size: (224, 192) is not "
     "square"),
    ([T.Resize((256, 256)), T.CenterCrop(224)],
     "transform 0, Resize: size=(256, 256): resizing to (h, w) does not keep the aspect ratio"),
    ([T.Resize(256, max_size=512), T.CenterCrop(224)],
     "transform 0, Resize: max_size=512: not supported"),
    ([T.CenterCrop(224), T.ToImage(), T.ToDtype(torch.float32),
      T.Normalize(IMAGENET_MEAN, IMAGENET_STD)],
     "transform 2, ToDtype: to float32 without scale=True keeps values in 0..255"),
    ([T.CenterCrop(224), T.ToImage(), T.ToDtype(torch.float64, scale=True)],
     "transform 2, ToDtype: dtype torch.float64: gpufeed outputs uint8, float16, bfloat16 or "
     "float32"),
    ([T.CenterCrop(224), T.ToImage(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)],
     "transform 2, Normalize: of a uint8 image: put ToDtype(torch.float32, scale=True) before "
     "it"),
    ([T.CenterCrop(224), T.ToDtype(torch.float32, scale=True), T.Normalize([0.5], [0.5])],
     "transform 2, Normalize: normalize: mean: want 3 finite numbers, got [0.5]"),
    ([T.RandomResizedCrop(224), T.ColorJitter(0.4, 0.4, 0.4)],
     "transform 1, ColorJitter: not a transform gpufeed implements"),
    ([T1.CenterCrop(224), T1.RandomVerticalFlip()],
     "transform 1, RandomVerticalFlip: not a transform gpufeed implements"),
    ([T.CenterCrop(224), lambda image: image],
     "transform 1, function: not a torchvision transform"),
    ([T.RandomResizedCrop(224), T.CenterCrop(192)],
     "transform 1, CenterCrop: after RandomResizedCrop: only one geometry"),
    ([T.Resize(256), T.CenterCrop(300)],
     "transform 1, CenterCrop: size 300 is larger than the Resize's 256 (torchvision pads it; "
     "gpufeed does not)"),
    ([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.RandomHorizontalFlip()],
     "transform 2, RandomHorizontalFlip: a second flip"),
    ([T.Resize(256), T.ToImage()],
     "no RandomResizedCrop or CenterCrop: gpufeed's batches need one output size"),
])
def test_what_gpufeed_cannot_do_is_refused_naming_the_transform(transforms, message):
    with pytest.raises(ValueError) as e:
        from_tv(T.Compose(transforms))
    text = str(e.value)
    assert text.startswith("pipeline_from_torchvision: " + message), text
    assert SUPPORTED in text


def test_a_converted_pipeline_delivers_torchvisions_pixels(daemon, job, datasets):
    # The 4 x 6 test images: Resize(4) keeps them (the shorter side is 4), CenterCrop(4) takes
    # the middle; then ToDtype(scale=True) and Normalize, as torchvision computes them.
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    pipeline = from_tv(T.Compose([T.Resize(4), T.CenterCrop(4), T.ToImage(),
                                  T.ToDtype(torch.float32, scale=True), T.Normalize(mean, std)]))
    with gpufeed.torch.Loader(datasets.images, kind="image_folder", batch_size=3, job=job,
                              socket=daemon.socket, device="cpu", timeout=20,
                              pipeline=pipeline) as loader:
        batch = next(iter(loader))
        image = batch["image"]
        assert image.dtype == torch.float32 and image.shape == (3, 3, 4, 4)
        for row, i in enumerate(batch.ids.tolist()):
            crop = reference.center_crop(datasets.image_pixels[i], 4).transpose(2, 0, 1)
            want = (crop.astype(np.float32) / 255 - np.float32(mean)[:, None, None]) / \
                np.float32(std)[:, None, None]
            np.testing.assert_allclose(image[row].numpy(), want, rtol=0, atol=1e-5)
            assert batch["label"][row].item() == datasets.image_labels[i]
