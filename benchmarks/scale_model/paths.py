"""Where the scaling model reads the component benchmarks' results, and where its outputs go."""

from __future__ import annotations

from pathlib import Path

__all__ = ["RESULTS_DIR", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""
RESULTS_DIR = ROOT / "docs" / "results"
"""The benchmarks' JSON results: ``rollout.json`` and ``lake.json`` are read, ``scale.json`` written."""
