"""Server RSS growth for one `n=16, max_tokens=600, logprobs=5` stream whose client never
reads (`stall`) against one that reads everything (`read`), each on a fresh server, the
request run to its end (`--stream-send-timeout 3600`). Issue 31's target: the stalled
reader's growth <= 2x the normal reader's (docs/reliability.md, Overload).

    PYTHONPATH=. python benchmarks/stalled_reader.py stall read
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time

from tests.reliability.support import process_stats
from tests.server_utils import ServerProcess, http_request

BODY = {"prompt": "Tell me a very long story about the sea.", "n": 16, "max_tokens": 600, "logprobs": 5,
        "ignore_eos": True, "stream": True}
ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", "480MiB", "--num-threads", "1",
        "--max-num-seqs", "16", "--disable-access-log", "--stream-send-timeout", "3600"]
FINISHED = 'tokenmill:request_success_total{finished_reason="length"}'


def measure(mode: str) -> dict[str, object]:
    server = ServerProcess(base_args=ARGS).start()
    try:
        server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})  # warm-up: 1 finished
        base = peak = process_stats(server.proc.pid)["rss"]
        started = time.monotonic()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(http_request("POST", "/v1/completions", json.dumps(BODY).encode()))
        if mode == "read":
            threading.Thread(target=lambda: [None for _ in iter(lambda: sock.recv(65536), b"")], daemon=True).start()
        while server.metrics().get(FINISHED, 0) < 1 + BODY["n"] and time.monotonic() - started < 1200:
            peak = max(peak, process_stats(server.proc.pid)["rss"])
            time.sleep(1)
        peak = max(peak, process_stats(server.proc.pid)["rss"])
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
        time.sleep(5)
        after = process_stats(server.proc.pid)["rss"]
        return {"mode": mode, "seconds": round(time.monotonic() - started),
                "rss_growth_peak_mb": round((peak - base) / 2**20, 1),
                "rss_growth_after_reset_mb": round((after - base) / 2**20, 1)}
    finally:
        server.stop()


if __name__ == "__main__":
    for mode in sys.argv[1:] or ["stall", "read"]:
        print(json.dumps(measure(mode)), flush=True)
