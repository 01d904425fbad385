"""Writes train.jsonl: 600 word problems of the built-in policy's kind (a * b + c and its variants),
in the columns any JSONL task file has: ``prompt`` (a string), ``answer`` and ``info``. Run from the
repository root: ``python examples/math_jsonl/make_data.py`` (the file is committed; this says how it
was made)."""

import json
from pathlib import Path

from sao.envs.math_tool import MathToolConfig, generate_tasks

if __name__ == "__main__":
    tasks = generate_tasks(MathToolConfig(seed=7, num_train=600, num_heldout=0))
    rows = [{"prompt": t.prompt, "answer": int(t.answer), "info": {"source": "generated, seed 7"}} for t in tasks]
    path = Path(__file__).with_name("train.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} tasks to {path}")
