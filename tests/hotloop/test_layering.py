"""The layers, checked from the source: `hotloop` (the library) < `services` < `measure`
(measuring from the users' side) < `launch` (starting and running processes) < `apps` (the
applications) and `benchmarks`, side by side, with the CLI (`apps/cli.py`) on top.

- `hotloop/` names no service;
- services do not name each other;
- neither `hotloop/` nor `services/` names `measure`, `launch`, `apps` or `benchmarks`;
- `measure/` names no service and nothing of `launch`, `apps` or `benchmarks`;
- `launch/` names no app and no benchmark;
- no module under `benchmarks/` names `apps`;
- in `apps/`, only the CLI names a benchmark;
- in the trainer, the learner (`services/trainer/learner/`) names no recipe and nothing of
  the orchestration around them (the tenants' lanes, pacing, publishing, the runner, the
  server, reports): orchestration imports the math, never the other way round;
- the trainer's pacing (`services/trainer/pacing/`) names no recipe and no tenants' lane: the
  recipes and the lanes use it;
- no recipe module names the runner: the runner finds recipes through their registry.

"Names" covers every way a module is reached: `import` statements (relative ones resolved),
and strings: `importlib.import_module("services.x")`, `__import__`, `find_spec`, a
`python -m services.x` argument, a module path kept in a table for later. A string counts when
it is a dotted module path (`services.x`, `services.` at the start of an f-string) or the
literal argument of an import function. In `hotloop/`, `import_module` and `__import__` may
not take a computed name at all: what they would run cannot be checked.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMPORT_FUNCTIONS = {"import_module", "__import__", "find_spec"}
RUNS_MODULE = {"import_module", "__import__"}  # find_spec only looks (hotloop.models: a wheel)
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\.?")


def _package(path: Path) -> list[str]:
    return list(path.relative_to(ROOT).with_suffix("").parts[:-1])


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _strings(node: ast.AST) -> Iterator[str]:
    """A str constant, or the literal parts of an f-string, the first one marked as a prefix."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            yield first.value


def named_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every module the file names. A computed argument of
    `import_module` or `__import__` is reported as the module `<computed>`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(path)[: len(_package(path)) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from package import module` names the module too (`from .. import recipes`)
            out += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call) and _call_name(node) in IMPORT_FUNCTIONS and node.args:
            literal = list(_strings(node.args[0])) if isinstance(node.args[0], ast.Constant) else []
            computed = [] if _call_name(node) not in RUNS_MODULE else [(node.lineno, "<computed>")]
            out += [(node.lineno, s) for s in literal] or computed
        else:
            for s in _strings(node):
                s = s.strip()
                if "." in s and DOTTED.fullmatch(s):
                    out.append((node.lineno, s.rstrip(".")))
    return out


def offenders(folder: str, forbidden, exempt: tuple[str, ...] = ()) -> list[str]:
    """`file:line module` for each module named under `folder` that `forbidden(path, module)`
    refuses; files whose path relative to the root is in `exempt` are not read."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in exempt or "/proto/" in rel:  # generated stubs name only protobuf modules
            continue
        found += [f"{rel}:{line} {m}" for line, m in named_modules(path) if forbidden(path, m)]
    return found


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def test_nothing_in_hotloop_names_a_service() -> None:
    assert not offenders("hotloop", lambda p, m: _top(m) == "services" or m == "<computed>")


def test_services_do_not_name_each_other() -> None:
    def other_service(path: Path, m: str) -> bool:
        parts = m.split(".")
        own = path.relative_to(ROOT / "services").parts[0]
        return parts[0] == "services" and len(parts) > 1 and parts[1] != own

    assert not offenders("services", other_service)


def test_neither_the_library_nor_a_service_names_a_room_above_it() -> None:
    def above(path: Path, m: str) -> bool:
        return _top(m) in ("measure", "launch", "apps", "benchmarks")

    assert not offenders("hotloop", above) + offenders("services", above)


def test_measure_names_no_service_launcher_app_or_benchmark() -> None:
    assert not offenders("measure", lambda p, m: _top(m) in ("services", "launch", "apps", "benchmarks"))


def test_launch_names_no_app_or_benchmark() -> None:
    assert not offenders("launch", lambda p, m: _top(m) in ("apps", "benchmarks"))


def test_no_benchmark_names_an_app() -> None:
    assert not offenders("benchmarks", lambda p, m: _top(m) == "apps")


def test_only_the_cli_names_a_benchmark() -> None:
    assert not offenders("apps", lambda p, m: _top(m) == "benchmarks", exempt=("apps/cli.py",))


def _within(m: str, *rooms: str) -> bool:
    return any(m == room or m.startswith(room + ".") for room in rooms)


ORCHESTRATION = tuple(f"services.trainer.{room}" for room in (
    "recipes", "tenants", "pacing", "publish", "runner", "server", "report", "__main__"))


def test_the_learner_names_no_recipe_and_no_orchestration() -> None:
    assert not offenders("services/trainer/learner", lambda p, m: _within(m, *ORCHESTRATION))


def test_pacing_names_no_recipe_and_no_lane() -> None:
    assert not offenders("services/trainer/pacing", lambda p, m: _within(
        m, "services.trainer.recipes", "services.trainer.tenants"))


def test_no_recipe_names_the_runner() -> None:
    assert not offenders("services/trainer/recipes", lambda p, m: _within(m, "services.trainer.runner"))
