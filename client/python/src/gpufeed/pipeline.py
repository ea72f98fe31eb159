"""Image pipelines for ``image_folder`` datasets, built in Python.

::

    from gpufeed.pipeline import (IMAGENET_MEAN, IMAGENET_STD, Pipeline, cast, flip, layout,
                                  normalize, random_resized_crop)

    train = Pipeline([random_resized_crop(224), flip(0.5),
                      normalize(IMAGENET_MEAN, IMAGENET_STD), cast("float16"), layout("nchw")])
    loader = gpufeed.torch.Loader(root, kind="image_folder", batch_size=256, pipeline=train)

A :class:`Pipeline` is a sequence of :class:`Op` (each a one-key mapping, ``{"resize":
{"shorter_side": 256}}``), so ``pipeline=`` takes it as it takes a list of op dicts;
:meth:`Pipeline.to_json` gives the JSON text (``deploy/pipelines/*.json``'s form) for
``gpufeedctl --pipeline`` or the C API. The builders check their arguments (a ``ValueError``
naming the op and the argument); the daemon checks the order of the ops at attach.

:func:`pipeline_from_torchvision` converts a torchvision ``Compose`` of the transforms gpufeed
implements (also as ``gpufeed.torch.pipeline_from_torchvision``).

This module needs neither torch nor torchvision: dtypes and transforms are read by duck
typing.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Mapping, Sequence
from typing import (Any, Dict, Iterable, Iterator, List, Literal, Optional, Tuple, Union,
                    overload)

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
"""ImageNet's per-channel mean (RGB, of images scaled to [0, 1])."""
IMAGENET_STD = (0.229, 0.224, 0.225)
"""ImageNet's per-channel standard deviation."""

_MAX_SIDE = 8192  # the daemon's kMaxPipelineSide (tests/structure/mirrors_test.py checks)
_DTYPES = {"uint8": "DTYPE_UINT8", "float16": "DTYPE_FLOAT16", "bfloat16": "DTYPE_BFLOAT16",
           "float32": "DTYPE_FLOAT32"}
_LAYOUTS = {"nchw": "IMAGE_LAYOUT_NCHW", "nhwc": "IMAGE_LAYOUT_NHWC"}
# layout()'s choice (upper case is taken too); the keys of _LAYOUTS (mirrors_test.py checks).
Layout = Literal["nchw", "nhwc"]


class Op(Mapping):
    """One op of a pipeline: a mapping of its name to its fields, as the pipeline JSON holds
    it (``dict(resize(256)) == {"resize": {"shorter_side": 256}}``). Made by the builders."""

    def __init__(self, name: str, fields: Mapping[str, Any]) -> None:
        self.name: str = name
        """The op's name (``"resize"``)."""
        self.fields: Dict[str, Any] = dict(fields)
        """Its fields by their proto names (``{"shorter_side": 256}``)."""

    def __getitem__(self, key: str) -> Dict[str, Any]:
        if key != self.name:
            raise KeyError(key)
        return dict(self.fields)

    def __iter__(self) -> Iterator[str]:
        return iter((self.name,))

    def __len__(self) -> int:
        return 1

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.fields.items())})"


