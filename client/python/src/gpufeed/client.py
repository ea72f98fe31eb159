"""The framework-free client: :class:`Client`, :class:`Session`, :class:`Batch`, :class:`Tensor`.

Needs only numpy. Batches arrive in place, in the session's ring of shared slots (host
delivery) or in the GPU (device delivery); nothing is copied::

    client = gpufeed.Client()                       # $GPUFEED_SOCKET or /run/gpufeed/gpufeed.sock
    with client.attach("/data/train.bin", kind="tokens", token_dtype="uint16", seq_len=1024,
                       batch_size=16, rank=rank, world_size=world, job="gpt") as session:
        for batch in session:                       # ends at stop_epoch (never, by default)
            tokens = batch.numpy()["tokens"]        # read-only [16, 1025] uint16, zero copy
            ...
            del batch, tokens                       # the slot goes back to the daemon

Lifetime: a batch holds one slot of the ring. The slot returns to the daemon when the
:class:`Batch`, its :class:`Tensor` objects and every array made from them are all garbage,
or at once on :meth:`Batch.release` (you are done with those arrays: the daemon refills the
slot). The daemon never writes a slot the consumer still holds, so a session
holding every slot of its ring gets no further batch until it lets one go.
"""

from __future__ import annotations

import ctypes
import json
import math
import numbers
import operator
import os
import stat
import threading
import time
from typing import (Any, Dict, Iterator, List, Literal, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np

from gpufeed import _capi
from gpufeed import notices as _notices
from gpufeed.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, OutOfRange
from gpufeed.errors import LibraryNotFound, Unavailable, error_for

DEFAULT_SOCKET = "/run/gpufeed/gpufeed.sock"
"""gpufeedd's socket when neither the argument nor ``GPUFEED_SOCKET`` names one."""

_OK = 0
_DEADLINE_EXCEEDED = 4
# The process that first called gpufeed_attach (the first use of gRPC). A process forked from
# it inherits gRPC's state but not its threads: an attach there would hang, so it is refused.
_GRPC_PID: Optional[int] = None
# gpufeed_next waits in slices this long, so that Ctrl-C (handled by Python between calls)
# interrupts a consumer waiting for a batch.
_WAIT_SLICE_MS = 200

# The string choices of attach: the names of feed.proto's enums (DatasetKind, DeliveryKind,
# IpcKind with "auto" for unspecified, ImageDecode, ImageAugment, BadSamplePolicy), which
# tests/structure/mirrors_test.py checks against the proto and the C library's options.
Kind = Literal["tokens", "records", "image_folder", "webdataset"]
Delivery = Literal["host", "device"]
Ipc = Literal["auto", "vmm", "legacy"]
Decode = Literal["auto", "cpu", "nvjpeg"]
Augment = Literal["auto", "cpu", "gpu"]
BadSample = Literal["skip", "fail"]
Elastic = Literal["global_batch", "rank_batch"]
"""What a resume at another world size keeps: the global batch (each rank then gets the saved
global batch / world_size; the global batches are the uninterrupted run's) or the per-rank
batch (the global batch changes; the rest of the epoch is every sample not yet delivered,
each once)."""
Pack = Literal["none", "concat", "best_fit"]
"""How token rows are made: one window each (``none``), Megatron's concatenate-and-cut over the
documents (``concat``) or whole documents packed best-fit into rows (``best_fit``); packed rows
come with ``position_ids``, ``loss_mask`` and ``cu_seqlens`` beside ``tokens``."""

BlendSpec = Union[Mapping[Union[str, "os.PathLike[str]"], float],
                  Sequence[Tuple[Union[str, "os.PathLike[str]"], float]]]
"""A blend of token sources: source -> weight, ``{"/data/web/": 0.7, "/data/code/*.bin": 0.2,
"/data/math.npy": 0.1}`` (or a list of such pairs). A source is a token file, a directory of
them or a glob in the last component; weights are > 0 and normalised over the sources."""

BlendSegments = List[Dict[str, Any]]
"""A blend's history, what a checkpoint keeps with the position: segments
``{"start": int, "weights": [float, ...], "ledger": [int, ...]}`` in order (the first from 0,
one more at each resume that changed the weights)."""

# gpufeed_dtype -> (name, numpy typestr). numpy has no bfloat16: its bits are shown as uint16.
DTYPES: Dict[int, Tuple[str, str]] = {
    1: ("bool", "|b1"),
    2: ("int8", "|i1"),
    3: ("uint8", "|u1"),
    4: ("int16", "<i2"),
    5: ("uint16", "<u2"),
    6: ("int32", "<i4"),
    7: ("uint32", "<u4"),
    8: ("int64", "<i8"),
    9: ("uint64", "<u8"),
    10: ("float16", "<f2"),
    11: ("bfloat16", "<u2"),
    12: ("float32", "<f4"),
    13: ("float64", "<f8"),
    14: ("complex64", "<c8"),
    15: ("complex128", "<c16"),
}
"""Element types of the C ABI (``gpufeed_dtype``): number -> (name, numpy typestr)."""
# Item sizes by typestr, looked up per tensor of every batch (np.dtype() costs ~0.5 us a call).
_ITEMSIZE: Dict[str, int] = {typestr: np.dtype(typestr).itemsize for _, typestr in DTYPES.values()}
# DTYPES with the item size: gpufeed_dtype -> (name, numpy typestr, item size), for Tensor.
_DTYPE_ITEMSIZES: Dict[int, Tuple[str, str, int]] = {
    code: (name, typestr, _ITEMSIZE[typestr]) for code, (name, typestr) in DTYPES.items()}


def _itemsize(typestr: str) -> int:
    size = _ITEMSIZE.get(typestr)
    return np.dtype(typestr).itemsize if size is None else size


def _dtype_name(dtype: Any) -> Optional[str]:
    """``"uint16"`` for ``"uint16"``, ``np.uint16``, ``np.dtype("uint16")`` or
    ``torch.uint16``; ``None`` stays ``None``; anything else as ``str()`` (the daemon names
    what it takes)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    name = str(dtype)
    if name.startswith("torch."):
        return name[len("torch."):]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return name


def default_socket() -> str:
    """The socket used when none is given: ``$GPUFEED_SOCKET``, else the C library's rule
    (``gpufeed_default_socket``): :data:`DEFAULT_SOCKET` if it exists, else
    ``$XDG_RUNTIME_DIR/gpufeed/gpufeed.sock`` (a gpufeedd run without root) if that exists,
    else :data:`DEFAULT_SOCKET`."""
    given = os.environ.get("GPUFEED_SOCKET")
    if given:
        return given
    try:
        return _capi.lib().gpufeed_default_socket().decode("utf-8", "replace")
    except LibraryNotFound:
        return DEFAULT_SOCKET


def _socket_origin(given: Any) -> str:
    """Where a client's socket path came from, as its "no socket" errors say it."""
    if given:
        return "the socket= argument"
    if os.environ.get("GPUFEED_SOCKET"):
        return "from GPUFEED_SOCKET"
    return "the default"


def _check_socket(path: str, origin: str) -> None:
    """Refuses, with Python's words (``socket=``), a socket path where no socket is; the C
    library's own message names ``gpufeedctl``'s ``--socket``. Anything else (a socket nobody
    listens on, one this process may not reach) is the library's to report."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        what = "no socket there"
    except OSError:
        return
    else:
        if stat.S_ISSOCK(mode):
            return
        what = "not a socket"
    where = f" ({origin})" if origin else ""
    raise Unavailable(
        f"{_NO_DAEMON}{path}{where}: {what}; is gpufeedd running? Start it, or pass socket= "
        f"the path it listens on (gpufeed.Client(socket=...), gpufeed.torch.Loader(..., socket=...)) "
        f"or set GPUFEED_SOCKET; the default is {DEFAULT_SOCKET} (or "
        f"$XDG_RUNTIME_DIR/gpufeed/gpufeed.sock for a gpufeedd run without root)")


def _for_python(error: Exception) -> Exception:
    """The C library's error in Python's words: its socket hints name gpufeedctl's
    ``--socket`` flag, which is ``socket=`` here."""
    if not isinstance(error, Unavailable):
        return error
    if "--socket" in error.message:
        return Unavailable(error.message.replace("--socket", "socket="))
    if error.message.startswith(_NO_DAEMON):
        return Unavailable(f"{error.message}; start gpufeedd, or pass socket= the path it "
                           "listens on or set GPUFEED_SOCKET")
    return error


# The C library's "no daemon" prefix (client::kNoDaemonListening in client.h).
_NO_DAEMON = "no gpufeedd listening at "


def _check(lib: ctypes.CDLL, status: int) -> None:
    if status != _OK:
        raise error_for(status, _capi.last_error(lib))


class _EpochStep(NamedTuple):
    epoch: int
    step: int


class Position(_EpochStep):
    """A place in the stream of batches: ``epoch`` and ``step`` (the rank's batch index within
    the epoch), a 2-tuple for unpacking and comparing, and the attribute ``samples``, the
    global cursor: the places of the epoch's order the job's batches before it cover, all
    ranks together, the same from every rank (so one rank's position describes the whole
    job, at any world size). What a checkpoint stores; attaching with ``start=`` a position
    resumes there. ``samples`` 0 in a start: ``step`` x the saved global batch (a position
    saved before the field)."""

    samples: int

    def __new__(cls, epoch: int, step: int, samples: int = 0) -> "Position":
        self = super().__new__(cls, epoch, step)
        self.samples = samples
        return self

    def __getnewargs__(self) -> Tuple[int, int, int]:  # pickles keep the cursor
        return (self.epoch, self.step, self.samples)

    def __repr__(self) -> str:
        return f"Position(epoch={self.epoch}, step={self.step}, samples={self.samples})"


class SessionInfo(NamedTuple):
    """What the daemon answered at attach."""

    session_id: int
    """The daemon's id of this session (as ``gpufeedctl sessions`` shows it)."""
    num_samples: int
    """Samples in the dataset."""
    steps_per_epoch: int
    """Batches per whole epoch for each rank (an epoch an elastic resume began mid-way may
    have one step fewer: :attr:`Batch.after` says where each ends)."""
    ring_slots: int
    """Slots in this session's ring: the most batches it can hold at once."""
    num_tensors: int
    """Tensors in every batch."""
    batch_size: int = 0
    """Samples per rank per step this session serves: the ``batch_size`` asked for, or at an
    elastic resume that keeps the global batch, the saved global batch / ``world_size``."""


class _SessionHandle:
    """Owns a ``gpufeed_session*``. Held by the :class:`Session` and by every batch lease, so
    the ring stays mapped (reading a released batch gives stale bytes, never a crash) until
    the session is closed and the last batch is garbage."""

    def __init__(self, lib: ctypes.CDLL, ptr: int) -> None:
        self.lib = lib
        self.ptr: Optional[int] = ptr
        self._destroy = lib.gpufeed_session_destroy
        self.pid = os.getpid()  # a forked child inherits the handle but not its threads

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr and os.getpid() == self.pid:
            self._destroy(ptr)


class _Lease:
    """One batch's slot (a ``gpufeed_batch*``): released once, explicitly or when garbage.

    Every :class:`Tensor` and every array made from a batch refers to its lease, so the slot
    is returned only when nothing can read it any more.
    """

    def __init__(self, session: _SessionHandle, ptr: int) -> None:
        self._session = session  # keeps the mapping alive, also after release
        self._ptr: Optional[int] = ptr
        self._lock = threading.Lock()
        self._release = session.lib.gpufeed_batch_release
        self._release_after = session.lib.gpufeed_batch_release_after
        self.stream: Optional[int] = None
        """Device delivery: the release is ordered after the work queued on this CUDA stream
        (``None``: the legacy default stream) when no other stream is given."""

    @property
    def released(self) -> bool:
        return self._ptr is None

    @property
    def ptr(self) -> int:
        if self._ptr is None:
            raise FailedPrecondition("the batch was released")
        return self._ptr

    def release(self, stream: Optional[int] = None) -> None:
        with self._lock:
            ptr, self._ptr = self._ptr, None
        # In a forked child (a DataLoader worker, multiprocessing) the slot belongs to the
        # parent's session: releasing it there would return the parent's batch early.
        if ptr is None or os.getpid() != self._session.pid:
            return
        if stream is None:
            stream = self.stream
        if stream is None:
            self._release(ptr)
        else:
            self._release_after(ptr, stream)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: nothing left to tell
            pass


class Tensor:
    """One tensor of a batch, in place: host memory (``device == "cpu"``) or a GPU's
    (``device == "cuda"``).

    A host tensor exposes ``__array_interface__`` (``numpy.asarray(t)`` views it, read-only);
    a device tensor exposes ``__cuda_array_interface__`` (``torch.as_tensor(t, device=...)``,
    ``cupy.asarray(t)``). Either way the view keeps the batch's slot leased while it lives.
    bfloat16 has no numpy type and is shown as ``uint16`` bits.
    """

    def __init__(self, lease: _Lease, info: _capi.TensorInfo) -> None:
        # Per tensor of every batch: plain lookups, each field read once (a packed token batch
        # has four tensors).
        names = _DTYPE_ITEMSIZES.get(info.dtype)
        if names is None:
            raise error_for(13, f"tensor {info.name!r}: unknown dtype {info.dtype}")
        dtype, typestr, itemsize = names
        self._lease = lease
        self.name: str = info.name.decode("utf-8")
        """The tensor's name: ``tokens``, ``data``, ``image``, ``label``."""
        self.dtype: str = dtype
        """Element type name, e.g. ``"uint16"``, ``"bfloat16"``."""
        self.typestr: str = typestr
        """numpy typestr of the elements (bfloat16: ``"<u2"``)."""
        shape = tuple(info.shape[:info.ndim])
        self.shape: Tuple[int, ...] = shape
        """Shape; the first dimension is the batch size."""
        self.data_ptr: int = info.data or 0
        """Address of the first element (host: in the mapped ring; device: a device pointer)."""
        nbytes = info.byte_size
        self.nbytes: int = nbytes
        """Size in bytes."""
        self.device: str = "cuda" if info.device_type == _capi.DEVICE_CUDA else "cpu"
        """``"cpu"`` or ``"cuda"``."""
        self.device_id: int = info.device_id
        """CUDA device ordinal in this process (device tensors), else 0."""
        if math.prod(shape) * itemsize != nbytes:
            raise error_for(13, f"tensor {self.name!r}: {nbytes} bytes for shape "
                                f"{shape} of {dtype}")

    def interface(self, typestr: Optional[str] = None, readonly: bool = True) -> Dict[str, Any]:
        """The array interface dict (v3) of this tensor, optionally reinterpreting its
        elements as ``typestr`` (same item size), e.g. ``"<i2"`` for uint16 bits. Host
        memory is mapped writable: with ``readonly=False`` a consumer may change the batch it
        holds in place (the daemon neither reads it back nor refills it before release)."""
        typestr = typestr or self.typestr
        if _itemsize(typestr) != _itemsize(self.typestr):
            raise InvalidArgument(f"typestr: {typestr} has another item size than {self.dtype}")
        return {"shape": self.shape, "typestr": typestr, "data": (self.data_ptr, readonly),
                "strides": None, "version": 3}

    def view(self, typestr: Optional[str] = None, readonly: bool = True) -> "_View":
        """An object exposing this tensor's array interface (``__array_interface__`` on the
        host, ``__cuda_array_interface__`` on a GPU) as ``typestr``, holding the lease (see
        :meth:`interface`)."""
        return _View(self._lease, self.interface(typestr, readonly), self.device == "cuda")

    def numpy(self) -> np.ndarray:
        """A read-only numpy array over the tensor, no copy (host tensors only)."""
        if self.device != "cpu":
            raise FailedPrecondition(f"tensor {self.name!r} is in GPU memory; use "
                                     "__cuda_array_interface__ (torch.as_tensor, cupy)")
        array = np.asarray(self)
        array.flags.writeable = False
        return array

    @property
    def __array_interface__(self) -> Dict[str, Any]:  # noqa: D105 (numpy protocol)
        if self.device != "cpu":
            raise AttributeError("__array_interface__: a device tensor (use "
                                 "__cuda_array_interface__)")
        return self.interface()

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:  # noqa: D105 (CUDA array protocol)
        if self.device != "cuda":
            raise AttributeError("__cuda_array_interface__: a host tensor (use "
                                 "__array_interface__)")
        return self.interface(readonly=False)

    def __repr__(self) -> str:
        return (f"gpufeed.Tensor({self.name!r}, {self.dtype}, shape={self.shape}, "
                f"device={self.device}:{self.device_id})")


class _View:
    """A bare array-interface carrier that keeps a lease alive (see :meth:`Tensor.view`)."""

    def __init__(self, lease: _Lease, interface: Dict[str, Any], cuda: bool) -> None:
        self._lease = lease
        if cuda:
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface


class Batch:
    """One batch: the rank's slice of a global batch, in place in the session's ring.

    Attributes describe it (:attr:`epoch`, :attr:`step`, :attr:`ids`, :attr:`valid_count`);
    :attr:`tensors` map names to :class:`Tensor`. The slot is returned when the batch and all
    views of its tensors are garbage, or at :meth:`release` (also on leaving a ``with``).
    """

    def __init__(self, session: _SessionHandle, ptr: int) -> None:
        lib = session.lib
        self._lease = _Lease(session, ptr)  # from here on the slot is released if we fail
        info = _capi.BatchInfo()
        _check(lib, lib.gpufeed_batch_get_info(ptr, ctypes.byref(info)))
        self.epoch: int = info.epoch
        """Epoch of this batch."""
        self.step: int = info.step
        """Step of this batch within the epoch (the rank's batch index)."""
        self.batch_size: int = info.batch_size
        """Rows in the batch."""
        self.valid_count: int = info.valid_count
        """Rows ``[0, valid_count)`` are real samples; the rest pad the epoch's last batch."""
        self.slot: int = info.slot
        """The ring slot holding the batch."""
        self.generation: int = info.generation
        """The slot's generation (the daemon rejects releases of an old one)."""
        epoch, step, samples = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        # ctypes passes them by reference (the arguments are pointers): cheaper than byref().
        _check(lib, lib.gpufeed_batch_after(ptr, epoch, step, samples))
        self.after: Position = Position(epoch.value, step.value, samples.value)
        """The position after this batch, what a checkpoint taken once it is consumed stores:
        ``(epoch + 1, 0, 0)`` after an epoch's last batch, else ``(epoch, step + 1, the
        global cursor)``."""
        # The ids' bytes copied out (ctypes.string_at), then into an array numpy owns, as
        # np.ctypeslib.as_array(...).copy() gave but in ~1.7 us instead of ~2.6.
        batch_size = info.batch_size
        if batch_size < 0 or (batch_size and not info.ids):
            raise error_for(13, f"batch of {batch_size} rows without sample ids")
        ids = np.frombuffer(ctypes.string_at(info.ids, batch_size * 8), np.int64).copy()
        ids.flags.writeable = False
        self.ids: np.ndarray = ids
        """Sample ids of the rows (int64, an owned copy)."""
        tensors: Dict[str, Tensor] = {}
        t = _capi.TensorInfo()  # one for all: Tensor copies its fields
        get_tensor, into = lib.gpufeed_batch_get_tensor, ctypes.byref(t)
        lease = self._lease
        for i in range(info.num_tensors):
            status = get_tensor(ptr, i, into)
            if status != _OK:
                _check(lib, status)
            tensor = Tensor(lease, t)
            tensors[tensor.name] = tensor
        self.tensors: Dict[str, Tensor] = tensors
        """The batch's tensors by name (``tokens``; ``data``; ``image`` and ``label``)."""

    @property
    def position(self) -> Position:
        """This batch's position (epoch, step)."""
        return Position(self.epoch, self.step)

    @property
    def released(self) -> bool:
        """Whether :meth:`release` returned the slot (the daemon may have refilled it)."""
        return self._lease.released

    def valid_mask(self) -> np.ndarray:
        """A bool array, True for the real rows (``[0, valid_count)``)."""
        return np.arange(self.batch_size) < self.valid_count

    def numpy(self) -> Dict[str, np.ndarray]:
        """Read-only numpy arrays over the tensors, by name, no copy (host delivery)."""
        return {name: t.numpy() for name, t in self.tensors.items()}

    def wait_ready(self, stream: Optional[int] = None) -> None:
        """Device delivery: makes CUDA ``stream`` (a ``cudaStream_t`` as an int; ``None``:
        the legacy default stream) wait until the batch is in device memory, without
        blocking the host. Call it before queueing work that reads the batch. No-op on host
        batches."""
        lease = self._lease
        lib = lease._session.lib
        # Under the lease's lock: a release from another thread must not free the C batch
        # between reading the pointer and the call.
        with lease._lock:
            if lease._ptr is None:
                raise FailedPrecondition("wait_ready: the batch was released")
            _check(lib, lib.gpufeed_batch_wait_ready(lease._ptr, stream))

    def release(self, stream: Optional[int] = None) -> None:
        """Returns the slot to the daemon now (idempotent). Device delivery: the daemon does
        not write the slot again before the work queued on ``stream`` (a ``cudaStream_t``;
        ``None``: the legacy default stream) has completed. Arrays over this batch must not
        be read afterwards."""
        self._lease.release(stream)

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"gpufeed.Batch(epoch={self.epoch}, step={self.step}, "
                f"valid={self.valid_count}/{self.batch_size}, tensors={list(self.tensors)})")


