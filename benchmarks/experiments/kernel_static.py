"""python benchmarks/experiments/kernel_static.py          (CPU only: compiles for sm_90 ahead of time)

Static cost of the fused AdamW step's specializations (kernels/adamw_fused.py), without a GPU:
each is compiled by triton.compile for GPUTarget("cuda", 90, 32) with the exact constexprs that
kernels/adamw_launch.py launches it with for the 1.31B set of benchmarks/whole_state_step.py
(bfloat16 p and g, master_bits=24, GROUP=128, EVEN, COMPRESSED, no AMSGrad, GradScaler or
maximize; FP8 moments at the default E4M3 with expansion) at the kernel's default launch
(adamw_fused's GROUPS_PER_PROGRAM, NUM_WARPS, MAX_REGISTERS). Reported per variant:
ttg.convert_layout and ttg.local_alloc ops in the TTGIR, the shared memory Triton allocates,
registers and spill bytes (ptxas -v, the ptxas Triton uses), PTX and SASS instruction counts, global
loads/stores by width in bytes, per thread (a [GPP, 128] tile: 8 elements a thread), and
the hot path: the SASS a thread runs when nothing is rare (slow-path calls, NaN/Inf branches and
the non-finite counters' atomics skipped), in all and on the integer/compare/select pipe ("alu":
half the FP32 pipe's rate on Hopper, so 2 * alu > hot means that pipe limits the issue).
The numbers are the imported Triton's: the H200 runs 3.6, whose layouts differ (the 4-bit step's
shared-memory shuffles showed only there); to see them, install its wheel into a folder
(pip install --no-deps --target DIR triton==3.6.0) and put DIR first on PYTHONPATH.
Writes benchmarks/experiments/results/kernel_static.json.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # compile the GPU code (kernels read this when imported)

import triton  # noqa: E402
from coatstate.formats.fp4_moment import FP4Format  # noqa: E402
from coatstate.formats.fp8 import FP8Format  # noqa: E402
from coatstate.formats.optimizer_state import MomentFormat  # noqa: E402
from coatstate.kernels import adamw_fused as K  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from common import result_meta  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
FP8 = MomentFormat(FP8Format.E4M3, True)
VARIANTS = {
    "fp8 m + fp8 v (expand)": (FP8, FP8),
    "fp8 m + fp8 v (no expand)": (MomentFormat(FP8Format.E4M3, False), MomentFormat(FP8Format.E4M3, False)),
    "4-bit m + 4-bit v": (MomentFormat(FP4Format.E2M1, False), MomentFormat(FP4Format.UE3M1_SQRT, False)),
    "fp8 m + 4-bit v": (FP8, MomentFormat(FP4Format.UE3M1_SQRT, False)),
}
POINTERS = {
    "p_base": "*bf16", "g_base": "*bf16", "m_base": "*u8", "v_base": "*u8", "x_base": "*u8", "c_base": "*i8",
    "table_ptr": "*i64", "meta_ptr": "*i64", "blocks_ptr": "*i32", "hyper_ptr": "*fp32",
    "scalars_ptr": "*fp32", "found_inf_ptr": "*fp32", "grad_scale_ptr": "*fp32", "nonfinite_ptr": "*i32",
}  # fmt: skip


def compile_variant(fm: MomentFormat, fv: MomentFormat, grad: str):
    fn = K._adamw_kernel
    pointers = {**POINTERS, "g_base": grad}
    constexprs = dict(
        COMPRESSED=True, AMSGRAD=False, MAXIMIZE=False, HAS_SCALE=False, HAS_INF=False,
        GROUP=128, GPP=K.GROUPS_PER_PROGRAM, EVEN=True, MASTER=24,
        **K.format_constexprs(fm, fv),
    )  # fmt: skip
    signature = {n: pointers.get(n, "constexpr") for n in fn.arg_names}
    # torch tensors are 16-byte aligned: the launcher's JIT specializes pointers as divisible by 16
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=K.launch_options())


SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def ptx_instructions(ptx: str) -> int:
    lines = (ln.strip() for ln in ptx.splitlines())
    return sum(ln.endswith(";") and not ln.startswith((".", "//", "{", "}")) for ln in lines)


def disassemble(cubin: bytes) -> list[tuple[str, str, str]]:
    """(label or "", instruction text, its source line's text) in order (nvdisasm -g line info)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", "-g", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    out, src, label = [], "", ""
    for ln in sass.splitlines():
        if m := re.search(r'File "([^"]+)", line (\d+)', ln):
            src = (_source_lines(m.group(1)) + [""] * int(m.group(2)))[int(m.group(2)) - 1]
        elif m := re.match(r"^(\.L_x_\d+):", ln.strip()):
            label = m.group(1)
        elif m := SASS_LINE.search(ln):
            out.append((label, ln[m.start(1) :].strip(), src))
            label = ""
    return out


@functools.cache
def _source_lines(path: str) -> list[str]:
    return open(path).read().splitlines() if os.path.exists(path) else []


ALU = set("LOP3 SHF ISETP FSETP SEL FSEL FMNMX IMNMX VIMNMX PRMT IADD3 LEA SGXT VIADD P2R PLOP3 FCHK".split())


def hot_path(ins: list[tuple[str, str, str]]) -> collections.Counter:
    """Opcodes a thread runs when nothing is rare: from the entry to the first EXIT, where a forward
    conditional branch skips its region if that holds a slow-path CALL or an atomic (the non-finite
    counters) or if the branch is a source line marked `# rare`, and falls through otherwise; so
    does BRA.DIV (a warp-synchronous shuffle's check for a diverged warp: one-warp launches have
    them, and jumping there would skip the rest of the kernel's hot path)."""
    at = {lab: i for i, (lab, _, _) in enumerate(ins) if lab}
    i, ops = 0, collections.Counter()
    while i < len(ins):
        _, text, src = ins[i]
        op = SASS_LINE.search("/*0000*/ " + text).group(1).split(".")[0]
        ops[op] += op != "NOP"
        if op == "EXIT" and not text.startswith("@"):
            break
        target = re.search(r"`\((\.L_x_\d+)\)", text)
        if text.startswith("BRA.DIV"):  # taken only by a diverged warp (shuffles' fallback)
            i += 1
            continue
        if op == "BRA" and target and at.get(target.group(1), -1) > i:
            j = at[target.group(1)]
            region = " ".join(t for _, t, _ in ins[i + 1 : j])
            if not text.startswith("@") or "# rare" in src or re.search(r"\b(CALL|ATOMG?|RED)\b", region):
                i = j
                continue
        i += 1
    return ops


def sass_stats(cubin: bytes) -> dict:
    ins = disassemble(cubin)
    ops = [o for o in (SASS_LINE.search("/*0000*/ " + t).group(1) for _, t, _ in ins) if o != "NOP"]
    widths = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
    mem = collections.Counter()
    for o in ops:
        head, *mods = o.split(".")
        if head in ("LDG", "STG", "LDS", "STS", "LDL", "STL"):
            mem[f"{head} {next((widths[x] for x in mods if x in widths), 4)}B"] += 1
    kinds = collections.Counter(o.split(".")[0] for o in ops)
    hot = hot_path(ins)
    return {
        "instructions": len(ops), "hot_path": sum(hot.values()),
        "hot_path_alu": sum(n for k, n in hot.items() if k in ALU), "hot_path_mufu": hot["MUFU"],
        "memory": dict(sorted(mem.items())), "ops": {k: kinds[k] for k in ("BAR", "SHFL", "MUFU", "PRMT")},
    }  # fmt: skip


def ptxas_usage(ptx: str) -> dict:
    """registers and spill bytes, from ptxas -v with the flags Triton's make_cubin passes."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [os.path.join(BIN, "ptxas-blackwell"), "-lineinfo", "-v", "--regAllocOptLevel=2",
               "--gpu-name=sm_90a", path, "-o", path + ".o"]  # fmt: skip
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(re.search(pat, log).group(1))  # noqa: E731
    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores_B": num(r"(\d+) bytes spill stores"),
        "spill_loads_B": num(r"(\d+) bytes spill loads"),
        "stack_B": num(r"(\d+) bytes stack frame"),
    }


def analyse(ck) -> dict:
    ttgir = ck.asm["ttgir"]
    return {
        "convert_layout": len(re.findall(r"ttg\.convert_layout", ttgir)),
        "local_alloc": len(re.findall(r"ttg\.local_alloc", ttgir)),
        "shared_B": ck.metadata.shared,
        **ptxas_usage(ck.asm["ptx"]),
        "ptx_instructions": ptx_instructions(ck.asm["ptx"]),
        "sass": sass_stats(ck.asm["cubin"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grad", default="*bf16", help="gradient pointer type: *bf16 (the benchmark's) or *fp32")
    ap.add_argument("--out", default="benchmarks/experiments/results/kernel_static.json")
    ap.add_argument("--dump", default=None, help="folder to write each variant's TTGIR, PTX and SASS")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, without its warning
    rows = {}
    for name, (fm, fv) in VARIANTS.items():
        ck = compile_variant(fm, fv, args.grad)
        rows[name] = analyse(ck)
        for ext in ("ttgir", "ptx", "cubin") if args.dump else ():
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, re.sub(r"\W+", "_", name).strip("_") + "." + ext), "wb") as f:
                f.write(ck.asm[ext] if ext == "cubin" else ck.asm[ext].encode())
    cols = {
        "cvt": lambda r: r["convert_layout"], "alloc": lambda r: r["local_alloc"],
        "smem B": lambda r: r["shared_B"], "regs": lambda r: r["registers"],
        "spill B": lambda r: r["spill_stores_B"] + r["spill_loads_B"],
        "PTX": lambda r: r["ptx_instructions"],
        **{k: (lambda r, k=k: r["sass"][k]) for k in ("instructions", "hot_path", "hot_path_alu")},
        **{k: (lambda r, k=k: r["sass"]["memory"].get(k, 0))
           for k in ("LDG 1B", "LDG 4B", "LDG 16B", "STG 1B", "STG 4B", "STG 16B")},
        "BAR": lambda r: r["sass"]["ops"]["BAR"], "SHFL": lambda r: r["sass"]["ops"]["SHFL"],
    }  # fmt: skip
    heads = {"instructions": "SASS", "hot_path": "hot", "hot_path_alu": "hot alu"}
    print(f"Triton {triton.__version__}, sm_90, grad {args.grad}; per thread of 8 elements")
    print(f"{'variant':26s}" + "".join(f"{heads.get(c, c):>8s}" for c in cols))
    for name, r in rows.items():
        print(f"{name:26s}" + "".join(f"{get(r):>8d}" for get in cols.values()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        head = {"meta": result_meta(args), "triton": triton.__version__, "target": "sm_90", "grad": args.grad,
                "launch": {"groups_per_program": K.GROUPS_PER_PROGRAM, "num_warps": K.NUM_WARPS,
                           "max_registers": K.MAX_REGISTERS}}  # fmt: skip
        json.dump({**head, "variants": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
