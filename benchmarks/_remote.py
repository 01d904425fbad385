"""Calling a benchmark's function in another Python environment (the vLLM one: vLLM cannot be imported
beside this project's own environment)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

__all__ = ["call_in_python"]


def call_in_python(python: str, module: str, function: str, *arguments: Any, timeout_s: float = 900) -> Any:
    """``module.function(*arguments)`` in a fresh process of ``python`` (arguments and result as JSON).

    Raises:
        RuntimeError: the process failed or printed no result (the end of its stderr is in the message).
    """
    code = (f"import json, sys\nimport {module} as target\n"
            f"print('RESULT ' + json.dumps(target.{function}(*json.loads(sys.argv[1]))), flush=True)")
    done = subprocess.run([python, "-c", code, json.dumps(arguments)], capture_output=True, text=True,
                          timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{module}.{function} failed in {python} (exit {done.returncode}): "
                           f"{done.stderr.strip()[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))
