"""A stand-in for torchvision where it is not installed (tests/python/test_pipeline.py puts
this folder on sys.path only then): the transform classes gpufeed.pipeline converts, with
torchvision's names, modules, constructor arguments and the attributes torchvision >= 0.17
stores (``size`` as torchvision normalises it, ``interpolation`` as InterpolationMode). They
transform nothing."""

__version__ = "0.17.0+standin"  # the API it mimics
