"""PyTorch: :class:`Loader`, an iterable of batches as torch tensors, with no copy.

::

    import gpufeed.torch

    loader = gpufeed.torch.Loader("/data/imagenet/train", kind="image_folder", batch_size=256,
                                  pipeline="deploy/pipelines/imagenet_train.json")
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:        # [256, 3, 224, 224], [256]; batch["image"] too
            loss = criterion(model(images), labels)
            ...
    torch.save({"model": ..., "loader": loader.state_dict()}, path)   # exact resume

Epochs follow a DataLoader's rule: each ``iter(loader)`` yields one epoch; one broken off
(``break``, ``next(iter(loader))``) is not resumed by the next ``iter()``, which starts the
following epoch; a loaded :meth:`Loader.state_dict` resumes mid-epoch.

Rank and world size come from torchrun's ``RANK`` / ``WORLD_SIZE``, the job name from
``TORCHELASTIC_RUN_ID`` or the rendezvous address (one that no other job on the node uses); ``device=None`` means the current CUDA device when there is one
(device delivery: the batch lands in that GPU), else host memory.

**Lifetime of a batch's tensors.** The tensors are views of one slot of the session's ring
(``ring_slots`` deep). The slot goes back to the daemon only when nothing can read it any
more: when the batch and every tensor and view of it are garbage, or on
:meth:`Batch.release` (also on leaving ``with batch:``). Nothing else recycles it:

- When the loader needs a slot for the next batch and the batches you hold fill the ring, it
  moves the oldest held batch whose tensors are referenced only by its :class:`Batch` dict
  into owned memory (the dict's values become copies, equal to the slot's bytes) and returns
  that slot. So ``list(loader)``, or holding batches for later, gives exact batches.
- If every held batch has tensors or views referenced outside its dict (``x = batch["data"]``
  kept), nothing can be moved: :class:`~gpufeed.ResourceExhausted` says how many batches are
  held; the loader's position stays at the batch not yielded.
- Closing the loader moves its held batches the same way; a batch whose tensors are
  referenced elsewhere keeps the session, and its ring, until they are garbage. Iterating at
  another position (the next epoch after a ``break``, or after :meth:`Loader.set_epoch` /
  :meth:`Loader.load_state_dict`), which attaches anew, does the same, and also moves the
  batch's own tensor objects that you took out of it where they stand (``Tensor.set_`` to a
  copy: ``images, labels = next(iter(loader))`` kept while the next epoch starts); it raises
  :class:`~gpufeed.FailedPrecondition` when a view of them (``x[1:]``) still reads the slot.

Host tensors are views of memory the consumer maps writable: an in-place operation on a batch
you hold (``x.add_(1)``) changes that slot only, which the daemon neither reads back nor
refills before its release.

Device delivery: before yielding a batch the loader makes the current CUDA stream wait for
it (no host synchronisation); its slot is released after the work queued on that stream, so
read a batch on the stream that was current when it was yielded (or synchronise).

Element types torch lacks (``uint16`` and ``uint32`` before torch 2.3, e.g. ``uint16``
tokens) are widened to the next signed type (``int32``, ``int64``): that is a copy, made once
per batch, and the slot goes back at once.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import gc
import itertools
import os
import re
import socket as _socket
import sys
import warnings
import weakref
from typing import (Any, Deque, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence,
                    Tuple, Union)

import numpy as np
import torch

from gpufeed.client import Batch as _CoreBatch
from gpufeed.client import Augment, BadSample, BlendSegments, BlendSpec, Decode, Elastic, Kind
from gpufeed.client import Client, Pack, PipelineSpec, Position, Session, SessionInfo, _Lease
from gpufeed.client import blend_segments, blend_sources, check_dataset_or_blend, check_pack
from gpufeed.client import Tensor as _CoreTensor
from gpufeed.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted
from gpufeed.errors import NotFound, PermissionDenied
from gpufeed.pipeline import pipeline_from_torchvision  # noqa: F401  (re-exported)

__all__ = ["Batch", "Loader"]

# Loaders made in this process that took a default job name, in order: the n in those names.
_DEFAULT_JOBS = itertools.count()


def _default_job(world_size: int) -> str:
    """A job name that no other job on the node uses and that every rank of this job makes
    alike: the job's identity from torchrun (``TORCHELASTIC_RUN_ID``, else the rendezvous
    ``MASTER_ADDR:MASTER_PORT``, which two jobs running at once on a node cannot share), or for
    a single process its host and pid; then ``.N`` from the second loader of the process on
    (train, then eval), so ranks that make their loaders in the same order agree."""
    n = next(_DEFAULT_JOBS)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if run_id not in ("", "none"):  # torchrun without --rdzv-id says "none"
        base = run_id
    elif addr and port:
        base = f"{addr}:{port}"
    elif world_size == 1:
        base = f"{_socket.gethostname()}:{os.getpid()}"
    else:  # ranks with nothing in common to name them by: the old shared default
        base = "default"
    name = base if n == 0 else f"{base}.{n}"
    return re.sub(r"[^A-Za-z0-9._:@+=/-]", "_", name)[:128]  # the daemon's job-name rule

# gpufeed dtype name -> (numpy typestr of the carrier view, torch dtype) for types torch
# cannot take directly from numpy or __cuda_array_interface__: their bits are viewed as the
# signed type of the same width, then reinterpreted. The name of the unsigned type is
# resolved at run time (torch >= 2.3 has it); without it the values are widened.
_REINTERPRETED: Dict[str, Tuple[str, str]] = {
    "uint16": ("<i2", "uint16"),
    "uint32": ("<i4", "uint32"),
    "uint64": ("<i8", "uint64"),
    "bfloat16": ("<i2", "bfloat16"),
}
# Unsigned types torch may lack -> (wider signed dtype, mask of the original bits).
_WIDENED = {"uint16": (torch.int32, 0xFFFF), "uint32": (torch.int64, 0xFFFFFFFF)}


class _Carried(NamedTuple):
    """How a tensor of one gpufeed dtype is made as a view of its batch's carrier."""

    np_dtype: np.dtype  # of the numpy view, the carrier typestr's
    target: str  # _REINTERPRETED's torch type name, "" when the view has the tensor's type


# gpufeed dtype name -> _Carried, looked up per tensor of every batch (np.dtype() costs
# ~0.5 us a call); filled on first use.
_CARRIED: Dict[str, _Carried] = {}


def _carried_type(tensor: _CoreTensor) -> _Carried:
    carried = _CARRIED.get(tensor.dtype)
    if carried is None:
        typestr, target = _REINTERPRETED.get(tensor.dtype, (tensor.typestr, ""))
        np_dtype = np.dtype(typestr)  # one torch takes from numpy (see _REINTERPRETED)
        carried = _CARRIED[tensor.dtype] = _Carried(np_dtype, target)
    return carried