class Session:
    """One attached consumer (rank ``rank`` of ``world_size``): a stream of :class:`Batch`.

    Made by :meth:`Client.attach`. Iterating yields batches until ``stop_epoch`` (forever by
    default). :meth:`close` (or leaving a ``with``) detaches; batches still held stay
    readable. Use a session from one thread at a time (batches may be released from any).
    """

    def __init__(self, handle: _SessionHandle, socket: str) -> None:
        self._handle: Optional[_SessionHandle] = handle
        self.socket = socket
        """The daemon's socket."""
        info = _capi.SessionInfo()
        _check(handle.lib, handle.lib.gpufeed_session_get_info(handle.ptr, ctypes.byref(info)))
        batch_size = ctypes.c_int64()
        _check(handle.lib, handle.lib.gpufeed_session_batch_size(handle.ptr,
                                                                 ctypes.byref(batch_size)))
        self.info = SessionInfo(info.session_id, info.num_samples, info.steps_per_epoch,
                                info.ring_slots, info.num_tensors, batch_size.value)
        """What the daemon answered at attach."""
        self.notices: Tuple[_notices.Notice, ...] = _notices.read(handle.lib, handle.ptr)
        """What the daemon reported about the dataset (samples left out at open, cautions):
        warned once here, as a :class:`~gpufeed.GpufeedWarning`."""
        _notices.warn(self.notices)  # at the first caller outside the package

    def _live(self) -> _SessionHandle:
        if self._handle is None:
            raise FailedPrecondition("the session is closed")
        if self._handle.pid != os.getpid():
            raise FailedPrecondition(f"the session belongs to process {self._handle.pid}; a "
                                     "forked child cannot use it (attach in the child)")
        return self._handle

    def next(self, timeout: Optional[float] = None) -> Batch:
        """The next batch, waiting up to ``timeout`` seconds (``None``: forever; Ctrl-C still
        interrupts). :class:`~gpufeed.DeadlineExceeded` after the timeout,
        :class:`~gpufeed.OutOfRange` after the last batch before ``stop_epoch``, the daemon's
        error when the session ended (:class:`~gpufeed.Unavailable` on shutdown,
        :class:`~gpufeed.DataLoss` on an unreadable dataset, ...)."""
        handle = self._live()
        lib = handle.lib
        deadline = None if timeout is None else time.monotonic() + timeout
        out = ctypes.c_void_p()
        while True:
            if deadline is None:
                wait_ms = _WAIT_SLICE_MS
            else:
                wait_ms = max(0, min(_WAIT_SLICE_MS, int((deadline - time.monotonic()) * 1000)))
            status = lib.gpufeed_next(handle.ptr, wait_ms, ctypes.byref(out))
            if status == _OK and out.value:
                return Batch(handle, out.value)
            if status != _DEADLINE_EXCEEDED:
                raise error_for(status, _capi.last_error(lib))
            if deadline is not None and time.monotonic() >= deadline:
                raise DeadlineExceeded(f"no batch within {timeout:g} s from gpufeedd at "
                                       f"{self.socket}")

    def __iter__(self) -> Iterator[Batch]:
        """Batches until the end of the data (``stop_epoch``)."""
        while True:
            try:
                batch = self.next()
            except OutOfRange:
                return
            yield batch
            # Drop our reference before asking for the next batch: the caller's ``del batch``
            # must be enough to return the slot (a 1-slot ring would wait forever otherwise).
            del batch

    @property
    def fingerprint(self) -> str:
        """The feed's fingerprint (dataset identity and every setting that shapes the
        batches): save it with :meth:`position` and pass it back as ``start_fingerprint``, so
        that a position resumes only the feed it came from."""
        handle = self._live()
        text = ctypes.c_char_p()
        _check(handle.lib, handle.lib.gpufeed_fingerprint(handle.ptr, ctypes.byref(text)))
        return (text.value or b"").decode("utf-8", "replace")

    @property
    def blend_segments(self) -> BlendSegments:
        """A blend's segments as the daemon last reported them (at attach, or at a re-attach
        after it came back): save them with :meth:`position` and pass them back as
        ``blend_history``. ``[]``: no blend."""
        handle = self._live()
        text = ctypes.c_char_p()
        _check(handle.lib, handle.lib.gpufeed_session_blend_segments_json(handle.ptr,
                                                                          ctypes.byref(text)))
        return list(json.loads((text.value or b"[]").decode("utf-8")))

    @property
    def mps(self) -> Tuple[Optional[bool], Optional[bool]]:
        """Device delivery: whether the daemon's work on this session's GPU, and this
        process's, go through MPS (``None``: unknown, e.g. host delivery). The daemon's
        kernels run beside training's instead of time-sliced against them only when both
        do."""
        handle = self._live()
        daemon, consumer = ctypes.c_int32(), ctypes.c_int32()
        _check(handle.lib, handle.lib.gpufeed_session_mps(handle.ptr, ctypes.byref(daemon),
                                                          ctypes.byref(consumer)))
        return (None if daemon.value < 0 else bool(daemon.value),
                None if consumer.value < 0 else bool(consumer.value))

    def position(self) -> Position:
        """The position after the last batch :meth:`next` returned: what to checkpoint (with
        :attr:`fingerprint`)."""
        handle = self._live()
        epoch, step, samples = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        _check(handle.lib, handle.lib.gpufeed_position(handle.ptr, ctypes.byref(epoch),
                                                       ctypes.byref(step)))
        _check(handle.lib, handle.lib.gpufeed_position_samples(handle.ptr, ctypes.byref(samples)))
        return Position(epoch.value, step.value, samples.value)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._handle is None

    def close(self) -> None:
        """Detaches from the daemon (idempotent). Batches still held stay readable; the
        mapping goes away with the last of them. In a forked child it only forgets the
        parent's session."""
        handle, self._handle = self._handle, None
        if handle is not None and handle.pid == os.getpid():
            _check(handle.lib, handle.lib.gpufeed_detach(handle.ptr))

    def _abandon(self) -> None:
        """Closes this object without detaching: the session stays attached, its slots held,
        until the last batch that refers to it is garbage (its handle then detaches)."""
        self._handle = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"session {self.info.session_id}"
        return f"gpufeed.Session({state}, socket={self.socket!r})"


