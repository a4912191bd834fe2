"""A vLLM KV connector over xfer.kv: the worker side is xfer.kv.KvWorker, the scheduler
side builds xfer.kv.ConnectorMetadata. vLLM is imported only when present, so this file
imports (and its classes exist) without it; with vLLM, point
``--kv-transfer-config '{"kv_connector": "XferConnector", "kv_connector_module_path":
"vllm_connector", "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config":
{"mode": "push"}}'`` at it.

What the scheduler side has to add per request is the other side's block ids and ranks'
infos (``KvWorker.info()`` of every worker of the other instance, exchanged once, e.g. in
``kv_transfer_params`` as vLLM's NIXL connector does with its handshake); that exchange
is the deployment's and left to ``request_peers`` below.
"""

from __future__ import annotations

from typing import Any

from xfer import Agent
from xfer.kv import ConnectorMetadata, KvWorker, ReqMeta

try:  # vLLM's base class, where installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
except ImportError:  # keep the adapter importable (and testable) without vLLM
    KVConnectorBase_V1 = object  # type: ignore[assignment,misc]
    KVConnectorMetadata = object  # type: ignore[assignment,misc]
    KVConnectorRole = None  # type: ignore[assignment]


class XferConnectorMetadata(ConnectorMetadata, KVConnectorMetadata):  # type: ignore[misc]
    """xfer.kv's per-step metadata as vLLM's metadata type."""


class XferConnectorWorker(KvWorker):
    """The worker side: KvWorker's calls are vLLM's, one to one."""


class XferConnector(KVConnectorBase_V1):  # type: ignore[misc,valid-type]
    """vLLM's connector: the worker calls go to a KvWorker; the scheduler side records
    the requests to move and builds their metadata."""

    def __init__(self, vllm_config: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        if KVConnectorBase_V1 is not object:
            super().__init__(vllm_config, role, *args, **kwargs)
        tc = vllm_config.kv_transfer_config
        self.side = "prefill" if tc.kv_role == "kv_producer" else "decode"
        self.mode = tc.get_from_extra_config("mode", "push")
        self.pending: list[ReqMeta] = []
        self.worker: XferConnectorWorker | None = None
        if role is not None and getattr(role, "name", "") == "WORKER":
            pc, mc = vllm_config.parallel_config, vllm_config.model_config
            from vllm.distributed import get_tensor_model_parallel_rank  # type: ignore[import-not-found]  # noqa: PLC0415

            agent = Agent(memory="cuda", gpu=0, listen=tc.get_from_extra_config("listen", "127.0.0.1"))
            self.worker = XferConnectorWorker(
                agent,
                self.side,
                get_tensor_model_parallel_rank(),
                pc.tensor_parallel_size,
                mc.get_total_num_kv_heads(),
                backend=tc.get_from_extra_config("backend", "flash_attn"),
                kv_layout=tc.get_from_extra_config("kv_layout", "NHD"),
            )

    # Worker side: one line each.
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    # Scheduler side: what the request's kv_transfer_params carry.
    def request_peers(self, request: Any) -> dict[str, Any]:
        """The other side's block ids, tokens and ranks' infos of ``request`` (the
        deployment's exchange: here from kv_transfer_params)."""
        return dict(request.kv_transfer_params or {})

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        if self.side == "decode" and self.request_peers(request):
            return len(request.prompt_token_ids) - num_computed_tokens, False
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        p = self.request_peers(request)
        if not p:
            return
        mine = list(blocks.get_block_ids()[0])
        prefill, decode = (mine, p["remote_block_ids"]) if self.side == "prefill" else (p["remote_block_ids"], mine)
        self.pending.append(ReqMeta(request.request_id, p["num_tokens"], prefill, decode, self.mode, [bytes.fromhex(i) for i in p["peers"]]))

    def build_connector_meta(self, scheduler_output: Any) -> XferConnectorMetadata:
        meta = XferConnectorMetadata(self.pending)
        self.pending = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Prefill holds the blocks until get_finished reports the request sent.
        return self.side == "prefill", None
