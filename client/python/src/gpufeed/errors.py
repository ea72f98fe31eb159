"""Errors: one :class:`Error` subclass per canonical status code (the gRPC codes).

Every failure the daemon or the C library reports is raised as the subclass named after its
code, carrying the message unchanged (it names the field, path or socket at fault)::

    try:
        loader = gpufeed.torch.Loader("/data/train.bin", kind="tokens", seq_len=0, ...)
        len(loader)                     # the first attach
    except gpufeed.InvalidArgument as e:
        print(e.code_name, e.message)   # INVALID_ARGUMENT  attach: seq_len: ...

Argument errors caught in Python before any call (a wrong ``kind`` type, an unknown
``device``) are raised as :class:`InvalidArgument` too, so one ``except`` covers both.
"""

from __future__ import annotations

from typing import Dict, Type


class Error(Exception):
    """A failed gpufeed call: :attr:`code` (the canonical status code), :attr:`code_name`
    and ``message`` (the daemon's or library's message, also ``str(error)``).
    """

    code: int = 2
    """The canonical status code (``gpufeed_status`` in the C header)."""
    code_name: str = "UNKNOWN"
    """The code's canonical name, e.g. ``"INVALID_ARGUMENT"``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self):  # picklable across DataLoader / multiprocessing boundaries
        return (type(self), (self.message,))


class Cancelled(Error):
    """CANCELLED (1): the operation was cancelled, e.g. the session was detached."""

    code, code_name = 1, "CANCELLED"


class Unknown(Error):
    """UNKNOWN (2): an error with no better code."""

    code, code_name = 2, "UNKNOWN"


class InvalidArgument(Error, ValueError):
    """INVALID_ARGUMENT (3): a bad option; the message names the field. Also a
    :class:`ValueError`, as Python's own argument errors are (``except ValueError`` catches
    it)."""

    code, code_name = 3, "INVALID_ARGUMENT"


class DeadlineExceeded(Error):
    """DEADLINE_EXCEEDED (4): no batch (or no reply) within the timeout."""

    code, code_name = 4, "DEADLINE_EXCEEDED"


class NotFound(Error):
    """NOT_FOUND (5): the dataset path (or a session) does not exist."""

    code, code_name = 5, "NOT_FOUND"


class AlreadyExists(Error):
    """ALREADY_EXISTS (6): this job's rank is already attached."""

    code, code_name = 6, "ALREADY_EXISTS"


class PermissionDenied(Error):
    """PERMISSION_DENIED (7): the daemon may not read the dataset path."""

    code, code_name = 7, "PERMISSION_DENIED"


class ResourceExhausted(Error):
    """RESOURCE_EXHAUSTED (8): the ring does not fit the staging pool or the GPU budget."""

    code, code_name = 8, "RESOURCE_EXHAUSTED"


class FailedPrecondition(Error):
    """FAILED_PRECONDITION (9): e.g. the job's other ranks use another feed, or device
    delivery on a daemon that sees no GPU."""

    code, code_name = 9, "FAILED_PRECONDITION"


class LibraryNotFound(FailedPrecondition, ImportError):
    """The C library (``libgpufeed_c.so``) could not be found or loaded, or is of another
    version: raised at the first call that needs it (``Client.attach``, ``Loader()``). Both a
    :class:`Error` (so ``except gpufeed.Error`` covers it) and an :class:`ImportError`."""

    def __init__(self, message: str) -> None:
        FailedPrecondition.__init__(self, message)


class Aborted(Error):
    """ABORTED (10)."""

    code, code_name = 10, "ABORTED"


class OutOfRange(Error):
    """OUT_OF_RANGE (11): the end of the data (``stop_epoch`` reached), or a start position
    past the epoch."""

    code, code_name = 11, "OUT_OF_RANGE"


class Unimplemented(Error):
    """UNIMPLEMENTED (12)."""

    code, code_name = 12, "UNIMPLEMENTED"


class Internal(Error):
    """INTERNAL (13): a bug in gpufeed (or a daemon that broke the protocol)."""

    code, code_name = 13, "INTERNAL"


class Unavailable(Error):
    """UNAVAILABLE (14): no daemon answers at the socket, or it is shutting down."""

    code, code_name = 14, "UNAVAILABLE"


class DataLoss(Error):
    """DATA_LOSS (15): the dataset could not be read (it shrank, or a bad image with
    ``bad_sample="fail"``); the message names the file."""

    code, code_name = 15, "DATA_LOSS"


class Unauthenticated(Error):
    """UNAUTHENTICATED (16)."""

    code, code_name = 16, "UNAUTHENTICATED"


_BY_CODE: Dict[int, Type[Error]] = {
    cls.code: cls
    for cls in (Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists,
                PermissionDenied, ResourceExhausted, FailedPrecondition, Aborted, OutOfRange,
                Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated)
}


def error_for(code: int, message: str) -> Error:
    """The :class:`Error` subclass instance for status ``code`` (:class:`Unknown` if the code
    is not a canonical one)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return Unknown(f"status {code}: {message}")
    return cls(message)
