"""The GPU memory plan of a run config, per phase of an RL step, before anything starts.

    plan = memory_plan(cfg)                  # from the config alone (model.make, or model.path's config.json)
    plan.fits(card_bytes)  -> bool           # every phase's total within the card
    print(plan.render(card_bytes))           # the table `megamoe-rl doctor --config` and `train --dry-run` print
    max_layers(cfg, card_bytes)              # the most decoder layers of this model that fit
    check_run(cfg, card_seen_by_child())     # `megamoe-rl train`: refuse a run this machine's card cannot hold
    check_host_memory(**model_make_args)     # make-model / model.make: refuse a model the host memory cannot hold

The plan is arithmetic on the model's dimensions and the config, for one GPU that holds a trainer rank and
(colocated) an engine. What is counted, in bytes:
- trainer state: the base weights (LoRA without FSDP2: frozen, in the compute dtype, nothing else; full
  fine-tuning: fp32 master weights, fp32 gradients, two fp32 AdamW moments, sharded over trainer.world_size),
  LoRA's factors (fp32 weights, gradients and two AdamW moments: 16 bytes a parameter);
- train activations per micro-batch token: with activation checkpointing each layer's input (H in the
  compute dtype) and one layer's recomputed activations, else every layer's: the MoE's 24 KiB per token
  per layer measured for the fused kernel (Qwen3 bf16, benchmarks/RESULTS.md; scaled by H / 2048 for other
  widths) and the attention's estimate 2 bytes x (3H + 3 heads*head_dim + 4 kv_heads*head_dim); the logits,
  V x 2 bytes a token plus V x 12 (fp32 copy, log-softmax, its gradient) as an upper bound for completion tokens;
  a micro-batch is trainer.token_budget tokens packed, else micro_batch_size x max_seq_len;
- LoRA's transient per layer: the effective weights W + scale*B@A in the compute dtype, their gradient, and
  the merge's fp32 temporaries of the largest adapted tensor (three of its size);
- the engine: its weights (model.dtype), its KV cache (rollout.kv_cache_bytes) and ENGINE_OVERHEAD
  (activations, CUDA graphs, workspaces: an estimate, not measured for this model);
- CUDA_CONTEXT per process (two processes on the card when colocated).
The engine's start-up gate (colocated): vLLM refuses to start unless the card's free memory is at least
gpu_memory_utilization x its total (rollout.engine_kwargs, else vLLM's default); with kv_cache_memory_bytes set,
as the project always does, that is all the fraction does. The trainer rank and the engine are built
concurrently, so the trainer's whole state may already be on the card then: the plan fits only if the gate
passes with it resident.
Phases: rollout (the trainer's state stays resident, the engine awake), train (the engine asleep as
rollout.sleep_level says: 0 keeps weights and KV, 1 moves weights to host and frees KV, 2 frees both),
sync (the engine's weights back, the trainer's IPC bucket of rollout.ipc_bucket_bytes, one merged tensor).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30
KiB = 2**10
MOE_ACT_PER_TOKEN_H2048 = 24 * KiB  # fused kernel, per token per MoE layer, Qwen3 bf16 (benchmarks/RESULTS.md)
ENGINE_OVERHEAD = 3 * GiB           # vLLM's activations, CUDA graphs, workspaces (estimate)
CUDA_CONTEXT = GiB // 2             # per process on the card (estimate)
VLLM_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM 0.26's default gpu_memory_utilization (vllm/config/cache.py), used where rollout.engine_kwargs sets none."""
MAX_LAYERS_SEARCHED = 1024  # max_layers' bound (a plan that still fits there reports it)
CARDS = {"H200": 139 * GiB, "H100": 78 * GiB}  # usable memory of the lent cards (torch.cuda.mem_get_info's total)


@dataclass(frozen=True)
class Dims:
    layers: int
    hidden: int
    experts: int
    topk: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False

    @property
    def attn_params(self) -> int:
        H, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return H * q + 2 * H * kv + q * H + 2 * self.head_dim  # q, k, v, o and Qwen3's q/k norms

    @property
    def expert_params(self) -> int:
        return self.experts * 3 * self.intermediate * self.hidden

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.expert_params + self.experts * self.hidden + 2 * self.hidden

    @property
    def fixed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.fixed_params


