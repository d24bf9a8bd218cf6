"""Where the sampler and the trainer part, op by op: the activations at every op boundary of every
decoder layer, captured on both sides for the same token sequences, compared bit for bit.

    report = measure("runs/tiny-model", max_tokens=4, temperature=1.0)   # starts its own vLLM engine
    print(format_report(report))

    megamoe-rl divergence --model runs/tiny-model [--prompts 4] [--max-tokens 4]   (rl/divergence_cmd.py)

Two views of the same sequences (prompt + completion, the completion sampled by vLLM):
- prefill: vLLM prefills the whole sequence as one prompt (`prompt_logprobs` makes it compute the
  logits of every position); the trainer runs one forward over it. Every row is compared. vLLM's
  prompt logprobs are raw (no temperature: vLLM's model runner skips the sampling processors for
  prompt tokens), so this view's `logprobs` are at temperature 1 on both sides.
- decode: the rows vLLM computed one token at a time against its KV cache while generating, against
  the trainer's rows for the same positions; `logprobs` are vLLM's processed logprobs of the sampled
  tokens (at the run's temperature) against the trainer's at that temperature.

Capture. vLLM side: forward hooks inside the engine's worker (`rollout.probe.capture_ops_in_worker`
through the worker extension's `megamoe_capture_ops`), one request per generate call so that each
forward holds one sequence. Trainer side: forward hooks on the transformers model, and an attention
function registered in transformers' attention registry that records q and k after rotary and
calls the model's own implementation (sdpa) unchanged.

Op names, in forward order (per layer `L<i>.`): embed; input_norm; q_proj, k_proj, v_proj (vLLM's
fused qkv_proj split); q_norm, k_norm (Qwen3's per-head norms, OLMoE's over the whole projection); q_rope, k_rope; attn (o_proj's
input); o_proj; resid_mid (residual + attention: vLLM sums it inside its fused add-norm);
post_norm; router_logits; moe; resid_out; then final_norm, logits, logprobs.

Per op the report gives: bitwise equal or max |Δ| and max |Δ| / max |trainer| ("rel"); whether the
op's inputs were bitwise equal; "parts here" when they were but the output is not (that op's
kernels differ); the first such op in forward order. "own": the trainer's implementation of the op
run on the sampler's own inputs against the sampler's output, which measures every op's own kernel
difference at every layer, even downstream of the first parting, where inputs already differ.

Over 500 lines, on purpose: the op graph of a decoder layer, the trainer-side capture and replay, and
the comparison belong together (each names the same ops); the vLLM-side capture is in rollout/probe.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from megamoe.contract import FAST

LAYER_OPS = ("input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "q_rope", "k_rope", "attn",
             "o_proj", "resid_mid", "post_norm", "router_logits", "moe", "resid_out")
CAPTURE_ATTENTION = "megamoe_divergence_capture"
DEFAULT_PROMPTS = ("1 + 2 =", "7 * 8 = 56. 9 * 3 =", "count: 1 2 3 4", "the answer is")


@dataclasses.dataclass(frozen=True)
class Op:
    """One op boundary: its output's name and the names of the ops whose outputs it reads. Inputs in
    `context` are read over the causal context (rows 0..p for a row p: attention's keys and values)."""
    name: str
    inputs: tuple[str, ...] = ()
    context: tuple[str, ...] = ()


def op_graph(num_layers: int, qk_norm: bool = True) -> list[Op]:
    """The ops of a Qwen3-MoE-style decoder in forward order, each with its inputs."""
    ops = [Op("embed")]
    resid = "embed"
    for i in range(num_layers):
        p = f"L{i}."
        q_in, k_in = (p + "q_norm", p + "k_norm") if qk_norm else (p + "q_proj", p + "k_proj")
        ops += [Op(p + "input_norm", (resid,)),
                Op(p + "q_proj", (p + "input_norm",)), Op(p + "k_proj", (p + "input_norm",)),
                Op(p + "v_proj", (p + "input_norm",))]
        if qk_norm:
            ops += [Op(p + "q_norm", (p + "q_proj",)), Op(p + "k_norm", (p + "k_proj",))]
        ops += [Op(p + "q_rope", (q_in,)), Op(p + "k_rope", (k_in,)),
                Op(p + "attn", (p + "q_rope",), (p + "k_rope", p + "v_proj")),
                Op(p + "o_proj", (p + "attn",)), Op(p + "resid_mid", (resid, p + "o_proj")),
                Op(p + "post_norm", (p + "resid_mid",)), Op(p + "router_logits", (p + "post_norm",)),
                Op(p + "moe", (p + "post_norm",)), Op(p + "resid_out", (p + "resid_mid", p + "moe"))]
        resid = p + "resid_out"
    return ops + [Op("final_norm", (resid,)), Op("logits", ("final_norm",)), Op("logprobs", ("logits",))]


# ---------------------------------------------------------------------------------------------
# comparison (pure: captures in, table rows out)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """One sequence of one view: full-sequence captures of both sides ({op: [T, ...]}) and the rows
    compared; `rows_for` overrides the rows of single ops (logprobs: positions that have a target)."""
    sampler: dict[str, torch.Tensor]
    trainer: dict[str, torch.Tensor]
    rows: list[int]
    rows_for: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    own: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # trainer's op on sampler inputs


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(max |a - b|, max |a - b| / max |b|, fraction of elements not bitwise equal)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: sampler {tuple(a.shape)} vs trainer {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0, 0.0, 0.0
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isnan(d) & ~(torch.isnan(a) & torch.isnan(b)), torch.inf, torch.nan_to_num(d, nan=0.0))
    scale = b.double().abs().nan_to_num(nan=0.0).max().item()
    mx = d.max().item()
    neq = (a.contiguous().view(torch.uint8).view(a.numel(), -1) != b.contiguous().view(torch.uint8)
           .view(b.numel(), -1)).any(-1).double().mean().item()
    return mx, (mx / scale if scale > 0 else (0.0 if mx == 0 else math.inf)), neq


def compare(cases: Sequence[Case], ops: Sequence[Op]) -> dict:
    """Per op over every case: {"op", "bitwise", "max_abs", "rel", "frac_diff", "inputs_equal",
    "parts_here", "own_*"}; and "first_parting": the first op (forward order) whose inputs are bitwise
    equal and whose output is not, or None when every op is equal."""
    rows = []
    for op in ops:
        if not all(op.name in c.sampler and op.name in c.trainer for c in cases):
            continue
        equal, mx, rel, frac, inputs_equal = True, 0.0, 0.0, [], True
        own_equal, own_mx, own_rel, has_own = True, 0.0, 0.0, False
        for c in cases:
            r = c.rows_for.get(op.name, c.rows)
            a, b = c.sampler[op.name][r], c.trainer[op.name][r]
            equal &= _bits_equal(a, b)
            m, rr, f = _diff(a, b)
            mx, rel = max(mx, m), max(rel, rr)
            frac.append(f)
            ctx = list(range(max(r) + 1)) if r else []
            for name, rws in [(n, r) for n in op.inputs] + [(n, ctx) for n in op.context]:
                if name not in c.sampler or name not in c.trainer:
                    inputs_equal = False
                else:
                    inputs_equal &= _bits_equal(c.sampler[name][rws], c.trainer[name][rws])
            if op.name in c.own:
                has_own = True
                o = c.own[op.name][r]
                own_equal &= _bits_equal(a, o)
                m, rr, _ = _diff(a, o)
                own_mx, own_rel = max(own_mx, m), max(own_rel, rr)
        rows.append({"op": op.name, "bitwise": bool(equal), "max_abs": mx, "rel": rel,
                     "frac_diff": sum(frac) / len(frac), "inputs_equal": bool(inputs_equal),
                     "parts_here": bool(inputs_equal and not equal),
                     "own_bitwise": bool(own_equal) if has_own else None,
                     "own_max_abs": own_mx if has_own else None, "own_rel": own_rel if has_own else None})
    first = next((r["op"] for r in rows if r["parts_here"]), None)
    return {"ops": rows, "first_parting": first}


# ---------------------------------------------------------------------------------------------
# trainer side: hooks + an attention function in transformers' registry
# ---------------------------------------------------------------------------------------------
_ATTN = {"put": None, "impl": None}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Records q and k after rotary ([B, heads, L, d]) and runs the model's own attention function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    put = _ATTN["put"]
    if put is not None:
        p = f"L{module.layer_idx}."
        put(p + "q_rope", query.transpose(1, 2)[0].reshape(query.shape[2], -1))
        put(p + "k_rope", key.transpose(1, 2)[0].reshape(key.shape[2], -1))
    return ALL_ATTENTION_FUNCTIONS[_ATTN["impl"]](module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def _capturing_attention(model, put):
    """Switch the model to the capturing attention function (same masks as its own) for the block."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    impl = model.config._attn_implementation
    AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    _ATTN.update(put=put, impl=impl)
    model.set_attn_implementation(CAPTURE_ATTENTION)
    try:
        yield impl
    finally:
        model.set_attn_implementation(impl)
        _ATTN.update(put=None, impl=None)


def _layers(model):
    return list(model.model.layers)


@torch.no_grad()
def trainer_capture(model, ids: Sequence[int], temperatures: Sequence[float] = (1.0,), numerics: str = FAST
                    ) -> dict[str, torch.Tensor]:
    """Every op boundary of one forward of `model` over `ids` (batch 1, no padding), {op: [L, ...]};
    `logprobs@<t>` [L] per temperature: log_softmax(logits / t) of the next token (NaN at the last row),
    by trainer.loss.token_logprobs."""
    from trainer.loss import token_logprobs

    out: dict[str, torch.Tensor] = {}
    L = len(ids)

    def rows(t):  # [1, L, ...] or [L, ...] -> [L, -1]
        return t.reshape(L, -1)

    handles = []

    def on_out(m, fn):
        handles.append(m.register_forward_hook(lambda mod, args, o: fn(o)))

    def on_in(m, fn):
        handles.append(m.register_forward_pre_hook(lambda mod, args, kwargs: fn(args, kwargs), with_kwargs=True))

    def first(o):
        return o[0] if isinstance(o, (tuple, list)) else o

    def store(name):
        return lambda o: out.__setitem__(name, rows(first(o)).float().clone())

    def store_in(name):
        return lambda a, kw: out.__setitem__(name, rows(a[0] if a else kw["hidden_states"]).float().clone())

    inner = model.model
    on_out(inner.embed_tokens, store("embed"))
    for i, layer in enumerate(_layers(model)):
        p, attn = f"L{i}.", layer.self_attn
        on_out(layer.input_layernorm, store(p + "input_norm"))
        for proj in ("q_proj", "k_proj", "v_proj"):
            on_out(getattr(attn, proj), store(p + proj))
        for norm in ("q_norm", "k_norm"):
            if hasattr(attn, norm):
                on_out(getattr(attn, norm), store(p + norm))
        on_in(attn.o_proj, store_in(p + "attn"))
        on_out(attn.o_proj, store(p + "o_proj"))
        on_in(layer.post_attention_layernorm, store_in(p + "resid_mid"))
        on_out(layer.post_attention_layernorm, store(p + "post_norm"))
        if isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module):
            on_out(layer.mlp.gate, store(p + "router_logits"))
        on_out(layer.mlp, store(p + "moe"))
        on_out(layer, store(p + "resid_out"))
    on_out(inner.norm, store("final_norm"))
    on_out(model.lm_head, store("logits"))
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(ids)], device=device)
    try:
        with _capturing_attention(model, lambda n, t: out.__setitem__(n, t.float().clone())):
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    for t in temperatures:
        lp = torch.full((L,), math.nan)
        lp[:-1] = token_logprobs(logits[:, :-1], input_ids[:, 1:], t, numerics)[0].float().cpu()
        out[f"logprobs@{t:g}"] = lp
    return {k: v.cpu() for k, v in out.items()}


