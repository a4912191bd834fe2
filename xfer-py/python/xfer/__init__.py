"""xfer: move non-contiguous (GPU) memory between processes and machines.

A thin layer over the Rust library (the ``xfer`` crate): an :class:`Engine` is one of its
agents. It registers memory (numpy arrays, bytearrays and other buffer-protocol objects,
or torch / cupy CUDA tensors), adds peers by address (its transport chosen per peer with
the default ``transport="auto"``: cuda-ipc between GPU memory of one host, efa, tcp), and
writes ranges or pages of its memory into a peer's registered memory, optionally with a
32-bit immediate value that the peer waits for with :meth:`Engine.wait_imm`. Every
blocking call releases the GIL. Addresses and descriptors are the library's metadata as
bytes: any Rust program of the library reads them.

>>> import numpy as np, xfer
>>> a, b = xfer.Engine(transport="mem"), xfer.Engine(transport="mem")
>>> src = np.arange(4096, dtype=np.uint8); dst = np.zeros(4096, dtype=np.uint8)
>>> rs, rd = a.register(src, remote_write=False), b.register(dst)
>>> p = a.add_peer(b.address)
>>> a.write(p, rs, rd.descriptor, [(0, 0, 4096)], imm=7).wait(timeout=5)
4096
>>> b.wait_imm(7, timeout=5); bool((dst == src).all())
True

The receiver's side: every write with immediate data is counted where it lands, per
sender and value, and never dropped however late the receiver looks.
:meth:`Engine.wait_imm` (a value and a count), :meth:`Engine.next_notification`
(one :class:`Notification`: ``sender``, ``value``, ``count``, and the ``message`` bytes a
sender attached with ``write(..., message=b"...")``),
:meth:`Engine.next_notification_async` (asyncio) and :meth:`Engine.notifications` (all
there is) take from the same counts, each arrival once. A peer's or registration of
another engine is refused with :class:`ForeignHandle`.

:mod:`xfer.weights` syncs a model's weights from trainer ranks to inference ranks laid out
another way (layouts, a static plan, pushes with immediate data per destination, pulls).
:mod:`xfer.kv` moves a request's paged KV cache from prefill ranks to decode ranks of
another shape, layer by layer (layouts from vLLM's and SGLang's tensors, request plans,
ranks, and classes with the calls of vLLM's KV connector and SGLang's sender/receiver).

Errors are subclasses of :class:`Error`, one per kind (``TimedOut`` and its
``PeerStalled``: a peer that stopped answering while its connection stands, with
``Engine(stall_timeout=...)``; ``PeerUnreachable``, ``PeerRemoved``, ``RemoteKeyInvalid``, ``OutOfBounds``,
``PermissionDenied``, ``InvalidArgument`` and its ``RegionInvalidated``: a registered torch
tensor whose storage was resized, ...), raised with the engine's message.
"""

from ._xfer import (  # noqa: F401
    Cancelled,
    Directory,
    DirectoryError,
    Engine,
    EngineClosed,
    Error,
    ForeignHandle,
    Following,
    Handle,
    InvalidArgument,
    Notification,
    OutOfBounds,
    Peer,
    PeerRemoved,
    PeerStalled,
    PeerUnreachable,
    PermissionDenied,
    Publication,
    Registration,
    RegionInUse,
    RegionInvalidated,
    Server,
    RemoteKeyInvalid,
    TimedOut,
    TransportFailed,
    Unsupported,
    Watch,
    __version__,
)
from . import kv, weights  # noqa: E402, F401

__all__ = [
    "Engine",
    "Directory",
    "Following",
    "Publication",
    "Watch",
    "DirectoryError",
    "Registration",
    "Peer",
    "Notification",
    "Server",
    "Handle",
    "Error",
    "TimedOut",
    "PeerStalled",
    "PeerUnreachable",
    "PeerRemoved",
    "RemoteKeyInvalid",
    "OutOfBounds",
    "PermissionDenied",
    "InvalidArgument",
    "ForeignHandle",
    "Cancelled",
    "EngineClosed",
    "RegionInUse",
    "RegionInvalidated",
    "Unsupported",
    "TransportFailed",
    "weights",
    "kv",
]
