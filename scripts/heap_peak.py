"""The heap memory one inference forward adds, every allocation counted, beside the figure the
study and the bench report (torch.profiler's allocation records, which see only what torch
allocates, not the C kernels' own scratch and weight packs).

    python scripts/heap_peak.py [--quick]

Builds scripts/heap_peak.c (an LD_PRELOAD shim over malloc and free) with gcc and runs itself
again under it. For the study's MLP (2048 tokens, 768 -> 3072 -> 3072 -> 768 GELU) and GeGLU
block (8192 tokens, 768 -> 3072 -> 768) in float32 and bfloat16, prints per variant (eager,
fused, fused+compile) the peak of live heap bytes during one forward above those live before
it, and the profiler's figure. --quick: small shapes, no compile (the test's run).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM_SOURCE = Path(__file__).with_name("heap_peak.c")
MIB = 2**20


def shim() -> ctypes.CDLL | None:
    """The preloaded shim, or None when this process runs without it."""
    process = ctypes.CDLL(None)
    if not hasattr(process, "heap_reset"):
        return None
    process.heap_live.restype = process.heap_peak.restype = ctypes.c_longlong
    return process


def rerun_under_shim() -> int:
    with tempfile.TemporaryDirectory() as out:
        library = Path(out) / "heap_peak.so"
        subprocess.run(["gcc", "-std=c11", "-O2", "-shared", "-fPIC", "-o", str(library),
                        str(SHIM_SOURCE), "-ldl"], check=True)
        env = {**os.environ, "LD_PRELOAD": str(library)}
        return subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode


def blocks(quick: bool):
    """(name, rows, features, eager module, fused module) per block, built in float32."""
    import fusedmlp
    from fusedmlp.modules import FusedGatedMLP
    from fusedmlp.tools.eager_blocks import GatedBlock, linear_chain

    dim, hidden = (16, 48) if quick else (768, 3072)
    mlp = linear_chain((dim, hidden, hidden, dim), "gelu")
    gated = GatedBlock(dim, hidden, "gelu_tanh")
    fused_gated = FusedGatedMLP(dim, hidden, activation="gelu_tanh", bias=False)
    fused_gated.load_state_dict(gated.state_dict())
    yield "mlp", 64 if quick else 2048, dim, mlp, fusedmlp.convert(mlp)
    yield "gated", 256 if quick else 8192, dim, gated, fused_gated


def heap_peak(counter: ctypes.CDLL, call) -> int:
    """Peak live heap bytes during call() above those live before it."""
    import torch

    with torch.inference_mode():
        call()  # warm: lazy initialisation and compiling stay out of the count
        counter.heap_reset()
        before = counter.heap_live()
        output = call()
        peak = counter.heap_peak() - before
    del output
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, no compile")
    args = parser.parse_args()
    counter = shim()
    if counter is None:
        return rerun_under_shim()
    import torch
    from fusedmlp.tools.memory import inference_peak

    cpu = torch.device("cpu")
    print(f"{'block':<6} {'dtype':<9} {'variant':<14} {'heap MiB':>9} {'profiler MiB':>13}")
    for dtype in (torch.float32, torch.bfloat16):
        dtype_name = str(dtype).removeprefix("torch.")
        for name, rows, features, eager, fused in blocks(args.quick):
            eager, fused = eager.to(dtype), fused.to(dtype)
            x = torch.randn(rows, features, dtype=dtype)
            variants = {"eager": eager, "fused": fused}
            if not args.quick:
                variants["fused+compile"] = torch.compile(fused)
            for variant, module in variants.items():
                heap = heap_peak(counter, lambda module=module, x=x: module(x))
                profiled = inference_peak(module, x, cpu)
                print(f"{name:<6} {dtype_name:<9} {variant:<14} {heap / MIB:>9.2f} "
                      f"{profiled / MIB:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