PipelineSpec = Union[Sequence[Mapping[str, Any]], Mapping[str, Any], str, "os.PathLike[str]"]
"""A pipeline: a list of op dicts (``[{"center_crop": {"size": 224}}, ...]``), a dict with
``"ops"``, or the path of a JSON file holding one (``deploy/pipelines/*.json``)."""


def pipeline_json(pipeline: PipelineSpec) -> str:
    """The ``pipeline_json`` C option for ``pipeline`` (see :data:`PipelineSpec`)."""
    import json

    if isinstance(pipeline, (str, os.PathLike)):
        path = os.fspath(pipeline)
        try:
            with open(path, encoding="utf-8") as f:
                return json.dumps(json.load(f))
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"pipeline: cannot read {path}: {e}") from e
    if isinstance(pipeline, Mapping):
        if "ops" not in pipeline:
            raise InvalidArgument("pipeline: a dict must hold the op list under 'ops'")
        return json.dumps(dict(pipeline))
    if isinstance(pipeline, Sequence):
        ops: List[Any] = list(pipeline)
        for i, op in enumerate(ops):
            if not isinstance(op, Mapping) or len(op) != 1:
                raise InvalidArgument(f"pipeline: op {i} must be a dict with one key, the op's "
                                      f"name, e.g. {{'center_crop': {{'size': 224}}}}; got {op!r}")
        return json.dumps({"ops": [dict(op) for op in ops]})
    raise InvalidArgument(f"pipeline: want a list of ops, a dict or a JSON file path, got "
                          f"{type(pipeline).__name__}")


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidArgument(f"{key}: want an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{key}: want an integer, got {value!r}") from None


