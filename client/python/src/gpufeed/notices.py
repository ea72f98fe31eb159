"""What gpufeedd reports at attach about a dataset (so nothing is skipped silently).

A session's :attr:`~gpufeed.Session.notices` are the samples the daemon left out when it
opened the dataset (``reason`` ``"no_image"``: WebDataset keys without an image, e.g. names
with a second dot such as ``img.001.jpg``; ``"other_image_type"`` and ``"link"``: image folder
files), which ``gpufeedctl feeds`` also counts as bad samples, and dataset-level cautions
(``"warning"``). Attaching warns once with all of them as a :class:`GpufeedWarning`, which a
program may filter like any warning::

    warnings.simplefilter("error", gpufeed.GpufeedWarning)   # make them fatal
    warnings.simplefilter("ignore", gpufeed.GpufeedWarning)  # or silence them
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from typing import NamedTuple, Sequence, Tuple

from gpufeed import _capi


class GpufeedWarning(UserWarning):
    """What gpufeedd reported about the dataset at attach (samples left out, cautions)."""


class Notice(NamedTuple):
    """One thing gpufeedd reported at attach about the dataset."""

    reason: str
    """Why samples were left out (``"no_image"``, ``"other_image_type"``, ``"link"``), or
    ``"warning"``."""
    count: int
    """Samples left out (0 for a warning)."""
    example: str
    """The first of them (``SHARD:KEY``, a file's path)."""
    message: str
    """One line: what, how many, the first, and what to do."""


def _text(value: bytes) -> str:
    return value.decode("utf-8", "replace") if value else ""


def read(lib: ctypes.CDLL, session: int) -> Tuple[Notice, ...]:
    """The notices of the C session handle ``session``."""
    count = ctypes.c_int32()
    if lib.gpufeed_session_notice_count(session, ctypes.byref(count)) != 0:
        return ()
    out = []
    for i in range(count.value):
        n = _capi.NoticeInfo()
        if lib.gpufeed_session_get_notice(session, i, ctypes.byref(n)) == 0:
            out.append(Notice(_text(n.reason), int(n.count), _text(n.example), _text(n.message)))
    return tuple(out)


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _outside_package_level() -> int:
    """The ``stacklevel`` of the first caller outside this package (so a warning raised
    under ``Loader.__iter__`` names the user's line, not the loader's)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def warn(notices: Sequence[Notice]) -> None:
    """One :class:`GpufeedWarning` with every notice's message (none without notices),
    attributed to the first line outside the gpufeed package that led here."""
    if notices:
        text = "\n".join(n.message for n in notices)
        warnings.warn(f"gpufeed: {text}", GpufeedWarning, stacklevel=_outside_package_level())