@torch.no_grad()
def replay_ops(model, s: dict[str, torch.Tensor], ids: Sequence[int], temperature: float,
               decode_rows: Sequence[int] = (), numerics: str = FAST) -> dict[str, torch.Tensor]:
    """The trainer's implementation of each op run on the sampler's captured inputs `s` (full
    sequence, {op: [T, ...]}): {op: [T, ...]}. Attention runs causally over all rows, and once more per
    row in `decode_rows` with that row's query against the keys and values of rows 0..p (a decode step)."""
    import importlib

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from trainer.loss import token_logprobs

    T = len(ids)
    dev = next(model.parameters()).device
    # Rows the sampler never computed (NaN: the last sampled token is never fed) become zeros, so that
    # routing and attention stay finite; no such row is compared.
    # The captures are fp32 copies (exact) of the model dtype's tensors: back to that dtype as inputs.
    dt = next(model.parameters()).dtype
    s = {k: v.nan_to_num(nan=0.0).to(dev, dt) for k, v in s.items()}
    own: dict[str, torch.Tensor] = {}
    inner = model.model
    input_ids = torch.tensor([list(ids)], device=dev)
    own["embed"] = inner.embed_tokens(input_ids)[0]
    pos = torch.arange(T, device=dev)[None]
    impl = model.config._attn_implementation
    resid = "embed"
    for i, layer in enumerate(_layers(model)):
        p, attn = f"L{i}.", layer.self_attn
        if p + "input_norm" not in s:
            break
        nh, hd = attn.config.num_attention_heads, attn.head_dim
        nkv = attn.config.num_key_value_heads
        own[p + "input_norm"] = layer.input_layernorm(s[resid])
        for proj in ("q_proj", "k_proj", "v_proj"):
            own[p + proj] = getattr(attn, proj)(s[p + "input_norm"])
        q_in, k_in = p + "q_proj", p + "k_proj"
        if hasattr(attn, "q_norm"):
            # per head (Qwen3: a norm of head_dim) or over the whole projection (OLMoE)
            per_head = attn.q_norm.weight.numel() == hd
            own[p + "q_norm"] = attn.q_norm(s[p + "q_proj"].view(T, nh, hd) if per_head else s[p + "q_proj"]).reshape(T, -1)
            own[p + "k_norm"] = attn.k_norm(s[p + "k_proj"].view(T, nkv, hd) if per_head else s[p + "k_proj"]).reshape(T, -1)
            q_in, k_in = p + "q_norm", p + "k_norm"
        rope = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb
        cos, sin = inner.rotary_emb(s[q_in][None], pos)
        q = s[q_in].view(1, T, nh, hd).transpose(1, 2)
        k = s[k_in].view(1, T, nkv, hd).transpose(1, 2)
        qr, kr = rope(q, k, cos, sin)
        own[p + "q_rope"] = qr.transpose(1, 2)[0].reshape(T, -1)
        own[p + "k_rope"] = kr.transpose(1, 2)[0].reshape(T, -1)
        fn = ALL_ATTENTION_FUNCTIONS[impl]
        sq = s[p + "q_rope"].view(1, T, nh, hd).transpose(1, 2)
        sk = s[p + "k_rope"].view(1, T, nkv, hd).transpose(1, 2)
        sv = s[p + "v_proj"].view(1, T, nkv, hd).transpose(1, 2)
        a = fn(attn, sq, sk, sv, None, dropout=0.0, scaling=attn.scaling)[0].reshape(T, -1)
        for r in decode_rows:
            a[r] = fn(attn, sq[:, :, r:r + 1], sk[:, :, :r + 1], sv[:, :, :r + 1], None, dropout=0.0,
                      scaling=attn.scaling)[0].reshape(-1)
        own[p + "attn"] = a
        own[p + "o_proj"] = attn.o_proj(s[p + "attn"])
        own[p + "resid_mid"] = s[resid] + s[p + "o_proj"]      # transformers: residual + hidden_states
        own[p + "post_norm"] = layer.post_attention_layernorm(s[p + "resid_mid"])
        if isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module):
            g = layer.mlp.gate(s[p + "post_norm"])
            own[p + "router_logits"] = g[0] if isinstance(g, (tuple, list)) else g
        m = layer.mlp(s[p + "post_norm"][None])
        own[p + "moe"] = (m[0] if isinstance(m, (tuple, list)) else m)[0]
        own[p + "resid_out"] = s[p + "resid_mid"] + s[p + "moe"]
        resid = p + "resid_out"
    if resid in s:
        own["final_norm"] = inner.norm(s[resid])
    if "final_norm" in s:
        own["logits"] = model.lm_head(s["final_norm"])
    if "logits" in s:
        lp = torch.full((T,), math.nan)
        lg = s["logits"][:-1].nan_to_num(nan=0.0)
        lp[:-1] = token_logprobs(lg[None], input_ids[:, 1:], temperature, numerics)[0].float().cpu()
        own["logprobs"] = lp
    return {k: v.detach().float().cpu() for k, v in own.items()}


