"""ctypes bindings of ``libgpufeed_c.so`` (header ``client/c/include/gpufeed/gpufeed.h``).

Internal: the public API is in :mod:`gpufeed`. The library is loaded on first use, not on
import, so ``import gpufeed`` works (for documentation, type checking, reading the code) on a
machine without it. Where it is looked for, in order:

1. next to the package: ``gpufeed/_lib/libgpufeed_c.so`` (a wheel or an install step may put
   it there);
2. the path in the environment variable ``GPUFEED_LIBRARY``;
3. the dynamic loader's search path (``ctypes.util.find_library("gpufeed_c")``, then plain
   ``libgpufeed_c.so``, which honours ``LD_LIBRARY_PATH``).

The structs below mirror the header field by field; :data:`API_VERSION` is the header's
``GPUFEED_API_VERSION`` these bindings were written for, and a library reporting another
version is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import List, Optional

from gpufeed.errors import LibraryNotFound

API_VERSION = 1
"""``GPUFEED_API_VERSION`` these bindings match."""

LIBRARY_NAME = "libgpufeed_c.so"
"""File name of the C library."""

DEVICE_CPU = 1
"""``GPUFEED_DEVICE_CPU``: a tensor in host memory."""
DEVICE_CUDA = 2
"""``GPUFEED_DEVICE_CUDA``: a tensor in a GPU's memory."""


class SessionInfo(ctypes.Structure):
    """``gpufeed_session_info``."""

    _fields_ = [
        ("session_id", ctypes.c_uint64),
        ("num_samples", ctypes.c_int64),
        ("steps_per_epoch", ctypes.c_int64),
        ("ring_slots", ctypes.c_int32),
        ("num_tensors", ctypes.c_int32),
    ]


class BatchInfo(ctypes.Structure):
    """``gpufeed_batch_info``."""

    _fields_ = [
        ("epoch", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("batch_size", ctypes.c_int64),
        ("valid_count", ctypes.c_int64),
        ("ids", ctypes.POINTER(ctypes.c_int64)),
        ("num_tensors", ctypes.c_int32),
        ("slot", ctypes.c_int32),
        ("generation", ctypes.c_uint64),
    ]


class TensorInfo(ctypes.Structure):
    """``gpufeed_tensor``."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("data", ctypes.c_void_p),
        ("byte_size", ctypes.c_uint64),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
    ]


class NoticeInfo(ctypes.Structure):
    """``gpufeed_notice``."""

    _fields_ = [
        ("reason", ctypes.c_char_p),
        ("count", ctypes.c_int64),
        ("example", ctypes.c_char_p),
        ("message", ctypes.c_char_p),
    ]


_status = ctypes.c_int
_p = ctypes.c_void_p

# name: (restype, argtypes)
_PROTOTYPES = {
    "gpufeed_api_version": (ctypes.c_uint32, []),
    "gpufeed_last_error": (ctypes.c_char_p, []),
    "gpufeed_default_socket": (ctypes.c_char_p, []),
    "gpufeed_options_create": (_status, [ctypes.POINTER(_p)]),
    "gpufeed_options_destroy": (None, [_p]),
    "gpufeed_options_set_string": (_status, [_p, ctypes.c_char_p, ctypes.c_char_p]),
    "gpufeed_options_set_int": (_status, [_p, ctypes.c_char_p, ctypes.c_int64]),
    "gpufeed_options_add_array": (_status, [_p, ctypes.c_char_p, ctypes.c_char_p]),
    "gpufeed_options_add_dataset_path": (_status, [_p, ctypes.c_char_p]),
    "gpufeed_options_add_blend_source": (_status, [_p, ctypes.c_char_p, ctypes.c_double]),
    "gpufeed_attach": (_status, [_p, ctypes.POINTER(_p)]),
    "gpufeed_session_get_info": (_status, [_p, ctypes.POINTER(SessionInfo)]),
    "gpufeed_next": (_status, [_p, ctypes.c_int64, ctypes.POINTER(_p)]),
    "gpufeed_position": (
        _status,
        [_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)],
    ),
    "gpufeed_position_samples": (_status, [_p, ctypes.POINTER(ctypes.c_int64)]),
    "gpufeed_session_batch_size": (_status, [_p, ctypes.POINTER(ctypes.c_int64)]),
    "gpufeed_fingerprint": (_status, [_p, ctypes.POINTER(ctypes.c_char_p)]),
    "gpufeed_session_blend_segments_json": (_status, [_p, ctypes.POINTER(ctypes.c_char_p)]),
    "gpufeed_session_mps": (
        _status,
        [_p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)],
    ),
    "gpufeed_session_notice_count": (_status, [_p, ctypes.POINTER(ctypes.c_int32)]),
    "gpufeed_session_get_notice": (_status, [_p, ctypes.c_int32, ctypes.POINTER(NoticeInfo)]),
    "gpufeed_detach": (_status, [_p]),
    "gpufeed_session_destroy": (None, [_p]),
    "gpufeed_batch_get_info": (_status, [_p, ctypes.POINTER(BatchInfo)]),
    "gpufeed_batch_get_tensor": (_status, [_p, ctypes.c_int32, ctypes.POINTER(TensorInfo)]),
    "gpufeed_batch_after": (
        _status,
        [_p, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64),
         ctypes.POINTER(ctypes.c_int64)],
    ),
    "gpufeed_batch_wait_ready": (_status, [_p, _p]),
    "gpufeed_batch_release": (None, [_p]),
    "gpufeed_batch_release_after": (None, [_p, _p]),
}

_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None


def candidates() -> List[str]:
    """The paths and names tried, in order, to load the library."""
    out = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lib", LIBRARY_NAME)]
    env = os.environ.get("GPUFEED_LIBRARY", "")
    if env:
        out.append(env)
    found = ctypes.util.find_library("gpufeed_c")
    if found:
        out.append(found)
    out.append(LIBRARY_NAME)
    return out


def _open() -> ctypes.CDLL:
    tried = []
    for i, candidate in enumerate(candidates()):
        # The bundled copy is only a candidate when it exists; the environment variable is
        # an explicit choice, so its failure to load is reported, never skipped over.
        if i == 0 and not os.path.exists(candidate):
            continue
        try:
            lib = ctypes.CDLL(candidate)
        except OSError as e:
            if candidate == os.environ.get("GPUFEED_LIBRARY"):
                raise LibraryNotFound(f"gpufeed: cannot load GPUFEED_LIBRARY={candidate}: {e}") from e
            tried.append(f"{candidate} ({e})")
            continue
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError as e:
                raise LibraryNotFound(f"gpufeed: {candidate} lacks {name}: not a gpufeed C library "
                                  "or an incompatible version") from e
            fn.restype = restype
            fn.argtypes = argtypes
        version = lib.gpufeed_api_version()
        if version != API_VERSION:
            raise LibraryNotFound(f"gpufeed: {candidate} has C API version {version}; this package "
                              f"needs {API_VERSION}")
        return lib
    raise LibraryNotFound(
        "gpufeed: cannot find libgpufeed_c.so; set GPUFEED_LIBRARY to its path (built as "
        "build/client/c/libgpufeed_c.so) or put it on the loader path. Tried: "
        + "; ".join(tried))


def lib() -> ctypes.CDLL:
    """The loaded C library (loaded once, on first use); :class:`ImportError` if not found."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _open()
    return _lib


def last_error(library: ctypes.CDLL) -> str:
    """The calling thread's message for its last failed call."""
    message = library.gpufeed_last_error()
    return message.decode("utf-8", "replace") if message else ""
