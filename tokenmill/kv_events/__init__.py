"""KV events on the wire: the engine's prefix-cache events (`engine.kv_events`) encoded
as vLLM's msgspec structs and published over ZMQ (PUB, with a ROUTER for replays), so a
KV-aware router written for vLLM (vllm-router's kv_aware policy, vLLM's example
subscriber) reads tokenmill unchanged. Imports the engine's records and config only;
msgspec and pyzmq, no torch. docs/kv-tiers.md."""
