"""The arms of ``sao bench demo`` side by side: one table and one figure from their result files.

    sao bench demo --compare ARM.json [ARM.json ...] --against BASE.json --tag NAME

Each arm is a record that ``sao bench demo --seeds ... --set ...`` wrote; the base is the default's
record with the same seeds, evaluated on the same tasks with the same evaluation seed. Every arm is
paired with the base seed by seed (:func:`benchmarks.demo.paired`), and its runs' recorded figures are
gathered into one row: the held-out accuracy of each seed, the paired difference, the failed episodes
by class, the critic's fit and where its value moves at the first wrong token (with the demonstration
oracle's step there), value pretraining, the time. Over every run that recorded it, the range of the
critic's step there and of the oracle's. Nothing is run again: every figure is read from the records,
so the table and the figure can be made again from the committed files.

Writes ``docs/results/demo-NAME.json``, ``docs/results/demo-NAME.png`` and the section ``demo-NAME`` of
``docs/RESULTS.md``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks._report import machine, machine_line, save_figure

FAILURE_KINDS = ("tool_call", "answer")
"""The failure classes a row shows (structure failures are under 1% in every arm recorded)."""

OFF_PATH_KEYS = ("step_off_path", "step_on_path", "value_before", "oracle_step_off_path", "oracle_value_before")
"""The figures of :func:`benchmarks.demo.critic_off_path` a row gathers, early and late."""


def _span(values: list[float | None]) -> dict[str, float] | None:
    """Min and max of a figure over an arm's runs; None unless every run recorded it."""
    if not values or any(value is None for value in values):
        return None
    return {"min": min(values), "max": max(values)}


def _share(result: dict[str, Any], kind: str) -> float | None:
    """The share of the held-out tasks failed after training in class ``kind``; None: not recorded."""
    failures = result.get("failures_after")
    return None if not failures else failures.get(kind, 0) / result["eval_tasks"]


def _recorded(run: dict[str, Any], *keys: str) -> Any:
    """The figure a run recorded under ``keys`` (each a level of its record); None where a level is missing
    or None (a record written before the figure was)."""
    value: Any = run
    for key in keys:
        value = (value or {}).get(key)
    return value


def arm_row(record: dict[str, Any], base: dict[str, Any], file: str, *, is_base: bool) -> dict[str, Any]:
    """One arm's row: what its runs recorded, gathered, and (unless it is the base) its pairing with
    ``base``. Raises ValueError when its runs have no seed or do not pair with the base's."""
    from benchmarks.demo import _algorithm, paired
    from sao.train.config import UpdateConfig

    runs = record["runs"]
    if any(run.get("seed") is None for run in runs):
        raise ValueError(f"{file}: its runs have no seed (run it with --seeds): an arm pairs with the base by seed")
    runs = sorted(runs, key=lambda run: run["seed"])
    results = [run["result"] for run in runs]
    algorithm = _algorithm(record)
    own = [s for s in record["sets"] if s not in base["sets"]]
    failures = {kind: _span([_share(r, kind) for r in results]) for kind in FAILURE_KINDS}
    pretraining = [run.get("value_pretraining") for run in runs]
    return {
        "file": file, "tag": record.get("tag", ""), "sets": own, "algorithm": algorithm,
        "critic": UpdateConfig(algorithm=algorithm).uses_critic,
        "seeds": [run["seed"] for run in runs], "steps": results[0]["steps"], "eval_tasks": results[0]["eval_tasks"],
        "accuracy": [r["accuracy_after"] for r in results],
        "median": statistics.median(r["accuracy_after"] for r in results),
        "against": None if is_base else paired(base, runs),
        "failures": failures,
        "critic_fit_last": _span([_recorded(run, "critic_fit", "critic/explained_variance", "last") for run in runs]),
        "off_path": {when: {key: _span([_recorded(run, "critic_off_path", when, key) for run in runs])
                            for key in OFF_PATH_KEYS}
                     for when in ("first", "last")},
        "surprise_last": {key: _span([_recorded(run, "sampled_surprise", "last", key) for run in runs])
                          for key in ("all", "succeeded")},
        "pretraining_rollouts": sorted({p["num_train"] + p["num_heldout"] for p in pretraining if p}),
        "pretraining_explained_variance": _span([p["explained_variance_after"] if p else None for p in pretraining]),
        "train_min": _span([r["train_wall_s"] / 60 for r in results]),
        "wall_min": _span([run["wall_s"] / 60 for run in runs]),
        "trajectories": _span([r["trajectories"] for r in results]),
    }