class Pipeline(Sequence):
    """The ops of an image pipeline, in order: what ``Loader(pipeline=...)`` takes.

    Args:
        ops: :class:`Op` from the builders, or op dicts (``{"resize": {"shorter_side":
            256}}``, in either JSON form README.md shows).
    """

    def __init__(self, ops: Iterable[Union[Op, Mapping[str, Any]]] = ()) -> None:
        self.ops: Tuple[Op, ...] = tuple(_as_op(i, op) for i, op in enumerate(ops))
        """The ops."""

    @overload
    def __getitem__(self, index: int) -> Op: ...

    @overload
    def __getitem__(self, index: slice) -> "Pipeline": ...

    def __getitem__(self, index: Union[int, slice]) -> Union[Op, "Pipeline"]:
        if isinstance(index, slice):
            return Pipeline(self.ops[index])
        return self.ops[index]

    def __len__(self) -> int:
        return len(self.ops)

    def __add__(self, other: Iterable[Union[Op, Mapping[str, Any]]]) -> "Pipeline":
        return Pipeline([*self.ops, *other])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Pipeline):
            return self.ops == other.ops
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.to_json())

    def to_dict(self) -> Dict[str, List[Dict[str, Any]]]:
        """``{"ops": [{"resize": {"shorter_side": 256}}, ...]}``."""
        return {"ops": [{op.name: dict(op.fields)} for op in self.ops]}

    def to_json(self, indent: Optional[int] = None) -> str:
        """The pipeline JSON (deploy/pipelines/*.json's form), for a file (``gpufeedctl
        --pipeline``) or the C API's ``pipeline_json``. ``Loader(pipeline=...)`` takes the
        Pipeline itself (a string there is a file's path)."""
        return json.dumps(self.to_dict(), indent=indent)

    def __repr__(self) -> str:
        return f"Pipeline([{', '.join(map(repr, self.ops))}])"


def compose(*ops: Union[Op, Mapping[str, Any]]) -> Pipeline:
    """``Pipeline(ops)``: ``compose(resize(256), center_crop(224), ...)``."""
    return Pipeline(ops)


def _as_op(index: int, op: Union[Op, Mapping[str, Any]]) -> Op:
    if isinstance(op, Op):
        return op
    if isinstance(op, Mapping) and len(op) == 1:
        (name, fields), = op.items()
        if isinstance(name, str) and isinstance(fields, Mapping):
            return Op(name, fields)
    raise ValueError(f"Pipeline: op {index}: want an op (gpufeed.pipeline.resize(256), ...) or "
                     f"a dict {{name: {{field: value}}}}, got {op!r}")


# ---- argument checks: a ValueError naming the op and the argument ----


def _fail(op: str, arg: str, want: str, value: Any) -> ValueError:
    return ValueError(f"{op}: {arg}: want {want}, got {value!r}")


def _int(op: str, arg: str, value: Any, lo: int, hi: int) -> int:
    if not isinstance(value, bool):
        try:
            n = operator.index(value)
        except TypeError:
            pass
        else:
            if lo <= n <= hi:
                return n
    raise _fail(op, arg, f"an integer from {lo} to {hi}", value)


def _side(op: str, arg: str, value: Any) -> int:
    """A square's side: an int, or (s,) / (s, s) as torchvision takes sizes."""
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (1, 2):
        if len(value) == 2 and value[0] != value[1]:
            raise ValueError(f"{op}: {arg}: {tuple(value)} is not square; gpufeed's outputs are "
                             f"square: give one side")
        value = value[0]
    return _int(op, arg, value, 1, _MAX_SIDE)


def _float(op: str, arg: str, value: Any) -> float:
    if not isinstance(value, bool):
        try:
            x = float(value)
        except (TypeError, ValueError):
            pass
        else:
            if math.isfinite(x):
                return x
    raise _fail(op, arg, "a finite number", value)


def _floats(op: str, arg: str, value: Any, n: int) -> List[float]:
    if not isinstance(value, (str, bytes, Mapping)) and isinstance(value, Iterable):
        values = list(value)
        if len(values) == n:
            try:
                return [_float(op, arg, v) for v in values]
            except ValueError:
                pass
    raise _fail(op, arg, f"{n} finite numbers", value)


def _range(op: str, arg: str, value: Any, upper: Optional[float]) -> Tuple[float, float]:
    lo, hi = _floats(op, arg, value, 2)
    if not (0 < lo <= hi and (upper is None or hi <= upper)):
        bound = f" <= {upper:g}" if upper is not None else ""
        raise _fail(op, arg, f"(lo, hi) with 0 < lo <= hi{bound}", value)
    return lo, hi