# ---------------------------------------------------------------------------------------------
# sampler side: one request per generate call, hooks in the engine's worker
# ---------------------------------------------------------------------------------------------
def _collect(engine) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """The worker's records split per forward: [{op: tensor}] in call order, plus its metadata."""
    from safetensors.torch import load

    blob = engine.llm.collective_rpc("megamoe_capture_ops", args=("collect",))[0]
    flat = load(blob)
    # safetensors: an 8-byte little-endian header length, then the JSON header with __metadata__.
    meta = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")]).get("__metadata__", {})
    per_op: dict[str, list[torch.Tensor]] = {}
    for key in sorted(flat, key=lambda k: (k.rsplit("#", 1)[0], int(k.rsplit("#", 1)[1]))):
        per_op.setdefault(key.rsplit("#", 1)[0], []).append(flat[key])
    return per_op, {"dispatch": json.loads(meta.get("dispatch", "{}")), "threads": int(meta.get("threads", 0))}


def _assemble(per_op: dict[str, list[torch.Tensor]], T: int) -> dict[str, torch.Tensor]:
    """Full-sequence tensors {op: [T, ...]} from the forwards of one request: each forward's rows go
    to the positions it ran (recorded from the rotary's input); logits rows to the rows whose
    final-norm output they were computed from (matched bit for bit), NaN where none was computed."""
    positions = [p.long().tolist() for p in per_op["positions"]]
    full: dict[str, torch.Tensor] = {}
    for name, calls in per_op.items():
        if name in ("positions", "logits", "logits_in"):
            continue
        if len(calls) != len(positions):
            raise RuntimeError(f"vLLM capture: {name} ran {len(calls)} times in {len(positions)} forwards")
        t = torch.full((T, *calls[0].shape[1:]), math.nan)
        for pos, c in zip(positions, calls):
            t[pos] = c[:len(pos)]
        full[name] = t
    fn = full["final_norm"]
    index = {fn[r].numpy().tobytes(): r for r in range(T) if not torch.isnan(fn[r]).any()}
    logits = None
    for x, y in zip(per_op.get("logits_in", []), per_op.get("logits", [])):
        if logits is None:
            logits = torch.full((T, y.shape[-1]), math.nan)
        for j in range(x.shape[0]):
            r = index.get(x[j].numpy().tobytes())
            if r is None:
                raise RuntimeError("vLLM capture: a logits row matches no final-norm row of the sequence")
            logits[r] = y[j]
    if logits is not None:
        full["logits"] = logits
    return full


