"""Compile megamoe's Triton kernels for Hopper (sm_90) on any machine, GPU or not, and report their
resources: a kernel that fails to compile, outgrows shared memory or loses its software pipelining
shows up here before any GPU time is spent.

    python benchmarks/device/compile_check.py [--json]

Uses the ptxas and cuobjdump that ship inside the Triton wheel. The kernels are compiled with the
launchers' own compile-time arguments (megamoe.fused.persistent_constexprs / dw_constexprs, the
CUDA default configs) and with the specialisation a real launch gets on an H200 (every pointer and
H, I, E divisible by 16; the shapes below). Must run without TRITON_INTERPRET (the interpreter
replaces the kernels by Python functions at import). tests/megamoe/test_kernel_compile.py runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def _compile(fn, types: dict, consts: dict, divisible: tuple[str, ...], num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in divisible or (n.endswith("_ptr") and n not in consts)}
    return triton.compile(ASTSource(fn, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def arg_types(tname: str) -> dict:
    """The kernels' pointer arguments as a launch types them (x's dtype `tname` where it applies);
    pointers not named here are int32 (`_compile`'s default)."""
    types = {n: f"*{tname}" for n in ("x_ptr", "w13_ptr", "w2_ptr", "dy_ptr", "act_ptr", "hw_ptr", "slot_out_ptr",
                                      "out_ptr", "dgu_ptr", "dw13_ptr", "dw2_ptr", "gu_ptr", "xs_ptr", "dys_ptr", "y_ptr",
                                      "b13_ptr", "b2_ptr", "db13_ptr", "db2_ptr")}
    types.update(tw_ptr="*fp32", ids_ptr="*i64", dtw_part_ptr="*fp32", dtw_ptr="*fp32", ep_ptr="*i64",
                 ep_epoch_ptr="*i64", ids_src_ptr="*i64", tw_src_ptr="*fp32", trace_ptr="*i64",
                 ALPHA="fp32", LIMIT="fp32")
    return types


# (backward, (gate, up), EP, weights through TMA): what the launchers compile. TMA where the dtype's
# config asks for it (bf16; fp32's exact-precision dots read their operands into registers and with
# TMA tiles spill hundreds); the pointer variants also serve shapes whose rows TMA cannot address
# (H or I not a multiple of 16 bytes) and the EP forward.
def persistent_variants(cfg) -> list[tuple[bool, bool, bool, bool, bool, bool]]:
    """(is_bwd, gu, ep, tma, small_t, gpt_oss) for every persistent launch the config makes: forward
    and backward with and without saved (gate, up), the pointer fallbacks where the weights go
    through TMA, the EP forward, the forwards at T <= small_tokens where those get other pipeline
    stages, and gpt-oss's experts (biases and the clamped SwiGLU) in the inference forward and the
    training pair (forward saving (gate, up), backward reading it)."""
    tma = cfg.tma_weights
    main = [(is_bwd, gu, False, tma) for is_bwd in (False, True) for gu in (False, True)]
    fallback = [(False, False, False, False), (True, True, False, False)] if tma else []
    out = [(*v, False, False) for v in main + fallback + [(False, False, True, False)]]
    if cfg.small_stages not in (None, cfg.num_stages):
        out += [(False, gu, False, t, True, False) for t in ((tma, False) if tma else (False,)) for gu in (False, True)]
    out += [(is_bwd, gu, False, tma, False, True) for is_bwd, gu in ((False, False), (False, True), (True, True))]
    return out


def weight_arg_types(tname: str, consts: dict, is_bwd: bool, gu: bool) -> dict:
    """The types of the kernel's (w13_d1, w2_d1, w_d2) arguments as megamoe.fused.weight_args makes
    them (descriptor block shapes from the same code; tiny tensors: the types do not depend on shape)."""
    import torch

    from megamoe import fused
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[tname]
    w13, w2 = torch.empty(1, 2 * 16, 16, dtype=dtype), torch.empty(1, 16, 16, dtype=dtype)
    return _launch_arg_types(tname, ("w13_d1", "w2_d1", "w_d2"), fused.weight_args(w13, w2, consts, is_bwd, gu))


def _launch_arg_types(tname: str, names, args) -> dict:
    """{name: type} of arguments a launcher passes: a tensor is a `*tname` pointer, anything else
    (a TMA descriptor) the type Triton's launcher gives it."""
    import torch
    from triton.runtime.jit import mangle_type
    return {n: f"*{tname}" if isinstance(a, torch.Tensor) else mangle_type(a) for n, a in zip(names, args)}


def dw_desc_types(tname: str, cfg, tma: bool) -> dict:
    """The types of the weight-gradient kernel's (xs_d, dys_d, dgu_d, hw_d) arguments as
    megamoe.fused.dw_operand_args makes them."""
    import torch

    from megamoe import fused
    t = torch.empty(16, 16, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[tname])
    return _launch_arg_types(tname, ("xs_d", "dys_d", "dgu_d", "hw_d"), fused.dw_operand_args(t, t, t, t, cfg, tma))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def _resources(cubin: bytes) -> dict:
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", _cuobjdump(cubin, "--dump-resource-usage")))
    return {k.lower(): int(v) for k, v in found.items()}


def local_memory_ops(sass: str) -> tuple[int, int]:
    """(all, in innermost loops): the SASS local-memory loads and stores (STL/LDL: register spills
    and stack traffic). A loop is a backward branch's [target, branch] address range; innermost ones
    contain no other loop: the GEMM K loops, where a spill costs on every iteration, as opposed to
    the persistent item loop, where it costs once per work item."""
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    inner = [(a, b) for a, b in loops if not any((c, d) != (a, b) and a <= c and d <= b for c, d in loops)]
    local = [addr for addr, text in ins if re.search(r"\b(STL|LDL)(\.\w+)*\s", text)]
    return len(local), sum(any(a <= x <= b for a, b in inner) for x in local)


def _local_ops(cubin: bytes) -> dict:
    total, inner = local_memory_ops(_cuobjdump(cubin, "-sass"))
    return dict(local_ops=total, inner_loop_local_ops=inner)


def _row(kernel: str, tname: str, k) -> dict:
    """A compiled kernel's report row: shared memory, pipelined and TMA loads, registers, local memory."""
    return dict(kernel=kernel, dtype=tname, shared=k.metadata.shared,
                async_copies=k.asm["ttgir"].count("async_copy_global_to_local"),
                tma_loads=k.asm["ttgir"].count("async_tma_copy_global_to_local"),
                **_resources(k.asm["cubin"]), **_local_ops(k.asm["cubin"]))


def persistent_builds(cfg, dtype, tname: str, E: int) -> list[tuple[str, dict, dict, int]]:
    """(name, argument types, constexprs, pipeline stages) of every persistent-kernel variant the
    config compiles (persistent_variants), as its launch compiles it (ptx_diff.py compiles the same list)."""
    from megamoe import ep_fused, fused

    out = []
    for is_bwd, gu, ep, tma, small_t, gpt_oss in persistent_variants(cfg):
        consts = fused.persistent_constexprs(cfg, is_bwd, dtype, E, gu=gu, ep=ep, tma_w=tma,
                                             poll_ns=ep_fused.POLL_NS["cuda"] if ep else 0)
        if gpt_oss:  # what launch.act_args gives for biases and megamoe.contract.clamped_swiglu
            consts.update(BIAS=True, ACT=1)
        types = {**arg_types(tname), **weight_arg_types(tname, consts, is_bwd, gu)}
        stages = fused.persistent_stages(cfg, is_bwd, cfg.small_tokens if small_t else None,
                                         recompute=is_bwd and not gu)
        name = (("bwd" if is_bwd else "fwd") + (" gu" if gu else "") + (" ep" if ep else "")
                + (" tma" if tma else "") + (" small-T" if small_t else "") + (" gpt-oss" if gpt_oss else ""))
        out.append((name, types, consts, stages))
    return out


def check(overrides: dict | None = None, E: int = 128) -> list[dict]:
    """One row per kernel variant. `overrides`: KernelConfig fields replaced in the bf16 config
    (then only bf16 is compiled). E: the expert count (the phase-0 key width KB and the expert
    lookup of every GEMM item depend on it; 128 is Qwen3-30B-A3B's, 256 DeepSeek-V3's)."""
    import dataclasses

    import torch

    from megamoe import fused
    from megamoe.kernels import moe_kernels as mk

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("compile_check: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
    rows = []
    dtypes = ((torch.bfloat16, "bf16"),) if overrides else ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
    for dtype, tname in dtypes:
        cfg = dataclasses.replace(fused.default_config(dtype, torch.device("cuda")), **(overrides or {}))
        data = arg_types(tname)
        for name, types, consts, stages in persistent_builds(cfg, dtype, tname, E):
            k = _compile(mk._moe_persistent_kernel, types, consts, ("H", "I", "E"), cfg.num_warps, stages)
            rows.append(dict(kernel="persistent " + name, dtype=tname, stages=stages,
                             shared=k.metadata.shared, async_copies=k.asm["ttgir"].count("async_copy_global_to_local"),
                             tma_loads=k.asm["ttgir"].count("async_tma_copy_global_to_local"),
                             clock_reads=k.asm["ptx"].count("%globaltimer"),
                             **_resources(k.asm["cubin"]), **_local_ops(k.asm["cubin"])))
        # the weight gradients: through TMA where the config asks for it, and the pointer variant the
        # launcher falls back to where TMA cannot address the rows (H or I not a multiple of 8 in bf16)
        for tma in ((True, False) if cfg.dw_tma else (False,)):
            k = _compile(mk._moe_bwd_dw_kernel, {**data, **dw_desc_types(tname, cfg, tma)},
                         fused.dw_constexprs(cfg, dtype, tma), ("H", "I"), cfg.dw_warps, cfg.dw_stages)
            rows.append(_row("weight gradients" + (" tma" if tma else ""), tname, k))
        k = _compile(mk._moe_bwd_bias_kernel, data, fused.bias_grad_constexprs(), ("H", "I"), 4, 3)
        rows.append(_row("bias gradients", tname, k))
        if not overrides:
            rows += router_rows(tname)
    return rows


def router_rows(tname: str) -> list[dict]:
    """megamoe.router's two kernels (x and w in `tname`), with the launcher's blocks and a real launch's
    specialisation (E, H and the row strides divisible by 16; T and the partials' stride not specialised);
    the chunk sum at S = 8 chunks (H = 2048)."""
    from megamoe.kernels import router_kernels as rk
    from megamoe.router import BLOCKS

    chunks = _compile(rk._router_logits_chunk_kernel, {"x_ptr": f"*{tname}", "w_ptr": f"*{tname}", "out_ptr": "*fp32"},
                      dict(BLOCKS), ("E", "H", "stride_xt", "stride_we", "stride_ot"), 4, 3)
    sums = _compile(rk._router_logits_sum_kernel, {"part_ptr": "*fp32", "out_ptr": "*fp32"},
                    dict(BT=BLOCKS["BT"], BE=BLOCKS["BE"], S=8), ("E", "stride_pt", "stride_ot"), 4, 3)
    return [_row("router logits chunks", tname, chunks), _row("router logits sum", tname, sums)]


def warp_specialize_probe() -> dict:
    """Does Triton's `tl.range(..., warp_specialize=True)` produce a warp-specialised loop on sm_90?
    Compiles one GEMM loop three ways: every operand through a TMA descriptor, the weight through a
    descriptor and gathered token rows through pointers (the shape of the MoE kernels' GEMM1), and
    plain pointer loads, each with 4 and 8 warps. Returns {variant: what the compiler made of it}
    (the number of ttg.warp_specialize ops in the TTGIR, or the compiler's error)."""
    import importlib.util

    import triton
    import triton.language as tl  # noqa: F401  (used by the probe source)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = """
import triton
import triton.language as tl


@triton.jit
def all_tma(a_desc, b_desc, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=True):
        acc = tl.dot(a_desc.load([tl.program_id(0) * BM, k0]), b_desc.load([0, k0]).T, acc)
    tl.store(c_ptr + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], acc.to(tl.bfloat16))


@triton.jit
def gathered_rows(a_ptr, idx_ptr, b_desc, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.load(idx_ptr + tl.program_id(0) * BM + tl.arange(0, BM))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=True):
        a = tl.load(a_ptr + rows[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
        acc = tl.dot(a, b_desc.load([0, k0]).T, acc)
    tl.store(c_ptr + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], acc.to(tl.bfloat16))


@triton.jit
def pointers(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, warp_specialize=True):
        ks = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + (tl.program_id(0) * BM + tl.arange(0, BM))[:, None] * K + ks[None, :])
        b = tl.load(b_ptr + tl.arange(0, BN)[None, :] * K + ks[:, None])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :], acc.to(tl.bfloat16))