def make_dims(*, layers: int, hidden: int, experts: int, topk: int, intermediate: int, vocab: int | None = None,
              heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None, **_) -> Dims:
    """The dimensions of the model make_model makes from these arguments (its defaults for vocab and heads)."""
    from rl.make_model import DEFAULT_VOCAB, head_layout

    h, kv, hd = (heads, kv_heads, head_dim) if heads is not None else head_layout(hidden)
    return Dims(layers, hidden, experts, topk, intermediate, vocab or DEFAULT_VOCAB, h, kv, hd)


def dims_of(cfg) -> Dims:
    """The model's dimensions from model.make, or from model.path's config.json (no torch)."""
    m = cfg.model.make
    if m is not None:
        return make_dims(layers=m.layers, hidden=m.hidden, experts=m.experts, topk=m.topk, intermediate=m.intermediate,
                         vocab=m.vocab, heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim)
    c = json.loads((Path(cfg.model.path) / "config.json").read_text())
    heads = c["num_attention_heads"]
    return Dims(c["num_hidden_layers"], c["hidden_size"], c.get("num_experts") or c.get("num_local_experts"),
                c["num_experts_per_tok"], c.get("moe_intermediate_size") or c["intermediate_size"], c["vocab_size"],
                heads, c.get("num_key_value_heads", heads), c.get("head_dim") or c["hidden_size"] // heads,
                bool(c.get("tie_word_embeddings", False)))


def lora_params(d: Dims, rank: int, targets: list[str]) -> int:
    """Factor parameters of every layer (A and B of each target; trainer/lora.py's shapes)."""
    H, q, kv, E, I = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.experts, d.intermediate
    per = {"q_proj": H + q, "k_proj": H + kv, "v_proj": H + kv, "o_proj": q + H,
           "gate_up_proj": E * (2 * I + H), "down_proj": E * (H + I), "router": H + E}
    return d.layers * rank * sum(per[t] for t in targets)


@dataclass
class Plan:
    dims: Dims
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    gate_utilization: float | None = None  # colocated: the engine's gpu_memory_utilization (the start-up gate)
    resident_at_engine_start: int = 0       # the trainer's state and both CUDA contexts

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak(self) -> int:
        return max(self.total(p) for p in self.phases)

    def fits(self, card_bytes: int) -> bool:
        return self.peak <= card_bytes and self.engine_gate(card_bytes) is None

    def engine_gate(self, card_bytes: int) -> str | None:
        """None when a colocated engine passes vLLM's start-up gate on this card (module docstring), else why not."""
        if self.gate_utilization is None:
            return None
        free = card_bytes - self.resident_at_engine_start
        asked = math.ceil(card_bytes * self.gate_utilization)
        if asked <= free:
            return None
        most = math.floor(100 * max(free, 0) / card_bytes) / 100
        return (f"rollout.engine_kwargs.gpu_memory_utilization {self.gate_utilization} makes vLLM ask for "
                f"{asked / GiB:.1f} GiB free at the engine's start, but with the trainer's state on the card "
                f"({self.resident_at_engine_start / GiB:.1f} GiB) {free / GiB:.1f} GiB are free: set it to at most "
                f"{most:.2f} (the KV cache is rollout.kv_cache_bytes either way)")

    def render(self, card_bytes: int | None = None, card: str = "the card") -> str:
        d = self.dims
        lines = [f"memory plan: {d.layers} layers, H={d.hidden}, {d.experts} experts top-{d.topk}, I={d.intermediate}, "
                 f"{d.heads}/{d.kv_heads} heads x {d.head_dim}, vocab {d.vocab}: {d.params / 1e9:.2f} B parameters"]
        for phase, items in self.phases.items():
            parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in items.items() if v)
            lines.append(f"  {phase:8s} {self.total(phase) / GiB:7.1f} GiB = {parts}")
        lines += [f"  note: {n}" for n in self.notes]
        if card_bytes is not None:
            verdict = "fits" if self.peak <= card_bytes else "does NOT fit"
            lines.append(f"  peak {self.peak / GiB:.1f} GiB {verdict} {card} ({card_bytes / GiB:.1f} GiB)")
            gate = self.engine_gate(card_bytes)
            if gate is not None:
                lines.append(f"  the engine does NOT start on {card}: {gate}")
        return "\n".join(lines)


