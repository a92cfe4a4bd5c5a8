"""Every notebook in notebooks/ runs top to bottom (nbclient, a fresh python3 kernel), and is stored without
outputs. The executed copies are saved as artifacts (``$MMLORA_ARTIFACTS`` or ``artifacts/`` at the
repository root) under ``notebooks/``.

Needs: ``pip install nbclient nbformat ipykernel matplotlib pandas``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install nbformat")
nbclient = pytest.importorskip("nbclient", reason="pip install nbclient")
pytest.importorskip("ipykernel", reason="the notebooks run in a python3 kernel: pip install ipykernel")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 900


def test_there_are_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS][:2] == ["01_quickstart.ipynb", "02_backends.ipynb"], NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; strip them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.monotonic()
    try:
        client.execute()
    finally:
        out = Path(os.environ.get("MMLORA_ARTIFACTS", REPO / "artifacts")) / "notebooks"
        out.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out / path.name)
    seconds = time.monotonic() - start
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
    print(f"{path.name}: ran in {seconds:.0f} s; executed copy in {out / path.name}")
