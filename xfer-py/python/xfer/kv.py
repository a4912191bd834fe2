"""xfer.kv: a request's KV cache moved between prefill and decode servers of different
shapes, layer by layer, pushed by prefill or pulled by decode.

The pieces, from the bottom up:

- :class:`Layout` (made from a :class:`Model` by the constructors of vLLM's and SGLang's
  caches, or from the inference engine's tensors by :func:`layout_from_vllm`,
  :func:`layout_from_sglang` and :func:`layout_from_sglang_mla`) says how one rank's
  paged cache lies in memory and which KV heads it holds (:func:`heads_for_rank`: a TP
  split, a replica when KV heads < TP, MLA's latent held by all).
- :class:`Request`: the tokens and both sides' block tables; :func:`plan` (or
  :meth:`Rank.plan`) gives its :class:`Plan`, a handful of strided runs per rank pair,
  the same for every layer (``Plan.stats()`` counts them against a per-block path);
  :func:`check` proves a plan.
- :class:`Rank`: one rank's end over an :class:`xfer.Agent`. Prefill
  ``push_layer(request_id, plan, layer, stream=)`` as each layer is saved (the transfers
  wait for the stream's work: a layer's kernels, not the whole model), decode
  ``wait``/``wait_layer``/``poll`` from notifications that carry the request; or decode
  ``pull``/``pull_layer`` and prefill ``wait`` to learn that its blocks are free. A failed
  transfer raises its cause's class (``PeerUnreachable``, ...) naming the request.
- :class:`KvWorker`: the worker-side calls of vLLM's ``KVConnectorBase_V1``
  (``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
  ``wait_for_save``, ``get_finished``) driven by :class:`ConnectorMetadata` of
  :class:`ReqMeta`; :class:`KvManager`, :class:`KVSender` and :class:`KVReceiver` the
  calls of SGLang's ``BaseKVSender``/``BaseKVReceiver`` (``init``, ``send``, ``poll`` with
  :class:`KVPoll`, ``failure_exception``). Adapters that subclass the real base classes
  are a few lines: ``examples/vllm_connector.py``, ``examples/sglang_connector.py``.

``examples/kv_disagg.py`` puts it together: prefill TP 2 -> decode TP 4 and TP 4 -> 1 as
processes, Llama-3-8B and DeepSeek-V3 (MLA) caches, layers pushed as computed, every
decode byte checked.

>>> import numpy as np, xfer
>>> from xfer import kv
>>> m = kv.Model(num_layers=2, kv_heads=4, head_dim=8, elem_size=2)
>>> lay = lambda tp, r, nb: kv.Layout.vllm_flash_attn(m, kv.heads_for_rank(4, tp, r), nb, 4)
>>> pre, dec = [lay(1, 0, 8)], [lay(2, 0, 6), lay(2, 1, 6)]
>>> p = kv.plan(pre, dec, kv.Request(10, [5, 2, 7], [0, 1, 2]))
>>> p.pairs, p.stats()["transfers"]
([(0, 0), (0, 1)], 24)
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ._xfer import Error, InvalidArgument, TimedOut
from ._xfer import kv as _kv

Model = _kv.Model
Layout = _kv.Layout
Request = _kv.Request
Plan = _kv.Plan
Rank = _kv.Rank
Transfers = _kv.Transfers
Event = _kv.Event
heads_for_rank = _kv.heads_for_rank
plan = _kv.plan
check = _kv.check
rank_info = _kv.rank_info
read_info = _kv.read_info

__all__ = [
    "Model",
    "Layout",
    "Request",
    "Plan",
    "Rank",
    "Transfers",
    "Event",
    "heads_for_rank",
    "plan",
    "check",
    "rank_info",
    "read_info",
    "Cache",
    "cache_from_vllm",
    "cache_from_sglang",
    "cache_from_sglang_mla",
    "layout_from_vllm",
    "layout_from_sglang",
    "layout_from_sglang_mla",
    "side_layouts",
    "ReqMeta",
    "ConnectorMetadata",
    "KvWorker",
    "KVPoll",
    "KvManager",
    "LocalBootstrap",
    "KVSender",
    "KVReceiver",
]


# --- layouts from tensors -------------------------------------------------------------


class Cache(NamedTuple):
    """A rank's cache as found in an inference engine's tensors: its :class:`Layout`, the objects
    holding its regions (by region index, each a contiguous view in memory order, what
    :class:`Rank` registers) and the layers' names (in layer order)."""

    layout: Layout
    regions: list[Any]
    layer_names: list[str]


class _Meta(NamedTuple):
    shape: tuple[int, ...]
    itemsize: int
    strides: tuple[int, ...]  # bytes
    dtype: str