class Batch(dict):
    """What the :class:`Loader` yields: a ``dict`` of torch tensors by name (``image`` and
    ``label``; ``tokens``; ``data``; a records mapping's names; plus ``valid``, a bool mask of
    the real rows, when ``drop_last=False``), with the batch's position and sample ids as
    attributes.

    It also unpacks as a torchvision dataset's batch does: ``images, labels = batch`` (and
    ``for images, labels in loader``); a records batch gives its tensors in the dataset's
    order (``x, y`` for ``{"x": ..., "y": ...}``; ``(data,)`` for one ``.npy``), as a
    ``TensorDataset``'s would. ``valid`` is not part of that tuple. A tokens batch does not
    unpack (:class:`TypeError` saying how to split ``tokens``). So iterating a batch yields
    tensors, not names: the names are :meth:`keys` (``items()``, ``[]``, ``in``, ``dict(batch)``
    and ``**batch`` work as for any dict)."""

    # Design: a dict subclass whose iteration yields the tensors. The alternatives were worse:
    # a dict's own iteration made ``images, labels = batch`` bind the strings "image" and
    # "label" with no error; a class that is not a dict would break code that takes any dict
    # (``isinstance(batch, dict)``, Lightning's and accelerate's device moves, which go
    # through ``items()``). What iteration over names costs: ``for k in batch`` (use
    # ``.keys()``) and torch's default_convert / default_collate, which iterate a mapping;
    # the batch's __missing__ names the cause when code looks a tensor up as a key, and
    # IterableDataset refuses the DataLoader settings that would do so.

    epoch: int
    """Epoch of this batch."""
    step: int
    """Step of this batch within the epoch."""
    ids: np.ndarray
    """Sample ids of the rows (int64 numpy array)."""
    valid_count: int
    """Real samples in the batch: with one rank every row (the epoch's last batch is short
    when ``drop_last=False``); with several, rows ``[0, valid_count)``, the rest padding."""
    _lease: Optional[_Lease] = None  # the slot its tensors view; None for owned tensors
    # name -> the tensor put there that views the slot (weak: the dict holds it)
    _slot_tensors: Dict[str, "weakref.ref[torch.Tensor]"] = {}
    _stream: Optional["torch.cuda.Stream"] = None  # device: the stream the batch was ready on

    @property
    def in_place(self) -> bool:
        """True while the tensors are views of the session's ring slot; False for owned
        tensors (``copy=True``, widened types, or a batch the loader moved into owned memory
        to return its slot)."""
        return self._lease is not None

    @property
    def released(self) -> bool:
        """True once :meth:`release` returned the slot these tensors view."""
        return self._lease is not None and self._lease.released

    def __iter__(self):
        if "tokens" in self:
            raise TypeError(
                "a tokens batch does not unpack: each row holds seq_len + 1 tokens; take "
                "tokens = batch['tokens'], x = tokens[:, :-1], y = tokens[:, 1:] (add "
                ".long() for an embedding or a loss); the batch's names are batch.keys()")
        return (tensor for name, tensor in self.items() if name != "valid")

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, torch.Tensor):
            raise TypeError(
                "gpufeed.torch.Batch: looked up by a tensor: iterating a batch yields its "
                "tensors (images, labels = batch), not its names; use batch.keys() or "
                "batch.items() for the names (torch's default_convert and default_collate "
                "iterate a mapping so: DataLoader(loader.as_dataset(), batch_size=None, "
                "collate_fn=gpufeed.torch.IterableDataset.collate) hands batches through)")
        raise KeyError(key)

    def __reduce__(self):
        # Pickles (torch.save, multiprocessing) as owned tensors, without the slot's lease.
        return (_restore_batch, (dict(self), self.epoch, self.step, self.ids, self.valid_count))

    def release(self) -> None:
        """Returns the slot now, without waiting for garbage collection (e.g. once the batch
        was copied to the GPU): you are done with the tensors, and the daemon writes the next
        batch there. Device delivery: the daemon writes the slot only after the work queued
        so far on the stream that was current when the batch was yielded."""
        if self._lease is not None:
            self._lease.release()

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _own(self) -> bool:
        """Moves the tensors that view the slot into owned memory, in this dict, and drops
        the dict's hold on the slot; True if that returned the slot (nothing else referred
        to it). Otherwise the dict is left as it was (False)."""
        lease = self._lease
        if lease is None or lease.released:
            return True
        # The copies are ordered after the batch's arrival (device: on its stream), and the
        # slot's release after the copies (the lease's release follows the same stream).
        stream = self._stream
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            copies = {name: tensor.clone() for name, tensor in self.items()
                      if name in self._slot_tensors and tensor is self._slot_tensors[name]()}
        originals = {name: weakref.ref(self[name]) for name in copies}
        held = weakref.ref(lease)
        self.update(copies)
        self._lease, self._slot_tensors, self._stream = None, {}, None
        del lease, copies
        if held() is None:  # nothing else referred to the slot: released by its finalizer
            return True
        # A tensor or view taken out of the dict still reads the slot: put the dict back.
        for name, ref in originals.items():
            tensor = ref()
            if tensor is not None:
                self[name] = tensor
                self._slot_tensors[name] = ref
        self._lease, self._stream = held(), stream
        return False


def _restore_batch(tensors: Dict[str, Any], epoch: int, step: int, ids: np.ndarray,
                   valid_count: int) -> Batch:
    batch = Batch(tensors)
    batch.epoch, batch.step, batch.ids, batch.valid_count = epoch, step, ids, valid_count
    return batch


class _Held(NamedTuple):
    """A batch the loader yielded in place, while its slot may still be held."""

    epoch: int
    step: int
    batch: "weakref.ref[Batch]"
    lease: "weakref.ref[_Lease]"
    tensors: Tuple["weakref.ref[torch.Tensor]", ...]  # the objects yielded that view the slot
    stream: Optional["torch.cuda.Stream"]  # device: the stream the batch was ready on

    def holds_slot(self) -> bool:
        lease = self.lease()
        return lease is not None and not lease.released

    def move_tensors(self) -> None:
        """Moves the batch's own tensor objects into owned memory where they stand
        (``set_`` to a copy: the same objects with the same values, wherever they are
        referenced, e.g. ``images, labels = batch`` kept after the dict is gone). Views
        taken of them still read the slot. Only before a session ends (a new attach):
        ``set_`` changes the object's storage, which autograd would count as a write."""
        stream = self.stream
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        moved = True
        with context, torch.no_grad():
            for ref in self.tensors:
                tensor = ref()
                if tensor is None:
                    continue
                try:
                    tensor.set_(tensor.clone())
                except RuntimeError:  # e.g. an inference-mode tensor: it stays in place
                    moved = False
                del tensor
        batch = self.batch()
        if moved and batch is not None:  # its values are the moved objects: it owns them
            batch._lease, batch._slot_tensors, batch._stream = None, {}, None


def _describe(held: Sequence[_Held]) -> str:
    """``"2 batches: epoch 0 steps 3, 4"``."""
    by_epoch: Dict[int, List[str]] = {}
    for h in held:
        by_epoch.setdefault(h.epoch, []).append(str(h.step))
    where = "; ".join(f"epoch {e} step{'s' if len(steps) > 1 else ''} {', '.join(steps)}"
                      for e, steps in by_epoch.items())
    return f"{len(held)} batch{'es' if len(held) != 1 else ''}: {where}"


# Sessions a closed Loader left attached because batches of theirs are still referenced
# outside their dicts (the session ends with the last of them): (socket, job, rank) -> the
# batches, to explain the daemon's ALREADY_EXISTS when that job and rank attach again.
_LINGERING: List[Tuple[Tuple[str, Optional[str], int], List[_Held]]] = []


