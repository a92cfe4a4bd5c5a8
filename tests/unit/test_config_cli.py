"""The command line generated from the config dataclasses (mmlora.config.add_cli_args)."""

from __future__ import annotations


def test_generated_help_renders_every_option_text_and_its_percent_signs() -> None:
    """``--help`` of the generated command line: argparse %-formats help strings, so an option documented
    with "6-12%" crashed ``launch_server --help``; each option's help text comes out as written."""
    import argparse
    import dataclasses

    from mmlora.config import ENGINE_SECTIONS, add_cli_args

    parser = argparse.ArgumentParser(formatter_class=lambda prog: argparse.HelpFormatter(prog, width=10**6))
    add_cli_args(parser, *ENGINE_SECTIONS)
    text = parser.format_help()
    texts = [
        f.metadata["help"]
        for cls in ENGINE_SECTIONS
        for f in dataclasses.fields(cls)
        if f.metadata.get("help")
    ]
    assert any("%" in t for t in texts)  # the case this guards
    for t in texts:
        assert " ".join(t.split()) in " ".join(text.split())


def test_weight_layout_is_checked_and_reaches_the_config_from_the_command_line() -> None:
    """``--weight-layout``: generated from ModelConfig, parsed into the engine config; an unknown layout
    is a ValueError naming the option, and ``bench serving`` passes its own flag on."""
    import argparse

    import pytest

    from mmlora.bench.serving_cli import parse_args
    from mmlora.config import ENGINE_SECTIONS, EngineConfig, add_cli_args, engine_config_from_cli

    parser = argparse.ArgumentParser()
    add_cli_args(parser, *ENGINE_SECTIONS)
    config = engine_config_from_cli(parser.parse_args(["--weight-layout", "column-major"]))
    assert config.model.weight_layout == "column-major"
    assert EngineConfig.from_kwargs().model.weight_layout == "row-major"
    with pytest.raises(ValueError, match='weight_layout: must be "row-major" or "column-major"'):
        EngineConfig.from_kwargs(weight_layout="diagonal")
    assert parse_args(["--model", "dummy:tiny-llama"], "serving").weight_layout == "row-major"
    args = parse_args(["--model", "dummy:tiny-llama", "--weight-layout", "column-major"], "serving")
    assert args.weight_layout == "column-major"
    with pytest.raises(SystemExit):
        parse_args(["--model", "dummy:tiny-llama", "--weight-layout", "diagonal"], "serving")
