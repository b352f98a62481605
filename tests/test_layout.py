"""The code's shape: imports run one way (pipeline -> eval -> runtime -> kernels) and no module of
a package imports one that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"pipeline": "infer.pipeline", "eval": "infer.eval", "runtime": "infer.runtime", "kernels": "infer.kernels"}
# what each package may import of the others
ALLOWED = {"pipeline": {"eval", "runtime", "kernels"}, "eval": {"runtime", "kernels"}, "runtime": {"kernels"},
           "kernels": set()}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Absolute names of the infer modules a module imports, anywhere in it (lazy imports included)."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("infer.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("infer."):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names}
    return found


def _package_of(module: str) -> str | None:
    return next((folder for folder, pkg in PACKAGES.items() if module == pkg or module.startswith(pkg + ".")), None)


def test_imports_run_one_way():
    bad = []
    for name, path in _modules().items():
        own = _package_of(name)
        for target in _imports(name, path):
            other = _package_of(target)
            if other and other != own and other not in ALLOWED[own]:
                bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert not bad, bad


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_no_import_circles_between_modules(folder):
    modules = _modules()
    graph = {name: {t for t in _imports(name, path) if t in modules and t != name}
             for name, path in modules.items() if _package_of(name) == folder}
    package_inits = {n for n, p in modules.items() if p.name == "__init__.py"}

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):  # an __init__ that re-exports is a door, not a cycle
                if nxt not in seen and nxt not in package_inits:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if b not in package_inits
                      and a in reach(b)})
    assert not circles, circles


def test_each_artifact_file_name_is_written_once():
    """The names of the files an artifact carries are declared in runtime/artifact.py and used by name
    everywhere else (pipeline, eval, runtime, kernels, bench): a second literal would drift from the
    manifest's list."""
    from infer.runtime import artifact

    names = {v for k, v in vars(artifact).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert {"manifest.json", "config.json", "tokenizer.json", "tensor_parallel.json", "tuning.json"} <= names
    found = []
    for folder in ("pipeline", "eval", "runtime", "kernels", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            if path == REPO / "runtime" / "artifact.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "use runtime/artifact.py's constant instead of the literal:\n" + "\n".join(found)


def test_which_kernel_runs_each_row_is_decided_in_the_plan_alone():
    """runtime/engine/plan.py decides which kernel reads each kind of row and whether the one-call step takes a
    step. Nowhere else in the runtime reads the resolver's attention kernels to pick one (the tune stage's
    measurement, runtime/tuning_measure.py, times both alternatives), tests a step's context with hasattr or
    identity to decide the step's path, or branches on a describe() string."""
    import re

    patterns = {r"kernels\.(prefill_attention|chunk_attention|decode_attention|store_kv)\b": "a resolver kernel",
                r"hasattr\(ctx\b|ctx\.\w+ is (not )?self\.": "a check on the step's context",
                r"describe\([^)]*\)\[": "a describe() string", r"decode_rows_only\s*=": "the prompt rows' kind"}
    allowed = {REPO / "runtime" / "engine" / "plan.py", REPO / "runtime" / "tuning_measure.py"}
    found = []
    for path in (REPO / "runtime").rglob("*.py"):
        if path in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in patterns.items():
                if re.search(pattern, line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {what}: {line.strip()}")
    assert not found, "decide it in runtime/engine/plan.py:\n" + "\n".join(found)
    # and the guard sees such a line where one is written
    assert re.search(next(iter(patterns)), "chunk = kernels.prefill_attention")
