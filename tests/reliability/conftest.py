"""The reliability suite's shared server and process probes.

One `tokenmill serve` for the suite, with small limits so that they are reached fast:
8 running sequences, 32 queued, a 64 MiB KV cache (about 1,400 tokens in float32), a
256-token context, a 64 KiB body limit, one thread. float32, so that
greedy outputs are exact whatever the batch (bf16 outputs depend on the batch: see
docs/reliability.md). Tests that kill or break a server start their own. `dp_rserver`
is the same server behind the data-parallel router (`--data-parallel-size 2`, each
replica with those settings), for the tests that must hold through the router too
(test_fuzz.py); it starts only when such a test runs. `pooling_rserver` and
`dp_pooling_rserver`: the same on the pooling runner, where /v1/embeddings embeds (the
long fuzz only).

`-m slow` runs the long versions (the 30-minute soak, bigger storms and fuzz runs);
CI runs the short ones. Every test records its figures in RESULTS, printed at the end
of the session (docs/reliability.md's table is copied from that).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.reliability.support import RELIABILITY_ARGS, RESULTS
from tests.server_utils import ServerProcess


@pytest.fixture(scope="session")
def rserver():
    process = ServerProcess(base_args=RELIABILITY_ARGS).start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="session")
def dp_rserver():
    process = ServerProcess("--data-parallel-size", "2", base_args=RELIABILITY_ARGS).start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="session")
def pooling_rserver():
    """The suite's server on the pooling runner (/v1/embeddings), for the long fuzz."""
    process = ServerProcess("--runner", "pooling", base_args=RELIABILITY_ARGS).start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(scope="session")
def dp_pooling_rserver():
    process = ServerProcess("--runner", "pooling", "--data-parallel-size", "2", base_args=RELIABILITY_ARGS).start()
    yield process
    assert process.stop() == 0, process.log_tail()


@pytest.fixture(params=["single", "router"])
def any_rserver(request):
    """The suite's server, then the same behind the data-parallel router."""
    return request.getfixturevalue("rserver" if request.param == "single" else "dp_rserver")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if RESULTS:
        print("\nreliability figures: " + json.dumps(RESULTS, indent=1, default=str))
        out = os.environ.get("TOKENMILL_RELIABILITY_RESULTS")
        if out:
            Path(out).write_text(json.dumps(RESULTS, indent=1, default=str))
