"""Writes tasks.jsonl: 300 shopping questions whose answer needs the shop's prices, which only the
tool function ``price`` (shop.py) knows. Run from the repository root:
``python examples/tool_use/make_data.py`` (the file is committed; this says how it was made)."""

import json
import random
from pathlib import Path

from shop import price

ITEMS = ("pen", "notebook", "eraser", "ruler", "stapler", "folder")

if __name__ == "__main__":
    rng = random.Random(11)
    rows, seen = [], set()
    while len(rows) < 300:
        first, second = rng.sample(ITEMS, 2)
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if (first, second, a, b) in seen:
            continue
        seen.add((first, second, a, b))
        rows.append({"prompt": f"How many cents do {a} {first}s and {b} {second}s cost? "
                               "The tool can call price(item).",
                     "answer": a * price(first) + b * price(second), "info": {"items": [first, second]}})
    path = Path(__file__).with_name("tasks.jsonl")
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} tasks to {path}")
