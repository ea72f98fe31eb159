"""gpufeed.pipeline's builders (no torch needed), and pipeline JSON in README.md's short names
through the C library to a real gpufeedd."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed import pipeline as P

ROOT = Path(__file__).resolve().parents[2]


def deployed(name: str) -> dict:
    return json.loads((ROOT / "deploy" / "pipelines" / name).read_text())


def same_pipeline(got: dict, want: dict) -> bool:
    """Equal as the daemon reads them: the same ops and fields, numbers equal as float32
    (the proto's floats; the files write 4/3 as 1.3333333)."""
    def norm(x):
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        if isinstance(x, list):
            return [norm(v) for v in x]
        if isinstance(x, float) or (isinstance(x, int) and not isinstance(x, bool)):
            return pytest.approx(float(x), rel=1e-7)
        return x
    return norm(want) == got


def test_builders_make_the_deployed_imagenet_pipelines():
    train = P.Pipeline([P.random_resized_crop(224), P.flip(0.5),
                        P.normalize(P.IMAGENET_MEAN, P.IMAGENET_STD), P.cast("float16"),
                        P.layout("nchw")])
    evaluate = P.compose(P.resize(256), P.center_crop(224),
                         P.normalize(P.IMAGENET_MEAN, P.IMAGENET_STD), P.cast(np.float16),
                         P.layout())
    assert same_pipeline(json.loads(train.to_json()), deployed("imagenet_train.json"))
    assert same_pipeline(evaluate.to_dict(), deployed("imagenet_eval.json"))
    assert not same_pipeline(evaluate.to_dict(), deployed("imagenet_train.json"))


def test_a_pipeline_is_a_sequence_of_one_key_mappings():
    p = P.Pipeline([P.center_crop(4), {"cast": {"dtype": "DTYPE_UINT8"}}])
    assert len(p) == 2
    assert dict(p[0]) == {"center_crop": {"size": 4}}
    assert p[1] == P.cast("uint8")  # a dict op becomes an Op
    assert p[:1] == P.Pipeline([P.center_crop(4)])
    assert p + [P.layout("nhwc")] == P.Pipeline([*p, P.layout("nhwc")])
    assert repr(p) == "Pipeline([center_crop(size=4), cast(dtype='DTYPE_UINT8')])"
    # What Loader(pipeline=...) and Client.attach(pipeline=...) send for it.
    assert gpufeed.client.pipeline_json(p) == p.to_json()
    assert pickle.loads(pickle.dumps(p)) == p  # a picklable Loader's configuration holds it
    assert gpufeed.Pipeline is P.Pipeline
    assert P.random_resized_crop((32, 32), scale=[0.5, 1], ratio=(1, 1)) == {
        "random_resized_crop": {"size": 32, "scale_min": 0.5, "scale_max": 1.0,
                                "ratio_min": 1.0, "ratio_max": 1.0}}
    assert P.decode(dct_scaling=True) == {"decode": {"dct_scaling": True}}
    assert P.layout("NHWC") == {"layout": {"layout": "IMAGE_LAYOUT_NHWC"}}


@pytest.mark.parametrize("dtype", ["float16", "Float16", np.float16, np.dtype("float16")])
def test_cast_takes_names_and_numpy_dtypes(dtype):
    assert P.cast(dtype) == {"cast": {"dtype": "DTYPE_FLOAT16"}}


def test_cast_takes_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert [P.dtype_name(d) for d in (torch.float16, torch.half, torch.bfloat16, torch.float,
                                      torch.uint8)] == [
        "float16", "float16", "bfloat16", "float32", "uint8"]
    with pytest.raises(ValueError, match=r"^cast: dtype: want uint8, .* got torch.int8$"):
        P.cast(torch.int8)


@pytest.mark.parametrize("build, message", [
    (lambda: P.resize(0), "resize: shorter_side: want an integer from 1 to 8192, got 0"),
    (lambda: P.resize(256.0), "resize: shorter_side: want an integer from 1 to 8192, got 256.0"),
    (lambda: P.center_crop(True), "center_crop: size: want an integer from 1 to 8192, got True"),
    (lambda: P.random_resized_crop((224, 160)),
     "random_resized_crop: size: (224, 160) is not square; gpufeed's outputs are square: give "
     "one side"),
    (lambda: P.random_resized_crop(224, scale=(0.5, 0.1)),
     "random_resized_crop: scale: want (lo, hi) with 0 < lo <= hi <= 1, got (0.5, 0.1)"),
    (lambda: P.random_resized_crop(224, scale=(0.5, 2)),
     "random_resized_crop: scale: want (lo, hi) with 0 < lo <= hi <= 1, got (0.5, 2)"),
    (lambda: P.random_resized_crop(224, ratio=(0, 1)),
     "random_resized_crop: ratio: want (lo, hi) with 0 < lo <= hi, got (0, 1)"),
    (lambda: P.random_resized_crop(224, ratio=0.75),
     "random_resized_crop: ratio: want 2 finite numbers, got 0.75"),
    (lambda: P.flip(1.5), "flip: p: want a probability, 0 <= p <= 1, got 1.5"),
    (lambda: P.flip("half"), "flip: p: want a finite number, got 'half'"),
    (lambda: P.normalize([0.5, 0.5], [1, 1, 1]),
     "normalize: mean: want 3 finite numbers, got [0.5, 0.5]"),
    (lambda: P.normalize([0.5] * 3, [1, 0, 1]),
     "normalize: std: want 3 numbers > 0, got [1, 0, 1]"),
    (lambda: P.normalize([0.5] * 3, [1, float("nan"), 1]),
     "normalize: std: want 3 finite numbers, got [1, nan, 1]"),
    (lambda: P.cast("int8"),
     "cast: dtype: want uint8, float16, bfloat16 or float32 (a name, a torch or a numpy dtype), "
     "got 'int8'"),
    (lambda: P.cast(np.float64),
     "cast: dtype: want uint8, float16, bfloat16 or float32 (a name, a torch or a numpy dtype), "
     "got <class 'numpy.float64'>"),
    (lambda: P.layout("chw"), "layout: layout: want 'nchw' or 'nhwc', got 'chw'"),
    (lambda: P.decode("yes"), "decode: dct_scaling: want True or False, got 'yes'"),
    (lambda: P.Pipeline([P.resize(8), "center_crop"]),
     "Pipeline: op 1: want an op (gpufeed.pipeline.resize(256), ...) or a dict {name: {field: "
     "value}}, got 'center_crop'"),
])
def test_a_bad_argument_names_the_op_and_the_argument(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert str(e.value) == message


# ---- through the C library and the daemon ----


def test_short_names_reach_the_daemon(daemon, job, datasets):
    # README.md's short JSON: {"center_crop": 4}, "bfloat16", "nhwc".
    ops = [{"center_crop": 4}, {"cast": "bfloat16"}, {"layout": {"layout": "nhwc"}}]
    with gpufeed.Client(daemon.socket).attach(datasets.images, kind="image_folder", batch_size=2,
                                              job=job, pipeline=ops, stop_epoch=1) as session:
        batch = session.next(timeout=20)
        image = batch.tensors["image"]
        assert (image.dtype, image.shape) == ("bfloat16", (2, 4, 4, 3))
        batch.release()


def test_a_built_pipeline_attaches_as_the_deployed_file_does(daemon, job, datasets):
    built = P.Pipeline([P.random_resized_crop(4), P.flip(0.5),
                        P.normalize(P.IMAGENET_MEAN, P.IMAGENET_STD), P.cast("float16"),
                        P.layout("nchw")])
    client = gpufeed.Client(daemon.socket)
    # The file crops to 224: its text with the size made 4, for the 4 x 6 images.
    from_file = deployed("imagenet_train.json")
    from_file["ops"][0]["random_resized_crop"]["size"] = 4
    fingerprints = []
    for name, pipeline in [("built", built), ("file", from_file)]:
        with client.attach(datasets.images, kind="image_folder", batch_size=2, seed=3,
                           job=f"{job}-{name}", pipeline=pipeline, stop_epoch=1) as session:
            fingerprints.append(session.fingerprint)
            batch = session.next(timeout=20)
            assert batch.tensors["image"].shape == (2, 3, 4, 4)
            batch.release()
    assert fingerprints[0] == fingerprints[1]  # the daemon saw the same pipeline


@pytest.mark.parametrize("ops, message", [
    ([{"resize": {"size": 256}}],
     'pipeline.ops[0] resize: no field "size"; resize takes: shorter_side'),
    ([{"center_crop": 4}, {"blur": {"sigma": 1}}],
     'pipeline.ops[1]: no op "blur"; ops are: random_resized_crop, resize, center_crop, '
     'flip, normalize, cast, layout, decode'),
    ([{"center_crop": 4}, {"cast": "half"}],
     'pipeline.ops[1] cast: dtype: no value "half"; want uint8, float16, bfloat16, '
     'float32'),
])
def test_a_bad_op_is_refused_naming_it(daemon, job, datasets, ops, message):
    with pytest.raises(gpufeed.InvalidArgument) as e:
        gpufeed.Client(daemon.socket).attach(datasets.images, kind="image_folder", batch_size=2,
                                             job=job, pipeline=ops)
    assert str(e.value) == message
