"""Stand-in for torchvision.transforms (v1): see ../__init__.py."""

import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def square(size):
    """An int s or (s,) as (s, s); (h, w) as given: how torchvision stores crop sizes."""
    if isinstance(size, int):
        return (size, size)
    if len(size) == 1:
        return (size[0], size[0])
    return tuple(size)


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms


class RandomResizedCrop:
    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0),
                 interpolation=InterpolationMode.BILINEAR, antialias=True):
        self.size = square(size)
        self.scale, self.ratio = scale, ratio
        self.interpolation, self.antialias = interpolation, antialias


class Resize:
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR, max_size=None,
                 antialias=True):
        self.size = size  # v1 keeps an int as an int
        self.interpolation, self.max_size, self.antialias = interpolation, max_size, antialias


class CenterCrop:
    def __init__(self, size):
        self.size = square(size)


class RandomHorizontalFlip:
    def __init__(self, p=0.5):
        self.p = p


class RandomVerticalFlip(RandomHorizontalFlip):
    pass


class ColorJitter:
    def __init__(self, brightness=0, contrast=0, saturation=0, hue=0):
        self.brightness, self.contrast = brightness, contrast
        self.saturation, self.hue = saturation, hue


class ToTensor:
    pass


class PILToTensor:
    pass


class ConvertImageDtype:
    def __init__(self, dtype):
        self.dtype = dtype


class Normalize:
    def __init__(self, mean, std, inplace=False):
        self.mean, self.std, self.inplace = mean, std, inplace
