"""The package's layers point one way: no module imports a module that imports it back (directly or
through others), at its top level or inside a function (a lazy import that only breaks a cycle is a
cycle still)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sao", "flows", "schemas")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere (``from a import b`` counts ``a.b`` when that is a
    module, else ``a``)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def cycles() -> list[list[str]]:
    paths = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, [*stack, target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return found


def test_no_module_imports_itself_back():
    assert cycles() == []


def test_the_walk_finds_a_cycle(tmp_path, monkeypatch):
    """The check can fail: two modules that import each other are found."""
    import sys

    (tmp_path / "sao").mkdir()
    (tmp_path / "sao" / "__init__.py").write_text("")
    (tmp_path / "sao" / "a.py").write_text("from sao import b\n")
    (tmp_path / "sao" / "b.py").write_text("import sao.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("sao",))
    assert cycles() == [["sao.a", "sao.b", "sao.a"]]