def compare(base_file: Path, arm_files: list[Path]) -> dict[str, Any]:
    """The base's row and each arm's (in the order given; the base's file among them is skipped), and
    the ranges over every run that recorded the critic's step off the path."""
    base = json.loads(base_file.read_text())
    rows = [arm_row(base, base, str(base_file), is_base=True)]
    for path in arm_files:
        if path.resolve() == base_file.resolve():
            continue
        rows.append(arm_row(json.loads(path.read_text()), base, str(path), is_base=False))
    pooled = {}
    for when in ("first", "last"):
        spans = {}
        for key in OFF_PATH_KEYS:
            found = [row["off_path"][when][key] for row in rows if row["off_path"][when][key] is not None]
            spans[key] = None if not found else {"min": min(s["min"] for s in found),
                                                 "max": max(s["max"] for s in found)}
        counted = [row for row in rows if row["off_path"][when]["step_off_path"] is not None]
        spans["arms"], spans["runs"] = [row["tag"] for row in counted], sum(len(row["seeds"]) for row in counted)
        pooled[when] = spans
    return {"against": str(base_file), "arms": rows, "pooled_off_path": pooled}


def _range(span: dict[str, float] | None, digits: str, scale: float = 1.0, unit: str = "", sep: str = " to ") -> str:
    if span is None:
        return "not recorded"
    low, high = span["min"] * scale, span["max"] * scale
    return f"{low:{digits}}{unit}" if low == high else f"{low:{digits}}{unit}{sep}{high:{digits}}{unit}"


def _step(row: dict[str, Any], when: str) -> str:
    if not row["critic"]:
        return "no critic"
    spans = row["off_path"][when]
    if spans["step_off_path"] is None:
        return "not recorded"
    return f"{_range(spans['step_off_path'], '+.3f')} ({_range(spans['oracle_step_off_path'], '+.2f')})"


def _surprise(row: dict[str, Any]) -> str:
    spans = row["surprise_last"]
    if spans["all"] is None:
        return "not recorded"
    return f"{_range(spans['all'], '.3f')} ({_range(spans['succeeded'], '.4f')})"


def _accuracies(row: dict[str, Any], base: dict[str, Any]) -> str:
    """Each seed's accuracy, the seeds named where they are not the base's."""
    text = " / ".join(f"{a:.3f}" for a in row["accuracy"])
    return text if row["seeds"] == base["seeds"] else f"{text} (seed {', '.join(map(str, row['seeds']))})"


def _setting(row: dict[str, Any]) -> str:
    return ", ".join(f"`{s}`" for s in row["sets"]) if row["sets"] else "the demo config"


