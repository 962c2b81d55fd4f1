"""The room rules of docs/architecture.md, in code: import-linter's contracts in
pyproject.toml ([tool.importlinter]) are checked on every test run.

- `floors`: every room of `tokenmill/` sits on a floor, and no import (module-level or
  inside a function: grimp reads both) runs from a lower floor up to a higher one; a new
  room must be placed on a floor (`exhaustive`) before its first import is accepted.
- `no-circles`: no circle between the rooms of `tokenmill/`, nor between the files or
  subpackages inside any room.
- `torch-free-engine`: `engine/` reaches no torch, directly or through another room.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_every_room_is_on_a_floor_and_every_rule_is_declared():
    found = contracts()
    assert set(found) >= {"floors", "no-circles", "torch-free-engine"}
    assert found["floors"]["exhaustive"] is True
    rooms_on_floors = {room.strip() for floor in found["floors"]["layers"]
                       for room in floor.replace(":", "|").split("|")}
    rooms = {p.stem if p.is_file() else p.name for p in (ROOT / "tokenmill").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__" and p.stem != "__main__")
             or (p.is_dir() and (p / "__init__.py").exists())}
    assert rooms == rooms_on_floors, f"rooms without a floor: {rooms - rooms_on_floors}; " \
        f"floors naming no room: {rooms_on_floors - rooms}"


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
