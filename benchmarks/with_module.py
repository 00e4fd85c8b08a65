"""Runs a benchmark script with one of the project's modules taken from another file, e.g. an older version of a
kernel, to time it against today's in the same GPU session (the two in separate processes, same machine):

    git show <commit>:pallas_kernels/nvfp4_fused_moe.py > /tmp/old.py
    python3 benchmarks/with_module.py pallas_kernels.nvfp4_fused_moe /tmp/old.py \\
        benchmarks/moe/mgpu_probe.py --variants '[{}]' --tokens 1,2 --spans

The file is imported under the module's name before the script runs, so every import of that module (the
script's and the project's own) gets it.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys


def use_module_from(name: str, path: str):
    """Imports the file at `path` as module `name` (registered in sys.modules) and returns it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    package, _, attribute = name.rpartition(".")
    if package:  # `from package import attribute` reads the package's attribute
        setattr(importlib.import_module(package), attribute, module)
    return module


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    name, path, script, *arguments = sys.argv[1:]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    use_module_from(name, path)
    print(f"with_module: {name} from {path}", flush=True)
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