def _sampler_prefill(engine, ids: list[int], seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    from vllm import SamplingParams, TokensPrompt

    engine.llm.collective_rpc("megamoe_capture_ops", args=("start",))
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                              SamplingParams(max_tokens=1, temperature=1.0, seed=seed, prompt_logprobs=0),
                              use_tqdm=False)[0]
    per_op, meta = _collect(engine)
    full = _assemble(per_op, len(ids))
    lp = torch.full((len(ids),), math.nan)
    for j in range(1, len(ids)):
        lp[j - 1] = out.prompt_logprobs[j][ids[j]].logprob
    full["logprobs"] = lp
    return full, meta


def _sampler_generate(engine, prompt: list[int], max_tokens: int, temperature: float, seed: int
                      ) -> tuple[dict[str, torch.Tensor], list[int], dict]:
    from vllm import SamplingParams, TokensPrompt

    from rollout import adapter

    engine.llm.collective_rpc("megamoe_capture_ops", args=("start",))
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                              SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                             seed=seed, logprobs=0), use_tqdm=False)[0]
    per_op, meta = _collect(engine)
    completion = list(out.outputs[0].token_ids)
    ids = prompt + completion
    full = _assemble(per_op, len(ids))
    lp = torch.full((len(ids),), math.nan)
    for j, v in enumerate(adapter.sampled_logprobs(out.outputs[0])):
        lp[len(prompt) - 1 + j] = v
    full["logprobs"] = lp
    return full, completion, meta


