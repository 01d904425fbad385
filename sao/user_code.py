"""The code of one's own a run imports, fingerprinted for its ``runs`` row (column ``code``).

A run's reward, tool and agent functions and its verifiers environment are modules of the user's; the
``runs`` table records each start's config, and :func:`fingerprint` adds what those modules were: each
module the config names (``reward.functions``, ``env.tools``, ``env.agent``, ``env.verifiers``) and each
module they imported from their own folders (helpers beside them), by file and SHA-256 of its bytes.
A resume whose code differs from the run's previous start is not refused (fixing a reward function
mid-run is a user's call), but it is said (:func:`changes`) and kept: SQL over ``runs`` shows which
steps ran with which code.

Left out: the project's own modules (``sao_version`` names them), modules of installed packages other
than the named ones (a module under the interpreter's prefix counts as installed), and code a module
reads at run time rather than imports. The helpers are those imported when the start is recorded (after
the run's inputs were checked, which imports the named modules): a helper a module imports only later,
inside a function, is not among them. A module in the working directory itself makes that whole folder
its folder: each module imported from it then counts as a helper.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["changed_since", "changes", "fingerprint", "named_modules", "recorded_code"]

PRODUCT_PACKAGES = frozenset({"sao", "flows", "schemas"})
"""Top-level packages of this project: versioned by the row's ``sao_version``, not fingerprinted."""


def named_modules(config) -> dict[str, str]:
    """Module name -> the config key that names it, for each module of one's own the run's config
    names (``module:function`` specs, the verifiers environment's module); {} for the built-in task."""
    if not config.own_tasks:
        return {}
    named: dict[str, str] = {}
    specs = [("reward.functions", spec) for spec in config.reward.functions]
    specs += [("env.tools", spec) for spec in config.env.tools]
    specs += [("env.agent", config.env.agent)] if config.env.agent else []
    from sao.rewards import split_spec

    for key, spec in specs:
        module = split_spec(spec, key)[0]
        if module.split(".", 1)[0] not in PRODUCT_PACKAGES:
            named.setdefault(module, key)
    if config.env.verifiers is not None:
        from sao.envs.verifiers_env import module_name

        named.setdefault(module_name(config.env.verifiers.id), "env.verifiers")
    return named


def fingerprint(config) -> dict[str, dict[str, str]] | None:
    """Module name -> {"file", "sha256", "key"} for the modules of one's own the run imports (see the
    module docstring); None when it names none, or none of them is a Python file. Reads the modules the
    run's start imported (a module not imported yet is looked up, not imported, nor is its package)."""
    named = named_modules(config)
    if not named:
        return None
    files: dict[str, tuple[Path, str]] = {}
    for name, key in named.items():
        path = _module_file(name)
        if path is not None:
            files[name] = (path, key)
    folders = {path.parent for path, _ in files.values()}
    for name, module in list(sys.modules.items()):
        path = _file_of(module)
        if (name in files or path is None or name.split(".", 1)[0] in PRODUCT_PACKAGES
                or not any(path.is_relative_to(folder) for folder in folders) or _installed(path)):
            continue
        files[name] = (path, "imported")
    if not files:  # named, but none is a Python file (an extension module, or not found)
        return None
    return {name: {"file": str(path), "sha256": _digest(path), "key": key}
            for name, (path, key) in sorted(files.items())}


def changes(before: str | dict | None, after: dict | None, gone: str = "no longer imported") -> list[str]:
    """What differs between two :func:`fingerprint` records (``before`` as stored: JSON text), one line
    per module: changed, new or ``gone``, with its file. [] when equal or when ``before`` is unknown (a row
    written before the ``code`` column)."""
    if before is None:
        return []
    before = json.loads(before) if isinstance(before, str) else before
    before, after = before or {}, after or {}
    lines = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None:
            lines.append(f"{name} ({new['file']}): new")
        elif new is None:
            lines.append(f"{name} ({old['file']}): {gone}")
        elif old["sha256"] != new["sha256"]:
            where = new["file"] if new["file"] == old["file"] else f"{old['file']} -> {new['file']}"
            lines.append(f"{name} ({where}): changed, sha256 {old['sha256'][:12]} -> {new['sha256'][:12]}")
    return lines


def changed_since(recorded: str | dict | None) -> list[str]:
    """The modules of a :func:`fingerprint` record (``recorded``, as stored: JSON text) whose files
    differ now, one line each as :func:`changes` words it (a file gone: "no longer found"); [] for no
    record."""
    if recorded is None:
        return []
    recorded = json.loads(recorded) if isinstance(recorded, str) else recorded
    now = {}
    for name, entry in (recorded or {}).items():
        path = Path(entry["file"])
        if path.is_file():
            now[name] = {**entry, "sha256": _digest(path)}
    return changes(recorded, now, gone="no longer found")


def recorded_code(lake, run_id: str, at=None) -> str | None:
    """The ``code`` of the ``runs`` row of run ``run_id`` in effect at time ``at`` (its latest start or
    resume at or before it; None: the latest row), or None when the run has no such row or it holds
    no code."""
    rows = [row for row in lake.read_run("runs", run_id, ["started_at", "event", "code"]).to_pylist()
            if row["event"] != "what_if" and (at is None or row["started_at"] <= at)]
    return max(rows, key=lambda row: row["started_at"])["code"] if rows else None


def _module_file(name: str) -> Path | None:
    """The source file of module ``name``: the imported module's, else where an import from the working
    directory or the import path would find it (None: not found, or no file)."""
    module = sys.modules.get(name)
    if module is not None:
        return _file_of(module)
    search: list[str] | None = [str(Path.cwd()), *sys.path]
    found = None
    for part in name.split("."):  # each package's folders in turn: nothing is imported, not even a parent
        if search is None:
            return None
        try:
            found = importlib.machinery.PathFinder.find_spec(part, search)
        except (ImportError, ValueError):
            return None
        if found is None:
            return None
        search = list(found.submodule_search_locations) if found.submodule_search_locations is not None else None
    if (found is None or not isinstance(found.origin, str) or not found.origin.endswith(".py")
            or not Path(found.origin).is_file()):
        return None
    return Path(found.origin).resolve()


def _file_of(module: ModuleType) -> Path | None:
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not file.endswith(".py"):
        return None
    path = Path(file).resolve()
    return path if path.is_file() else None


def _installed(path: Path) -> bool:
    """Whether ``path`` is in an installed package (site-packages, or the interpreter's own library)."""
    if "site-packages" in path.parts or "dist-packages" in path.parts:
        return True
    prefixes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    return any(path.is_relative_to(prefix) for prefix in prefixes)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