def _check_not_forked_from_grpc() -> None:
    """Refuses to attach in a process forked from one that already used gRPC (it would hang:
    gRPC's threads do not survive fork); notes this process as the one using gRPC."""
    global _GRPC_PID
    pid = os.getpid()
    if _GRPC_PID is not None and _GRPC_PID != pid:
        raise FailedPrecondition(
            f"attach: this process ({pid}) was forked from process {_GRPC_PID}, which had "
            "already connected to gpufeedd; gRPC cannot connect again in a forked child (it "
            "would hang): fork before the first connection, or start the child with the spawn "
            "method (multiprocessing.get_context('spawn'); a gpufeed.torch.Loader pickles as "
            "its configuration)")
    _GRPC_PID = pid


def _record_arrays(dataset: Any, kind: str) -> Optional[List[Tuple[str, str]]]:
    """A records dataset of several arrays as (name, absolute path) pairs in order, or None
    for a dataset named by one path. The daemon checks names and files again."""
    if not isinstance(dataset, Mapping):
        return None
    if kind != "records":
        raise InvalidArgument(f"dataset: a mapping of names to .npy files is for kind records, "
                              f"not {kind!r}")
    if not dataset:
        raise InvalidArgument("dataset: the mapping of names to .npy files is empty")
    out = []
    for name, path in dataset.items():
        if not isinstance(name, str):
            raise InvalidArgument(f"dataset: tensor names are strings, got {name!r}")
        try:
            out.append((name, os.path.abspath(os.fspath(path))))
        except TypeError:
            raise InvalidArgument(f"dataset[{name!r}]: want a path, got {path!r}") from None
    return out


