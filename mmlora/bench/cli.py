"""What every benchmark command line shares: defaults in --help, a progress bar, target marks, quiet deps."""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default and keeps the module docstring's line breaks."""


class BenchParser(argparse.ArgumentParser):
    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        kwargs.setdefault(
            "help", "(default: %(default)s)"
        )  # argparse shows nothing for an option without help
        return super().add_argument(*args, **kwargs)


def make_parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    return BenchParser(prog=prog, description=description, formatter_class=HelpFormatter)


def quiet_third_party() -> None:
    """Benchmarks print their own table only: transformers', PEFT's and Python's warnings are hushed."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("transformers", "peft", "accelerate", "torch", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def progress(runs: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """A tqdm bar over a benchmark's runs (on stderr, so the results on stdout stay clean)."""
    from tqdm.auto import tqdm

    yield from tqdm(runs, desc=desc, total=total, unit="run", leave=False)


def target_mark(value: Any, target: float, *, at_least: bool = True) -> str:
    """``met`` or ``MISSED`` for a measured value against its target (``at_least``: higher is better)."""
    if value is None:
        return "not measured"
    ok = value >= target if at_least else value <= target
    return "met" if ok else "MISSED"


def precheck_backend_names(argv: list[str]) -> None:
    """``--lora-backend`` and ``--attention-backend`` checked before a benchmark's module (and so torch)
    is imported: a misspelt backend is one line and exit status 2 in a fraction of a second. Options a
    benchmark does not take are left to its own parser."""
    from mmlora.config import EngineConfig
    from mmlora.preflight import check_backend_names, exit_on_config_error

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--lora-backend", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    args, _ = parser.parse_known_args(argv)
    config = exit_on_config_error(
        EngineConfig.from_kwargs, lora_backend=args.lora_backend, attention_backend=args.attention_backend
    )
    exit_on_config_error(check_backend_names, config)


def check_engine_options(**engine_kwargs: Any) -> None:
    """The engine options a benchmark will use, checked before anything loads: one line, exit status 2."""
    from mmlora.config import EngineConfig
    from mmlora.preflight import check_engine_config, exit_on_config_error

    config = exit_on_config_error(EngineConfig.from_kwargs, **engine_kwargs)
    exit_on_config_error(check_engine_config, config)