def _meta(t: Any, what: str) -> _Meta:
    """Shape, item size, byte strides and dtype of a numpy array or torch tensor."""
    if hasattr(t, "element_size") and callable(getattr(t, "stride", None)):  # torch
        item = int(t.element_size())
        return _Meta(tuple(int(d) for d in t.shape), item, tuple(int(s) * item for s in t.stride()), str(t.dtype))
    if hasattr(t, "strides") and hasattr(t, "itemsize") and hasattr(t, "shape"):  # numpy
        return _Meta(tuple(int(d) for d in t.shape), int(t.itemsize), tuple(int(s) for s in t.strides), str(t.dtype))
    raise InvalidArgument(f"{what}: a {type(t).__name__} is neither a torch tensor nor a numpy array")


def _dense(shape: Sequence[int], itemsize: int, order: Sequence[int]) -> tuple[int, ...]:
    """Byte strides of a tensor of ``shape`` whose memory holds its dimensions in ``order``
    (outermost first), densely."""
    strides = [0] * len(shape)
    step = itemsize
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def _same_strides(m: _Meta, want: tuple[int, ...]) -> bool:
    return all(d == 1 or s == w for d, s, w in zip(m.shape, m.strides, want, strict=True))


def _permute(t: Any, order: Sequence[int]) -> Any:
    """``t`` with its dimensions in ``order`` (a view: torch ``permute``, numpy
    ``transpose``)."""
    if list(order) == list(range(len(order))):
        return t
    if hasattr(t, "permute"):
        return t.permute(*order)
    return t.transpose(order)


def _layers(caches: Any, what: str) -> tuple[list[str], list[Any]]:
    """(names, tensors) of a per-layer dict (in its order) or list."""
    if isinstance(caches, Mapping):
        names, tensors = [str(k) for k in caches], list(caches.values())
    elif isinstance(caches, Sequence):
        tensors = list(caches)
        names = [str(i) for i in range(len(tensors))]
    else:
        raise InvalidArgument(f"{what}: expected a dict of layer name -> tensor, or a list of tensors, one per layer")
    if not tensors:
        raise InvalidArgument(f"{what}: no layers")
    return names, tensors


def _uniform(tensors: Sequence[Any], names: Sequence[str], what: str) -> _Meta:
    """The tensors' common shape, dtype and strides, or InvalidArgument naming the first
    layer that differs."""
    first = _meta(tensors[0], f"{what}[{names[0]!r}]")
    for n, t in zip(names[1:], tensors[1:], strict=True):
        m = _meta(t, f"{what}[{n!r}]")
        if m != first:
            raise InvalidArgument(
                f"{what}[{n!r}] is {m.dtype} {m.shape} with strides {m.strides}, layer "
                f"{names[0]!r} {first.dtype} {first.shape} with strides {first.strides}: every layer's "
                "cache must be alike"
            )
    return first


def _heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    return heads_for_rank(int(num_kv_heads), int(tp_size), int(tp_rank))


def _want_heads(found: int, heads: tuple[int, int], num_kv_heads: int, tp_size: int, what: str) -> None:
    if found != heads[1] - heads[0]:
        raise InvalidArgument(
            f"{what}: the tensors hold {found} KV heads, and a TP rank of {tp_size} of a model of "
            f"{num_kv_heads} KV heads holds {heads[1] - heads[0]} (heads {heads[0]}..{heads[1]}): check "
            "num_kv_heads, tp_size and the tensors' shape"
        )


