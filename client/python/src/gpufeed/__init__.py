"""gpufeed: batches from the node-local gpufeedd daemon, in place, for training processes.

The core (:class:`Client`, :class:`Session`, :class:`Batch`, :class:`Tensor`) needs only
numpy and ``libgpufeed_c.so`` (loaded with ctypes on first use; see :mod:`gpufeed._capi` for
where it is looked for). :mod:`gpufeed.torch` adds the PyTorch :class:`~gpufeed.torch.Loader`
and is the only part that imports torch.

Errors are :class:`Error` subclasses named after the canonical status code
(:class:`InvalidArgument`, :class:`NotFound`, :class:`Unavailable`, ...).
"""

from gpufeed.client import (
    DEFAULT_SOCKET,
    Batch,
    Client,
    Position,
    Session,
    SessionInfo,
    Tensor,
    default_socket,
)
from gpufeed.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Error,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    LibraryNotFound,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)
from gpufeed.notices import GpufeedWarning, Notice
from gpufeed.pipeline import Pipeline

__version__ = "0.1.0"
"""Version of this package."""


def library_api_version() -> int:
    """``gpufeed_api_version()`` of the loaded C library (loads it)."""
    from gpufeed import _capi

    return int(_capi.lib().gpufeed_api_version())


__all__ = [
    "Aborted", "AlreadyExists", "Batch", "Cancelled", "Client", "DEFAULT_SOCKET", "DataLoss",
    "DeadlineExceeded", "Error", "FailedPrecondition", "Internal", "InvalidArgument",
    "LibraryNotFound",
    "NotFound", "OutOfRange", "PermissionDenied", "Pipeline", "Position", "ResourceExhausted",
    "Session",
    "SessionInfo", "Tensor", "Unauthenticated", "Unavailable", "Unimplemented", "Unknown",
    "default_socket", "library_api_version", "__version__",
    "GpufeedWarning", "Notice",
]
