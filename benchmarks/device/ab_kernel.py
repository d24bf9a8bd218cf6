"""A/B of the megamoe Triton path in one process on a GPU: an earlier version vs the working tree's.

The earlier version lives in abold/ (git-ignored; carry it to the GPU machine), made from a commit
before megamoe/fused.py became a package (e9ecef6; for a later one, copy megamoe/fused/ instead):

    C=9cc384b; mkdir -p abold && touch abold/__init__.py
    git show $C:megamoe/kernels/moe_kernels.py > abold/moe_kernels.py
    git show $C:megamoe/fused.py | sed 's/from megamoe.kernels.moe_kernels import/from abold.moe_kernels import/' \
        | awk '/^# torch.library op/{exit} {print}' > abold/fused.py     # (its op registration clashes)
    python3 benchmarks/device/ab_kernel.py

Prints forward, launch-only, CUDA-graph-replayed forward and forward+backward times (fused_moe_fwd /
fused_moe_bwd called directly) and whether both versions give the same outputs.
Result of 2026-11-30: benchmarks/results/2026-11-30-h200-ab-fused-metadata.log.
"""
import os
import sys

sys.path.insert(0, os.getcwd())
import torch
from benchmarks.bench_moe import SHAPES, make_inputs, time_ms
from megamoe import fused as new
from abold import fused as old  # abold/fused/ (a package copy) or abold/fused.py
R = 30
print("shape T | old fwd | new fwd | new launch only | new fwd graph | old fwd+bwd | new fwd+bwd | new fwd+bwd, (gate, up) saved")
for name in ("qwen3", "olmoe"):
    E, H, I, k = SHAPES[name]
    for T in (4096, 16384):
        x, w13, w2, tw, ids = make_inputs(E, H, I, k, T)
        ids = ids.contiguous()  # the raw launcher below indexes it as a dense array
        dy = torch.randn_like(x)
        yo = old.fused_moe_fwd(x, w13, w2, tw, ids, check=False); yn = new.fused_moe_fwd(x, w13, w2, tw, ids, check=False)
        go = old.fused_moe_bwd(dy, x, w13, w2, tw, ids); gn = new.fused_moe_bwd(dy, x, w13, w2, tw, ids)
        same = torch.equal(yo, yn)  # y; the gradients differ by design when the versions round (gate, up) differently
        same_grads = all(torch.equal(a, b) for a, b in zip(go, gn))
        grad_err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(go, gn))
        t = {}
        for rnd in range(2):  # interleaved twice, keep the min of the two medians
            # AB_NEW_FIRST=1 times the new version first in each round (an order effect shows as a swap)
            cases = [("old_f", lambda: old.fused_moe_fwd(x, w13, w2, tw, ids, check=False)),
                     ("new_f", lambda: new.fused_moe_fwd(x, w13, w2, tw, ids, check=False)),
                     ("new_l", lambda: new.launch_persistent(False, x, w13, w2, tw, ids, None, T, H, I, E, k,
                                                             new.config_for(x))),
                     ("old_fb", lambda: (old.fused_moe_fwd(x, w13, w2, tw, ids, check=False),
                                         old.fused_moe_bwd(dy, x, w13, w2, tw, ids))),
                     ("new_fb", lambda: (new.fused_moe_fwd(x, w13, w2, tw, ids, check=False),
                                         new.fused_moe_bwd(dy, x, w13, w2, tw, ids))),
                     ("new_fbs", lambda: new.fused_moe_bwd(dy, x, w13, w2, tw, ids, gu=new.fused_moe_fwd(
                         x, w13, w2, tw, ids, check=False, save_gu=True)[1]))]
            if os.environ.get("AB_NEW_FIRST") == "1":
                cases = [c for c in cases if c[0].startswith("new")] + [c for c in cases if c[0].startswith("old")]
            for key, fn in cases:
                v = time_ms(fn, R)
                t[key] = min(v, t.get(key, 1e9))
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            new.fused_moe_fwd(x, w13, w2, tw, ids, check=False)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            yg = new.fused_moe_fwd(x, w13, w2, tw, ids, check=False)
        t["new_g"] = time_ms(g.replay, R)
        print(f"{name} {T} | {t['old_f']:.3f} | {t['new_f']:.3f} | {t['new_l']:.3f} | {t['new_g']:.3f} | {t['old_fb']:.3f} | {t['new_fb']:.3f} | {t['new_fbs']:.3f} | y old==new: {same}, gradients old==new: {same_grads} (max rel diff {grad_err:.1e})", flush=True)