def _dataset_path(dataset) -> str:
    """A local path made absolute; an ``s3://`` URL as it is (docs/howto/object-storage.md:
    the client library passes the caller's own AWS credentials for it)."""
    path = os.fspath(dataset)
    if isinstance(path, str) and path.startswith("s3://"):
        return path
    return os.path.abspath(path)


def _shard_list(dataset: Any, kind: str) -> Optional[List[str]]:
    """An explicit list of shard files as absolute paths in order, or None for a dataset
    named by one path. The client library and the daemon check the entries again."""
    if not isinstance(dataset, (list, tuple)):
        return None
    if kind not in ("tokens", "webdataset"):
        raise InvalidArgument(f"dataset: a list of shard files is for kind tokens and "
                              f"webdataset, not {kind!r}")
    if not dataset:
        raise InvalidArgument("dataset: the list of shard files is empty")
    out = []
    for i, path in enumerate(dataset):
        try:
            out.append(os.path.abspath(os.fspath(path)))
        except TypeError:
            raise InvalidArgument(f"dataset.paths[{i}]: want a path, got {path!r}") from None
    return out


def blend_sources(blend: Any, kind: Any) -> List[Tuple[str, float]]:
    """``blend`` as (absolute source name, weight) pairs in order, checked as far as this
    process can alone; the C library expands each source to its files and checks again."""
    if kind != "tokens":
        raise InvalidArgument(f"blend: a blend of token sources is for kind tokens, not {kind}")
    if isinstance(blend, Mapping):
        pairs = list(blend.items())
    elif isinstance(blend, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in blend):
        pairs = [tuple(p) for p in blend]
    else:
        raise InvalidArgument(
            "blend: want a mapping of sources to weights, {'/data/web/': 0.7, "
            f"'/data/code/*.bin': 0.3}} (or a list of such pairs), got {type(blend).__name__}")
    if not pairs:
        raise InvalidArgument("blend: no sources")
    out = []
    for i, (name, weight) in enumerate(pairs):
        try:
            path = os.fspath(name)
        except TypeError:
            raise InvalidArgument(f"blend[{i}]: a source is a path, got {name!r}") from None
        if not isinstance(path, str) or not path:
            raise InvalidArgument(f"blend[{i}]: a source is a path, got {name!r}")
        if not os.path.isabs(path):
            # Absolute here, as the daemon must see it; a directory's trailing slash kept (the
            # name labels the source as the user wrote it).
            path = os.path.abspath(path) + ("/" if path.endswith("/") else "")
        if (isinstance(weight, bool) or not isinstance(weight, numbers.Real)
                or not math.isfinite(weight) or weight <= 0):
            raise InvalidArgument(f"blend[{i}] '{path}': weight must be > 0 and finite, got "
                                  f"{weight!r}")
        out.append((path, float(weight)))
    return out


