"""Test-only fault injection: make the engine loop fail or hang after N steps.

Read once, when the server starts, from the environment variable
TOKENMILL_FAULT_INJECTION, so that no request and no flag can turn it on:

    TOKENMILL_FAULT_INJECTION=raise_after_steps=5   the 6th step raises InjectedFault
    TOKENMILL_FAULT_INJECTION=hang_after_steps=5    the 6th step blocks forever

The fault happens on the engine thread where `engine.step()` would run, so the server
sees exactly what a model step that raised (or a loop that got stuck) would show it.
The reliability suite (tests/reliability/test_faults.py) uses it to check engine-death
and stuck-loop behaviour.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FAULT_ENV = "TOKENMILL_FAULT_INJECTION"
_SPEC = re.compile(r"^(raise|hang)_after_steps=(\d+)$")


class InjectedFault(RuntimeError):
    """The failure TOKENMILL_FAULT_INJECTION asked for."""


@dataclass
class FaultInjector:
    kind: str  # "raise" or "hang"
    after_steps: int
    steps: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultInjector | None:
        spec = environ.get(FAULT_ENV, "").strip()
        if not spec:
            return None
        match = _SPEC.match(spec)
        if match is None:
            raise ValueError(f"{FAULT_ENV} must be 'raise_after_steps=N' or 'hang_after_steps=N', got {spec!r}")
        injector = cls(match.group(1), int(match.group(2)))
        logger.warning("fault injection is on (%s=%s): this server is for tests only", FAULT_ENV, spec)
        return injector

    def before_step(self) -> None:
        """Called on the engine thread before each step."""
        self.steps += 1
        if self.steps <= self.after_steps:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault after {self.after_steps} steps")
        logger.warning("injected hang after %d steps: the engine loop blocks forever", self.after_steps)
        threading.Event().wait()