# ---------------------------------------------------------------------------------------------
# the measurement
# ---------------------------------------------------------------------------------------------
def measure(model_dir: str | Path, *, prompts: Sequence[str] = DEFAULT_PROMPTS, max_tokens: int = 4,
            temperature: float = 1.0, seed: int = 0, engine=None, own: bool = True,
            engine_kwargs: dict | None = None, numerics: str = FAST, dtype: str | None = None) -> dict:
    """Capture both sides on `prompts` (+ `max_tokens` sampled tokens each) and compare; the report.

    `engine`: a started rollout.worker.RolloutWorker on `model_dir` (moe_impl megamoe, `numerics`), or
    None to start one here (and close it: eager, so that its hooks run at every decode step). The trainer
    side is trainer.model.load_model(model_dir, "megamoe", numerics=numerics) on the same device. `dtype`:
    both sides' ("float32" on CPU, "bfloat16" on CUDA by default).
    """
    import transformers
    import vllm
    from transformers import AutoTokenizer

    from trainer.model import load_model

    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype: expected 'float32' or 'bfloat16', got {dtype!r}")
    model_dir = Path(model_dir).absolute()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [list(tok(p)["input_ids"]) for p in prompts]
    own_engine = engine is None
    if own_engine:
        from rollout.worker import RolloutWorker

        engine = RolloutWorker(model_dir, "megamoe", dtype=dtype, seed=seed, max_model_len=128,
                               kv_cache_memory_bytes=32 << 20, numerics=numerics, enforce_eager=True,
                               **(engine_kwargs or {}))
    try:
        gen, pre, meta = [], [], {}
        for i, p in enumerate(prompt_ids):
            full, completion, meta = _sampler_generate(engine, p, max_tokens, temperature, seed + i)
            gen.append((p, completion, full))
        for p, c, _ in gen:
            full, meta = _sampler_prefill(engine, p + c, seed)
            pre.append(full)
    finally:
        if own_engine:
            engine.close()

    model = load_model(model_dir, "megamoe", dtype=getattr(torch, dtype), device=device, numerics=numerics).eval()
    ops = op_graph(len(_layers(model)), qk_norm=hasattr(_layers(model)[0].self_attn, "q_norm"))
    views = {"prefill": [], "decode": []}
    t_key = f"logprobs@{temperature:g}"
    for (p, c, s_gen), s_pre in zip(gen, pre):
        ids = p + c
        tr = trainer_capture(model, ids, temperatures=sorted({1.0, temperature}), numerics=numerics)
        T = len(ids)
        tr_pre = dict(tr, logprobs=tr["logprobs@1"])
        tr_gen = dict(tr, logprobs=tr[t_key])
        decode_rows = list(range(len(p), T - 1))
        views["prefill"].append(Case(s_pre, tr_pre, list(range(T)), {"logprobs": list(range(T - 1))},
                                     replay_ops(model, s_pre, ids, 1.0, numerics=numerics) if own else {}))
        views["decode"].append(Case(s_gen, tr_gen, decode_rows, {},
                                    replay_ops(model, s_gen, ids, temperature, decode_rows, numerics) if own else {}))
    report = {"meta": {"model_dir": str(model_dir), "numerics": numerics, "dtype": dtype, "device": device,
                       "prompts": len(prompt_ids),
                       "max_tokens": max_tokens,
                       "temperature": temperature, "seed": seed, "tokens": sum(len(p) + len(c) for p, c, _ in gen),
                       "sampler_threads": meta.get("threads"), "trainer_threads": torch.get_num_threads(),
                       "sampler_dispatch": meta.get("dispatch"),
                       "trainer_attention": model.config._attn_implementation,
                       "versions": {"torch": torch.__version__, "vllm": vllm.__version__,
                                    "transformers": transformers.__version__},
                       "seconds": time.perf_counter() - t0},
              "views": {name: compare(cases, ops) for name, cases in views.items() if cases}}
    return report


