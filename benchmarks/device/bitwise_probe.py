"""Which GPU kernels could carry run.numerics=bitwise on the H200 (vLLM 0.26), measured op by op, bf16.

    source .gpu-vllm/env.sh && VLLM_BATCH_INVARIANT=1 python3 benchmarks/device/bitwise_probe.py

For each candidate, whether an output row's bits depend only on that row (a decode step's M=1 against
the same row inside a prefill / training batch of M rows) and, for the linears, whether a fused weight
([q; k; v]) gives the separate projections' bits:
- cuBLASLt as vLLM's batch-invariant mode sets it up on Hopper (split-K off through the workspace
  variables; F.linear), vLLM's Triton persistent matmul (`matmul_persistent`), megamoe.invariant.linear
  (fixed-shape row tiles through cuBLAS);
- vLLM's batch-invariant RMSNorm kernel against the trainer's torch RMSNorm formula;
- vLLM's Triton unified attention with VLLM_BATCH_INVARIANT=1 (2D kernel, one key tile size): one decode
  query against a paged KV cache vs the same position inside a whole-sequence prefill, and a sequence alone
  vs in a batch with others; megamoe.invariant.paged_causal_attention (torch, fp32) the same way.
Prints one line per check; the last lines are a table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
RESULTS: list[tuple[str, str]] = []


def record(name: str, fn) -> None:
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
        out = f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}"
    RESULTS.append((name, str(out)))
    print(f"{name}: {out}", flush=True)


def rows_check(f, x, tag_rows=(0, 1, 17, 255)) -> str:
    """f(x[M, K]) row by row: rows computed alone (M=1) and in a block of 7 against the full M's."""
    full = f(x)
    alone = all(torch.equal(f(x[r:r + 1]), full[r:r + 1]) for r in tag_rows)
    chunk = torch.equal(f(x[3:10]), full[3:10])
    return f"M=1 equal {alone}, M=7 equal {chunk}"