def markdown(record: dict[str, Any], name: str, figure: Path | None) -> str:
    from benchmarks.demo import TARGET_ACCURACY

    rows, base = record["arms"], record["arms"][0]
    seeds = " / ".join(map(str, base["seeds"]))
    lines = [
        f"## The demo's arms side by side (`sao bench demo --compare`) ({name.removeprefix('demo-')})",
        "",
        f"Command: `{record['command']}`. {machine_line(record['machine'])} Nothing was run: every "
        f"figure is read from the arms' result files (first column) and the base's, `{record['against']}`. "
        f"Raw data: `docs/results/{name}.json`.",
        "",
        f"Every run: {base['steps']} steps of the demo config (an arm's own settings in the second column), "
        f"held-out sampled accuracy on {base['eval_tasks']} tasks, each arm paired seed by seed with the base "
        "(the same seeds, tasks and evaluation seed): the mean difference and its standard error over the "
        "seeds. Ranges are min to max over an arm's seeds. The critic's step is `V(after) - V(before)` at the "
        "first token where a failed rollout leaves its task's demonstration (a copy error's first wrong digit), "
        "over the failed rollouts trained in the first 25 steps (the critic after value pretraining) and the "
        "last 25 (the last critic); in brackets the demonstration oracle's step at the same tokens. The "
        "sampled tokens' mean `-log p` (their probability as the engine recorded it, at temperature 1) "
        "estimates the policy's entropy per token where it went.",
        "",
        f"| arm (file) | setting | held-out accuracy, seeds {seeds} | median | vs the base, seed by seed | failed "
        "after training: tool call / answer | critic's explained variance, last 25 steps | value pretraining: "
        "rollouts, held-out explained variance | critic's step at the first wrong token, first 25 steps (oracle's) "
        "| the same, last 25 steps (oracle's) | mean -log p of a sampled action token, last 25 steps (of the "
        "successful rollouts) | trajectories "
        "| training (min) | wall (min) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        against = row["against"]
        versus = "(the base)" if against is None else (
            f"{against['mean_diff']:+.3f}" + ("" if against["stderr"] is None else f" ± {against['stderr']:.3f}"))
        failures = " / ".join(_range(row["failures"][kind], ".1f", 100, "%", "-") for kind in FAILURE_KINDS)
        fit = _range(row["critic_fit_last"], ".2f", sep="-") if row["critic"] else "no critic"
        rollouts = ", ".join(map(str, row["pretraining_rollouts"])) or "none"
        pretraining = "none" if not row["pretraining_rollouts"] else (
            f"{rollouts}, {_range(row['pretraining_explained_variance'], '.2f')}")
        lines.append(
            f"| {row['tag'] or 'base'} (`{Path(row['file']).name}`) | {_setting(row)} | "
            f"{_accuracies(row, base)} | {row['median']:.3f} | {versus} | {failures} | {fit} "
            f"| {pretraining} | {_step(row, 'first')} | {_step(row, 'last')} | {_surprise(row)} | "
            f"{_range(row['trajectories'], ',.0f', sep='-')} | {_range(row['train_min'], '.1f', sep='-')} | {_range(row['wall_min'], '.1f', sep='-')} |")
    passing = [row["tag"] or "base" for row in rows if row["median"] > TARGET_ACCURACY]
    lines += ["", f"Arms whose median passes {TARGET_ACCURACY}: {', '.join(passing) if passing else 'none'}."]
    last = record["pooled_off_path"]["last"]
    if last["runs"]:
        lines += [
            "",
            f"Over the {last['runs']} runs of the arms that recorded it ({', '.join(last['arms'])}), the last "
            "critic's value "
            f"moves by {_range(last['step_off_path'], '+.3f')} at a failed rollout's first wrong token, and by "
            f"{_range(last['step_on_path'], '+.3f')} a token on average at the right tokens before it; its "
            f"value before the wrong token averages {_range(last['value_before'], '.2f')} over a run's failed "
            f"rollouts. The oracle's value, under the same policy, moves by "
            f"{_range(last['oracle_step_off_path'], '+.2f')} there, from {_range(last['oracle_value_before'], '.2f')}.",
        ]
    if figure is not None:
        lines += ["", f"![{name}](results/{figure.name})"]
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> Path:
    """Each arm's difference from the base, seed by seed (dots) and their mean with two standard errors;
    the dashed line is what the base's median needs to pass the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.demo import TARGET_ACCURACY

    rows = [row for row in record["arms"] if row["against"] is not None]
    base = record["arms"][0]
    figure, ax = plt.subplots(figsize=(7, 0.38 * len(rows) + 1.4))
    for y, row in enumerate(reversed(rows)):
        against = row["against"]
        diffs = [pair["diff"] for pair in against["pairs"]]
        ax.scatter(diffs, [y] * len(diffs), s=12, color="tab:blue", alpha=0.6, zorder=3)
        error = 0.0 if against["stderr"] is None else 2 * against["stderr"]
        ax.errorbar(against["mean_diff"], y, xerr=error, fmt="o", color="black", markersize=4, capsize=3, zorder=4)
    ax.axvline(0.0, color="grey", linewidth=1)
    ax.axvline(TARGET_ACCURACY - base["median"], color="tab:red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), [row["tag"] or "base" for row in reversed(rows)], fontsize=7)
    ax.set_xlabel(f"held-out accuracy minus the base's ({Path(record['against']).name}), seed by seed", fontsize=8)
    ax.set_title("dots: seeds; black: mean ± 2 standard errors over the seeds\n"
                 f"red dashed: the base's median + this = {TARGET_ACCURACY}", fontsize=8)
    return save_figure(figure, path)


def main(base_file: Path, arm_files: list[Path], name: str, argv: list[str], *, out: Path | None,
         results_md: Path | None) -> int:
    """``sao bench demo --compare``: the record, the figure beside it and the section ``name``."""
    from benchmarks._report import publish
    from benchmarks.demo import DEFAULT_JSON, DEFAULT_RESULTS

    record = {"machine": machine(), "command": " ".join(["sao bench demo", *argv]), **compare(base_file, arm_files)}
    json_path = out or DEFAULT_JSON.with_name(f"{name}.json")
    figure = plot(record, json_path.with_suffix(".png"))
    publish(name, record, markdown(record, name, figure), out=json_path, results_md=results_md, quick=False,
            default_json=json_path, default_results=DEFAULT_RESULTS)
    return 0