def dtype_name(dtype: Any) -> str:
    """``"uint8"``, ``"float16"``, ``"bfloat16"`` or ``"float32"`` for a name, a torch dtype
    (``torch.float16``) or a numpy dtype or type (``np.float16``); ValueError otherwise."""
    name: Optional[str] = None
    if isinstance(dtype, str):
        name = dtype.lower()
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = str(dtype).rpartition(".")[2]  # "torch.float16"
    else:
        try:
            name = np.dtype(dtype).name
        except (TypeError, ValueError):
            pass
    if name not in _DTYPES:
        raise _fail("cast", "dtype", "uint8, float16, bfloat16 or float32 (a name, a torch or a "
                    "numpy dtype)", dtype)
    return name


# ---- the ops ----


def random_resized_crop(size: Union[int, Sequence[int]], scale: Sequence[float] = (0.08, 1.0),
                        ratio: Sequence[float] = (3 / 4, 4 / 3)) -> Op:
    """torchvision's ``RandomResizedCrop(size, scale, ratio, antialias=True)``: a random
    ``scale`` of the area at a random aspect ``ratio`` (log-uniform), resized to size x size
    (antialiased bilinear)."""
    op = "random_resized_crop"
    s = _side(op, "size", size)
    scale_lo, scale_hi = _range(op, "scale", scale, 1.0)
    ratio_lo, ratio_hi = _range(op, "ratio", ratio, None)
    return Op(op, {"size": s, "scale_min": scale_lo, "scale_max": scale_hi,
                   "ratio_min": ratio_lo, "ratio_max": ratio_hi})


def resize(shorter_side: int) -> Op:
    """``Resize(shorter_side, antialias=True)``: the shorter side to ``shorter_side`` pixels,
    keeping the aspect ratio. A ``center_crop`` must follow."""
    return Op("resize", {"shorter_side": _int("resize", "shorter_side", shorter_side, 1,
                                              _MAX_SIDE)})


def center_crop(size: Union[int, Sequence[int]]) -> Op:
    """``CenterCrop(size)``: the central size x size pixels."""
    return Op("center_crop", {"size": _side("center_crop", "size", size)})


def flip(p: float = 0.5) -> Op:
    """``RandomHorizontalFlip(p)``."""
    x = _float("flip", "p", p)
    if not 0 <= x <= 1:
        raise _fail("flip", "p", "a probability, 0 <= p <= 1", p)
    return Op("flip", {"p": x})


def normalize(mean: Sequence[float], std: Sequence[float]) -> Op:
    """``ToDtype(float, scale=True)`` then ``Normalize(mean, std)``: (x / 255 - mean) / std per
    channel (RGB). Comes before ``cast``, which must then be a float type."""
    m = _floats("normalize", "mean", mean, 3)
    s = _floats("normalize", "std", std, 3)
    if not all(v > 0 for v in s):
        raise _fail("normalize", "std", "3 numbers > 0", std)
    return Op("normalize", {"mean": m, "std": s})


def cast(dtype: Any) -> Op:
    """The output's element type: ``"uint8"``, ``"float16"``, ``"bfloat16"`` or ``"float32"``,
    also as ``torch.float16`` or ``np.float16``. Float outputs are scaled to [0, 1]. Without a
    cast: uint8, or float32 once normalised."""
    return Op("cast", {"dtype": _DTYPES[dtype_name(dtype)]})


def layout(layout: Layout = "nchw") -> Op:
    """``"nchw"`` (``[B, 3, H, W]``, torchvision's; the default) or ``"nhwc"``."""
    name = layout.lower() if isinstance(layout, str) else None
    if name not in _LAYOUTS:
        raise _fail("layout", "layout", "'nchw' or 'nhwc'", layout)
    return Op("layout", {"layout": _LAYOUTS[name]})


def decode(dct_scaling: bool = False) -> Op:
    """First when given: ``dct_scaling=True`` decodes JPEGs on the CPU at the smallest DCT scale
    (1/2, 1/4, 1/8) that leaves the crop at least the pixels it is resized to: faster, with
    outputs slightly different from a full-size decode (README.md, image pipelines)."""
    if not isinstance(dct_scaling, bool):
        raise _fail("decode", "dct_scaling", "True or False", dct_scaling)
    return Op("decode", {"dct_scaling": dct_scaling})


