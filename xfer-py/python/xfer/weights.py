"""Weight sync: a model's weights from M source ranks (trainers) to N destination ranks
(inference servers), each laid out its own way, over xfer agents.

A :class:`Layout` says what a rank holds of each tensor and where: every local tensor
(numpy array or torch tensor, registered with its agent) is a region, holding one or more
pieces of the model's tensors, each a box of the global index space (a tensor-parallel
split) or a flat range of its row-major order (an FSDP shard), packed in order (vLLM's
fused ``qkv_proj`` holds parts of ``q_proj``, ``k_proj`` and ``v_proj``).
:class:`LayoutBuilder` makes one from the local tensors. A :class:`Plan` is the static
schedule from source layouts to destination layouts, computed once. A :class:`Source`
pushes its share with one-sided writes, pipelined in chunks, and every destination learns
from immediate data that its whole update has landed (:meth:`Destination.wait`); a
:class:`Destination` may instead pull its share with reads (a replica joining mid-run, the
sources' code doing nothing). A destination that fails mid-update fails alone: the push
reports it with its exception, the others land, and ``push(version, destinations=[d])``
redoes it. Dtype conversion and FSDP gathering are the caller's: a push calls
``prepare(piece, tensor, region)`` before it sends a piece's first byte, where that work
would write the piece, so that it overlaps the sending of earlier pieces.

:class:`WeightSender` and :class:`WeightReceiver` put the calls in the order of vLLM's
weight-transfer engine (``init_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``, ``shutdown``), so that an adapter for it is a
few lines (see ``examples/weights_llama.py``).

An adapter for vLLM is the receiver's calls under its names (the trainer side attaches
each worker by ``info()`` and calls ``send_weights(version)``)::

    class XferWeightTransferEngine(WeightTransferEngine):
        def init_transfer_engine(self, init_info):
            self.r = WeightReceiver(xfer.Agent(memory="cuda"), builder_for(self.model), **init_info["sync"])
            self.r.init_transfer_engine(init_info)
        def start_weight_update(self): self.r.start_weight_update()
        def update_weights(self, update_info): self.r.update_weights(update_info)
        def finish_weight_update(self): self.r.finish_weight_update()
        def shutdown(self): self.r.shutdown()

>>> import numpy as np, xfer
>>> from xfer.weights import LayoutBuilder, Plan, Source, Destination, split, whole
>>> w = np.arange(24, dtype=np.uint16).reshape(4, 6)            # the model: one 4 x 6 tensor
>>> halves = [np.ascontiguousarray(w[2 * i : 2 * i + 2]) for i in range(2)]   # 2 sources: row halves
>>> def rows(i):
...     b = LayoutBuilder(); b.add("w", halves[i], [("w", (4, 6), split((4, 6), 0, 2, i))]); return b
>>> def whole_w(a):
...     b = LayoutBuilder(); b.add("w", a, [("w", (4, 6), whole((4, 6)))]); return b
>>> out = np.zeros((4, 6), dtype=np.uint16)                      # 1 destination: all of it
>>> src, dst = [rows(0), rows(1)], whole_w(out)
>>> plan = Plan([s.layout for s in src], [dst.layout])
>>> e = xfer.Agent(transport="mem")
>>> d = Destination(e, dst.layout, [e.register(a) for a in dst.objects], sources=2, rank=0)
>>> for i, s in enumerate(src):
...     se = xfer.Agent(transport="mem")
...     source = Source(se, plan, i, s.layout, [se.register(a, remote_write=False) for a in s.objects])
...     source.attach(0, se.connect(e.info), d.descriptors)
...     assert source.push(1)[0]["bytes"] > 0
>>> d.wait(1, timeout=10); bool((out == w).all())
True
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

from ._xfer import Destination, InvalidArgument, Layout, Plan, Source

__all__ = [
    "Layout",
    "Plan",
    "Source",
    "Destination",
    "LayoutBuilder",
    "Flat",
    "split",
    "whole",
    "flat_shard",
    "WeightSender",
    "WeightReceiver",
]


class Flat(NamedTuple):
    """Elements ``start..end`` of a tensor's row-major order (an FSDP/ZeRO flat shard)."""

    start: int
    end: int


Box = list[tuple[int, int]]