def blend_segments(history: Any, what: str = "blend_history") -> BlendSegments:
    """``history`` as plain segments (ints and floats, a copy), checked for their shape; the C
    library checks the values again."""
    if not isinstance(history, (list, tuple)):
        raise InvalidArgument(f"{what}: want a list of segments {{'start': 0, 'weights': [...], "
                              f"'ledger': [...]}}, got {type(history).__name__}")
    out = []
    for i, segment in enumerate(history):
        if not isinstance(segment, Mapping):
            raise InvalidArgument(f"{what}[{i}]: want {{'start': 0, 'weights': [...], "
                                  f"'ledger': [...]}}, got {segment!r}")
        for key in ("start", "weights", "ledger"):
            if key not in segment:
                raise InvalidArgument(f"{what}[{i}]: no {key!r}")
        try:
            out.append({"start": _int(f"{what}[{i}].start", segment["start"]),
                        "weights": [float(w) for w in segment["weights"]],
                        "ledger": [_int(f"{what}[{i}].ledger", c) for c in segment["ledger"]]})
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"{what}[{i}]: {e}") from None
    return out


def check_dataset_or_blend(dataset: Any, blend: Any) -> None:
    """One of ``dataset`` and ``blend``, never both (InvalidArgument saying so)."""
    if dataset is not None and blend is not None:
        raise InvalidArgument("dataset and blend given together: a blend names its sources "
                              "itself (blend={'/data/web/': 0.7, ...}); give one")
    if dataset is None and blend is None:
        raise InvalidArgument("dataset: required (a path, a list of shard files or a mapping of "
                              ".npy arrays), or blend={path: weight, ...} for a weighted blend "
                              "of token sources")


def check_pack(pack: Any) -> None:
    """``pack`` is one of :data:`Pack` or None (InvalidArgument otherwise)."""
    if pack is not None and pack not in ("none", "concat", "best_fit"):
        raise InvalidArgument(f"pack: want none, concat or best_fit, got {pack!r}")


