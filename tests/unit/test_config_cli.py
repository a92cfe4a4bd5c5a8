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
