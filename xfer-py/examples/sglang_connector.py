"""SGLang's disaggregation sender and receiver over xfer.kv: subclasses of SGLang's
``BaseKVSender``/``BaseKVReceiver`` (imported only when SGLang is present, so this file
imports without it) whose calls are xfer.kv.KVSender's and KVReceiver's. The manager
(one per rank) is xfer.kv.KvManager over the rank's pool (``cache_from_sglang`` or
``cache_from_sglang_mla`` of its buffers); its bootstrap (where receivers leave their
pages for the senders) is SGLang's bootstrap server in a deployment, wrapped in an
object with ``put(room, pages, num_tokens)`` and ``get(room)``.
"""

from __future__ import annotations

from typing import Any

from xfer.kv import KVPoll, KvManager, KVReceiver, KVSender, cache_from_sglang

try:  # SGLang's base classes, where installed
    from sglang.srt.disaggregation.base.conn import BaseKVReceiver, BaseKVSender  # type: ignore[import-not-found]
except ImportError:  # keep the adapter importable (and testable) without SGLang
    BaseKVSender = object  # type: ignore[assignment,misc]
    BaseKVReceiver = object  # type: ignore[assignment,misc]


class XferKVSender(KVSender, BaseKVSender):  # type: ignore[misc,valid-type]
    """SGLang's sender: KVSender's init/send/poll/failure_exception."""

    def __init__(self, mgr: KvManager, bootstrap_addr: str, bootstrap_room: int, dest_tp_ranks: list[int] | None = None, pp_rank: int = 0) -> None:
        KVSender.__init__(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank)


class XferKVReceiver(KVReceiver, BaseKVReceiver):  # type: ignore[misc,valid-type]
    """SGLang's receiver: KVReceiver's init/poll/failure_exception."""

    def __init__(self, mgr: KvManager, bootstrap_addr: str, bootstrap_room: int | None = None, prefill_dp_rank: int | None = None) -> None:
        KVReceiver.__init__(self, mgr, bootstrap_addr, bootstrap_room, prefill_dp_rank)


def make_manager(agent: Any, side: str, tp_rank: int, tp_size: int, pool: Any, num_kv_heads: int, bootstrap: Any) -> KvManager:
    """A KvManager over SGLang's MHA token pool ``pool`` (its ``k_buffer``/``v_buffer``
    lists and ``page_size``)."""
    cache = cache_from_sglang(pool.k_buffer, pool.v_buffer, pool.page_size, num_kv_heads, tp_size, tp_rank)
    return KvManager(agent, side, tp_rank, tp_size, cache, bootstrap=bootstrap)


__all__ = ["XferKVSender", "XferKVReceiver", "make_manager", "KVPoll"]
