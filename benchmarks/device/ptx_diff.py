"""Does a kernel change alter the code of kernels that were measured? Compiles the persistent
kernel's non-EP variants (forward, backward, with and without saved (gate, up); bf16 and fp32) for
sm_90 from the tree and from an earlier commit's megamoe/kernels/moe_kernels.py, on any machine, and
compares their PTX instructions (debug info and label names left out).

    python benchmarks/device/ptx_diff.py REV        # e.g. a9c5159
    python benchmarks/device/ptx_diff.py 036f38f --old-set SUB=32 MSORT=True   # a parameter the tree removed

"same instructions" = the same multiset of PTX instruction lines: at most their order differs.
Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
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
    """`module`: the kernel module's name, whose mangled form prefixes the names of its noinline
    functions (so the two copies' helper names compare equal)."""
    body = ptx.split(".section\t.debug")[0]
    prefix = module.replace(".", "_$_") + "_$_" if module else None
    keep = []
    for line in body.splitlines():
        s = line.strip()
        if prefix:
            s = s.replace(prefix, "")
        # a noinline helper's mangled name also lists its constexpr arguments, so a new constexpr
        # argument (at its default) renames it without changing its code: compare without names
        s = re.sub(r"[A-Za-z_][\w]*\$[\w$]*", "<fn>", s)
        if not s or s.startswith(("//", ".loc", ".file", ".param", "$L__")) or "_param_" in s or "$L__tmp" in s:
            continue
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
    from compile_check import _compile, arg_types

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
        types = arg_types(tname)
        for is_bwd, gu in ((False, False), (False, True), (True, False), (True, True)):
            consts = fused.persistent_constexprs(cfg, is_bwd, dtype, E, gu=gu)
            got = []
            for mod in (new, old):
                fn = mod._moe_persistent_kernel
                c = {k: v for k, v in {**consts, **(old_consts if mod is old else {})}.items() if k in fn.arg_names}
                k = _compile(fn, types, c, ("H", "I", "E"), cfg.num_warps, cfg.num_stages)
                got.append(_instructions(k.asm["ptx"], mod.__name__))
            same = collections.Counter(got[0]) == collections.Counter(got[1])
            same_all &= same
            name = ("bwd" if is_bwd else "fwd") + (" gu" if gu else "")
            print(f"persistent {name:7s} {tname}: {len(got[0])} vs {len(got[1])} instructions, "
                  f"{'same instructions' if same else 'DIFFERENT'}")
    os.unlink(f.name)
    sys.exit(0 if same_all else 1)


if __name__ == "__main__":
    main()