def _f(v) -> str:
    if v is None:
        return "-"
    return "0" if v == 0 else f"{v:.2e}"


def format_report(report: dict) -> str:
    """Readable tables: one per view, one line per op."""
    m = report["meta"]
    lines = [f"divergence: {m['model_dir']} {m['prompts']} sequences, {m['tokens']} tokens, "
             f"temperature {m['temperature']}, vLLM {m['versions']['vllm']} / transformers "
             f"{m['versions']['transformers']} / torch {m['versions']['torch']}; threads sampler "
             f"{m['sampler_threads']} trainer {m['trainer_threads']}; trainer attention {m['trainer_attention']}",
             f"vLLM kernels: {m['sampler_dispatch']}"]
    for name, view in report["views"].items():
        lines.append(f"\n[{name}] first op where the two sides part: {view['first_parting'] or 'none (all equal)'}")
        head = ("op", "equal", "max|Δ|", "rel", "frac≠", "inputs equal", "parts here", "own equal", "own max|Δ|",
                "own rel")
        rows = [(r["op"], "yes" if r["bitwise"] else "no", _f(r["max_abs"]), _f(r["rel"]), f"{r['frac_diff']:.3f}",
                 "yes" if r["inputs_equal"] else "no", "<<" if r["parts_here"] else "",
                 "-" if r["own_bitwise"] is None else ("yes" if r["own_bitwise"] else "no"),
                 _f(r["own_max_abs"]), _f(r["own_rel"])) for r in view["ops"]]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        lines += [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m rl.divergence ...` = `megamoe-rl divergence ...` (rl/divergence_cmd.py)."""
    from rl.cli import main as cli

    return cli(["divergence", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