def cache_from_vllm(
    kv_caches: Any,
    num_kv_heads: int,
    tp_size: int,
    tp_rank: int,
    backend: str = "flash_attn",
    kv_layout: str = "NHD",
) -> Cache:
    """The :class:`Cache` of vLLM's per-layer ``kv_caches`` (a dict of layer name ->
    tensor, as ``register_kv_caches`` gets it, or a list), torch tensors or numpy arrays.

    backend "flash_attn": each ``(2, num_blocks, block_size, heads, head_dim)``,
    contiguous (NHD only). "flashinfer": each ``(num_blocks, 2, block_size, heads,
    head_dim)``; kv_layout "NHD" is that order in memory (contiguous), "HND" the memory
    order ``(num_blocks, 2, heads, block_size, head_dim)`` (vLLM hands out the permuted
    view: its strides must say so). "mla": each ``(num_blocks, block_size, latent)``,
    contiguous, held by every rank (num_kv_heads is ignored). The heads a rank holds are
    :func:`heads_for_rank` ``(num_kv_heads, tp_size, tp_rank)``, and must be the tensors'.
    Shapes, dtypes and strides that do not say so are refused with InvalidArgument.
    """
    what = "kv_caches"
    names, tensors = _layers(kv_caches, what)
    m = _uniform(tensors, names, what)
    layers = len(tensors)
    if backend == "mla":
        if len(m.shape) != 3:
            raise InvalidArgument(f"{what}: an MLA cache is (num_blocks, block_size, latent) per layer, not {m.shape}")
        if not _same_strides(m, _dense(m.shape, m.itemsize, range(3))):
            raise InvalidArgument(f"{what}: the MLA cache is not contiguous (strides {m.strides})")
        nb, bs, latent = m.shape
        layout = Layout.vllm_mla(Model.mla(layers, latent, m.itemsize), nb, bs)
        return Cache(layout, list(tensors), names)
    if len(m.shape) != 5:
        raise InvalidArgument(f"{what}: a {backend} cache has 5 dimensions per layer, these have shape {m.shape}")
    heads = _heads(num_kv_heads, tp_size, tp_rank)
    if backend == "flash_attn":
        if kv_layout != "NHD":
            raise InvalidArgument(f"kv_layout={kv_layout!r}: vLLM's FlashAttention cache is NHD (use backend='flashinfer' for HND)")
        two, nb, bs, h, d = m.shape
        if two != 2:
            raise InvalidArgument(f"{what}: a flash_attn cache is (2, num_blocks, block_size, heads, head_dim), not {m.shape}")
        if not _same_strides(m, _dense(m.shape, m.itemsize, range(5))):
            raise InvalidArgument(f"{what}: the flash_attn cache is not contiguous (strides {m.strides})")
        _want_heads(h, heads, num_kv_heads, tp_size, what)
        layout = Layout.vllm_flash_attn(Model(layers, num_kv_heads, d, m.itemsize), heads, nb, bs)
        return Cache(layout, list(tensors), names)
    if backend != "flashinfer":
        raise InvalidArgument(f"backend={backend!r}: expected 'flash_attn', 'flashinfer' or 'mla'")
    nb, two, bs, h, d = m.shape
    if two != 2:
        raise InvalidArgument(f"{what}: a flashinfer cache is (num_blocks, 2, block_size, heads, head_dim), not {m.shape}")
    _want_heads(h, heads, num_kv_heads, tp_size, what)
    orders = {"NHD": (0, 1, 2, 3, 4), "HND": (0, 1, 3, 2, 4)}
    if kv_layout not in orders:
        raise InvalidArgument(f"kv_layout={kv_layout!r}: expected 'NHD' or 'HND'")
    order = orders[kv_layout]
    if not _same_strides(m, _dense(m.shape, m.itemsize, order)):
        other = "HND" if kv_layout == "NHD" else "NHD"
        hint = f" (they are {other}'s: pass kv_layout={other!r})" if _same_strides(m, _dense(m.shape, m.itemsize, orders[other])) else ""
        raise InvalidArgument(
            f"{what}: strides {m.strides} are not those of a dense {kv_layout} flashinfer cache of shape {m.shape}{hint}"
        )
    layout = Layout.vllm_flashinfer(Model(layers, num_kv_heads, d, m.itemsize), heads, nb, bs, order=kv_layout)
    return Cache(layout, [_permute(t, order) for t in tensors], names)


