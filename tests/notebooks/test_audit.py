"""notebooks/audit.ipynb runs top to bottom against a tiny finished run (no Ray): termination reasons,
the versions behind one trajectory, staleness and DIS masking, MoE routing disagreement and experts' load,
a step's snapshot, and a bit-exact
replay of that step. The notebook's own asserts check the answers."""

import re
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from sao.lake.store import Lake
from sao.train.loop import prepare_run, run_training
from tests.train.test_loop import make_config, roll_out

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "audit.ipynb"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, policy_dir, tokenizer):
    """Run ``audit`` with two committed steps on eight real trajectories; returns the lake root."""
    root = tmp_path_factory.mktemp("audit")
    cfg = make_config(root, policy_dir, run_id="audit", total_steps=2)
    prepare_run(cfg)
    roll_out(policy_dir, tokenizer, Lake.open(cfg.lake), cfg.run_id, 8)
    run_training(cfg)
    return cfg.lake.root


def execute(tmp_path, monkeypatch, lake_root: str, run_id: str) -> nbformat.NotebookNode:
    monkeypatch.setenv("SAO_LAKE", lake_root)
    monkeypatch.setenv("SAO_RUN_ID", run_id)
    monkeypatch.delenv("SAO_STEP", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    kernel = KernelManager(kernel_name="python3", transport="ipc")  # no TCP ports for the kernel
    kernel.ip = str(tmp_path / "kernel")
    client = NotebookClient(notebook, km=kernel, timeout=300, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return notebook


def test_the_committed_notebook_has_no_outputs_and_a_parameters_cell():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    assert 'os.environ.get("SAO_LAKE"' in code[0].source and 'os.environ.get("SAO_RUN_ID"' in code[0].source


def test_the_audit_notebook_runs_against_a_tiny_run(tiny_run, tmp_path, monkeypatch):
    notebook = execute(tmp_path, monkeypatch, tiny_run, "audit")
    text = "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.outputs)
    assert "run audit: steps 0..1; auditing step 1" in text
    assert "step 1: v1 -> v2" in text and "metrics equal" in text
    assert "read trajectories at Delta version" in text
    # The tiny MoE policy's engine records routing; both steps replay it and report its metrics.
    assert re.search(r"routing: \d+ \(version, layer, expert\) loads from [1-9]\d* selections; 2 steps with", text)


def test_the_audit_notebook_fails_on_an_unknown_run(tiny_run, tmp_path, monkeypatch):
    with pytest.raises(CellExecutionError, match="run 'nobody' has no steps"):
        execute(tmp_path, monkeypatch, tiny_run, "nobody")
