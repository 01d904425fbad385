"""Benchmark: ``make demo`` from a fresh clone, timed, as a newcomer runs it on a new machine.

    sao bench fresh [--runs 3] [--repo DIR] [--workdir DIR] [--warm-pip-cache] [--keep]
    sao bench fresh --reread RECORD.json

Each run clones the repository's committed ``HEAD`` (``git clone --no-local``: uncommitted changes are not
in it) into an empty folder and runs, there, ``make install`` and then ``make demo``, timing each apart.
``make demo`` installs first; once ``make install`` has run it only runs ``sao demo``, so the two times
add up to ``make demo`` from the clone, with where the time went: creating ``.venv`` and installing,
then the demo itself. The commands run with the environment of a new shell: no virtual environment
active (``VIRTUAL_ENV`` unset, its ``bin`` off ``PATH``), no ``PYTHONPATH``.

pip's cache is a new, empty folder in each run's folder, as on a machine that never installed the
project (``PIP_CACHE_DIR``); ``--warm-pip-cache`` keeps the user's cache instead (a second clone on the
same machine). Packages still come from the registries this machine reaches, so the install time
depends on them too.

Beside the times: the demo's own result (held-out accuracy before and after, trajectories, its
training time), read from the clone's run (``runs/demo/result.json``). A run's folder is removed once
it is read, unless ``--keep``.

``--reread RECORD.json`` runs nothing: it writes the section again from a record this benchmark wrote.

Target (issue 24): ``make demo`` from a fresh clone in under 10 minutes, held-out sampled accuracy
above 0.8 with a rise of at least +0.25. Writes ``docs/results/fresh-clone.json`` and the
``fresh-clone`` section of ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._report import (
    add_output_arguments,
    git_commit,
    machine,
    machine_line,
    median_spread,
    publish,
    run_echoed,
    spread_text,
)
from benchmarks.demo import TARGET_ACCURACY, TARGET_RISE, TARGET_WALL_S, demo_result

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "docs" / "results" / "fresh-clone.json"
DEFAULT_RESULTS = ROOT / "docs" / "RESULTS.md"
PHASES = ("clone", "install", "demo")
"""What each run times: ``git clone``, ``make install``, ``make demo`` (``sao demo``, once installed)."""
RESULT_KEYS = ("accuracy_before", "accuracy_after", "eval_tasks", "steps", "trajectories", "train_wall_s")


def newcomer_env(pip_cache: Path | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's by default) as a new shell has it: no virtual environment active, no
    ``PYTHONPATH``; pip's cache at ``pip_cache`` when given."""
    env = dict(os.environ if env is None else env)
    active = env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.pop("PYTHONHOME", None)
    venvs = {str(Path(sys.prefix) / "bin")} | ({str(Path(active) / "bin")} if active else set())
    env["PATH"] = os.pathsep.join(part for part in env.get("PATH", "").split(os.pathsep) if part not in venvs)
    if pip_cache is not None:
        env["PIP_CACHE_DIR"] = str(pip_cache)
    return env


def fresh_clone_run(repo: Path, folder: Path, *, warm_pip_cache: bool = False) -> dict[str, float]:
    """Clone ``repo``'s HEAD into ``folder``/``clone`` and run ``make install`` and ``make demo`` there; the
    seconds of each phase (:data:`PHASES`) and their sum (``total``)."""
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise RuntimeError(f"{folder} is not empty: each run starts from nothing")
    clone = folder / "clone"
    pip_cache = None if warm_pip_cache else folder / "pip-cache"
    env = newcomer_env(pip_cache)
    seconds = {"clone": run_echoed(["git", "clone", "--quiet", "--no-local", str(repo), str(clone)], folder, env=env,
                                   label="clone")}
    seconds["install"] = run_echoed(["make", "install"], clone, env=env, label="make install")
    seconds["demo"] = run_echoed(["make", "demo"], clone, env=env, label="make demo")
    seconds["total"] = sum(seconds[phase] for phase in PHASES)
    return seconds


