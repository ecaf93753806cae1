"""basedpyright ``--verifytypes`` on the package: the public API's type completeness must be 100%.

Without torch installed, the torch-only subpackage ``metrale_model_engine.reference``
cannot be resolved (its classes derive from ``torch.nn.Module``), nor, without torch
and the serve extra, ``metrale_model_engine.serve`` (its bodies derive from pydantic's
``BaseModel``): then every symbol outside them must be complete, and those inside are
counted, not failed; the run with torch and every extra (Python 3.11 in CI) checks
them.  Exit status 0 on success, 1 otherwise.

    python scripts/verify_types.py   # with the virtual environment's python, basedpyright on PATH
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A subpackage and the packages it needs to resolve.
NEEDS = {"metrale_model_engine.reference": ("torch",), "metrale_model_engine.serve": ("torch", "fastapi", "pydantic")}


def main() -> int:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    command = [str(bin_dir / "basedpyright"), "--pythonpath", sys.executable, "--verifytypes", "metrale_model_engine"]
    json_run = [*command, "--ignoreexternal", "--outputjson"]  # its status is non-zero below 100%: read the report
    run = subprocess.run(json_run, check=False, capture_output=True, text=True, env=env)
    report = json.loads(run.stdout)["typeCompleteness"]
    incomplete = [s["name"] for s in report["symbols"] if not s["isTypeKnown"] or s["isTypeAmbiguous"]]
    score = report["completenessScore"]
    unresolved = tuple(
        f"{package}." for package, needs in NEEDS.items() if any(importlib.util.find_spec(n) is None for n in needs)
    )
    excused = [name for name in incomplete if name.startswith(unresolved)]
    failing = [name for name in incomplete if name not in excused]
    print(f"type completeness: {score:.1%} of {report['exportedSymbolCounts']['withKnownType'] + len(incomplete)}"
          f" exported symbols")  # fmt: skip
    if excused:
        print(f"{len(excused)} symbols of {', '.join(p.rstrip('.') for p in unresolved)} unresolved without the "
              "packages they need (checked where those are installed)")  # fmt: skip
    for name in failing:
        print(f"incomplete: {name}")
    if failing:
        subprocess.run([*command, "--ignoreexternal"], env=env, check=False)  # the readable report
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