def fused_check(f, x, w, sizes) -> str:
    fused = f(x, w)
    parts = torch.cat([f(x, p) for p in w.split(sizes)], -1)
    return f"fused = separate {torch.equal(fused, parts)}"


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    import vllm
    from vllm.model_executor.layers import batch_invariant as bi

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"VLLM_BATCH_INVARIANT={os.environ.get('VLLM_BATCH_INVARIANT')}", flush=True)
    bi.enable_batch_invariant_mode()  # what vLLM's worker does at start in this mode (also in this process)
    torch.backends.cuda.matmul.fp32_precision = "ieee"

    from megamoe import invariant

    for K, sizes in ((1024, [1024, 256, 256]), (2048, [4096, 512, 512])):
        N = sum(sizes)
        x = torch.randn(1024, K, device=dev, generator=g).to(bf)
        w = (torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(bf)
        cands = {
            "cuBLASLt F.linear": lambda a, b: torch.nn.functional.linear(a, b),
            "vLLM matmul_persistent": lambda a, b: bi.matmul_persistent(a, b.t().contiguous()),
            "megamoe.invariant.linear": lambda a, b: invariant.linear(a, b),
        }
        for name, f in cands.items():
            record(f"linear {name} K={K} N={N} rows", lambda f=f: rows_check(lambda a: f(a, w), x))
            record(f"linear {name} K={K} fused q/k/v {sizes}", lambda f=f: fused_check(f, x[:64], w, sizes))

    H = 2048
    xn = torch.randn(512, H, device=dev, generator=g).to(bf)
    wn = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).to(bf)

    def torch_rms(a):  # transformers' Qwen3MoeRMSNorm formula
        v = a.float()
        return (wn * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf))

    record("rmsnorm vLLM batch-invariant kernel rows", lambda: rows_check(lambda a: bi.rms_norm_batch_invariant(a, wn, 1e-6), xn))
    record("rmsnorm torch formula rows", lambda: rows_check(torch_rms, xn))
    record("rmsnorm vLLM kernel = torch formula",
           lambda: torch.equal(bi.rms_norm_batch_invariant(xn, wn, 1e-6), torch_rms(xn)))

    # attention: one sequence of L tokens as a paged cache (block size 16), h=16 query heads, g=4 KV heads, D=128
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    h, gk, D, bsz = 16, 4, 128, 16
    lens = [300, 77, 1, 129]

    def paged(Ls):
        nb = sum((L + bsz - 1) // bsz for L in Ls)
        kc = torch.randn(nb, bsz, gk, D, device=dev, generator=g).to(bf)
        vc = torch.randn(nb, bsz, gk, D, device=dev, generator=g).to(bf)
        table, start = [], 0
        for L in Ls:
            n = (L + bsz - 1) // bsz
            table.append(list(range(start, start + n)))
            start += n
        width = max(map(len, table))
        bt = torch.tensor([t + [0] * (width - len(t)) for t in table], device=dev, dtype=torch.int32)
        return kc, vc, bt

    kc, vc, bt = paged(lens)
    qs = [torch.randn(L, h, D, device=dev, generator=g).to(bf) for L in lens]

    def ua(q_list, q_lens, seq_ids):
        """unified_attention over sequences seq_ids, each bringing its last q_lens[i] queries."""
        q = torch.cat([qs[s][lens[s] - ql:] for s, ql in zip(seq_ids, q_lens)])
        out = torch.empty_like(q)
        cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), device=dev, dtype=torch.int32)
        used = torch.tensor([lens[s] for s in seq_ids], device=dev, dtype=torch.int32)
        one = torch.ones(len(seq_ids), gk, device=dev, dtype=torch.float32)
        unified_attention(q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu, max_seqlen_q=max(q_lens), seqused_k=used,
                          max_seqlen_k=max(lens[s] for s in seq_ids), softmax_scale=D ** -0.5, causal=True,
                          window_size=(-1, -1), block_table=bt[list(seq_ids)], softcap=0, q_descale=None,
                          k_descale=one, v_descale=one)
        return out

    def ua_checks():
        full = ua(None, [lens[0]], [0])                          # sequence 0's whole prefill
        dec = ua(None, [1], [0])                                 # its last position as one decode query
        batch = ua(None, [lens[0], 1, 1, 5], [0, 1, 2, 3])       # alongside decodes and a prefill chunk
        mixed = ua(None, [1, 1, 1], [1, 0, 3])                   # decodes of three sequences
        return (f"decode = prefill row {torch.equal(dec, full[-1:])}, alone = in batch "
                f"{torch.equal(batch[:lens[0]], full)}, decode in a decode batch {torch.equal(mixed[1:2], full[-1:])}")

    record("attention vLLM unified_attention (batch-invariant) ", ua_checks)

    def ours():
        k_ = kc.permute(0, 2, 1, 3)  # [blocks, g, block size, D]: this module's page layout
        v_ = vc.permute(0, 2, 1, 3)
        L0 = lens[0]
        lens_t = torch.tensor(lens, device=dev)
        full = invariant.paged_causal_attention(qs[0], k_, v_, bt.long(), lens_t, torch.zeros(L0, dtype=torch.long, device=dev),
                                                torch.arange(L0, device=dev), D ** -0.5)
        dec = invariant.paged_causal_attention(qs[0][-1:], k_, v_, bt.long(), lens_t, torch.zeros(1, dtype=torch.long, device=dev),
                                               torch.tensor([L0 - 1], device=dev), D ** -0.5)
        return f"decode = prefill row {torch.equal(dec, full[-1:])}"

    record("attention megamoe.invariant.paged_causal_attention", ours)

    print("\n| check | result |\n|---|---|")
    for name, out in RESULTS:
        print(f"| {name} | {out} |")


if __name__ == "__main__":
    main()
