"""A/B of megamoe.invariant.paged_causal_attention inside a bitwise vLLM CPU engine: the current
implementation against an earlier copy of megamoe/invariant.py, interleaved in one process.

    git show REV:megamoe/invariant.py > /tmp/invariant_old.py
    python benchmarks/ab_paged_attention.py /tmp/invariant_old.py

One engine (in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the function can be swapped),
4 layers H=256 E=16 k=2 I=128, 16 prompts x 8 completions of 32 tokens at T=0.8, three rounds of
(current, earlier); prints completion tokens/s per round and whether both gave the same samples.
"""
import os, sys, time, importlib.util, tempfile
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
def main() -> None:
    spec = importlib.util.spec_from_file_location("inv_old", sys.argv[1]); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
    from megamoe import invariant
    new_fn = invariant.paged_causal_attention
    from rl.make_model import make_model
    from rollout.worker import RolloutWorker
    d = make_model(os.path.join(tempfile.mkdtemp(), "m"), layers=4, hidden=256, experts=16, topk=2, intermediate=128)
    w = RolloutWorker(d, "megamoe", dtype="float32", seed=0, max_model_len=256, kv_cache_memory_bytes=256 << 20, numerics="bitwise")
    prompts = [f"digit {i % 10}: the red bird is number {i}" for i in range(16)]
    sp = {"temperature": 0.8, "max_tokens": 32, "seed": 1, "ignore_eos": True}
    w.generate(prompts[:2], 2, sp)
    res = {"old": [], "new": []}
    outs = {}
    for rnd in range(3):
        for name, fn in (("new", new_fn), ("old", old.paged_causal_attention)):
            invariant.paged_causal_attention = fn
            t0 = time.perf_counter(); s = w.generate(prompts, 8, sp); dt = time.perf_counter() - t0
            res[name].append(sum(len(x.completion_ids) for x in s) / dt)
            outs.setdefault(name, [x.sampler_logprobs for x in s])
    w.close()
    print({k: [round(v) for v in vs] for k, vs in res.items()}, "same samples:", outs["old"] == outs["new"])
if __name__ == "__main__":
    main()