def clone_result(clone: Path) -> dict[str, Any]:
    """What the clone's demo run recorded (:data:`RESULT_KEYS`, and the rise)."""
    result = demo_result(clone)
    out = {key: result.get(key) for key in RESULT_KEYS}
    out["rise"] = result["accuracy_after"] - result["accuracy_before"]
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median (min-max) over the runs of each phase's seconds, the total, and the demo's accuracies;
    whether the targets are met (judged on the medians)."""
    figures = {key: median_spread([run["seconds"][key] for run in runs]) for key in (*PHASES, "total")}
    for key in ("accuracy_before", "accuracy_after", "rise"):
        figures[key] = median_spread([run["result"][key] for run in runs])
    figures["met"] = {"time": figures["total"]["median"] < TARGET_WALL_S,
                      "accuracy": figures["accuracy_after"]["median"] > TARGET_ACCURACY,
                      "rise": figures["rise"]["median"] >= TARGET_RISE}
    return figures


def _markdown(record: dict[str, Any]) -> str:
    s = record["summary"]
    cache = "the user's (warm)" if record["warm_pip_cache"] else "a new, empty one per run"
    lines = [
        "## `make demo` from a fresh clone (`sao bench fresh`)",
        "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])} Cloned commit `{record['commit']}`. "
        f"pip's cache: {cache}. Benchmark wall time {record['wall_s']:.0f} s.",
        "",
        "Each run clones the committed HEAD into an empty folder, then times `make install` and `make demo` "
        "there apart (the two add up to `make demo` from the clone), in a new shell's environment.",
        "",
        "| run | clone (s) | `make install` (min) | `sao demo` (min) | total (min) | accuracy before -> after | rise |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for index, run in enumerate(record["runs"], 1):
        sec, res = run["seconds"], run["result"]
        lines.append(f"| {index} | {sec['clone']:.1f} | {sec['install'] / 60:.1f} | {sec['demo'] / 60:.1f} | "
                     f"{sec['total'] / 60:.1f} | {res['accuracy_before']:.3f} -> {res['accuracy_after']:.3f} | "
                     f"{res['rise']:+.3f} |")
    minutes = {key: {k: v / 60 for k, v in s[key].items()} for key in ("install", "demo", "total")}
    yes = {True: "yes", False: "NO"}
    lines += [
        "",
        f"Targets (issue 24), medians (min-max) over {len(record['runs'])} run(s):",
        "",
        "| target | measured | met |",
        "|---|---:|---|",
        f"| `make demo` from a fresh clone under {TARGET_WALL_S / 60:.0f} minutes | "
        f"{spread_text(minutes['total'], '.1f')} min (installing {spread_text(minutes['install'], '.1f')} min, "
        f"`sao demo` {spread_text(minutes['demo'], '.1f')} min) | {yes[s['met']['time']]} |",
        f"| held-out sampled accuracy after training above {TARGET_ACCURACY} | "
        f"{spread_text(s['accuracy_after'], '.3f')} | {yes[s['met']['accuracy']]} |",
        f"| rise at least +{TARGET_RISE} | {spread_text(s['rise'], '+.3f', sep=' to ')} | {yes[s['met']['rise']]} |",
    ]
    return "\n".join(lines)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sao bench fresh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="clones to time, one after another (default 3)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the repository to clone (default: this one)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="an empty folder for the runs' folders (default: a new temporary one)")
    parser.add_argument("--warm-pip-cache", action="store_true",
                        help="keep the user's pip cache (default: an empty one per run, as on a new machine)")
    parser.add_argument("--keep", action="store_true", help="keep each run's clone (default: removed once read)")
    parser.add_argument("--reread", type=Path, default=None, metavar="RECORD.json",
                        help="run nothing: write the section again from a record this benchmark wrote")
    add_output_arguments(parser, DEFAULT_JSON, DEFAULT_RESULTS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.reread is not None:
        record = json.loads(args.reread.read_text())  # the section again; the record stays as it is
        publish("fresh-clone", record, _markdown(record), out=None, results_md=args.results_md or DEFAULT_RESULTS,
                quick=True, default_json=args.reread, default_results=DEFAULT_RESULTS)
        return 0
    machine_info = machine()  # the load before the runs, not after them
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sao-bench-fresh-"))
    started = time.perf_counter()
    runs = []
    for index in range(args.runs):
        folder = workdir / f"run-{index + 1}"
        print(f"sao bench fresh: run {index + 1} of {args.runs} in {folder}: clone, make install, make demo "
              f"(about 7-12 minutes on 2 cores) ...", file=sys.stderr)
        seconds = fresh_clone_run(args.repo, folder, warm_pip_cache=args.warm_pip_cache)
        runs.append({"seconds": seconds, "commit": git_commit(folder / "clone"), "result": clone_result(folder / "clone")})
        print(f"sao bench fresh: run {index + 1}: {seconds['total'] / 60:.1f} min", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    commits = sorted({run["commit"] for run in runs})  # one, unless HEAD moved between the runs
    record = {"machine": machine_info, "command": " ".join(["sao bench fresh", *argv]), "commit": ", ".join(commits),
              "warm_pip_cache": args.warm_pip_cache, "wall_s": time.perf_counter() - started, "runs": runs,
              "summary": summary(runs)}
    publish("fresh-clone", record, _markdown(record), out=args.out_json, results_md=args.results_md, quick=False,
            default_json=DEFAULT_JSON, default_results=DEFAULT_RESULTS)
    return 0
