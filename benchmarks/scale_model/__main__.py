"""``python -m benchmarks.scale_model [ARGS]``, the same as ``sao bench scale [ARGS]``."""

import sys

from benchmarks.scale_model.cli import main

raise SystemExit(main(sys.argv[1:]))
