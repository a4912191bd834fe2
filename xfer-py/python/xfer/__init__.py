"""xfer: move non-contiguous (GPU) memory between processes and machines.

A thin layer over the Rust library (the ``xfer`` crate), with its names: an
:class:`Agent` is one of its agents (Rust's ``xfer::Agent``), a :class:`Region` memory
registered with it, a :class:`Peer` another agent it is connected to, a :class:`Handle`
a submitted transfer and a :class:`Notification` arrivals of a peer's immediate data. An
agent registers memory (numpy arrays, bytearrays and other buffer-protocol objects, or
torch / cupy CUDA tensors), connects to peers by their info (its transport chosen per peer
with the default ``transport="auto"``: cuda-ipc between GPU memory of one host, efa, tcp),
and writes ranges or pages of its memory into a peer's registered memory, optionally with a
32-bit immediate value that the peer waits for with :meth:`Agent.wait_imm`. Every
blocking call releases the GIL. Infos and descriptors are the library's metadata as
bytes (``AgentInfo``, ``RegionDescriptor``): any Rust program of the library reads them.

>>> import numpy as np, xfer
>>> a, b = xfer.Agent(transport="mem"), xfer.Agent(transport="mem")
>>> src = np.arange(4096, dtype=np.uint8); dst = np.zeros(4096, dtype=np.uint8)
>>> rs, rd = a.register(src, remote_write=False), b.register(dst)
>>> p = a.connect(b.info)
>>> a.write(p, rs, rd.descriptor, [(0, 0, 4096)], imm=7).wait(timeout=5)
4096
>>> b.wait_imm(7, timeout=5); bool((dst == src).all())
True

The receiver's side: every write with immediate data is counted where it lands, per
sender and value, and never dropped however late the receiver looks.
:meth:`Agent.wait_imm` (a value and a count), :meth:`Agent.next_notification`
(one :class:`Notification`: ``sender``, ``imm``, ``count``, and the ``message`` bytes a
sender attached with ``write(..., message=b"...")``),
:meth:`Agent.next_notification_async` (asyncio) and :meth:`Agent.notifications` (all
there is) take from the same counts, each arrival once. A peer or region of another
agent is refused with :class:`ForeignHandle`.

:mod:`xfer.weights` syncs a model's weights from trainer ranks to inference ranks laid out
another way (layouts, a static plan, pushes with immediate data per destination, pulls).
:mod:`xfer.kv` moves a request's paged KV cache from prefill ranks to decode ranks of
another shape, layer by layer (layouts from vLLM's and SGLang's tensors, request plans,
ranks, and classes with the calls of vLLM's KV connector and SGLang's sender/receiver).

Errors are subclasses of :class:`Error`, one per kind (``TimedOut`` and its
``PeerStalled``: a peer that stopped answering while its connection stands, with
``Agent(stall_timeout=...)``; ``PeerUnreachable``, ``PeerRemoved``, ``RemoteKeyInvalid``,
``OutOfBounds``, ``PermissionDenied``, ``AgentClosed``, ``InvalidArgument`` and its
``RegionInvalidated``: a registered torch tensor whose storage was resized, ...), raised
with the library's message.

Old names, kept as deprecated aliases (each use warns ``DeprecationWarning``):
``xfer.Engine`` is :class:`Agent`, ``xfer.Registration`` is :class:`Region`,
``xfer.EngineClosed`` is :class:`AgentClosed` (the same class: ``except
xfer.EngineClosed`` catches it), ``Agent.add_peer(address)`` is :meth:`Agent.connect`,
``Agent.address`` is :attr:`Agent.info` and ``Notification.value`` is
:attr:`Notification.imm`.
"""

import warnings as _warnings

from ._xfer import (  # noqa: F401
    Agent,
    AgentClosed,
    Cancelled,
    Directory,
    DirectoryError,
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
    Region,
    RegionInUse,
    RegionInvalidated,
    RemoteKeyInvalid,
    Server,
    TimedOut,
    TransportFailed,
    Unsupported,
    Watch,
    __version__,
)
from . import kv, weights  # noqa: E402, F401

__all__ = [
    "Agent",
    "Region",
    "Peer",
    "Notification",
    "Server",
    "Handle",
    "Directory",
    "Following",
    "Publication",
    "Watch",
    "DirectoryError",
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
    "AgentClosed",
    "RegionInUse",
    "RegionInvalidated",
    "Unsupported",
    "TransportFailed",
    "weights",
    "kv",
]

# The package's old names, each the same object as the library's name for it. Not in
# __all__: `from xfer import *` gives the new names only.
_DEPRECATED = {
    "Engine": "Agent",
    "Registration": "Region",
    "EngineClosed": "AgentClosed",
}


def __getattr__(name: str):
    """``xfer.Engine``, ``xfer.Registration`` and ``xfer.EngineClosed``: the old names of
    :class:`Agent`, :class:`Region` and :class:`AgentClosed`, returned with a
    DeprecationWarning at the caller's line."""
    new = _DEPRECATED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _warnings.warn(
        f"xfer.{name} is deprecated: use xfer.{new}, the name the xfer library gives it",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
