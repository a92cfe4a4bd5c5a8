"""``python -m mmlora.bench`` with triton-auto's decode graphs limited to the per-row layout (BGMV), as
before the ``runs`` layout: the "before" side of an A/B in one device call (issue 13).

    PYTHONPATH=. python benchmarks/scripts/rows_only_graphs.py serving [bench options]
"""

import sys

from mmlora.backends.triton_auto import TritonAutoBackend
from mmlora.bench.__main__ import main

TritonAutoBackend.graph_layouts = ("rows",)
sys.exit(main(sys.argv[1:]))
