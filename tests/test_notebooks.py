"""The notebooks run headless top to bottom (nbclient, a kernel on this venv's Python) against
the real engine, each in under 2 minutes; the committed notebooks carry no outputs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
LIMIT_S = 120.0
KERNEL = "colibri-test"


def test_there_are_notebooks():
    names = [p.stem for p in NOTEBOOKS]
    assert names[:4] == [
        "01_quickstart",
        "02_routing_analysis",
        "03_tiers_and_offload",
        "04_perf_breakdown",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    """`make strip-notebooks` before committing."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert "widgets" not in nb.metadata  # saved widget state (it holds rendered images)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]
            assert "execution" not in cell.metadata, cell.source[:60]


@pytest.fixture(scope="module")
def kernel_specs(tmp_path_factory) -> KernelSpecManager:
    """A kernelspec for exactly this interpreter, so no user-level `python3` spec can win."""
    folder = tmp_path_factory.mktemp("kernels")
    spec = folder / KERNEL
    spec.mkdir()
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    return KernelSpecManager(kernel_dirs=[str(folder)], ensure_native_kernel=False)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, kernel_specs, tmp_path):
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name=KERNEL, kernel_spec_manager=kernel_specs)
    client = NotebookClient(
        nb, km=km, timeout=LIMIT_S, resources={"metadata": {"path": str(path.parent)}}
    )
    t0 = time.monotonic()
    client.execute()
    elapsed = time.monotonic() - t0
    nbformat.write(nb, tmp_path / path.name)  # executed copy, for a look after a failure
    print(f"{path.name}: {elapsed:.1f} s")
    assert elapsed < LIMIT_S, f"{path.name} took {elapsed:.0f} s"
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the notebook shows no figure"