"""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ws_probe.py")
        with open(path, "w") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location("ws_probe", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        desc = "tensordesc<bf16[128, 64]>"
        sigs = {
            "all_tma": dict(a_desc=desc, b_desc=desc, c_ptr="*bf16", K="i32"),
            "gathered_rows": dict(a_ptr="*bf16", idx_ptr="*i32", b_desc=desc, c_ptr="*bf16", K="i32"),
            "pointers": dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", K="i32"),
        }
        out = {}
        for name, sig in sigs.items():
            for warps in (4, 8):
                fn = getattr(mod, name)
                consts = dict(BM=128, BN=128, BK=64)
                full = {**sig, **{k: "constexpr" for k in consts}}
                attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t != desc}
                try:
                    k = triton.compile(ASTSource(fn, full, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                                       options=dict(num_warps=warps, num_stages=3))
                    out[f"{name}, {warps} warps"] = f"{k.asm['ttgir'].count('ttg.warp_specialize')} warp-specialised loop(s)"
                except Exception as exc:  # noqa: BLE001  (a compiler failure is a result here)
                    out[f"{name}, {warps} warps"] = f"compile error: {type(exc).__name__}: {str(exc)[:60]}"
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--warp-specialize-probe", action="store_true",
                    help="only report where Triton's warp_specialize applies on sm_90")
    ap.add_argument("--experts", type=int, default=128, help="the expert count E the kernels are compiled for")
    ap.add_argument("--set", nargs="+", default=[], metavar="FIELD=VALUE",
                    help="compile bf16 only, with these KernelConfig fields replaced (e.g. BM=64 num_warps=4)")
    args = ap.parse_args()
    if args.experts < 1:
        raise SystemExit(f"--experts: expected an expert count >= 1, got {args.experts}")
    if args.warp_specialize_probe:
        for name, what in warp_specialize_probe().items():
            print(f"{name:24s} {what}")
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ab_config import config_fields

    rows = check(config_fields(args.set, "--set"), args.experts)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'kernel':22s} {'dtype':5s} {'stages':>6s} {'shared':>8s} {'async copies':>12s} {'TMA':>3s} {'reg':>4s} "
          f"{'stack':>5s} {'local':>5s} {'STL/LDL':>7s} {'in inner loops':>14s}")
    for r in rows:
        print(f"{r['kernel']:22s} {r['dtype']:5s} {r.get('stages', '-'):>6} {r['shared']:8d} {r['async_copies']:12d} "
              f"{r.get('tma_loads', 0):3d} {r.get('reg', -1):4d} {r.get('stack', -1):5d} {r.get('local', -1):5d} "
              f"{r['local_ops']:7d} {r['inner_loop_local_ops']:14d}")


if __name__ == "__main__":
    main()