# ---- from torchvision ----

_SUPPORTED = ("RandomResizedCrop (square size, bilinear, antialias=True), Resize (an int: the "
              "shorter side; bilinear, antialias=True, no max_size), CenterCrop (square), "
              "RandomHorizontalFlip, ToImage, PILToTensor, ToPureTensor, ToTensor, "
              "ToDtype (uint8, float16, bfloat16, float32; scale=True), ConvertImageDtype, "
              "Normalize, in a Compose (v2, or v1 where the same), of torchvision 0.14 or "
              "later (v2: 0.16 or later)")
# The oldest torchvision whose transforms this reads: v1 as of 0.14 (Debian 12's, which the
# tests run against), v2 as of 0.16 (0.15's beta v2 named its transforms otherwise).
_OLDEST = {"v1": (0, 14), "v2": (0, 16)}
_TENSOR_MAKERS = ("ToImage", "PILToTensor", "ToTensor")


class _Refused(Exception):
    """A transform gpufeed cannot take, and why (made into the ValueError with its name)."""


def _torchvision_name(transform: Any) -> Optional[str]:
    cls = type(transform)
    module = getattr(cls, "__module__", "") or ""
    if module == "torchvision.transforms" or module.startswith("torchvision.transforms."):
        return cls.__name__
    return None


def _torchvision_version(transform: Any) -> Optional[Tuple[int, int]]:
    """(major, minor) of the torchvision a transform comes from; None if it does not say."""
    import re
    import sys

    package = sys.modules.get("torchvision")
    version = getattr(package, "__version__", None) if package is not None else None
    match = re.match(r"(\d+)\.(\d+)", str(version or ""))
    return (int(match[1]), int(match[2])) if match else None


def _check_version(transform: Any) -> None:
    module = type(transform).__module__ or ""
    api = "v2" if module.startswith("torchvision.transforms.v2") else "v1"
    version = _torchvision_version(transform)
    if version is not None and version < _OLDEST[api]:
        oldest = "%d.%d" % _OLDEST[api]
        raise _Refused(f"torchvision {version[0]}.{version[1]}'s {api} transforms are not "
                       f"supported: pipeline_from_torchvision reads those of torchvision "
                       f"{oldest} or later"
                       + ("; use the v1 transforms (torchvision.transforms)" if api == "v2"
                          else ""))


def _bilinear_antialiased(transform: Any, tensor_since: Optional[str]) -> None:
    """Refuses a resize that is not torchvision's antialiased bilinear one. ``tensor_since``:
    the transform that made the image a tensor before this one, if any: before it the image
    is the PIL image a torchvision dataset loads, which torchvision resizes with PIL, always
    antialiased (``antialias`` None, its default before 0.17, or 0.15's "warn")."""
    mode = getattr(transform, "interpolation", None)
    if getattr(mode, "value", mode) != "bilinear":
        raise _Refused(f"interpolation={getattr(mode, 'name', mode)}: gpufeed resizes with "
                       f"bilinear interpolation only (InterpolationMode.BILINEAR)")
    antialias = getattr(transform, "antialias", None)
    if antialias is True or (antialias in (None, "warn") and tensor_since is None):
        return
    if antialias in (None, "warn"):
        raise _Refused(f"antialias={antialias!r} after {tensor_since}: torchvision resizes a "
                       f"tensor without antialiasing then, gpufeed's resize is antialiased; "
                       f"want antialias=True (torchvision's default from 0.17), or the resize "
                       f"before {tensor_since} (on the PIL image, always antialiased)")
    raise _Refused(f"antialias={antialias!r}: gpufeed's resize is antialiased; want "
                   f"antialias=True (torchvision's default from 0.17)")


