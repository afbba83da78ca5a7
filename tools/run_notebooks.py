"""Execute the notebooks in place at full scale, outputs kept, as they are committed (a dev tool).

Each notebook runs in a kernel of this interpreter (a kernelspec written to a temporary Jupyter path, so a
``python3`` kernel found elsewhere on the machine cannot stand in), with ``KVROUTER_NOTEBOOK_SCALE=full``
unless ``--scale`` says otherwise, from the ``notebooks/`` directory.  A failing cell stops that notebook
and leaves its file untouched.

    .venv/bin/python tools/run_notebooks.py [notebooks/02_seeds_table.ipynb ...] [--timeout 7200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbclient
import nbformat
from ipykernel import kernelspec

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "kvrouter-notebooks"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    ap.add_argument("--scale", default="full", help="KVROUTER_NOTEBOOK_SCALE (full | small)")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds per cell")
    args = ap.parse_args()
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="kvrouter-jupyter-") as tmp:
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        kernelspec.write_kernel_spec(
            str(Path(tmp) / "kernels" / KERNEL), overrides={"argv": argv, "display_name": KERNEL}
        )
        os.environ.update(
            {"KVROUTER_NOTEBOOK_SCALE": args.scale, "JUPYTER_PATH": tmp, "JUPYTER_PLATFORM_DIRS": "1"}
        )
        for path in paths:
            t0 = time.monotonic()
            nb = nbformat.read(path, as_version=4)
            client = nbclient.NotebookClient(
                nb,
                kernel_name=KERNEL,
                timeout=args.timeout,
                resources={"metadata": {"path": str(path.parent)}},
            )
            try:
                client.execute()
            except nbclient.exceptions.CellExecutionError as e:
                print(f"{path.name}: a cell failed, file left as it was\n{e}", file=sys.stderr)
                return 1
            nbformat.write(nb, path)
            print(f"{path.name}: executed in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
