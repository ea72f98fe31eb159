"""Stand-in for torchvision.transforms.v2: see ../../__init__.py."""

import torch

from torchvision.transforms import InterpolationMode, square


class Transform:
    pass


class Compose(Transform):
    def __init__(self, transforms):
        self.transforms = transforms


class RandomResizedCrop(Transform):
    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0),
                 interpolation=InterpolationMode.BILINEAR, antialias=True):
        self.size = square(size)
        self.scale, self.ratio = scale, ratio
        self.interpolation, self.antialias = interpolation, antialias


class Resize(Transform):
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, max_size=None,
                 antialias=True):
        self.size = [size] if isinstance(size, int) else list(size)  # v2 keeps a list
        self.interpolation, self.max_size, self.antialias = interpolation, max_size, antialias


class CenterCrop(Transform):
    def __init__(self, size):
        self.size = square(size)


class RandomHorizontalFlip(Transform):
    def __init__(self, p=0.5):
        self.p = p


class ColorJitter(Transform):
    def __init__(self, brightness=0, contrast=0, saturation=0, hue=0):
        self.brightness, self.contrast = brightness, contrast
        self.saturation, self.hue = saturation, hue


class ToImage(Transform):
    pass


class PILToTensor(Transform):
    pass


class ToPureTensor(Transform):
    pass


class ToDtype(Transform):
    def __init__(self, dtype, scale=False):
        if not isinstance(dtype, (dict, torch.dtype)):
            raise ValueError(f"dtype must be a dict or a torch.dtype, got {type(dtype)} instead")
        self.dtype, self.scale = dtype, scale


class Normalize(Transform):
    def __init__(self, mean, std, inplace=False):
        self.mean, self.std, self.inplace = list(mean), list(std), inplace