def _lingering(key: Tuple[str, Optional[str], int]) -> List[_Held]:
    """The batches still holding a closed loader's session for ``key`` (pruned)."""
    _LINGERING[:] = [(k, [h for h in held if h.holds_slot()]) for k, held in _LINGERING]
    _LINGERING[:] = [(k, held) for k, held in _LINGERING if held]
    return [h for k, held in _LINGERING if k == key for h in held]


# The daemon's refusal of a position saved from another feed (feed.proto, Position.fingerprint):
# these two around the differing fields, joined by "; ".
_REFUSED = "start.fingerprint: the position was saved from another feed: "
_REFUSED_END = ". Resume with the settings and data it was saved with, or start without it"


def _refused_differences(message: str) -> Optional[List[str]]:
    """The fields the daemon named in its refusal of a saved fingerprint, each as it words
    them ("seq_len was 32, is 16"); None for any other message. The client library puts
    the call's name first ("attach: ")."""
    at = message.find(_REFUSED)
    if at < 0 or not message.endswith(_REFUSED_END):
        return None
    return message[at + len(_REFUSED):-len(_REFUSED_END)].split("; ")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(
            f"{name}: want an integer in the environment, got {value!r}") from None


def _default_cuda_index() -> int:
    """torchrun's ``LOCAL_RANK`` when set (each rank its own GPU, whether or not the script
    called ``torch.cuda.set_device`` yet), else the current device."""
    local = os.environ.get("LOCAL_RANK", "")
    if local != "":
        try:
            index = int(local)
        except ValueError:
            raise InvalidArgument(f"LOCAL_RANK: want an integer, got {local!r}") from None
        if 0 <= index < torch.cuda.device_count():
            return index
    return torch.cuda.current_device()


def _resolve_device(device: Union[None, str, int, "torch.device"]) -> "torch.device":
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", _default_cuda_index())
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"device: {e}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device: want cpu or cuda[:N], got {device!r}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise FailedPrecondition(f"device: {device!r} asked for, but torch sees no CUDA "
                                     "device (device='cpu' delivers to host memory)")
        if resolved.index is None:
            resolved = torch.device("cuda", _default_cuda_index())
    return resolved


