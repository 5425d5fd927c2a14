"""The tree's own rules, checked where CI runs: no import cycle among gpufeed's modules, and no development log
(commit hashes, lettered machines, session numbers) in what users read."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gpufeed"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The gpufeed modules ``name`` imports anywhere in it (function bodies and TYPE_CHECKING blocks too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
            for alias in node.names:
                target = f"{module}.{alias.name}"
                found.add(target if target in modules else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    # a module importing its own package (the package's __init__) is not a cycle through it
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def test_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    done, on_path, cycles = set(), [], []

    def visit(name):
        if name in on_path:
            cycles.append(on_path[on_path.index(name):] + [name])
            return
        if name in done:
            return
        on_path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        on_path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


HISTORY = re.compile(r"[Ss]essions? ?-?\d|\bS\d{1,2}-\d{1,2}\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
                     r"|\bmachines? [A-N]\b")


def test_no_development_log_in_what_users_read():
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.md", "src/*", "benchmarks/*", "examples/*"],
                               capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    hits = [f"{name}:{n}: {line.strip()[:80]}" for name in files if (ROOT / name).suffix in (".md", ".py", ".sh")
            for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "\n".join(hits)
