"""What Triton makes of the MoE kernels for an H100/H200 (sm_90), read on a CPU: the instruction mix
of each kernel's inner loop, per weight value.

It lowers `moe_gemm_kernel`'s two pallas_calls for CUDA (no GPU needed), compiles their Triton IR
with the `triton` wheel's own pipeline (TTIR passes, TTGIR, PTX, its bundled ptxas; the wheel comes
with torch, which the reference extra installs) and counts the
SASS instructions of every loop (a backward branch). The GPU runs XLA's copy of Triton, whose version
may differ from the wheel's: read the counts as a guide, and time on the GPU
(benchmarks/moe/decode_probe.py). How this was used: benchmarks/moe/RESULTS.md, run I.

    .venv/bin/python tools/pallas_sass.py --tokens 8 --format nvfp4 [--blocks "MoEBlocks(...)"] [--out DIR]

`--blocks` is a `pallas_kernels.moe_gemm.MoEBlocks(...)` expression (default: `choose_blocks`).
`--out` keeps the TTIR, TTGIR, PTX and SASS of each kernel.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing the package

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 256, 5120, 320, 8  # Beam's TP8 expert shape


def lower_to_triton_ir(tokens: int, fmt: str, blocks_expr: str | None, out: Path) -> tuple[list[Path], object]:
    """The Triton IR of each pallas_call of one MoE layer, as files; and the blocks used."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering, pallas_call_registration

    from pallas_kernels import moe_gemm as mg

    # Lower for an sm_90 GPU without one, and keep each kernel's module text.
    pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    modules = []
    lower = lowering.lower_jaxpr_to_triton_module

    def keep_module(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = keep_module
    spec = jax.ShapeDtypeStruct
    if fmt == "nvfp4":
        def weights(rows, cols):
            return mg.ExpertWeights(spec((EXPERTS, rows, cols // 2), jnp.uint8),
                                    spec((EXPERTS, rows, cols // 16), jnp.float8_e4m3fn),
                                    spec((EXPERTS,), jnp.float32), format="nvfp4")
    else:
        def weights(rows, cols):
            return mg.ExpertWeights(spec((EXPERTS, rows, cols), jnp.bfloat16))
    blocks = (eval(blocks_expr, {"MoEBlocks": mg.MoEBlocks}) if blocks_expr  # noqa: S307 - a developer's CLI argument
              else mg.choose_blocks(tokens, TOP_K, EXPERTS, HIDDEN, INTERMEDIATE, fmt))
    layer = (weights(INTERMEDIATE, HIDDEN), weights(INTERMEDIATE, HIDDEN), weights(HIDDEN, INTERMEDIATE))
    args = (spec((tokens, HIDDEN), jnp.bfloat16), spec((tokens, TOP_K), jnp.float32), spec((tokens, TOP_K), jnp.int32))
    kernel = lambda x, w, ids, gate, up, down: mg.moe_gemm_kernel(x, w, ids, gate, up, down, blocks=blocks)
    jax.jit(kernel).trace(*args, *layer).lower(lowering_platforms=("cuda",))
    paths = []
    for text in modules:
        name = re.search(r"module @(\w+)", text).group(1)
        paths.append(out / f"{name}.ttir")
        paths[-1].write_text(text)
    return paths, blocks


def compile_to_sass(ttir: Path, num_warps: int, num_stages: int) -> Path:
    """TTIR -> SASS with the triton wheel (run in its own process: its MLIR and jaxlib's stay apart)."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = ir.parse_mlir_module(str(ttir), context)
    module.context = context
    # The TTIR passes (combine, canonicalize, ...) that compiling from a .ttir file would skip.
    optimized = ttir.with_suffix(".opt.ttir")
    optimized.write_text(str(CUDABackend.make_ttir(module, {}, options, 90)))
    compiled = triton.compile(str(optimized), target=target, options=dict(num_warps=num_warps, num_stages=num_stages))
    for key in ("ttgir", "ptx"):
        ttir.with_suffix("." + key).write_text(compiled.asm[key])
    cubin = ttir.with_suffix(".cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = ttir.with_suffix(".sass")
    sass.write_text(subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout)
    return sass


def loop_instruction_counts(sass: str) -> list[collections.Counter]:
    """Opcode counts of every loop body (a label up to a branch back to it), in program order; the
    trap loop after the exit (a lone branch) is left out."""
    lines = sass.splitlines()
    labels = {m[1]: i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if target and labels.get(target[1], i) < i:
            body = lines[labels[target[1]]:i + 1]
            ops = (re.match(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", b) for b in body)
            counts = collections.Counter(m[1] for m in ops if m)
            if sum(counts.values()) > 1:
                loops.append(counts)
    return loops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--format", choices=("bf16", "nvfp4"), default="nvfp4")
    parser.add_argument("--blocks", help='e.g. "MoEBlocks(\'ids\', 16, 64, 128, 3, 128, 64, nvfp4_decode=\'packed\')"')
    parser.add_argument("--out", type=Path, help="keep the intermediate files here")
    parser.add_argument("--compile", type=Path, help=argparse.SUPPRESS)  # the child process's job
    parser.add_argument("--warps-stages", default="4,3", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile:
        print(compile_to_sass(args.compile, *map(int, args.warps_stages.split(","))))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="pallas_sass_"))
    out.mkdir(parents=True, exist_ok=True)
    paths, blocks = lower_to_triton_ir(args.tokens, args.format, args.blocks, out)
    print(f"T={args.tokens} {args.format} {blocks}")
    for ttir, (rows, k) in zip(paths, ((blocks.gate_up_n, blocks.gate_up_k), (blocks.down_n, blocks.down_k))):
        child = [sys.executable, __file__, "--compile", str(ttir), "--warps-stages",
                 f"{blocks.num_warps},{blocks.num_stages}"]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode:
            print(f"{ttir.stem}: compile failed:\n{done.stderr[-2000:]}")
            continue
        values_per_thread = rows * k / (32 * blocks.num_warps)  # weight values one K step gives a thread
        for counts in loop_instruction_counts(Path(done.stdout.strip()).read_text()):
            total = sum(counts.values())
            top = ", ".join(f"{op} {n}" for op, n in counts.most_common(12))
            print(f"{ttir.stem} loop: {total} instructions per K step, {total / values_per_thread:.2f} per weight "
                  f"value; {top}")


if __name__ == "__main__":
    main()