class Loader:
    """Batches of one rank from gpufeedd, as torch tensors in place (see the module's notes
    on lifetime).

    Args:
        dataset: path of the dataset (a tokens file, or a directory or glob of token shards;
            a ``.npy``; an image folder's root), or, for ``"records"`` of several arrays, a
            mapping of tensor names to ``.npy`` files of one directory and one row count
            (``{"x": "x.npy", "y": "y.npy"}``: ``batch["x"]``, ``batch["y"]``, row i of each
            being sample i), or, for ``"tokens"`` and ``"webdataset"``, a list of shard files
            read in the list's order (``["/a/0.bin", "/b/1.bin"]``). Not with ``blend``.
        blend: tokens, instead of ``dataset``: a weighted blend of token sources, ``{source:
            weight}``: ``{"/data/web/": 0.7, "/data/code/*.bin": 0.2, "/data/math.npy": 0.1}``
            (a token file, a directory of them or a glob in the last component; weights > 0,
            normalised). Each row comes from one source, chosen by Megatron-Core's blending
            rule (the source whose share lags its weight most), so the shares hold at every
            prefix; each source keeps its own shuffled order and cycles its own epochs.
            :meth:`state_dict` keeps the blend's history (``"blend"``), so a resume, also with
            changed weights, repeats and skips no sample of any source.
        pack: tokens: ``None`` / ``"none"`` (a row is one window of ``seq_len + 1`` tokens),
            ``"concat"`` (Megatron's concatenate-and-cut over the documents) or ``"best_fit"``
            (whole documents packed into rows, best-fit-decreasing; only documents longer
            than a row are cut). Packed batches carry ``position_ids`` (restarting at each
            document), ``loss_mask`` (0 on padding) and ``cu_seqlens`` (FlashAttention's
            varlen boundaries) beside ``tokens``, each ``[batch_size, seq_len + 1]`` but
            ``cu_seqlens``, ``[batch_size, W]``: W the most pieces a row can hold plus 2,
            each row 0, its pieces' ends, then ``seq_len`` repeated.
        eos_id: with ``pack``: a document ends at this token (included). ``None``: a Megatron
            ``.bin``'s ``.idx`` documents.
        pack_lookahead: ``pack="best_fit"``: documents packed together, at most (``None``:
            the daemon's default, 1024).
        kind: ``"tokens"``, ``"records"``, ``"image_folder"`` or ``"webdataset"`` (tar shards,
            e.g. ``"/data/train-{000000..000146}.tar"``).
        batch_size: rows per batch of this rank.
        seq_len: tokens: the window; each row holds ``seq_len + 1`` tokens (inputs and
            shifted targets).
        token_dtype: tokens: ``"uint16"`` (the default) or ``"uint32"``.
        pipeline: image_folder: the ops: a ``gpufeed.pipeline.Pipeline`` (or
            ``pipeline_from_torchvision(T.Compose([...]))``), a list of op dicts, a dict with
            ``"ops"`` or a JSON file's path.
        shuffle: visit each epoch in the shuffled order of ``(seed, epoch)``.
        seed: the shuffle's and the augmentations' seed.
        drop_last: drop the incomplete last global batch. When False, batches carry
            ``valid``, a bool mask of their real rows, and the epoch's last batch is, with
            one rank (``world_size == 1``), short, as a DataLoader's (``valid`` all True);
            with several ranks, full: the daemon pads it by wrapping around to the epoch's
            start, as ``DistributedSampler`` pads, and ``valid`` is False on the padding.
        even: with ``drop_last=False``, ``DistributedSampler``'s split: every rank gets the
            same count of real samples per epoch, ``ceil(N / world_size)`` (the last ones
            wrap to the epoch's start, as DistributedSampler pads), so evaluation loops that
            count rows without reading ``valid`` agree across ranks.
        device: ``None`` (the current CUDA device if there is one, else host), ``"cpu"``
            (host delivery) or ``"cuda[:N]"``.
        share_group: image datasets: jobs of this user that name one group (a sweep, several
            models on one dataset) read one sample order, fixed by the group's name (``seed``
            then keys only this job's crops and flips), and gpufeedd decodes each sample once
            for all of them. Each job's batches are byte for byte the ones it gets alone in
            the group; sharing changes the cost, never the bytes.
        rank, world_size: default to ``$RANK`` / ``$WORLD_SIZE``, else 0 / 1 (torchrun sets
            them; after an elastic restart at another size they differ from the saved
            state's, which :meth:`load_state_dict` resumes all the same: see ``elastic``).
        elastic: what a :meth:`load_state_dict` of a state saved at another world size (or
            batch size) keeps. ``"global_batch"`` (the default): each rank gets the saved
            global batch / ``world_size`` samples a step (``batch_size`` must be that or the
            saved per-rank batch; :attr:`batch_size` says which), and the job's global
            batches are the uninterrupted run's, byte for byte. ``"rank_batch"``:
            ``batch_size`` per rank, so the global batch changes; the rest of the epoch is
            every sample not yet delivered, each once.
        job: the job's name, shared by its ranks. The default never collides with another
            job on the node: torchrun's ``$TORCHELASTIC_RUN_ID``, else its rendezvous
            ``MASTER_ADDR:MASTER_PORT``, else (one process) ``HOST:PID``; the second and later
            loaders of a process add ``.1``, ``.2``, ... (so ranks that make their loaders
            in the same order agree; give ``job=`` when they do not). Without any of these
            and ``world_size > 1`` it is ``default``.
        ring_slots: slots in the ring (1-64); ``None``: the daemon's default. How many
            batches you can hold in place at once; beyond, held batches are copied (see the
            module's notes on lifetime).
        decode: image_folder, device delivery: ``"auto"`` (nvJPEG where the daemon has it),
            ``"cpu"`` or ``"nvjpeg"``. Passed to the C library only when not ``"auto"``.
        augment: image_folder, device delivery: where the crop/resize/flip/normalize ops
            run: ``"auto"`` (the GPU), ``"cpu"`` or ``"gpu"``. Passed only when not
            ``"auto"``.
        bad_sample: image_folder: ``"skip"`` a bad image (replaced by the next good one) or
            ``"fail"`` (:class:`~gpufeed.DataLoss` naming the file).
        socket: gpufeedd's socket; default ``$GPUFEED_SOCKET``, then
            ``/run/gpufeed/gpufeed.sock``.
        copy: yield owned copies and return each slot at once.
        timeout: seconds to wait for a batch before :class:`~gpufeed.DeadlineExceeded`;
            ``None`` waits as long as it takes while the daemon answers.
        reconnect_timeout: seconds to re-attach for when the daemon goes away (killed,
            restarted, drained; default 120, 0: never): the loader goes on with the next
            batch, no duplicate and no loss; past it :class:`~gpufeed.Unavailable`.
        keepalive: seconds between pings that find a daemon which stopped answering
            (SIGSTOP, a frozen process; default 10, 0: none): it then counts as gone.

    Making the loader checks the arguments it can check alone (``device``, ``RANK``...) and
    contacts nothing. It attaches once, when first needed: the first ``iter()``, ``len()``,
    :attr:`info` or :meth:`state_dict`, at the position then set (by :meth:`load_state_dict`
    or :meth:`set_epoch`). So the daemon's checks of the options (the field named) fail
    there; call ``len(loader)`` to have them at once. ``len()`` is the number of batches in
    an epoch.

    Iterating follows ``DataLoader``: each ``iter()`` yields one epoch, from the position
    (see :meth:`__iter__`): after an epoch ran to its end, the next; after one was broken
    off (a ``break``, ``next(iter(loader))``), the following epoch from its first step,
    never the rest of the broken one. Mid-epoch resumption is explicit, as with torchdata's
    ``StatefulDataLoader``: ``loader.load_state_dict(state)``, then ``iter()``. An error of
    the loader's own while it waits for a batch (a timeout, :class:`~gpufeed.ResourceExhausted`)
    yields nothing, and the next ``iter()`` retries that batch.

    A loader pickles as its configuration and position (never its session): ``pickle``,
    ``multiprocessing`` with the spawn context and ``torch.save`` hand it to another process,
    where it attaches when first used and resumes at that position (as a loaded
    ``state_dict`` does, also mid-epoch). A forked child cannot use a loader its parent attached
    (the session is the parent's: :class:`~gpufeed.FailedPrecondition` says so); one the
    parent has not attached yet attaches in the child.
    """

    def __init__(
        self,
        dataset: Union[None, str, "os.PathLike[str]", Mapping[str, Union[str, "os.PathLike[str]"]],
                       Sequence[Union[str, "os.PathLike[str]"]]] = None,
        *,
        kind: Kind,
        batch_size: int,
        seq_len: Optional[int] = None,
        token_dtype: Optional[str] = None,
        pipeline: Optional[PipelineSpec] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        even: bool = False,
        device: Union[None, str, int, "torch.device"] = None,
        vocab_size: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        job: Optional[str] = None,
        ring_slots: Optional[int] = None,
        decode: Decode = "auto",
        augment: Augment = "auto",
        bad_sample: BadSample = "skip",
        socket: Optional[Union[str, "os.PathLike[str]"]] = None,
        copy: bool = False,
        timeout: Optional[float] = None,
        reconnect_timeout: Optional[float] = None,
        keepalive: Optional[float] = None,
        share_group: Optional[str] = None,
        elastic: Elastic = "global_batch",
        blend: Optional[BlendSpec] = None,
        pack: Optional[Pack] = None,
        eos_id: Optional[int] = None,
        pack_lookahead: Optional[int] = None,
    ) -> None:
        check_dataset_or_blend(dataset, blend)
        check_pack(pack)
        # Checked here, alone; made absolute here, so a pickle names the same files.
        sources = None if blend is None else blend_sources(blend, kind)
        self.device: torch.device = _resolve_device(device)
        """Where batches land: ``cpu`` (host delivery) or ``cuda:N`` (device delivery)."""
        self.rank: int = _env_int("RANK", 0) if rank is None else rank
        """This process's rank."""
        self.world_size: int = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
        """The number of ranks."""
        self.job: str = _default_job(self.world_size) if job is None else job
        """The job's name (see ``job`` above)."""
        self.copy: bool = copy
        """Whether batches are owned copies."""
        self.drop_last: bool = drop_last
        """Whether the incomplete last global batch is dropped (else ``valid`` is yielded)."""
        self.timeout: Optional[float] = timeout
        """Seconds to wait for a batch (``None``: forever)."""
        self._client = Client(socket)
        self._options: Dict[str, Any] = dict(
            kind=kind, batch_size=batch_size, seq_len=seq_len, token_dtype=token_dtype,
            pipeline=pipeline, shuffle=shuffle, seed=seed, drop_last=drop_last, even=even,
            rank=self.rank, world_size=self.world_size, job=self.job, ring_slots=ring_slots,
            decode=decode, augment=augment, bad_sample=bad_sample, vocab_size=vocab_size,
            reconnect_timeout=reconnect_timeout, keepalive=keepalive, share_group=share_group,
            # Passed only when not the default, so a library without the option still serves.
            elastic=None if elastic == "global_batch" else elastic,
            blend=sources, pack=pack, eos_id=eos_id, pack_lookahead=pack_lookahead)
        if self.device.type == "cuda":
            self._options.update(delivery="device", gpu=f"cuda:{self.device.index}")
        self._dataset = dataset
        self._position = Position(0, 0)
        self._loaded: Optional[Position] = None  # a loaded position, until iteration starts
        # Whether the position was reached by yielding batches (not set by the constructor,
        # set_epoch or load_state_dict): then a new iter() does not resume a broken-off epoch.
        self._yielded = False
        self._fingerprint: str = ""  # the feed's, from the daemon at each attach
        self._loaded_fingerprint: Optional[str] = None  # from load_state_dict, checked at attach
        # A blend's segments as the daemon last reported them (or as a loaded state had them):
        # every attach sends them back, so a new session continues the same blend.
        self._blend_segments: Optional[BlendSegments] = None
        self._unattached()

    def _unattached(self) -> None:
        """The state of a loader that has not attached in this process: just made, or
        unpickled."""
        self._session: Optional[Session] = None
        self._info: Optional[SessionInfo] = None  # the last attach's answer
        self._held: Deque[_Held] = collections.deque()  # yielded in place, oldest first
        self._pid = os.getpid()  # the process that attached
        self._generation = 0
        self._widen_warned = False
        self._mps_warned = False
        self._classes: Optional[List[str]] = None
        # The session whose blend segments are the loader's (None after a load_state_dict,
        # whose segments hold until the next attach).
        self._blend_session: Optional[Session] = None

    # ---- pickling ----

    # What a pickle carries: the configuration and the position, never a session.
    # Not ``_yielded``: a pickle resumes at its position, as a loaded state_dict does.
    _PICKLED = ("device", "rank", "world_size", "job", "copy", "drop_last", "timeout",
                "_client", "_options", "_dataset", "_position", "_loaded", "_fingerprint",
                "_loaded_fingerprint", "_blend_segments")

    def __getstate__(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._PICKLED}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._blend_segments = None  # a pickle of a loader from before blends
        self.__dict__.update(state)
        self._yielded = False
        self._unattached()

    @property
    def info(self) -> SessionInfo:
        """What the daemon answered at the last attach (samples, steps per epoch, ring
        slots); attaches at the current position if the loader has not attached yet."""
        if self._info is None:
            self._attach(self._position)
        assert self._info is not None
        return self._info

    @property
    def classes(self) -> List[str]:
        """image_folder: the class folder names, sorted; ``batch["label"]`` is an index into
        this list. The daemon does not send the names: they are read here from the dataset
        path, by the daemon's rule, which is torchvision ``ImageFolder``'s (the folders
        directly under the root, sorted by their bytes) except that a symbolic link to a
        folder is no class. Other kinds raise :class:`AttributeError`."""
        if self._options["kind"] != "image_folder":
            raise AttributeError(f"classes: a {self._options['kind']} dataset has no classes "
                                 "(image_folder only)")
        if self._classes is None:
            root = os.path.abspath(os.fspath(self._dataset))
            try:
                with os.scandir(root) as entries:
                    names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
            except OSError as e:
                error = (NotFound if isinstance(e, (FileNotFoundError, NotADirectoryError))
                         else PermissionDenied if isinstance(e, PermissionError)
                         else FailedPrecondition)
                raise error(f"classes: cannot list {root}: {e.strerror}") from None
            self._classes = sorted(names, key=os.fsencode)
        return list(self._classes)

    @property
    def class_to_idx(self) -> Dict[str, int]:
        """image_folder: class folder name -> label, as torchvision ``ImageFolder``'s (see
        :attr:`classes`)."""
        return {name: i for i, name in enumerate(self.classes)}

    def as_dataset(self) -> "IterableDataset":
        """This loader as a ``torch.utils.data.IterableDataset`` (see
        :class:`IterableDataset`)."""
        return IterableDataset(self)

    # ---- position ----

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self.info.steps_per_epoch

    @property
    def batch_size(self) -> int:
        """Rows per batch of this rank: what the session serves once attached (after an
        elastic resume that keeps the global batch, the saved global batch / world_size), the
        ``batch_size`` given before."""
        if self._info is not None and self._info.batch_size > 0:
            return self._info.batch_size
        return int(self._options["batch_size"])

    @property
    def position(self) -> Position:
        """The position after the last batch yielded (epoch, step, samples), what :meth:`state_dict`
        saves; after :meth:`set_epoch`, :meth:`load_state_dict` or an ``iter()``, where the
        next batch comes from. (An epoch broken off is left by the next ``iter()``, which
        starts the following epoch.)"""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """The next ``iter()`` yields epoch ``epoch`` from its first step (as
        ``DistributedSampler.set_epoch``). Free when the loader is already there (e.g. after
        the previous epoch ran to its end). Right after :meth:`load_state_dict`, setting the
        loaded epoch keeps the loaded step, so the usual loop
        ``for e in range(start, n): loader.set_epoch(e); for batch in loader: ...`` resumes
        exactly."""
        epoch = int(epoch)
        self._generation += 1  # a running iterator ends: it belongs to the old position
        if self._loaded is not None and self._loaded.epoch == epoch:
            self._position = self._loaded
        else:
            self._position = Position(epoch, 0)
        self._loaded = None
        self._yielded = False

    def state_dict(self) -> Dict[str, Any]:
        """The resume state (torchdata ``StatefulDataLoader`` convention): the position after
        the last batch yielded (``epoch``, ``step`` and ``samples``, the job's global cursor:
        the same on every rank, so rank 0's state resumes the whole job, at any world size),
        and the layout it was saved at (``world_size``, ``batch_size`` as served, ``seed``).
        The feed's ``fingerprint`` comes from the daemon: a loader that never attached and
        loaded no state attaches for it."""
        fingerprint = self._fingerprint or self._loaded_fingerprint
        if not fingerprint:
            self._attach(self._position)
            fingerprint = self._fingerprint
        state: Dict[str, Any] = {
            "epoch": self._position.epoch, "step": self._position.step,
            "samples": self._position.samples, "world_size": self.world_size,
            "batch_size": self.batch_size, "seed": int(self._options["seed"]),
            "fingerprint": fingerprint}
        if self._options.get("blend") is not None:
            state["blend"] = blend_segments(self._current_blend_segments() or [])
        return state

    def _current_blend_segments(self) -> Optional[BlendSegments]:
        """The blend's segments: the session's (the daemon's latest, also after a re-attach)
        while attached, else those kept from the last session or a loaded state (which
        replaces the session's until the next attach)."""
        session = self._session
        if (self._options.get("blend") is not None and session is not None
                and session is self._blend_session and not session.closed
                and self._pid == os.getpid()):
            self._blend_segments = session.blend_segments
        return self._blend_segments

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resumes at the position of :meth:`state_dict`: the next ``iter()`` yields exactly
        the batches the saved loader would have yielded next. A blend's ``"blend"`` segments
        go back to the daemon with the position: with the loader's weights changed since the
        state was saved, the new weights hold from the position on, and no sample of any
        source is repeated or skipped. A state saved at another world
        size or batch size (torchrun elastic: ``$WORLD_SIZE`` differs) resumes as ``elastic``
        says (the daemon decides, from the fingerprint's layout: a batch size it cannot serve
        is :class:`~gpufeed.InvalidArgument` naming those that work). A state without a
        ``fingerprint`` (saved by an older gpufeed) must come from the same world size, batch
        size and seed (:class:`~gpufeed.InvalidArgument` otherwise). The ``fingerprint`` (the
        dataset's identity, the seed and every other setting that shapes the batches:
        ``seq_len``, dtype, shuffle, drop_last, the pipeline...) must be this feed's, else
        :class:`~gpufeed.FailedPrecondition` names each field that differs: raised here when
        the loader attached before (it knows its feed's fingerprint), else by the attach of
        the next ``iter()``. Before the first attach this only sets where that attach starts
        (one attach, at the loaded position)."""
        for key in ("epoch", "step"):
            if key not in state:
                raise InvalidArgument(f"state_dict: no '{key}' in {dict(state)!r}")
        fingerprint = state.get("fingerprint")
        # The fingerprint names the saved layout, from which the daemon resumes at another;
        # without it, only the same layout means the same batches.
        for key, mine in (("world_size", self.world_size),
                          ("batch_size", self._options["batch_size"]),
                          ("seed", self._options["seed"])):
            if not fingerprint and key in state and int(state[key]) != int(mine):
                raise InvalidArgument(
                    f"state_dict: {key} {state[key]} differs from this loader's {mine}, and "
                    "the state has no fingerprint (saved by an older gpufeed), which a resume "
                    "at another layout needs; resume with the settings it was saved with")
        # A state without them (saved by an older gpufeed, or of no blend) starts the blend anew.
        segments = (None if state.get("blend") is None
                    else blend_segments(state["blend"], "state_dict: blend"))
        self._generation += 1  # a running iterator ends: it belongs to the old position
        self._blend_segments, self._blend_session = segments, None
        self._position = Position(int(state["epoch"]), int(state["step"]),
                                  int(state.get("samples", 0)))
        self._loaded = self._position  # kept by a set_epoch of the same epoch
        self._yielded = False  # the next iter() resumes here, mid-epoch or not
        self._loaded_fingerprint = str(fingerprint) if fingerprint else None
        if self._loaded_fingerprint and self._fingerprint not in ("", self._loaded_fingerprint):
            # Said here, where it was loaded. Which fields differ, and which form an earlier
            # release saved still matches, only the daemon knows: the attach at the loaded
            # position (the one the next iter() makes) asks it; a loader closed stays closed.
            attached = self._session is not None and not self._session.closed
            try:
                self._attach(self._position, anew=True)
                if not attached:
                    self.close()
            except FailedPrecondition as e:
                differ = _refused_differences(e.message)
                if differ is None:
                    raise
                self._loaded_fingerprint = None
                raise FailedPrecondition(
                    "state_dict: the position was saved from another feed: " + "; ".join(differ)
                    + ". Resume with the settings and data it was saved with") from None

    # ---- iteration ----

    def __iter__(self) -> Iterator[Batch]:
        """Yields one epoch's :class:`Batch` dicts, as a ``DataLoader`` does: an epoch that
        ran to its end is followed by the next; one broken off (a ``break``, a
        ``next(iter(loader))``) is not resumed: the next ``iter()`` starts the following
        epoch from its first step. To resume mid-epoch, :meth:`load_state_dict` a
        :meth:`state_dict` (torchdata's ``StatefulDataLoader`` rule): the next ``iter()``
        yields the rest of that epoch; :meth:`set_epoch` chooses the epoch. One iterator at a
        time: a new ``iter()`` ends the previous one."""
        self._generation += 1
        if self._yielded and self._position.step != 0:
            self._position = Position(self._position.epoch + 1, 0)
        self._yielded = False
        self._loaded = None  # iterating consumes a loaded position
        return self._epoch(self._generation)

    def _epoch(self, generation: int) -> Iterator[Batch]:
        """The batches from the position to the end of its epoch, while ``generation`` is
        the loader's (a set_epoch, load_state_dict or new iter() ends this one)."""
        if generation != self._generation:
            return
        epoch = self._position.epoch
        session = self._attach(self._position)
        while self._position.epoch == epoch and generation == self._generation:
            yield self._next(session)

    def _check_process(self) -> None:
        """Refuses the session of the process this one was forked from."""
        if self._session is not None and self._pid != os.getpid():
            raise FailedPrecondition(
                f"gpufeed.torch.Loader: the session belongs to process {self._pid}, which "
                f"attached it; this process ({os.getpid()}) is a fork of it and cannot use "
                "it: make a new Loader in the child, or give the child one that has not "
                "attached yet (or a pickled one: a pickle carries no session)")

    def _attach(self, position: Position, anew: bool = False) -> Session:
        """The session, attached anew when it is not at ``position`` (or ``anew``)."""
        self._check_process()
        if self._session is not None and not self._session.closed:
            at = self._session.position()
            # A position loaded without its cursor (samples 0) is the session's at that step.
            if at == position and position.samples in (0, at.samples) and not anew:
                return self._session
            # Ending the session returns its ring: first every batch still held must be
            # moved out of it.
            if not self._own_held(0):
                gc.collect()  # batches only reference cycles still reach
                if not self._own_held(0):
                    for held in self._held:  # tensors taken out of their batches
                        held.move_tensors()
                if not self._own_held(0):
                    at = self._session.position()
                    raise FailedPrecondition(
                        f"gpufeed.torch.Loader: going to epoch {position.epoch} step "
                        f"{position.step} attaches anew and ends the session at epoch "
                        f"{at.epoch} step {at.step}, whose ring still holds batches you "
                        "reference through views taken of their tensors "
                        f"({_describe(self._held)}; the tensors themselves were moved out); "
                        "drop those views (del) or keep .clone()s, then iterate again")
            self.close()
        start = position
        key = (self._client.socket, self.job, self.rank)
        blend = self._options.get("blend") is not None
        options = dict(self._options, start_fingerprint=self._loaded_fingerprint,
                       blend_history=(self._blend_segments or None) if blend else None)
        try:
            self._session = self._client.attach(self._dataset, start=start, **options)
        except AlreadyExists as e:
            if not _lingering(key):
                raise
            gc.collect()  # the batches holding that session may be garbage in cycles
            held = _lingering(key)
            if held:
                base = e.message.split("; to run another job", 1)[0]
                raise AlreadyExists(
                    f"{base}: by a closed gpufeed.torch.Loader of this process, which "
                    "stays attached while you reference its batches through tensors or views "
                    f"taken out of them ({_describe(held)}); drop those references or keep "
                    ".clone()s") from None
            self._session = self._client.attach(self._dataset, start=start, **options)
        self._pid = os.getpid()
        self._info = self._session.info
        self._fingerprint = self._session.fingerprint
        self._blend_session = self._session
        self._current_blend_segments()
        if self._position == position:
            # The daemon's cursor for the start (a state saved before ``samples`` gives 0).
            self._position = self._session.position()
        self._check_mps(self._session)
        return self._session

    def _check_mps(self, session: Session) -> None:
        """Warns once when the daemon and this process disagree about MPS on the GPU: then
        the daemon's decode and augment kernels are time-sliced against training's (a large
        part of its rate with nvJPEG: docs/benchmarks.md) instead of running beside them."""
        if self._mps_warned or self.device.type != "cuda":
            return
        daemon, mine = session.mps
        if daemon is None or mine is None or daemon == mine:
            return
        self._mps_warned = True
        who = "gpufeedd's work goes through MPS and this process's does not" if daemon \
            else "this process's work goes through MPS and gpufeedd's does not"
        warnings.warn(
            f"gpufeed: on {self.device}, {who}: the daemon's kernels are time-sliced against "
            "training's instead of running beside them; start both under MPS (the same "
            "CUDA_MPS_PIPE_DIRECTORY) or neither (README, \"MPS\")", stacklevel=3)

    def _next(self, session: Session) -> Batch:
        self._check_process()
        try:
            self._make_room(session.info.ring_slots)
            core = session.next(timeout=self.timeout)
        except Exception:
            # The loader's own failure (a timeout, a full ring, the daemon gone): nothing was
            # yielded past the position, so the next iter() retries this batch.
            self._yielded = False
            raise
        try:
            batch, zero_copy = self._to_torch(core)
        except BaseException:
            # Not made (out of memory in a copy or a widening, an interrupt): not yielded, so
            # the position stays before it and the next iter() attaches anew to retry it.
            self._yielded = False
            raise
        # From the daemon's end-of-epoch mark: an epoch an elastic resume began mid-way may
        # have another number of steps than steps_per_epoch.
        self._position = core.after
        self._yielded = True
        if zero_copy:
            self._held.append(_Held(core.epoch, core.step, weakref.ref(batch),
                                    weakref.ref(core._lease),
                                    tuple(batch._slot_tensors.values()), batch._stream))
        return batch

    def _make_room(self, ring: int) -> None:
        """Leaves the daemon a slot for the next batch: when the batches still referenced fill
        the ring, moves the oldest one it can into owned memory; raises
        :class:`~gpufeed.ResourceExhausted` when none can be."""
        if self._own_held(ring - 1):
            return
        gc.collect()  # batches only reference cycles still reach
        if self._own_held(ring - 1):
            return
        raise ResourceExhausted(
            f"gpufeed.torch.Loader: every slot of the ring ({ring}) holds a batch you still "
            "reference through tensors or views taken out of it "
            f"({_describe(self._held)}), so the next batch has nowhere to go; drop those "
            "references (del, batch.release(), 'with batch:'), keep .clone()s, or pass "
            "copy=True or more ring_slots")

    def _own_held(self, most: int) -> bool:
        """Moves held batches, oldest first, into owned memory until at most ``most`` slots
        are held; whether that was reached. A batch whose tensors or views are referenced
        outside its dict stays as it is."""
        self._held = collections.deque(h for h in self._held if h.holds_slot())
        for held in list(self._held):
            if len(self._held) <= most:
                break
            batch = held.batch()
            if batch is not None and batch._own():
                self._held = collections.deque(h for h in self._held if h.holds_slot())
            del batch
        return len(self._held) <= most

    # ---- conversion ----

    def _to_torch(self, core: _CoreBatch) -> Tuple[Batch, bool]:
        """The batch as torch tensors; whether any of them still views the slot."""
        cuda = self.device.type == "cuda"
        stream = None
        if cuda:
            stream = torch.cuda.current_stream(self.device).cuda_stream
            core.wait_ready(stream)
            core._lease.stream = stream  # a release by garbage collection follows this stream
        out = Batch()
        in_place: Dict[str, "weakref.ref[torch.Tensor]"] = {}
        # One rank: the epoch's last batch is short, as a DataLoader's (drop_last=False), a
        # view of the slot's first rows. Several ranks keep every batch full (the daemon pads
        # by wrapping around, as DistributedSampler pads) and ``valid`` marks the real rows.
        rows = core.valid_count if self.world_size == 1 else core.batch_size
        made = self._carried(core, rows, cuda)
        if made is None:
            made = []
            for tensor in core.tensors.values():
                x, viewing = self._tensor(tensor, cuda)
                if rows < core.batch_size:
                    x = x[:rows]
                made.append((tensor.name, x, viewing))
        for name, x, viewing in made:
            if viewing and self.copy:
                x, viewing = x.clone(), False
            out[name] = x
            if viewing:
                in_place[name] = weakref.ref(x)
        del made  # with copy=True the views are garbage before the release below
        zero_copy = bool(in_place)
        if not self.drop_last:
            if cuda:
                out["valid"] = torch.arange(rows, device=self.device) < core.valid_count
            else:
                out["valid"] = torch.from_numpy(core.valid_mask()[:rows])
        out.epoch, out.step, out.ids, out.valid_count = (core.epoch, core.step, core.ids[:rows],
                                                         core.valid_count)
        if zero_copy:
            out._lease, out._slot_tensors = core._lease, in_place
            if cuda:
                out._stream = torch.cuda.current_stream(self.device)
        else:
            core.release(stream)  # every tensor is a copy: the slot can go back now
        return out, zero_copy

    def _carried(self, core: _CoreBatch, rows: int,
                 cuda: bool) -> Optional[List[Tuple[str, "torch.Tensor", bool]]]:
        """Host delivery: the batch's tensors, ``(name, tensor, whether it views the slot)``,
        each a view of ONE numpy ``uint8`` carrier over the bytes of the slot that they span
        (each tensor ``torch.from_numpy`` of a typed numpy view of it), so the carrier is
        made once a batch instead of once a tensor (a packed token batch has four).

        The span is one allocation: a slot's tensors lie at fixed offsets in it, the slot at
        ``base + slot * stride`` of the session's one mapped ring. Lifetime is the per-tensor
        path's: the carrier's buffer (a ctypes array) holds the batch's lease as an attribute,
        and every tensor made here keeps the carrier alive (the base of its numpy view), so the
        slot goes back only when none of them, nor any view of them, is referenced (or on an
        explicit release). The epoch's short last batch gets its first ``rows`` rows, as
        ``x[:rows]`` gives.

        None where the per-tensor path serves: device delivery (one carrier there too is the
        next step, not yet run on a GPU), no tensors, a tensor of no bytes, without a batch
        dimension or not in host memory."""
        if cuda:
            return None
        tensors = tuple(core.tensors.values())
        if not tensors:
            return None
        first = tensors[0]
        lo, hi = first.data_ptr, first.data_ptr + first.nbytes
        for t in tensors:
            start = t.data_ptr
            end = start + t.nbytes
            if end == start or not t.shape or t.device != "cpu":
                return None
            if start < lo:
                lo = start
            if end > hi:
                hi = end
        # The numpy carrier's buffer: a ctypes array over the span, holding the lease as a
        # _View does (an attribute): ~0.6 us to make and to free, against ~2.5 us for a
        # _View and numpy's parse of its __array_interface__. Writable: torch tensors are
        # writable whatever numpy says (a read-only array only earns a warning); the module
        # docs warn about writes. (ctypes keeps an array type for each length it was asked
        # for: a session's span is the same at every batch.)
        span = (ctypes.c_uint8 * (hi - lo)).from_address(lo)
        span._lease = core._lease
        carrier = np.frombuffer(span, np.uint8)
        made = []
        for t in tensors:
            carried = _CARRIED.get(t.dtype) or _carried_type(t)
            shape = t.shape
            if rows < shape[0]:
                shape = (rows,) + shape[1:]
            x = torch.from_numpy(np.ndarray(shape, carried.np_dtype, carrier, t.data_ptr - lo))
            if carried.target:
                x, viewing = self._typed(x, t)
                made.append((t.name, x, viewing))
            else:
                made.append((t.name, x, True))
        return made

    def _tensor(self, tensor: _CoreTensor, cuda: bool) -> Tuple["torch.Tensor", bool]:
        """One tensor in place, or widened (a copy); whether it views the slot."""
        carrier = _REINTERPRETED.get(tensor.dtype, (tensor.typestr, ""))[0]
        # torch tensors are writable whatever numpy says (a read-only array only earns a
        # warning), so the view is not flagged read-only; the module docs warn about writes.
        view = tensor.view(carrier, readonly=False)
        if cuda:
            x = torch.as_tensor(view, device=self.device)
        else:
            x = torch.from_numpy(np.asarray(view))
        return self._typed(x, tensor)

    def _typed(self, x: "torch.Tensor", tensor: _CoreTensor) -> Tuple["torch.Tensor", bool]:
        """``x``, the tensor's bits as its carrier type (:data:`_REINTERPRETED`), as its own
        type: ``x`` itself, reinterpreted in place, or widened (a copy); whether it views the
        slot."""
        target = _REINTERPRETED.get(tensor.dtype, ("", ""))[1]
        if not target:
            return x, True
        dtype = getattr(torch, target, None)
        if dtype is not None:
            try:
                return x.view(dtype), True
            except RuntimeError:
                pass
        if tensor.dtype not in _WIDENED:
            raise InvalidArgument(f"{tensor.name}: torch {torch.__version__} has no "
                                  f"{tensor.dtype}; read this dataset with gpufeed.Client")
        wide, mask = _WIDENED[tensor.dtype]
        if not self._widen_warned:
            self._widen_warned = True
            # _typed, _carried or _tensor, _to_torch, _next, _epoch: the caller's line.
            warnings.warn(f"gpufeed: torch {torch.__version__} has no {tensor.dtype}; "
                          f"'{tensor.name}' is widened to {wide} (a copy per batch)",
                          stacklevel=6)
        return x.to(wide).bitwise_and_(mask), False

    # ---- lifetime ----

    def close(self) -> None:
        """Detaches from the daemon (idempotent). Batches still held are moved into owned
        memory first; one whose tensors or views are referenced outside its dict keeps the
        session attached, and its slot unchanged, until they are garbage. Iterating again
        attaches anew."""
        session, self._session = self._session, None
        held, self._held = self._held, collections.deque()
        if session is None:
            return
        if os.getpid() == self._pid:  # a forked child leaves the parent's batches alone
            self._held = held
            try:
                self._own_held(0)
            finally:
                held, self._held = self._held, collections.deque()
            if held:
                _lingering((self._client.socket, self.job, self.rank))  # prunes
                _LINGERING.append(((self._client.socket, self.job, self.rank), list(held)))
                session._abandon()  # detached by the last of those batches
                return
        session.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        info = self._info  # never attaches
        shape = ("not attached" if info is None else
                 f"steps_per_epoch={info.steps_per_epoch}, ring_slots={info.ring_slots}")
        return (f"gpufeed.torch.Loader(rank={self.rank}/{self.world_size}, "
                f"device={self.device}, position={tuple(self._position)}, {shape})")


_AS_DATALOADER = ("DataLoader(loader.as_dataset(), batch_size=None, "
                  "collate_fn=gpufeed.torch.IterableDataset.collate)")


def _batched_again(what: str) -> InvalidArgument:
    return InvalidArgument(
        f"gpufeed.torch.IterableDataset: {what}: each item is already a whole batch of the "
        f"loader's batch_size, so torch would stack batches into [n, batch_size, ...] "
        f"tensors; use {_AS_DATALOADER}")


def _refuse_collating_batches(batches: Any, *, collate_fn_map: Any = None) -> Any:
    """torch's ``default_collate`` of :class:`Batch` items (registered below): refused."""
    raise _batched_again(f"default_collate of {len(batches)} gpufeed.torch.Batch items "
                         "(a DataLoader with a batch_size)")


# default_collate looks element types up in this registry first (torch >= 1.13), so a
# DataLoader batching our batches again stops with the message instead of stacking them.
_COLLATE_MAP = getattr(torch.utils.data._utils.collate, "default_collate_fn_map", None)
if isinstance(_COLLATE_MAP, dict):
    _COLLATE_MAP[Batch] = _refuse_collating_batches


def _dataloader_of(dataset: "IterableDataset") -> Optional["torch.utils.data.DataLoader"]:
    """The ``DataLoader`` that is iterating ``dataset`` in this thread, or None: found on
    the call stack, where ``DataLoader.__iter__`` and its iterator's constructor hold it as
    ``self`` / ``loader`` while the fetcher calls ``iter(dataset)``. The DataLoader tells
    the dataset nothing else: its batch_size and collate_fn are read here, so a
    configuration that would batch or rebuild our batches is refused before anything is
    fetched (and before the loader attaches)."""
    try:
        frame: Any = sys._getframe(2)
    except ValueError:  # called from the bottom of a thread's stack: no DataLoader there
        return None
    for _ in range(16):
        if frame is None:
            break
        for name in ("self", "loader"):
            value = frame.f_locals.get(name)
            if isinstance(value, torch.utils.data.DataLoader) and value.dataset is dataset:
                return value
        frame = frame.f_back
    return None


class IterableDataset(torch.utils.data.IterableDataset):
    """A :class:`Loader` as a ``torch.utils.data.IterableDataset``, for code that wants a
    ``DataLoader``::

        data = torch.utils.data.DataLoader(loader.as_dataset(), batch_size=None,
                                           collate_fn=gpufeed.torch.IterableDataset.collate)

    Iterating it iterates the loader itself (its position, epochs and ``set_epoch``): the same
    batches, in place, released as the loader releases them. Both arguments are required
    (:class:`~gpufeed.InvalidArgument` naming them otherwise, raised by the DataLoader's
    ``iter()``): ``batch_size=None`` because the items are whole batches already (torch's
    default, 1, would stack them into ``[1, batch_size, ...]``); ``collate_fn`` hands each
    :class:`Batch` through as it is (torch's default for ``batch_size=None``,
    ``default_convert``, rebuilds a mapping by iterating it, and a batch iterates its
    tensors). ``num_workers`` must be 0 (:class:`~gpufeed.InvalidArgument` otherwise):
    gpufeedd already reads, decodes and batches in its own threads, and each DataLoader
    worker would be one more consumer of this rank's stream.
    """

    def __init__(self, loader: Loader) -> None:
        if not isinstance(loader, Loader):
            raise InvalidArgument(f"IterableDataset: want a gpufeed.torch.Loader, got "
                                  f"{type(loader).__name__}")
        self.loader = loader
        """The loader it iterates."""

    @staticmethod
    def collate(batch: Batch) -> Batch:
        """The ``collate_fn`` that yields each :class:`Batch` unchanged."""
        if isinstance(batch, list):  # the DataLoader batches: items come as a list
            raise _batched_again(f"collate got a list of {len(batch)} batches (a DataLoader "
                                 "with a batch_size)")
        return batch

    def __iter__(self) -> Iterator[Batch]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            raise InvalidArgument(
                f"gpufeed.torch.IterableDataset: iterated in DataLoader worker {worker.id} of "
                f"{worker.num_workers}; pass num_workers=0: gpufeedd already reads, decodes "
                "and batches in its own workers, and each DataLoader worker would be another "
                "consumer of this rank's stream")
        data = _dataloader_of(self)
        if data is not None:
            if data.batch_size is not None:
                raise _batched_again(f"DataLoader(batch_size={data.batch_size})")
            if data.collate_fn is torch.utils.data._utils.collate.default_convert:
                raise InvalidArgument(
                    "gpufeed.torch.IterableDataset: DataLoader(batch_size=None) without a "
                    "collate_fn: torch's default_convert would rebuild each batch by "
                    "iterating it as a mapping (a batch iterates its tensors: images, labels "
                    f"= batch); use {_AS_DATALOADER}")
        return iter(self.loader)

    def __len__(self) -> int:
        """Batches per epoch (``len(loader)``)."""
        return len(self.loader)


__all__.append("IterableDataset")
