"""benchmarks/with_module.py: a script runs with one of the project's modules taken from another file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_script_and_the_project_import_the_other_file(tmp_path):
    replacement = tmp_path / "old_tiles.py"
    replacement.write_text("HOPPER = 'from the other file'\n")
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "from pallas_kernels import mgpu_tiles\n"
        "import pallas_kernels.mgpu_tiles as by_path\n"
        "print(mgpu_tiles.HOPPER, by_path.HOPPER, sys.argv[1:])\n")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/with_module.py"), "pallas_kernels.mgpu_tiles",
                           str(replacement), str(script), "--flag", "1"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "from the other file from the other file ['--flag', '1']"


def test_too_few_arguments_print_the_usage():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/with_module.py"), "pallas_kernels.mgpu_tiles"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "Runs a benchmark script" in done.stderr