def cache_from_sglang(
    k_buffers: Sequence[Any],
    v_buffers: Sequence[Any],
    page_size: int,
    num_kv_heads: int,
    tp_size: int,
    tp_rank: int,
) -> Cache:
    """The :class:`Cache` of SGLang's MHA pool: per layer a K and a V buffer, each
    ``(num_pages * page_size, heads, head_dim)`` contiguous (its padding page included;
    block ids are page indices). Regions are K0, V0, K1, V1, ..."""
    if len(k_buffers) != len(v_buffers) or not k_buffers:
        raise InvalidArgument(f"{len(k_buffers)} K buffers and {len(v_buffers)} V buffers: give one of each per layer")
    all_ = [t for kv in zip(k_buffers, v_buffers, strict=True) for t in kv]
    names = [f"{c}{i}" for i in range(len(k_buffers)) for c in "kv"]
    m = _uniform(all_, names, "k_buffers/v_buffers")
    if len(m.shape) != 3:
        raise InvalidArgument(f"an SGLang buffer is (tokens, heads, head_dim), not {m.shape}")
    if not _same_strides(m, _dense(m.shape, m.itemsize, range(3))):
        raise InvalidArgument(f"the SGLang buffers are not contiguous (strides {m.strides})")
    tokens, h, d = m.shape
    if page_size <= 0 or tokens % page_size:
        raise InvalidArgument(f"page_size={page_size}: the buffers' {tokens} token slots are not whole pages of it")
    heads = _heads(num_kv_heads, tp_size, tp_rank)
    _want_heads(h, heads, num_kv_heads, tp_size, "k_buffers")
    layout = Layout.sglang_mha(Model(len(k_buffers), num_kv_heads, d, m.itemsize), heads, tokens // page_size, page_size)
    return Cache(layout, all_, [str(i) for i in range(len(k_buffers))])


def cache_from_sglang_mla(kv_buffers: Sequence[Any], page_size: int) -> Cache:
    """The :class:`Cache` of SGLang's MLA pool: per layer ``(num_pages * page_size, 1,
    latent)`` contiguous, held by every rank."""
    names, tensors = _layers(list(kv_buffers), "kv_buffers")
    m = _uniform(tensors, names, "kv_buffers")
    if len(m.shape) != 3 or m.shape[1] != 1:
        raise InvalidArgument(f"an SGLang MLA buffer is (tokens, 1, latent), not {m.shape}")
    if not _same_strides(m, _dense(m.shape, m.itemsize, range(3))):
        raise InvalidArgument(f"the SGLang MLA buffers are not contiguous (strides {m.strides})")
    tokens, _, latent = m.shape
    if page_size <= 0 or tokens % page_size:
        raise InvalidArgument(f"page_size={page_size}: the buffers' {tokens} token slots are not whole pages of it")
    layout = Layout.sglang_mla(Model.mla(len(tensors), latent, m.itemsize), tokens // page_size, page_size)
    return Cache(layout, tensors, names)


def layout_from_vllm(kv_caches: Any, num_kv_heads: int, tp_size: int, tp_rank: int, backend: str = "flash_attn", kv_layout: str = "NHD") -> Layout:
    """The :class:`Layout` of vLLM's ``kv_caches`` (see :func:`cache_from_vllm`)."""
    return cache_from_vllm(kv_caches, num_kv_heads, tp_size, tp_rank, backend, kv_layout).layout


def layout_from_sglang(k_buffers: Sequence[Any], v_buffers: Sequence[Any], page_size: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> Layout:
    """The :class:`Layout` of SGLang's MHA pool (see :func:`cache_from_sglang`)."""
    return cache_from_sglang(k_buffers, v_buffers, page_size, num_kv_heads, tp_size, tp_rank).layout


def layout_from_sglang_mla(kv_buffers: Sequence[Any], page_size: int) -> Layout:
    """The :class:`Layout` of SGLang's MLA pool (see :func:`cache_from_sglang_mla`)."""
    return cache_from_sglang_mla(kv_buffers, page_size).layout


def side_layouts(layout: Layout, tp_size: int) -> list[Layout]:
    """Every rank's layout of a TP group of ``tp_size`` whose ranks' caches are alike
    (as an inference engine allocates them), from one rank's: the same geometry, each
    rank's heads."""
    return [layout.with_heads(heads_for_rank(layout.total_heads, tp_size, r)) for r in range(tp_size)]


def _register(agent: Any, side: str, objs: Sequence[Any]) -> list[Any]:
    """Regions of a rank's cache, registered with the access its side needs."""
    if side not in ("prefill", "decode"):
        raise InvalidArgument(f"side={side!r}: expected 'prefill' or 'decode'")
    if side == "prefill":
        return [agent.register(o, remote_write=False, remote_read=True) for o in objs]
    return [agent.register(o, remote_write=True) for o in objs]


def _warn_engine(owner: str) -> None:
    """The DeprecationWarning of ``owner.engine``, the old name of ``owner.agent``, at the
    line that read it."""
    warnings.warn(f"{owner}.engine is deprecated: use {owner}.agent (an xfer.Agent)", DeprecationWarning, stacklevel=3)


class _Attached:
    """A rank's :class:`Rank`, made once the other side's layouts are known (from their
    infos), and the infos attached so far."""

    def __init__(self, agent: Any, side: str, rank: int, layout: Layout, tp_size: int, registrations: list[Any]) -> None:
        self.agent, self.side, self.rank_index = agent, side, rank
        self.own = side_layouts(layout, tp_size)
        self.registrations = registrations
        self.rank: Rank | None = None
        self.other: list[Layout] = []
        self.attached: set[bytes] = set()
        self.lock = threading.Lock()

    def info(self) -> bytes:
        return rank_info(self.agent, self.side, self.rank_index, self.own[self.rank_index], self.registrations)

    def connect(self, peers: Sequence[bytes]) -> Rank:
        """The rank, attached to every info of ``peers`` (the other side's ranks, all of
        them the first time)."""
        with self.lock:
            if self.rank is None:
                other_side = "decode" if self.side == "prefill" else "prefill"
                found: dict[int, Layout] = {}
                for p in peers:
                    side, r, layout = read_info(bytes(p))
                    if side != other_side:
                        raise InvalidArgument(f"a {side} rank's info was given to a {self.side} rank: give the {other_side} ranks'")
                    found[r] = layout
                if not found or sorted(found) != list(range(len(found))):
                    raise InvalidArgument(f"the {other_side} ranks' infos cover ranks {sorted(found)}: give every rank's, 0..n-1")
                other = [found[r] for r in range(len(found))]
                self.other = other
                pre, dec = (self.own, other) if self.side == "prefill" else (other, self.own)
                self.rank = Rank(self.agent, self.side, self.rank_index, self.registrations, pre, dec)
            for p in peers:
                p = bytes(p)
                if p not in self.attached:
                    self.rank.attach(p)
                    self.attached.add(p)
            return self.rank


# --- vLLM's KV connector, worker side -----------------------------------------------------


@dataclasses.dataclass
class ReqMeta:
    """What a worker needs of one request (the scheduler side's per-request metadata).

    request_id: the request (str or bytes; every rank of both sides uses the same);
    num_tokens: tokens to move (from token 0); prefill_blocks, decode_blocks: each side's
    block table (shared by the side's ranks, or one per rank); mode: "push" (prefill
    writes each layer as it is saved) or "pull" (decode reads, as vLLM's NIXL connector
    does); peers: the other side's ranks' infos (:meth:`KvWorker.info` of each, all
    ranks).
    """

    request_id: str | bytes
    num_tokens: int
    prefill_blocks: list[int] | list[list[int]]
    decode_blocks: list[int] | list[list[int]]
    mode: str = "push"
    peers: list[bytes] = dataclasses.field(default_factory=list)

    def request(self) -> Request:
        return Request(self.num_tokens, self.prefill_blocks, self.decode_blocks)


@dataclasses.dataclass
class ConnectorMetadata:
    """One step's metadata, built by the scheduler (``build_connector_meta``) and given to
    every worker: on prefill the requests to save in this step, on decode the requests to
    load."""

    requests: list[ReqMeta] = dataclasses.field(default_factory=list)

    def add(self, req: ReqMeta) -> None:
        self.requests.append(req)


@dataclasses.dataclass
class _Job:
    meta: ReqMeta
    plan: Plan
    transfers: Transfers | None = None
    layers: list[Transfers] | None = None  # a pull's per layer
    failure: BaseException | None = None
    pushed: set[int] = dataclasses.field(default_factory=set)  # a push's layers


class KvWorker:
    """The worker side of a KV connector in the calls of vLLM's ``KVConnectorBase_V1``.

    agent: this worker's xfer.Agent (one per GPU worker); side: "prefill" (vLLM's
    kv_producer) or "decode" (kv_consumer); tp_rank, tp_size: its place in its TP group;
    num_kv_heads: the model's; backend, kv_layout: of its cache (see
    :func:`cache_from_vllm`); timeout: seconds a layer wait may take; layerwise: whether
    decode's ``wait_for_layer_load`` waits for each layer of the step's requests (the
    forward then runs as layers land); False: loads are asynchronous, the scheduler runs a
    request only after ``get_finished`` reported it.

    Call order: ``register_kv_caches`` once, then :meth:`info` goes to the other side's
    scheduler (into :class:`ReqMeta.peers`). Per step: ``start_load_kv(metadata)``; on
    prefill ``save_kv_layer`` after each attention layer (a push of the layer after the
    current stream's work), ``wait_for_save``; on decode ``wait_for_layer_load``; then
    ``get_finished``. Failed requests are kept in :attr:`failures` (and reported finished:
    nothing touches their blocks any more), their decode blocks in
    ``get_block_ids_with_load_errors``.
    """

    def __init__(
        self,
        agent: Any,
        side: str,
        tp_rank: int,
        tp_size: int,
        num_kv_heads: int,
        backend: str = "flash_attn",
        kv_layout: str = "NHD",
        timeout: float = 60.0,
        layerwise: bool = True,
    ) -> None:
        if side not in ("prefill", "decode"):
            raise InvalidArgument(f"side={side!r}: expected 'prefill' or 'decode'")
        self.agent, self.side = agent, side
        self.tp_rank, self.tp_size, self.num_kv_heads = tp_rank, tp_size, num_kv_heads
        self.backend, self.kv_layout = backend, kv_layout
        self.timeout, self.layerwise = timeout, layerwise
        self.cache: Cache | None = None
        self.layer_index: dict[str, int] = {}
        self._ends: _Attached | None = None
        self._jobs: dict[bytes, _Job] = {}
        self._step: list[bytes] = []
        self._landed: set[bytes] = set()
        self.failures: dict[bytes, BaseException] = {}
        self._load_errors: set[int] = set()

    @property
    def engine(self) -> Any:
        """Deprecated: the old name of :attr:`agent`."""
        _warn_engine("KvWorker")
        return self.agent

    @staticmethod
    def _key(request_id: str | bytes) -> bytes:
        return request_id.encode() if isinstance(request_id, str) else bytes(request_id)

    def register_kv_caches(self, kv_caches: Any) -> None:
        """Takes the inference engine's per-layer caches (registered with the agent here)."""
        self.cache = cache_from_vllm(kv_caches, self.num_kv_heads, self.tp_size, self.tp_rank, self.backend, self.kv_layout)
        self.layer_index = {n: i for i, n in enumerate(self.cache.layer_names)}
        regs = _register(self.agent, self.side, self.cache.regions)
        self._ends = _Attached(self.agent, self.side, self.tp_rank, self.cache.layout, self.tp_size, regs)

    def _need(self) -> _Attached:
        if self._ends is None:
            raise InvalidArgument("register_kv_caches first")
        return self._ends

    def info(self) -> bytes:
        """What the other side's workers attach this one with (into ReqMeta.peers)."""
        return self._need().info()

    @property
    def rank(self) -> Rank | None:
        """The :class:`Rank`, once the first request named the other side's ranks."""
        return self._need().rank

    def _layer(self, layer_name: str) -> int:
        try:
            return self.layer_index[layer_name]
        except KeyError:
            raise InvalidArgument(f"layer {layer_name!r} is not one of the registered kv_caches") from None

    def _fail(self, key: bytes, job: _Job, e: BaseException) -> None:
        if job.failure is None:
            job.failure = e
            if self.side == "decode":
                req = job.meta.request()
                tables = req.decode_blocks
                table = tables[0] if len(tables) == 1 else tables[self.tp_rank]
                layout = self._need().own[self.tp_rank]
                used = -(-job.meta.num_tokens // layout.block_size)
                self._load_errors.update(table[:used])

    def start_load_kv(self, metadata: ConnectorMetadata, **kwargs: Any) -> None:
        """Takes the step's requests. Decode: starts the pulls (pull mode) or waits for the
        pushes (push mode); prefill: plans the requests to save (push) or to be read
        (pull)."""
        ends = self._need()
        self._step = []
        for m in metadata.requests:
            key = self._key(m.request_id)
            if m.mode not in ("push", "pull"):
                raise InvalidArgument(f"request {m.request_id!r}: mode={m.mode!r}, expected 'push' or 'pull'")
            rank = ends.connect(m.peers)
            job = _Job(m, rank.plan(m.request()))
            self._jobs[key] = job
            self._step.append(key)
            if self.side == "decode" and m.mode == "pull":
                try:
                    if self.layerwise:
                        job.layers = [rank.pull_layer(key, job.plan, layer) for layer in range(rank.layers)]
                    else:
                        job.transfers = rank.pull(key, job.plan)
                except Error as e:
                    self._fail(key, job, e)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Decode: blocks until layer ``layer_name`` of the step's requests has landed (when
        ``layerwise``); a request that fails or times out is recorded, not raised."""
        if self.side != "decode" or not self.layerwise:
            return
        layer = self._layer(layer_name)
        rank = self._need().rank
        for key in self._step:
            job = self._jobs.get(key)
            if job is None or job.failure is not None or rank is None:
                continue
            try:
                if job.meta.mode == "pull":
                    assert job.layers is not None
                    job.layers[layer].wait(self.timeout)
                else:
                    rank.wait_layer(key, layer, self.timeout)
            except Error as e:
                self._fail(key, job, e)

    def save_kv_layer(self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any) -> None:
        """Prefill: pushes layer ``layer_name`` of the step's push-mode requests, after the
        work queued on the current stream (the layer's kernels)."""
        if self.side != "prefill":
            return
        layer = self._layer(layer_name)
        rank = self._need().rank
        for key in self._step:
            job = self._jobs.get(key)
            if job is None or job.meta.mode != "push" or job.failure is not None or rank is None:
                continue
            try:
                t = rank.push_layer(key, job.plan, layer)
            except Error as e:
                self._fail(key, job, e)
                continue
            job.pushed.add(layer)
            if job.transfers is None:
                job.transfers = t
            else:
                job.transfers.extend(t)

    def wait_for_save(self) -> None:
        """Prefill: returns at once; the pushes go on, and a request's blocks are reported
        free by ``get_finished`` once every push of it has finished."""

    def _drain(self) -> None:
        rank = self._need().rank
        if rank is None:
            return
        for ev in rank.poll():
            if ev.layer is None:
                self._landed.add(bytes(ev.request))

    def _finished(self, key: bytes, job: _Job) -> bool:
        """Whether nothing of the request moves any more (recording a failure)."""
        if job.failure is not None:
            ts = [job.transfers] if job.transfers is not None else list(job.layers or [])
            return all(t.done() for t in ts)
        me = self.tp_rank
        if self.side == "prefill":
            if not job.plan.sends(me):
                return True
            if job.meta.mode == "pull":
                return key in self._landed
            if len(job.pushed) < job.plan.num_layers:
                return False
        else:
            if job.meta.mode == "push":
                return key in self._landed
        ts = [job.transfers] if job.transfers is not None else list(job.layers or [])
        if not all(t.done() for t in ts):
            return False
        for t in ts:
            try:
                t.wait(0)
            except Error as e:
                self._fail(key, job, e)
        return True

    def get_finished(self, finished_req_ids: set[Any] | None = None) -> tuple[set[Any], set[Any]]:
        """(finished_sending, finished_recving): the request ids (as given in ReqMeta)
        whose transfers have all finished here (sent or read on prefill, landed on
        decode), or failed (see :attr:`failures`); each reported once."""
        self._drain()
        sending, recving = set(), set()
        for key, job in list(self._jobs.items()):
            if not self._finished(key, job):
                continue
            if job.failure is not None:
                self.failures[key] = job.failure
            (sending if self.side == "prefill" else recving).add(job.meta.request_id)
            del self._jobs[key]
            self._landed.discard(key)
            if self._ends is not None and self._ends.rank is not None:
                self._ends.rank.forget(key)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Decode blocks of requests whose load failed, taken once."""
        out, self._load_errors = self._load_errors, set()
        return out


# --- SGLang's sender and receiver ----------------------------------------------------------


class KVPoll(enum.IntEnum):
    """The states of SGLang's ``KVPoll``."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class LocalBootstrap:
    """Where a receiver leaves its request's decode pages for the senders (SGLang's
    bootstrap server does this between processes; an adapter gives its own object with
    the same ``put``/``get``). This one works within a process."""

    def __init__(self) -> None:
        self._rooms: dict[Any, tuple[list[int], int | None]] = {}
        self._lock = threading.Lock()

    def put(self, room: Any, decode_pages: Sequence[int], num_tokens: int | None = None) -> None:
        with self._lock:
            self._rooms[room] = ([int(p) for p in decode_pages], num_tokens)

    def get(self, room: Any) -> tuple[list[int], int | None] | None:
        with self._lock:
            return self._rooms.get(room)


class KvManager:
    """One rank's KV end for SGLang-shaped senders and receivers (SGLang's ``KVManager``).

    agent: its xfer.Agent; side: "prefill" or "decode"; rank, tp_size: its TP place;
    cache: its :class:`Cache` (:func:`cache_from_sglang` or :func:`cache_from_sglang_mla`);
    bootstrap: where receivers leave pages for senders (:class:`LocalBootstrap` by
    default); timeout: seconds a request may take before it fails. ``info()`` goes to the
    other side, whose ``connect([infos])`` attaches it.
    """

    def __init__(self, agent: Any, side: str, rank: int, tp_size: int, cache: Cache, bootstrap: Any = None, timeout: float = 60.0) -> None:
        self.agent, self.side, self.rank_index = agent, side, rank
        self.cache, self.timeout = cache, timeout
        self.bootstrap = bootstrap if bootstrap is not None else LocalBootstrap()
        self._ends = _Attached(agent, side, rank, cache.layout, tp_size, _register(agent, side, cache.regions))
        self._whole: set[bytes] = set()
        self._lock = threading.Lock()

    @property
    def engine(self) -> Any:
        """Deprecated: the old name of :attr:`agent`."""
        _warn_engine("KvManager")
        return self.agent

    def info(self) -> bytes:
        """This rank's info, for the other side's ``connect``."""
        return self._ends.info()

    def connect(self, peers: Sequence[bytes]) -> None:
        """Attaches the other side's ranks (every rank's info)."""
        self._ends.connect(peers)

    @property
    def rank(self) -> Rank | None:
        """The :class:`Rank`, once connected."""
        return self._ends.rank

    @property
    def page_size(self) -> int:
        return self.cache.layout.block_size

    def landed(self, key: bytes) -> bool:
        """Whether request ``key`` is whole here (taking the rank's events)."""
        rank = self.rank
        if rank is None:
            return False
        with self._lock:
            for ev in rank.poll():
                if ev.layer is None:
                    self._whole.add(bytes(ev.request))
            if key in self._whole:
                self._whole.discard(key)
                rank.forget(key)
                return True
            return False


def _room_key(room: Any) -> bytes:
    return room if isinstance(room, bytes) else str(room).encode()


class KVSender:
    """A prefill rank's side of one request, in the calls of SGLang's ``BaseKVSender``:
    ``init(num_kv_indices)``, ``send(kv_indices)`` (this chunk's prefill pages; the
    request is pushed, every layer, once the last page has come), ``poll()`` and
    ``failure_exception()``. ``bootstrap_room`` names the request on both sides."""

    def __init__(self, mgr: KvManager, bootstrap_addr: Any = None, bootstrap_room: Any = None, dest_tp_ranks: Any = None, pp_rank: int = 0) -> None:
        self.mgr, self.room = mgr, bootstrap_room
        self.key = _room_key(bootstrap_room)
        self.num_kv_indices: int | None = None
        self.pages: list[int] = []
        self.transfers: Transfers | None = None
        self.failure: BaseException | None = None
        self.state = KVPoll.Bootstrapping

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_kv_indices = int(num_kv_indices)

    def send(self, kv_indices: Sequence[int], state_indices: Any = None) -> None:
        """Takes this chunk's prefill pages; pushes the request once all have come."""
        self.pages.extend(int(p) for p in kv_indices)
        if self.num_kv_indices is not None and len(self.pages) >= self.num_kv_indices:
            self._push()

    def _push(self) -> None:
        dest = self.mgr.bootstrap.get(self.room)
        rank = self.mgr.rank
        if dest is None or rank is None:
            return  # poll pushes once the receiver's pages and the peers are known
        decode_pages, num_tokens = dest
        if num_tokens is None:
            # Whole pages on both sides: as many tokens as both tables hold.
            other = self.mgr._ends.other[0].block_size
            num_tokens = min(len(self.pages) * self.mgr.page_size, len(decode_pages) * other)
        try:
            p = rank.plan(Request(num_tokens, self.pages, decode_pages))
            self.transfers = rank.push(self.key, p)
            self.state = KVPoll.Transferring
        except Error as e:
            self.failure, self.state = e, KVPoll.Failed

    def poll(self) -> KVPoll:
        if self.state in (KVPoll.Failed, KVPoll.Success):
            return self.state
        if self.transfers is None:
            if self.mgr.rank is None or self.mgr.bootstrap.get(self.room) is None:
                return KVPoll.Bootstrapping
            if self.num_kv_indices is None or len(self.pages) < self.num_kv_indices:
                self.state = KVPoll.WaitingForInput
                return self.state
            self._push()
            return self.state
        if not self.transfers.done():
            return KVPoll.Transferring
        try:
            self.transfers.wait(0)
            self.state = KVPoll.Success
        except Error as e:
            self.failure, self.state = e, KVPoll.Failed
        return self.state

    def failure_exception(self) -> BaseException:
        return self.failure if self.failure is not None else Error(f"KV request {self.room!r} has not failed")


class KVReceiver:
    """A decode rank's side of one request, in the calls of SGLang's ``BaseKVReceiver``:
    ``init(kv_indices)`` (decode's pages, left for the senders in the bootstrap), then
    ``poll()`` until Success (every layer pushed into this rank) or Failed (not whole
    within the manager's timeout), ``failure_exception()``."""

    def __init__(self, mgr: KvManager, bootstrap_addr: Any = None, bootstrap_room: Any = None, prefill_dp_rank: Any = None) -> None:
        self.mgr, self.room = mgr, bootstrap_room
        self.key = _room_key(bootstrap_room)
        self.started: float | None = None
        self.failure: BaseException | None = None
        self.state = KVPoll.Bootstrapping

    def init(self, kv_indices: Sequence[int], aux_index: int | None = None, num_tokens: int | None = None) -> None:
        """Leaves this request's decode pages for the senders (one table for every decode
        rank, as SGLang's scheduler allocates)."""
        self.mgr.bootstrap.put(self.room, kv_indices, num_tokens)
        self.started = time.monotonic()
        self.state = KVPoll.Transferring

    def poll(self) -> KVPoll:
        if self.state in (KVPoll.Failed, KVPoll.Success):
            return self.state
        if self.started is None:
            return KVPoll.WaitingForInput if self.mgr.rank is not None else KVPoll.Bootstrapping
        if self.mgr.landed(self.key):
            self.state = KVPoll.Success
        elif time.monotonic() - self.started > self.mgr.timeout:
            self.failure = TimedOut(f"KV request {self.room!r} has not landed after {self.mgr.timeout} s")
            self.state = KVPoll.Failed
        return self.state

    def failure_exception(self) -> BaseException:
        return self.failure if self.failure is not None else Error(f"KV request {self.room!r} has not failed")