def _torch_dtype(value: Any) -> str:
    if isinstance(value, Mapping):  # v2's {tv_tensors.Image: dtype, "others": None}
        for key, dtype in value.items():
            if getattr(key, "__name__", key) == "Image":
                value = dtype
                break
        else:
            raise _Refused(f"dtype {value!r}: a dict without an entry for tv_tensors.Image")
    try:
        return dtype_name(value)
    except ValueError:
        raise _Refused(f"dtype {value}: gpufeed outputs uint8, float16, bfloat16 or "
                       f"float32") from None


class _FromTorchvision:
    """torchvision's transforms in order -> the ops: crops and flips where they stand, then
    the normalisation, the cast and the layout (torchvision's tensors are CHW)."""

    def __init__(self) -> None:
        self.ops: List[Op] = []
        self.geometry: List[str] = []  # the crops and resizes so far, by transform name
        self.resize_side = 0
        self.dtype = "uint8"
        self.normalized: Optional[Op] = None
        self.flipped = False
        self.tensor_since: Optional[str] = None  # the transform that made the image a tensor

    def add(self, name: str, t: Any) -> None:
        geometry_rule = ("only one geometry: a RandomResizedCrop, or a Resize then a CenterCrop, "
                         "or a CenterCrop")
        if name == "RandomResizedCrop":
            if self.geometry:
                raise _Refused(f"after {self.geometry[-1]}: {geometry_rule}")
            _bilinear_antialiased(t, self.tensor_since)
            self._op(lambda: random_resized_crop(t.size, t.scale, t.ratio))
            self.geometry.append(name)
        elif name == "Resize":
            if self.geometry:
                raise _Refused(f"after {self.geometry[-1]}: {geometry_rule}")
            size = t.size
            if isinstance(size, Sequence) and len(size) == 1:
                size = size[0]
            if isinstance(size, Sequence):
                raise _Refused(f"size={tuple(size)}: resizing to (h, w) does not keep the "
                               f"aspect ratio; gpufeed's resize takes the shorter side: "
                               f"Resize(int)")
            if getattr(t, "max_size", None) is not None:
                raise _Refused(f"max_size={t.max_size}: not supported")
            _bilinear_antialiased(t, self.tensor_since)
            op = self._op(lambda: resize(size))
            self.resize_side = op.fields["shorter_side"]
            self.geometry.append(name)
        elif name == "CenterCrop":
            if self.geometry not in ([], ["Resize"]):
                raise _Refused(f"after {self.geometry[-1]}: {geometry_rule}")
            op = self._op(lambda: center_crop(t.size))
            if self.resize_side and op.fields["size"] > self.resize_side:
                raise _Refused(f"size {op.fields['size']} is larger than the Resize's "
                               f"{self.resize_side} (torchvision pads it; gpufeed does not)")
            self.geometry.append(name)
        elif name == "RandomHorizontalFlip":
            if self.flipped:
                raise _Refused("a second flip: gpufeed flips once")
            self._op(lambda: flip(t.p))
            self.flipped = True
        elif name in ("ToImage", "PILToTensor", "ToPureTensor"):
            pass  # gpufeed's images are tensors already
        elif name == "ToTensor":  # v1: PILToTensor then ConvertImageDtype(torch.float32)
            self._to_dtype("float32", scale=True)
        elif name == "ConvertImageDtype":
            self._to_dtype(_torch_dtype(t.dtype), scale=True)
        elif name == "ToDtype":
            self._to_dtype(_torch_dtype(t.dtype), scale=getattr(t, "scale", False) is True)
        elif name == "Normalize":
            if self.normalized is not None:
                raise _Refused("a second Normalize: gpufeed normalises once")
            if self.dtype == "uint8":
                raise _Refused("of a uint8 image: put ToDtype(torch.float32, scale=True) "
                               "before it, as torchvision needs too")
            self.normalized = self._op(lambda: normalize(t.mean, t.std), keep=False)
        else:
            raise _Refused("not a transform gpufeed implements")
        if name in _TENSOR_MAKERS and self.tensor_since is None:
            self.tensor_since = name

    def _op(self, build: Any, keep: bool = True) -> Op:
        try:
            op = build()
        except ValueError as e:
            raise _Refused(str(e)) from None
        if keep:
            self.ops.append(op)
        return op

    def _to_dtype(self, dtype: str, scale: bool) -> None:
        if self.dtype == "uint8" and dtype != "uint8" and not scale:
            raise _Refused(f"to {dtype} without scale=True keeps values in 0..255; gpufeed's "
                           f"float images are scaled to [0, 1] (and normalised from there): "
                           f"want scale=True")
        if self.dtype != "uint8" and dtype == "uint8":
            raise _Refused("from a float image back to uint8: not supported")
        self.dtype = dtype

    def pipeline(self) -> Pipeline:
        if not self.geometry or self.geometry == ["Resize"]:
            raise ValueError("pipeline_from_torchvision: no RandomResizedCrop or CenterCrop: "
                             "gpufeed's batches need one output size (a Resize alone gives "
                             f"images of different sizes); supported: {_SUPPORTED}")
        ops = list(self.ops)
        if self.normalized is not None:
            ops.append(self.normalized)
        return Pipeline([*ops, cast(self.dtype), layout("nchw")])


