"""docs/agent-apis.md's examples run as written against a real `tokenmill serve` (only
the address differs: the test server's port instead of 8000)."""

from __future__ import annotations

import re

import pytest

from tests.server_utils import REPO

DOC = REPO / "docs" / "agent-apis.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_the_doc_has_its_three_examples() -> None:
    assert len(EXAMPLES) == 3
    assert all('base_url="http://localhost:8000/v1"' in code for code in EXAMPLES)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_example_runs(server, index) -> None:
    code = EXAMPLES[index].replace("http://localhost:8000/v1", server.url + "/v1")
    # dont_inherit: this file's `from __future__ import annotations` must not leak into the example.
    exec(compile(code, f"{DOC.name} example {index + 1}", "exec", dont_inherit=True), {"__name__": "__doc_example__"})
