"""``python -m mmlora.bench <subcommand> [options]``: one entry point for the benchmarks.

Each subcommand is a module with ``main(argv: list[str] | None) -> object``; add a line to
``SUBCOMMANDS`` to register another. Modules are imported only when chosen (some set environment
variables, such as ``TRITON_INTERPRET``, before their first Triton import).
"""

from __future__ import annotations

import importlib
import sys

from mmlora.bench.cli import precheck_backend_names, quiet_third_party

SUBCOMMANDS: dict[str, str] = {
    "kernels": "mmlora.bench.kernels",
    "attention": "mmlora.bench.attention",
    "cpu": "mmlora.bench.cpu",
    "serving": "mmlora.bench.serving",
    "adapters": "mmlora.bench.adapters",
    "profile": "mmlora.bench.profile",
    "cluster": "mmlora.bench.cluster",
    "soak": "mmlora.bench.soak",
    "grammar": "mmlora.bench.grammar",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        names = ", ".join(sorted(SUBCOMMANDS))
        sys.stderr.write(
            f"usage: python -m mmlora.bench {{{names}}} [options]  (--help after one for its options)\n"
        )
        return 2
    precheck_backend_names(argv[1:])
    quiet_third_party()
    importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
