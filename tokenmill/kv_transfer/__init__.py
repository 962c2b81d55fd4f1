"""Prefill-decode disaggregation's transport: KV blocks between instances over ZMQ
(docs/disaggregation.md). The scheduler's side is `tokenmill.engine.kv_transfer`."""

from tokenmill.kv_transfer.connector import ZmqKVConnector, kv_layout_facts

__all__ = ["ZmqKVConnector", "kv_layout_facts"]
