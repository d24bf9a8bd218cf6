"""Does a kernel change alter the code of kernels that were measured? Compiles every persistent-kernel
variant compile_check.py covers (forward and backward, with and without saved (gate, up), TMA and
pointer weights, EP, small-T stages, gpt-oss's biases and activation; bf16 and fp32) and the weight-
and bias-gradient kernels for sm_90, from the tree and from an earlier commit's
megamoe/kernels/moe_kernels.py, on any machine, and compares their PTX and their SASS.

    python benchmarks/device/ptx_diff.py REV        # e.g. a9c5159
    python benchmarks/device/ptx_diff.py 036f38f --old-set SUB=32 MSORT=True   # a parameter the tree removed

PTX: "identical" = the same instruction lines in the same order (debug info, label and noinline
helper names left out); "same instructions" = the same multiset, in another order. SASS: the same
instruction lines (addresses, encodings and branch targets left out), and the registers and stack.
Where identical PTX gives other SASS, both are compiled again without Triton's debug line info
(ptxas schedules around it, and it follows the source lines): "without line info: identical" then
says the only difference is that scheduling.
Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(__file__))


def _instructions(ptx: str, module: str = "") -> list[str]:
    """`module`: the kernel module's name, which older Tritons put in the mangled names of its
    noinline functions. Every function name defined in the PTX compares as <fn>: a noinline helper's
    mangled name also lists its constexpr arguments (and the module, with older Tritons), so a new
    constexpr argument (at its default) renames it without changing its code."""
    body = ptx.split(".section\t.debug")[0]
    names = set(re.findall(r"^\s*\.(?:visible\s+)?(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)", body, re.M))
    names = sorted(names, key=len, reverse=True)
    keep = []
    for line in body.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".loc", ".file", ".param", "$L__")) or "_param_" in s or "$L__tmp" in s:
            continue
        s = s.split("//")[0].rstrip()
        for n in names:
            s = s.replace(n, "<fn>")
        keep.append(s)
    return keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier commit")
    ap.add_argument("--old-set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="constexprs for the earlier copy only (integers, True/False/None): parameters it "
                         "takes that the tree's kernel no longer has")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("ptx_diff: unset TRITON_INTERPRET")
    import torch
    from compile_check import _compile, _resources, arg_types, dw_desc_types, persistent_builds

    from megamoe import fused
    from megamoe.kernels import moe_kernels as new

    src = subprocess.check_output(["git", "show", f"{args.rev}:megamoe/kernels/moe_kernels.py"], cwd=ROOT, text=True)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("moe_kernels_old", f.name)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    from ab_config import config_value
    old_consts = {}
    for a in args.old_set:
        name, eq, v = a.partition("=")
        if not eq:
            raise SystemExit(f"--old-set: expected NAME=VALUE, got {a!r}")
        old_consts[name] = config_value(v)
    E = 128
    same_all = True
    for dtype, tname in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        cfg = fused.default_config(dtype, torch.device("cuda"))
        builds = [("persistent " + name, "_moe_persistent_kernel", types, consts, ("H", "I", "E"), cfg.num_warps,
                   stages)
                  for name, types, consts, stages in persistent_builds(cfg, dtype, tname, E)]
        for tma in ((True, False) if cfg.dw_tma else (False,)):
            builds.append(("weight gradients" + (" tma" if tma else ""), "_moe_bwd_dw_kernel",
                           {**arg_types(tname), **dw_desc_types(tname, cfg, tma)}, fused.dw_constexprs(cfg, dtype, tma),
                           ("H", "I"), cfg.dw_warps, cfg.dw_stages))
        builds.append(("bias gradients", "_moe_bwd_bias_kernel", arg_types(tname), fused.bias_grad_constexprs(),
                       ("H", "I"), 4, 3))
        for name, kernel, types, consts, divisible, warps, stages in builds:
            def both(line_info: bool):
                got = []
                for mod in (new, old):
                    fn = getattr(mod, kernel)
                    c = {k: v for k, v in {**consts, **(old_consts if mod is old else {})}.items() if k in fn.arg_names}
                    with _line_info(line_info):
                        k = _compile(fn, types, c, divisible, warps, stages)
                    got.append((_instructions(k.asm["ptx"], mod.__name__), _sass(k.asm["cubin"]),
                                _resources(k.asm["cubin"])))
                return got

            (p_new, s_new, r_new), (p_old, s_old, r_old) = both(True)
            ptx = ("identical" if p_new == p_old else
                   "same instructions" if collections.Counter(p_new) == collections.Counter(p_old) else "DIFFERENT")
            sass = "same" if collections.Counter(s_new) == collections.Counter(s_old) and r_new == r_old else "DIFFERENT"
            if sass == "DIFFERENT" and ptx == "identical":
                # ptxas schedules around the debug line info (.loc, inlined-at labels), which moves with the
                # source lines: the same PTX instructions compiled without it
                (_, s_new2, r_new2), (_, s_old2, r_old2) = both(False)
                bare = s_new2 == s_old2 and r_new2 == r_old2
                sass += f" (without line info: {'identical' if bare else 'DIFFERENT'})"
                same_all &= bare
            else:
                same_all &= ptx != "DIFFERENT" and sass == "same"
            print(f"{name:34s} {tname}: PTX {len(p_new)} vs {len(p_old)} instructions, {ptx}; SASS {len(s_new)} vs "
                  f"{len(s_old)} instructions, {sass} (reg {r_new.get('reg')} vs {r_old.get('reg')}, "
                  f"stack {r_new.get('stack')} vs {r_old.get('stack')})", flush=True)
    os.unlink(f.name)
    sys.exit(0 if same_all else 1)


@contextlib.contextmanager
def _line_info(on: bool):
    """Compile with Triton's debug line info (its default) or without: through the environment, which
    Triton's compile cache keys on (TRITON_DISABLE_LINE_INFO)."""
    before = os.environ.get("TRITON_DISABLE_LINE_INFO")
    if on:
        os.environ.pop("TRITON_DISABLE_LINE_INFO", None)
    else:
        os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_DISABLE_LINE_INFO", None)
        else:
            os.environ["TRITON_DISABLE_LINE_INFO"] = before


def _sass(cubin: bytes) -> list[str]:
    """The SASS instruction lines, without addresses, encodings and branch / call targets."""
    from compile_check import _cuobjdump
    lines = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", _cuobjdump(cubin, "-sass"))
    return [re.sub(r"0x[0-9a-f]+", "<addr>", t.strip()) if re.search(r"\b(BRA|CALL|BSSY|JMP|RET|WARPSYNC|BREAK)\b", t)
            else t.strip() for t in lines]


if __name__ == "__main__":
    main()