def _bytes(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else 4


def memory_plan(cfg, dims: Dims | None = None) -> Plan:
    """The plan of `cfg` (see the module docstring); `dims` overrides the model's dimensions."""
    d = dims or dims_of(cfg)
    t, r = cfg.trainer, cfg.rollout
    compute = 2 if (t.gpus_per_rank > 0 and cfg.model.dtype == "bfloat16") else 4
    plan = Plan(d)
    W = t.world_size if t.fsdp else 1
    lo = t.lora
    if lo.enabled:
        base = d.params * (compute if not t.fsdp else 4) // (1 if not t.fsdp else W)
        n_lora = lora_params(d, lo.rank, lo.targets)
        trainer_state = {"base (frozen)": base, "adapters + AdamW": n_lora * 12 // W}
        grads = n_lora * 4 // W
        largest = max(d.experts * 2 * d.intermediate * d.hidden if {"gate_up_proj", "down_proj"} & set(lo.targets)
                      else 0, d.heads * d.head_dim * d.hidden)
        transient = 2 * d.layer_params * compute + 3 * 4 * largest  # W_eff and its gradient, merge temporaries
        if not t.activation_checkpointing:
            transient += (d.layers - 1) * d.layer_params * compute  # every layer's W_eff kept for its backward
            plan.notes.append("trainer.activation_checkpointing false: every layer's effective weights stay "
                              "until its backward")
    else:
        trainer_state = {"weights + AdamW (fp32)": d.params * 12 // W}
        grads = d.params * 4 // W
        transient = d.layer_params * compute * (2 if W > 1 else 0)  # FSDP2's unsharded layer (and prefetch)
    tokens = t.token_budget if t.packing else t.micro_batch_size * t.max_seq_len
    moe = MOE_ACT_PER_TOKEN_H2048 * d.hidden // 2048 * compute // 2
    attn = 2 * (3 * d.hidden + 3 * d.heads * d.head_dim + 4 * d.kv_heads * d.head_dim) * compute // 2
    if t.activation_checkpointing:
        act = tokens * (d.layers * d.hidden * compute + moe + attn)
    else:
        act = tokens * d.layers * (moe + attn + 2 * d.hidden * compute)
    logits = tokens * d.vocab * (compute + 12)
    engine_w = d.params * _bytes(cfg.model.dtype)
    colocated = cfg.ray.placement == "colocated"
    engine = {"engine weights": engine_w, "KV cache": r.kv_cache_bytes, "engine overhead": ENGINE_OVERHEAD} \
        if colocated else {}
    ctx = CUDA_CONTEXT * (2 if colocated else 1)
    plan.phases["rollout"] = {**trainer_state, **engine, "CUDA contexts": ctx}
    if colocated:
        plan.gate_utilization = float(r.engine_kwargs.get("gpu_memory_utilization", VLLM_GPU_MEMORY_UTILIZATION))
        plan.resident_at_engine_start = sum(trainer_state.values()) + ctx
    asleep = dict(engine)
    if colocated and r.sleep_level >= 1:
        asleep["engine weights"] = 0  # level 1: to host memory; level 2: freed
        asleep["KV cache"] = 0
    plan.phases["train"] = {**trainer_state, "adapter grads" if lo.enabled else "grads (fp32)": grads,
                            "activations": act, "logits": logits, "layer transients": transient, **asleep,
                            "CUDA contexts": ctx}
    sync_extra = {"IPC bucket": r.ipc_bucket_bytes if colocated else 0,
                  "one merged tensor": d.experts * 2 * d.intermediate * d.hidden * compute if lo.enabled else 0}
    plan.phases["sync"] = {**trainer_state, **engine, **sync_extra, "CUDA contexts": ctx}
    if colocated and r.sleep_level == 0:
        plan.notes.append("rollout.sleep_level 0: the engine keeps its weights and KV cache through training")
    return plan


def max_layers(cfg, card_bytes: int, dims: Dims | None = None) -> int:
    """The most decoder layers of this model (other dimensions kept) whose plan fits `card_bytes` (0: none)."""
    d = dims or dims_of(cfg)
    best = 0
    for n in range(1, MAX_LAYERS_SEARCHED + 1):  # the plan grows with the layer count: stop at the first misfit
        if memory_plan(cfg, Dims(**{**d.__dict__, "layers": n})).fits(card_bytes):
            best = n
        else:
            break
    return best


def card_bytes_seen() -> tuple[str, int] | None:
    """(name, total bytes) of CUDA device 0, or None without one (imports torch)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(0)
    return torch.cuda.get_device_name(0), int(total)


def report(cfg, card: tuple[str, int] | None) -> tuple[bool | None, str]:
    """(fits, text) for `cfg` on `card` ((name, bytes), or None: the plan and the lent cards' verdicts)."""
    plan = memory_plan(cfg)
    if card is None:
        text = plan.render() + "\n" + "\n".join(
            f"  {name} ({b / GiB:.0f} GiB): {'fits' if plan.fits(b) else 'does NOT fit'}; "
            f"at most {max_layers(cfg, b)} layers of this model fit"
            + (f"; the engine does not start: {plan.engine_gate(b)}" if plan.engine_gate(b) else "")
            for name, b in CARDS.items())
        return None, text
    name, b = card
    text = plan.render(b, name)
    if not plan.fits(b):
        text += f"\n  at most {max_layers(cfg, b)} layers of this model fit {name} (model.make.layers)"
    return plan.fits(b), text


def card_seen_by_child() -> tuple[str, int] | None:
    """card_bytes_seen() from a child process: the run's driver then holds no CUDA context of its own (about
    0.5 GiB of the card the run needs, for the whole run). None without a CUDA device."""
    code = "import json; from rl.memory_plan import card_bytes_seen; print(json.dumps(card_bytes_seen()))"
    here = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"could not read the GPU's memory for the memory plan: {proc.stderr.strip()[-600:]}")
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    return (seen[0], int(seen[1])) if seen else None


def check_run(cfg, card: tuple[str, int] | None) -> str:
    """Before a GPU run starts (`megamoe-rl train`, unless run.check_memory is false): its plan against `card`, the
    first GPU this machine shows (card_seen_by_child(); None: none). Returns the line for the run's log; raises
    ConfigError (the plan, and the most layers that fit) where the plan does not fit."""
    from trainer.config import ConfigError

    if card is None:
        return ("memory plan not checked: this machine shows no GPU (a driver on a CPU node of a Ray cluster; "
                "`megamoe-rl doctor --config` on a GPU machine checks the plan)")
    fits, text = report(cfg, card)
    if not fits:
        raise ConfigError(f"run.check_memory: the run's GPU memory plan does not fit {card[0]} "
                         f"({card[1] / GiB:.1f} GiB):\n{text}\n(the plan is an estimate, rl/memory_plan.py; "
                         "run.check_memory=false starts the run anyway)")
    return f"memory plan: peak {memory_plan(cfg).peak / GiB:.1f} GiB fits {card[0]} ({card[1] / GiB:.1f} GiB)"


def host_memory_available() -> int | None:
    """Linux's MemAvailable in bytes (/proc/meminfo), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host_memory(*, arch: str = "qwen3_moe", layers: int = 2, hidden: int = 64, experts: int = 8, topk: int = 2,
                      intermediate: int = 32, vocab: int | None = None, heads: int | None = None,
                      kv_heads: int | None = None, head_dim: int | None = None, dtype: str = "float32",
                      available: int | None = None, **_) -> None:
    """ValueError when the host cannot hold the model while make_model builds and writes it (on either device
    the whole model is in host memory before the write): its weights, Dims' parameter count x dtype's bytes,
    against `available` (None: host_memory_available(); a host whose MemAvailable cannot be read is not
    checked). Without it the kernel's out-of-memory killer ends the process without a word. The make-model
    command and train's model.make (rl/base_model.py) call it before make_model."""
    available = host_memory_available() if available is None else available
    if available is None:
        return
    params = make_dims(layers=layers, hidden=hidden, experts=experts, topk=topk, intermediate=intermediate,
                       vocab=vocab, heads=heads, kv_heads=kv_heads, head_dim=head_dim).params
    need = params * (4 if dtype == "float32" else 2)
    if need > available:
        raise ValueError(f"layers={layers}, hidden={hidden}, experts={experts}, intermediate={intermediate}, "
                         f"dtype={dtype}: about {params / 1e9:.2f} B parameters, {need / GiB:.1f} GiB that make_model "
                         f"holds in host memory while it builds and writes the model, but this machine has "
                         f"{available / GiB:.1f} GiB available (MemAvailable): fewer layers"
                         + (", bfloat16" if dtype == "float32" else "") + " or a machine with more memory")