def pipeline_from_torchvision(transform: Any) -> Pipeline:
    """The gpufeed :class:`Pipeline` that does what torchvision's ``transform`` (a
    ``Compose``, nested ones, or a list) does to an image, for ``Loader(pipeline=...)``.

    Converts RandomResizedCrop, Resize (an int size: the shorter side), CenterCrop,
    RandomHorizontalFlip, Normalize, ToDtype / ConvertImageDtype / ToTensor (uint8, float16,
    bfloat16 or float32; to a float with ``scale=True``) and the no-ops ToImage, PILToTensor,
    ToPureTensor, from ``torchvision.transforms.v2`` (or v1); resizing only bilinear and
    antialiased (``antialias=True``; or, before the transform that makes the image a tensor,
    the default ``None``: torchvision resizes the PIL image a dataset loads with PIL, always
    antialiased), sizes square. The output is NCHW, as torchvision's. Random choices differ
    from torchvision's (gpufeed's depend on the seed, epoch and sample id); pixels agree to
    rounding (gpufeed resizes and normalises in float32 and rounds once).

    torchvision versions: v1 transforms (``torchvision.transforms``) of 0.14 or later (the
    tests run against Debian 12's 0.14), v2 (``torchvision.transforms.v2``) of 0.16 or later
    (0.15's beta v2 named transforms and defaults otherwise). A transform of an older
    torchvision, or one whose settings this cannot read, raises the ValueError naming the
    version.

    Raises:
        ValueError: naming the transform that cannot be converted and why, and listing the
            transforms that can.
    """
    flat: List[Tuple[int, Any]] = []

    def walk(t: Any) -> None:
        if _torchvision_name(t) == "Compose":
            for inner in t.transforms:
                walk(inner)
        elif isinstance(t, (list, tuple)):
            for inner in t:
                walk(inner)
        else:
            flat.append((len(flat), t))

    walk(transform)
    converter = _FromTorchvision()
    for index, t in flat:
        name = _torchvision_name(t)
        try:
            if name is None:
                raise _Refused("not a torchvision transform")
            _check_version(t)
            try:
                converter.add(name, t)
            except AttributeError as e:  # a torchvision that stores its settings otherwise
                version = _torchvision_version(t)
                raise _Refused(
                    f"cannot read its settings from torchvision "
                    f"{'%d.%d' % version if version else '(version unknown)'} ({e}); "
                    f"pipeline_from_torchvision reads the transforms of the torchvision "
                    f"versions it was tested with") from None
        except _Refused as e:
            raise ValueError(f"pipeline_from_torchvision: transform {index}, "
                             f"{name or type(t).__name__}: {e}; supported: {_SUPPORTED}") from None
    return converter.pipeline()