def _even(n: int, parts: int, index: int) -> tuple[int, int]:
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def whole(shape: Sequence[int]) -> Box:
    """The whole of a tensor of ``shape``, as a box."""
    return [(0, int(d)) for d in shape]


def split(shape: Sequence[int], dim: int, parts: int, index: int) -> Box:
    """Part ``index`` of ``parts`` of an even split of dimension ``dim`` (the first
    ``shape[dim] % parts`` parts one longer), as Megatron and vLLM split a tensor-parallel
    weight: a box."""
    if not 0 <= dim < len(shape) or not 0 <= index < parts:
        raise InvalidArgument(f"split of dimension {dim} of {tuple(shape)} into {parts}: part {index}")
    b = whole(shape)
    b[dim] = _even(int(shape[dim]), parts, index)
    return b


def flat_shard(numel: int, parts: int, index: int) -> Flat:
    """Shard ``index`` of ``parts`` of the flat range ``0..numel`` (the first
    ``numel % parts`` one longer), as FSDP shards a flattened tensor."""
    return Flat(*_even(numel, parts, index))


def _elements(holding: Box | Flat) -> int:
    if isinstance(holding, Flat):
        return holding.end - holding.start
    n = 1
    for s, e in holding:
        n *= e - s
    return n


def _nbytes_itemsize(obj: Any) -> tuple[int, int]:
    """(bytes, bytes per element) of a numpy array or torch tensor."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # torch
        return obj.numel() * obj.element_size(), obj.element_size()
    return int(obj.nbytes), int(obj.itemsize)


class LayoutBuilder:
    """Builds a rank's :class:`Layout` from its local tensors, each a region named after it
    (register ``objects`` in order and give the registrations to :class:`Source` or
    :class:`Destination`).

    ``add(name, obj, parts)``: the local tensor ``obj`` (numpy array or torch tensor,
    contiguous) holds ``parts``, each ``(global_name, global_shape, holding)`` with
    ``holding`` a box (:func:`split`, :func:`whole`) or a :class:`Flat` range, packed one
    after the other in that order; its bytes must be exactly theirs. The element size is
    ``obj``'s; a tensor's global shape and element size must agree wherever it appears.
    """

    def __init__(self) -> None:
        self.layout = Layout()
        self.objects: list[Any] = []
        self._tensors: dict[str, tuple[tuple[int, ...], int]] = {}

    def add(self, name: str, obj: Any, parts: Sequence[tuple[str, Sequence[int], Box | Flat]]) -> LayoutBuilder:
        nbytes, itemsize = _nbytes_itemsize(obj)
        region = self.layout.add_region(name, nbytes)
        offset = 0
        for tensor, shape, holding in parts:
            shape = tuple(int(d) for d in shape)
            known = self._tensors.get(tensor)
            if known is None:
                self.layout.add_tensor(tensor, list(shape), itemsize)
                self._tensors[tensor] = (shape, itemsize)
            elif known != (shape, itemsize):
                raise InvalidArgument(
                    f"tensor {tensor}: shape {shape} of {itemsize}-byte elements here, {known[0]} of {known[1]} before"
                )
            if isinstance(holding, Flat):
                self.layout.add_piece(tensor, region, offset, flat=(holding.start, holding.end))
            else:
                self.layout.add_piece(tensor, region, offset, box=[(int(s), int(e)) for s, e in holding])
            offset += _elements(holding) * itemsize
        if offset != nbytes:
            raise InvalidArgument(f"{name}: its parts are {offset} bytes, the tensor {nbytes}")
        self.objects.append(obj)
        return self


def _warn_engine(owner: str) -> None:
    """The DeprecationWarning of ``owner.engine``, the old name of ``owner.agent``, at the
    line that read it."""
    warnings.warn(f"{owner}.engine is deprecated: use {owner}.agent (an xfer.Agent)", DeprecationWarning, stacklevel=3)


class WeightSender:
    """A trainer rank's side of a weight sync: a :class:`Source` with the info receivers
    need and a ``send_weights`` call.

    agent: its xfer.Agent; plan: the :class:`Plan`; rank: its source rank; builder: its
    :class:`LayoutBuilder` (its objects are registered here, readable by pulling
    receivers); options: those of :class:`Source` (chunk_bytes, max_inflight_bytes,
    max_inflight_transfers, timeout).
    """

    def __init__(self, agent: Any, plan: Plan, rank: int, builder: LayoutBuilder, **options: Any) -> None:
        self.agent = agent
        self.rank = rank
        self.layout = builder.layout
        self.registrations = [agent.register(o, remote_write=False, remote_read=True) for o in builder.objects]
        self.source = Source(agent, plan, rank, self.layout, self.registrations, **options)

    @property
    def engine(self) -> Any:
        """Deprecated: the old name of :attr:`agent`."""
        _warn_engine("WeightSender")
        return self.agent

    def info(self) -> dict[str, Any]:
        """What a receiver needs to pull from this rank (``init_transfer_engine``'s
        ``{"sources": [...]}``)."""
        return {
            "rank": self.rank,
            "address": self.agent.info,
            "layout": self.layout.to_json(),
            "descriptors": [r.descriptor for r in self.registrations],
            "record": self.source.record,
        }

    def attach(self, receiver: dict[str, Any]) -> None:
        """Attaches a receiver by its :meth:`WeightReceiver.info` (a joiner gets its rank
        from ``add_destination`` first)."""
        peer = self.agent.connect(receiver["address"])
        self.source.attach(receiver["rank"], peer, receiver["descriptors"])

    def begin_update(self) -> None:
        """Call before the optimizer writes the weights: pulls meanwhile retry."""
        self.source.begin_update()

    def send_weights(self, version: int, destinations: list[int] | None = None, prepare: Any = None) -> dict[int, Exception]:
        """Pushes ``version`` (to ``destinations`` only, to redo them); returns the
        destinations that failed, each with its exception (empty: every one landed)."""
        report = self.source.push(version, destinations=destinations, prepare=prepare)
        return {d: r for d, r in report.items() if isinstance(r, Exception)}


class WeightReceiver:
    """An inference rank's side, in the call order of vLLM's weight-transfer engine:
    ``init_transfer_engine(init_info)`` once, then per update ``start_weight_update()``,
    ``update_weights(update_info)``, ``finish_weight_update()``; ``shutdown()`` at the end.

    agent, builder: as :class:`WeightSender`'s (objects registered writable here);
    sources: the number of trainer ranks; rank: its rank in the plan (None for a replica
    that joins later: senders plan it in with ``add_destination``, or it pulls).
    ``update_info``: ``{"version": V}`` waits until every source has pushed V;
    ``{"version": V or None, "mode": "pull"}`` reads the share from the sources given at
    init (``{"sources": [WeightSender.info(), ...]}``); ``"timeout"`` in seconds.
    """

    def __init__(self, agent: Any, builder: LayoutBuilder, sources: int, rank: int | None = None, **options: Any) -> None:
        self.agent = agent
        self.rank = rank
        self.layout = builder.layout
        self.registrations = [agent.register(o, remote_write=True) for o in builder.objects]
        self.destination = Destination(agent, self.layout, self.registrations, sources, rank, **options)
        self.version: int | None = None
        self._pending = False

    @property
    def engine(self) -> Any:
        """Deprecated: the old name of :attr:`agent`."""
        _warn_engine("WeightReceiver")
        return self.agent

    def info(self) -> dict[str, Any]:
        """What senders attach this rank with."""
        return {"rank": self.rank, "address": self.agent.info, "descriptors": self.destination.descriptors, "layout": self.layout.to_json()}

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        for s in init_info.get("sources", []):
            peer = self.agent.connect(s["address"])
            layout = Layout.from_json(s["layout"])
            self.destination.attach_source(s["rank"], peer, layout, s["descriptors"], s["record"])

    def start_weight_update(self) -> None:
        self._pending = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        timeout = update_info.get("timeout", 600.0)
        if update_info.get("mode", "push") == "pull":
            self.version = self.destination.pull(update_info.get("version"), timeout=timeout)
        else:
            self.destination.wait(update_info["version"], timeout=timeout)
            self.version = update_info["version"]

    def finish_weight_update(self) -> int | None:
        """The version now in the weights."""
        self._pending = False
        return self.version

    def shutdown(self) -> None:
        for r in self.registrations:
            r.close()
