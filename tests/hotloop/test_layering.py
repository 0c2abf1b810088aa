"""The shared library never imports a service: services depend on hotloop, not the reverse."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_in_hotloop_imports_services() -> None:
    offenders = []
    for path in sorted((ROOT / "hotloop").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n == "services" or n.startswith("services.")]
    assert not offenders, offenders


def test_services_do_not_import_each_other() -> None:
    offenders = []
    for service in sorted(p for p in (ROOT / "services").iterdir() if p.is_dir() and p.name != "__pycache__"):
        for path in sorted(service.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                for m in mods:
                    parts = m.split(".")
                    if parts[0] == "services" and len(parts) > 1 and parts[1] != service.name:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {m}")
    assert not offenders, offenders
