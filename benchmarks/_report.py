"""Shared by the benchmarks: the machine's description, the sections of docs/RESULTS.md, and a
command run with its output passed on.

Each benchmark owns one section of ``docs/RESULTS.md`` between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` markers and replaces only that section, so benchmarks can run in any order.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["git_commit", "load_parts", "machine", "parts_lines", "median_spread", "publish", "run_echoed", "save_figure",
           "update_section", "write_json"]


def median_spread(values: list[float]) -> dict[str, float]:
    """The median, min and max of a figure over repeated runs (how every ratio is reported)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread_text(figure: dict[str, float], digits: str, unit: str = "", sep: str = "-") -> str:
    """``median (min-max)`` of a :func:`median_spread` figure, each number formatted with ``digits``
    and followed by ``unit``."""
    median, low, high = (f"{figure[key]:{digits}}{unit}" for key in ("median", "min", "max"))
    return f"{median} ({low}{sep}{high})"


def git_commit(root: Path | None = None) -> str:
    """The checkout's commit (short), with ``+changes`` when its tracked files outside ``docs/`` differ from
    it (what the benchmarks write there, result files and RESULTS sections, is not code the figures ran);
    "unknown" outside a git checkout. ``root``: the checkout (default: this one)."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                               cwd=root, capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def machine() -> dict[str, Any]:
    """Cores, memory, platform, load, the commit and the versions that decide the figures; ``packages``:
    every distribution installed in the environment with its version (two result files then show which
    package differs when the same code gives other figures: the demo's sampled evaluation moved with
    the environment once, docs/RESULTS.md, "Plateau experiments at a later commit")."""
    memory_gib = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    memory_gib = round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "commit": git_commit(),
    }
    for package in ("torch", "transformers", "ray", "deltalake", "pyarrow", "prefect"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            continue
    info["packages"] = dict(sorted({dist.metadata["Name"].lower(): dist.version
                                    for dist in importlib.metadata.distributions() if dist.metadata["Name"]}.items()))
    return info


def machine_line(info: dict[str, Any]) -> str:
    return (f"Machine: {info['cpus']} CPU cores, {info['memory_gib']} GiB memory, {info['platform']}; "
            f"Python {info['python']}, torch {info.get('torch')}, ray {info.get('ray')}. Date: {info['date']}; "
            f"1-minute load average at the start {info.get('load_average_1m')}."
            + (f" Commit `{info['commit']}`." if info.get("commit") else ""))


def update_section(path: Path, name: str, markdown: str) -> None:
    """Replace (or append) the section ``name`` of the results file with ``markdown``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Results\n"
    if begin in text and end in text:
        text = text.split(begin)[0] + block + text.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def load_parts(folder: Path, name: str, design: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The parts ``<name>-seed*.json`` in ``folder`` whose ``design`` equals ``design``, by seed (a
    benchmark that runs seed by seed merges them), and a note naming each part left out and why.

    Raises:
        SystemExit: no part matches (the message names the folder and every part left out)."""
    parts, notes = [], []
    for path in sorted(folder.glob(f"{name}-seed*.json")):
        part = json.loads(path.read_text())
        if part.get("design") != design:
            changed = sorted(k for k in design if part.get("design", {}).get(k) != design[k])
            notes.append(f"{path.name} left out: its design differs in {', '.join(changed)}")
            continue
        parts.append(part)
    if not parts:
        raise SystemExit("\n  ".join([f"no part of {name} with this design in {folder}", *notes]))
    return sorted(parts, key=lambda p: p["seed"]), notes


def parts_lines(commands: list[str], parts: list[dict[str, Any]]) -> list[str]:
    """The lines of a merged section that name each part's command and its seed, machine, commit and
    wall time (``parts``: ``seed``, ``machine`` (:func:`machine`), ``wall_s``)."""
    return ["Commands (one per part, then merged): " + "; ".join(f"`{c}`" for c in commands) + ".", "",
            "Parts: " + "; ".join(f"seed {p['seed']}: {machine_line(p['machine'])} "
                                  f"{p['wall_s'] / 60:.1f} min" for p in parts)]


def save_figure(figure, path: Path) -> Path:
    """Lay ``figure`` (a matplotlib figure) out, write it to ``path`` as a PNG (its folder made if
    missing) and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def add_output_arguments(parser: argparse.ArgumentParser, default_json: Path, default_results: Path) -> None:
    """``--out-json`` and ``--results-md``: where the result file and the results section go (default
    the committed ones; a ``--quick`` run writes only where these say: see :func:`publish`)."""
    parser.add_argument("--out-json", type=Path, default=None,
                        help=f"the JSON result (default {default_json}; --quick writes only where told)")
    parser.add_argument("--results-md", type=Path, default=None,
                        help=f"the results file whose section is replaced (default {default_results}; likewise)")


def publish(name: str, result: dict[str, Any], markdown: str, *, out: Path | None, results_md: Path | None,
            quick: bool, default_json: Path, default_results: Path) -> None:
    """Print ``markdown``; write ``result`` and the section ``name`` where ``out`` / ``results_md`` say,
    or to the defaults outside a quick run (a quick run writes only where it is told to)."""
    print(markdown)
    if out is not None or not quick:
        write_json(out or default_json, result)
    if results_md is not None or not quick:
        update_section(results_md or default_results, name, markdown)


def run_echoed(command: list[str], cwd: Path, *, env: dict[str, str] | None = None, label: str | None = None) -> float:
    """Run ``command`` in ``cwd`` (with ``env``: default this process's), passing its output on to stderr
    as it comes, each line after ``[label]`` when given; its wall seconds. Raises RuntimeError naming
    the command, its exit status and folder, with the last 60 lines of its output, when it fails."""
    tail: collections.deque[str] = collections.deque(maxlen=60)
    prefix = f"[{label}] " if label else ""
    started = time.perf_counter()
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as child:
        for line in child.stdout:
            print(f"{prefix}{line}", end="", file=sys.stderr, flush=True)
            tail.append(line)
    seconds = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"{label + ': ' if label else ''}{' '.join(command)} exited {child.returncode} in {cwd}:\n"
                           f"{''.join(tail)}")
    return seconds
