"""Sample from the tiny MoE with a real vLLM CPU engine and show the per-token logprobs.

    python -m rl.demo --out runs/demo          (what `make demo` runs)
    python -m rl.demo --out runs/demo --arch mixtral --max-tokens 16 --seed 1

Builds `<out>/tiny-<arch>` with rl.make_model if it is not there yet (reuses it otherwise), starts
vllm.LLM on it (fp32, 64 MiB KV cache, seeded), chat-formats a handful of prompts, samples one
completion each, and prints prompt, completion and the logprob of every sampled token. The model is
random-init, so completions are noise; what the demo shows is the plumbing the RL loop builds on:
checkpoint -> vLLM engine -> token ids + logprobs. (The RL loop, `megamoe-rl train`, will replace
it.) Logprobs are vLLM's "processed" ones (after temperature/top-p), the kind the RL loop compares
against the trainer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PROMPTS = (
    "What is 2 + 3?",
    "Compute 17 - 9.",
    "Count from one to five.",
    "Reverse the word cat.",
)
KV_CACHE_BYTES = 64 << 20  # vLLM CPU needs an explicit size; this tiny model needs ~0.5 KiB/token
MAX_MODEL_LEN = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from rl.make_model import ARCHS

    p = argparse.ArgumentParser(prog="python -m rl.demo", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/demo", help="run directory (default %(default)s)")
    p.add_argument("--arch", default="qwen3_moe", choices=ARCHS, help="default %(default)s")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per completion (default %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="model init and sampling seed (default %(default)s)")
    args = p.parse_args(argv)
    if not 1 <= args.max_tokens <= MAX_MODEL_LEN // 2:
        # The other half of the context is left for the chat-formatted prompt.
        p.error(f"--max-tokens: expected an int in [1, {MAX_MODEL_LEN // 2}], got {args.max_tokens}")
    if not args.temperature > 0:
        p.error(f"--temperature: expected > 0 (sampling, not greedy), got {args.temperature}")
    return args


def check_model_dir(model_dir: Path, arch: str, seed: int) -> bool:
    """True to reuse `model_dir`, False to build it; ValueError (naming the flag) when neither works."""
    from rl import make_model as mm

    marker = model_dir / mm.MARKER_FILE
    if marker.is_file():
        built = json.loads(marker.read_text())
        if built.get("seed") != seed:
            raise ValueError(f"--seed: {model_dir} was built with seed {built.get('seed')}, got {seed}; "
                             "pass that seed or another --out")
        return True
    mm.check_args(arch=arch, seed=seed)
    mm.check_out_dir(model_dir.absolute(), overwrite=False)
    return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = Path(args.out) / f"tiny-{args.arch}"
    try:
        reuse = check_model_dir(model_dir, args.arch, args.seed)
    except ValueError as e:
        print(f"python -m rl.demo: error: {e}", file=sys.stderr)
        return 2
    if reuse:
        print(f"reusing {model_dir}")
    else:
        from rl.make_model import make_model
        make_model(model_dir, arch=args.arch, seed=args.seed)
        print(f"built {model_dir}")

    import vllm
    from vllm import LLM, SamplingParams

    # enforce_eager: torch.compile costs about a minute at startup on 2 CPU cores and buys
    # nothing at this size.
    llm = LLM(model=str(model_dir), dtype="float32", seed=args.seed,
              kv_cache_memory_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN, max_num_seqs=len(PROMPTS),
              enforce_eager=True, logprobs_mode="processed_logprobs")
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                 add_generation_prompt=True) for q in PROMPTS]
        # One seed per prompt: with a shared per-request seed every prompt would draw the same
        # random numbers and, from a near-uniform random-init model, nearly the same tokens.
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=1.0,
                                 seed=args.seed * 1000 + i, logprobs=0) for i in range(len(prompts))]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        # Stop the engine-core process now rather than at interpreter exit.
        llm.llm_engine.engine_core.shutdown()

    print(f"\nvLLM {vllm.__version__}, fp32, model {model_dir}, temperature {args.temperature}, "
          f"seed {args.seed}")
    for i, out in enumerate(outputs):
        sample = out.outputs[0]
        ids, steps = list(sample.token_ids), sample.logprobs
        if steps is None or len(steps) != len(ids):
            raise RuntimeError(f"prompt {i}: vLLM returned {0 if steps is None else len(steps)} logprob "
                               f"entries for {len(ids)} sampled tokens")
        logprobs = [steps[j][tid].logprob for j, tid in enumerate(ids)]
        if not all(math.isfinite(lp) and lp <= 0 for lp in logprobs):
            raise RuntimeError(f"prompt {i}: expected finite logprobs <= 0, got {logprobs}")
        print(f"\n[{i}] prompt     {out.prompt!r}")
        print(f"    completion {sample.text!r}  ({len(ids)} tokens, finish: {sample.finish_reason}, "
              f"sum logprob {sum(logprobs):.3f})")
        for tid, lp in zip(ids, logprobs):
            print(f"      {tid:6d} {tokenizer.decode([tid])!r:>16}  {lp:9.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
