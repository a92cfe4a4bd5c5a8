"""``python -m mmlora.bench`` with eager forwards ordering their requests by adapter slot (as the CUDA-graph
runner orders decode rows): the "B" side of an in-call A/B of that ordering, which session 7 tried
(``da01bbd``) and reverted (``bdc497a``) when mixed steps measured slower with it, cause unknown.

    PYTHONPATH=. python benchmarks/scripts/slot_ordered_eager.py serving [bench options]
"""

import sys

from mmlora.bench.__main__ import main
from mmlora.engine.model_runner import ModelRunner
from mmlora.engine.scheduler import ScheduledBatch

_forward = ModelRunner.forward


def forward(self: ModelRunner, sched: ScheduledBatch):  # noqa: ANN201
    if self.decode_graphs is not None and self.decode_graphs.can_run(sched):
        return _forward(self, sched)
    order = sorted(range(len(sched)), key=lambda b: sched.requests[b].slot)
    permuted = ScheduledBatch([sched.requests[b] for b in order], [sched.num_new[b] for b in order])
    logits, sampling = _forward(self, permuted)
    return logits, [order[b] for b in sampling]


ModelRunner.forward = forward
sys.exit(main(sys.argv[1:]))