class Client:
    """A handle on one gpufeedd, by its Unix socket.

    ``socket`` defaults to ``$GPUFEED_SOCKET``, then ``/run/gpufeed/gpufeed.sock`` or
    ``$XDG_RUNTIME_DIR/gpufeed/gpufeed.sock`` (:func:`default_socket`). Making a
    client contacts nothing; :meth:`attach` does (a daemon that is not running gives
    :class:`~gpufeed.Unavailable` naming the socket).
    """

    _origin = ""  # where the socket path came from (pickles of an older client lack it)

    def __init__(self, socket: Optional[Union[str, "os.PathLike[str]"]] = None) -> None:
        self._origin = _socket_origin(socket)
        given = os.fspath(socket) if socket else default_socket()
        # "unix:///run/gpufeed/gpufeed.sock", as gpufeedd logs its address, names the path.
        for scheme in ("unix://", "unix:"):
            if given.startswith(scheme):
                given = given[len(scheme):]
                break
        self.socket: str = given
        """Path of gpufeedd's gRPC socket."""

    def attach(
        self,
        dataset: Union[None, str, "os.PathLike[str]", Mapping[str, Union[str, "os.PathLike[str]"]],
                       Sequence[Union[str, "os.PathLike[str]"]]] = None,
        *,
        kind: Kind,
        batch_size: int,
        seq_len: Optional[int] = None,
        token_dtype: Any = None,
        pipeline: Optional[PipelineSpec] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        even: bool = False,
        rank: int = 0,
        world_size: int = 1,
        job: Optional[str] = None,
        ring_slots: Optional[int] = None,
        delivery: Delivery = "host",
        gpu: Optional[str] = None,
        ipc: Optional[Ipc] = None,
        start: Optional[Union[Position, Tuple[int, int], Tuple[int, int, int]]] = None,
        stop_epoch: Optional[int] = None,
        bad_sample: Optional[BadSample] = None,
        decode: Decode = "auto",
        augment: Augment = "auto",
        rpc_timeout: Optional[float] = None,
        reconnect_timeout: Optional[float] = None,
        keepalive: Optional[float] = None,
        start_fingerprint: Optional[str] = None,
        vocab_size: Optional[int] = None,
        share_group: Optional[str] = None,
        elastic: Optional[Elastic] = None,
        blend: Optional[BlendSpec] = None,
        blend_history: Optional[BlendSegments] = None,
        pack: Optional[Pack] = None,
        eos_id: Optional[int] = None,
        pack_lookahead: Optional[int] = None,
    ) -> Session:
        """Attaches as rank ``rank`` of ``world_size`` and returns the :class:`Session`.

        ``dataset`` is the dataset's path (made absolute here; the daemon must see the same
        path), or, for ``tokens`` and ``webdataset``, a list of shard files read in the
        list's order (``["/a/0.bin", "/b/1.bin"]``; each opened here with this process's
        rights; at most 16384, none twice). ``kind``: ``tokens`` (give ``seq_len`` and ``token_dtype`` ``uint16`` or
        ``uint32``), ``records`` (a ``.npy``: tensor ``data``; or a mapping of tensor names to
        ``.npy`` files of one directory and one row count, ``{"x": "x.npy", "y": "y.npy"}``:
        one tensor each, in the mapping's order, sample i being row i of every array),
        ``image_folder`` (give ``pipeline``, see
        :data:`PipelineSpec`; ``bad_sample`` ``skip`` or ``fail``) or ``webdataset`` (tar
        shards: a directory of ``.tar`` files, a glob or brace pattern such as
        ``train-{000000..000146}.tar``, or one ``.tar``; image from ``jpg``/``jpeg``/``png``,
        label from ``cls``; as ``image_folder`` otherwise). ``batch_size`` is per
        rank. ``job`` names the training job (default ``"default"``): every rank of a job
        must ask for the same feed, and a job's rank attaches once. ``ring_slots``: the
        ring's depth (``None``: the daemon's default). ``delivery``: ``host`` or ``device``
        (then ``gpu``: ``None`` for this process's current CUDA device, ``"cuda:N"`` or a
        ``"GPU-..."`` UUID; ``ipc``: ``auto``, ``vmm`` or ``legacy``). ``start``: the
        position to resume at, ``(epoch, step)`` or a :class:`Position` (with its global
        cursor, ``samples``); ``stop_epoch``: the exclusive last epoch (``None``: never
        end). ``decode`` (``"auto"``, ``"cpu"``, ``"nvjpeg"``) and ``augment`` (``"auto"``,
        ``"cpu"``, ``"gpu"``): who decodes and augments images under device delivery; passed
        to the C library only when not ``"auto"`` (its default), so a library without these
        options still serves every other case.
        ``rpc_timeout``: seconds for each call to the daemon (default 10).
        ``reconnect_timeout``: seconds a session re-attaches for after the daemon went away
        (killed, restarted, drained: default 120; 0: never, the stream's error is raised).
        ``keepalive``: seconds between pings that find a daemon which stopped answering
        without closing its socket (SIGSTOP, a frozen process; default 10, 0: none, else >= 1): one
        silent for as long again counts as gone, so a ``next()`` with no timeout raises
        :class:`~gpufeed.Unavailable` within about 2 x keepalive + reconnect_timeout.
        ``start_fingerprint``: the :attr:`Session.fingerprint` saved with ``start``; a feed
        with another one is refused (FailedPrecondition naming each differing field), but for
        its world size and batch size: a ``start`` saved at another world size (or per-rank
        batch) resumes as ``elastic`` says: ``"global_batch"`` (``None``, the default: each
        rank gets the saved global batch / ``world_size``, so ``batch_size`` must be that or
        the saved per-rank batch; the global batches are the uninterrupted run's) or
        ``"rank_batch"`` (``batch_size`` per rank; the rest of the epoch is every sample not
        yet delivered, each once). ``Session.info.batch_size`` says what is served.
        ``vocab_size`` (tokens): refuse a file whose sampled tokens reach it (a wrong
        ``token_dtype`` shows so). ``token_dtype`` ``None``: a ``.npy`` file's header, else
        ``uint16``. ``share_group`` (image datasets): the jobs of one group (this uid's) read
        one order, fixed by the group's name (``seed`` then keys only this job's
        augmentation), and decode each sample once for all of them; each job's batches are
        the ones it would get alone in the group.
        ``blend`` (tokens, instead of ``dataset``): a weighted blend of token sources,
        ``{"/data/web/": 0.7, "/data/code/*.bin": 0.2, "/data/math.npy": 0.1}`` (a token file,
        a directory of them, or a glob in the last component; each expanded here to its files,
        opened with this process's rights); each row comes from one source by Megatron-Core's
        blending rule, each source in its own shuffled order. ``blend_history``: a resumed
        blend's segments (:attr:`Session.blend_segments` of the run that saved ``start``); with
        other weights than its last segment's, a new segment starts at ``start`` and no sample
        of any source is repeated or skipped. ``pack`` (tokens): ``"none"`` (the default: a row
        is one window), ``"concat"`` or ``"best_fit"``: documents packed into rows, with
        ``position_ids``, ``loss_mask`` and ``cu_seqlens`` beside ``tokens``; ``eos_id``: a
        document ends at this token (``None``: a Megatron ``.bin``'s ``.idx`` documents);
        ``pack_lookahead`` (best_fit): documents packed together, at most (``None``: 1024).

        Errors: the daemon's, as :class:`~gpufeed.Error` subclasses (InvalidArgument naming
        the field, NotFound naming the path, Unavailable naming the socket, ...).
        """
        if not isinstance(kind, str):
            raise InvalidArgument(f"kind: want tokens, records, image_folder or webdataset, got {kind!r}")
        check_dataset_or_blend(dataset, blend)
        check_pack(pack)
        sources = None if blend is None else blend_sources(blend, kind)
        history = None if blend_history is None else blend_segments(blend_history)
        _check_not_forked_from_grpc()
        arrays = _record_arrays(dataset, kind)
        listed = _shard_list(dataset, kind)
        strings: Dict[str, Optional[str]] = {
            "socket": self.socket,
            "kind": kind,
            "dataset": (None if arrays is not None or listed is not None or dataset is None
                        else _dataset_path(dataset)),
            "job": job,
            "token_dtype": _dtype_name(token_dtype),
            "delivery": delivery,
            "gpu": gpu,
            "ipc": ipc,
            "bad_sample": bad_sample,
            "pipeline_json": None if pipeline is None else pipeline_json(pipeline),
            "decode": None if decode == "auto" else decode,
            "augment": None if augment == "auto" else augment,
            "start_fingerprint": start_fingerprint or None,
            "share_group": share_group or None,
            "elastic": elastic,
            # Passed only when set, so a library without these options still serves the rest.
            "pack": None if pack in (None, "none") else pack,
            "blend_history_json": None if not history else json.dumps(history),
        }
        seed = _int("seed", seed)
        if not 0 <= seed < 1 << 64:
            raise InvalidArgument(f"seed: want 0 <= seed < 2**64, got {seed}")
        ints: Dict[str, Optional[int]] = {
            "rank": rank,
            "world_size": world_size,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "vocab_size": vocab_size,
            "seed": seed - (1 << 64) if seed >= 1 << 63 else seed,  # the C ABI's int64 bits
            "shuffle": int(bool(shuffle)),
            "drop_last": int(bool(drop_last)),
            "even": int(bool(even)),
            "ring_slots": ring_slots,
            "start_epoch": None if start is None else start[0],
            "start_step": None if start is None else start[1],
            "start_samples": (None if start is None
                              else start[2] if len(start) > 2 else getattr(start, "samples", None)),
            "stop_epoch": stop_epoch,
            "rpc_timeout_ms": None if rpc_timeout is None else int(rpc_timeout * 1000),
            "reconnect_timeout_ms": (None if reconnect_timeout is None
                                     else int(reconnect_timeout * 1000)),
            "keepalive_ms": None if keepalive is None else int(keepalive * 1000),
            "eos_id": eos_id,
            "pack_lookahead": pack_lookahead,
        }
        lib = _capi.lib()
        options = ctypes.c_void_p()
        _check(lib, lib.gpufeed_options_create(ctypes.byref(options)))
        try:
            for key, text in strings.items():
                if text is not None:
                    if not isinstance(text, str):
                        raise InvalidArgument(f"{key}: want a string, got {text!r}")
                    _check(lib, lib.gpufeed_options_set_string(options, key.encode(),
                                                               text.encode("utf-8")))
            for key, number in ints.items():
                if number is not None:
                    _check(lib, lib.gpufeed_options_set_int(options, key.encode(),
                                                            _int(key, number)))
            for path in listed or []:
                _check(lib, lib.gpufeed_options_add_dataset_path(options, path.encode("utf-8")))
            for name, path in arrays or []:
                _check(lib, lib.gpufeed_options_add_array(options, name.encode("utf-8"),
                                                          path.encode("utf-8")))
            for name, weight in sources or []:
                _check(lib, lib.gpufeed_options_add_blend_source(options, name.encode("utf-8"),
                                                                 weight))
            session = ctypes.c_void_p()
            _check_socket(self.socket, self._origin)
            try:
                _check(lib, lib.gpufeed_attach(options, ctypes.byref(session)))
            except Unavailable as e:
                raise _for_python(e) from None
        finally:
            lib.gpufeed_options_destroy(options)
        assert session.value, "gpufeed_attach returned OK without a session"
        return Session(_SessionHandle(lib, session.value), self.socket)

    def __repr__(self) -> str:
        return f"gpufeed.Client(socket={self.socket!r})"


__all__ = ["Augment", "BadSample", "Batch", "BlendSegments", "BlendSpec", "Client",
           "DEFAULT_SOCKET", "DTYPES", "Decode",
           "Delivery", "Elastic", "Ipc", "Kind", "Pack", "PipelineSpec", "Position",
           "Session", "SessionInfo", "Tensor", "default_socket", "pipeline_json"]
