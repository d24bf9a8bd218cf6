"""RolloutWorker: a vLLM engine whose MoE layers run through megamoe, with in-place weight updates.

    w = RolloutWorker("runs/tiny", moe_impl="megamoe", dtype="float32", seed=0)
    samples = w.generate(["1 + 2 ="], n=4, sampling={"temperature": 0.8, "top_p": 0.9, "max_tokens": 16})
    w.update_weights(trainer_state_dict_items)      # transformers names or on-disk names
    w.moe_calls()                                   # {"megamoe": ...}, counted in vLLM's worker process

A plain class; rl/ wraps it with `ray.remote` (one actor per engine). Each sample is a records.Sample:
prompt_index, prompt_ids, completion_ids, text, sampler_logprobs (of the sampled tokens, after
temperature / top-k / top-p: vLLM's "processed_logprobs", what the trainer must reproduce),
finish_reason, policy_version, and with return_routing its routed_experts.

How the pieces meet: RolloutWorker sets MEGAMOE_MOE_IMPL before it creates the engine, so every
process vLLM spawns runs rollout.plugin.register() with it; the plugin swaps vLLM's unquantized MoE
method for rollout.adapter.MegaMoEMethod. After start-up the worker asks the engine's worker
process (collective_rpc into rollout.extension) which implementation its MoE layers really use and
refuses to continue if that is not what was asked for.

Over 500 lines, on purpose: one actor class whose sampling, file updates and streamed updates (ipc,
nccl) share one engine; the streamed update's state and its legal steps are one object
(rollout/sync_engine.py), the trainer's side of the sync is rollout/sync.py, rollout/sync_nccl.py
and rollout/weights.py (docs/WEIGHT_SYNC.md).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping

import torch

from megamoe.contract import BITWISE, FAST, HOST_IMPLS, MEGAMOE, NUMERICS
from records import Sample
from records.weights import FORMATS, EngineAnswer, Publication
from rollout import kernel_format, moe_method, plugin, weights
from rollout.sync import STREAMED
from rollout.sync_engine import EnginePlan, EngineUpdate, State, check_publication

logger = logging.getLogger(__name__)

# Sampling options whose effect on the distribution the trainer can reproduce (processed logprobs
# are taken after exactly these). Penalties, logit bias and min_tokens would change the logits in
# ways the trainer does not model, so they are refused rather than silently mismatched.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "ignore_eos")
_SEED_RANGE = 2**62


def _check_moe_impl(moe_impl: object) -> str:
    if moe_impl not in HOST_IMPLS:
        raise ValueError(f"moe_impl: expected one of {HOST_IMPLS}, got {moe_impl!r}")
    return moe_impl  # type: ignore[return-value]


def _check_numerics(numerics: object, moe_impl: str, architecture: str, tensor_parallel_size: int,
                    engine_kwargs: dict, enforce_eager: bool | None = None) -> dict:
    """Refuse a numerics this engine cannot provide (naming what is missing); the engine arguments it needs."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics: expected one of {NUMERICS}, got {numerics!r}")
    if numerics == FAST:
        return {}
    from rollout import bitwise

    missing = []
    if moe_impl != MEGAMOE:
        missing.append(f"moe_impl='megamoe' (got {moe_impl!r}: the MoE must be the trainer's kernel too)")
    cuda = torch.cuda.is_available()
    if cuda:
        from rollout import invariant_kernels

        try:
            invariant_kernels.require()
        except ImportError as e:
            missing.append(str(e))
    if tensor_parallel_size != 1:
        missing.append(f"tensor_parallel_size=1 (got {tensor_parallel_size}: a split K reduction is not the trainer's)")
    if not cuda and enforce_eager is False:
        # Dynamo cannot trace the batch-invariant linear (vLLM's parameter subclass; the engine died at start,
        # vLLM 0.32 CPU, 2026-12-05), and Inductor would re-derive the norms and activations in code of its
        # own rounding: a compiled CPU engine is not the trainer's, bit for bit.
        missing.append("enforce_eager=True or None on CPU (got False: torch.compile would compute the dense ops "
                       "with Inductor's kernels, not the trainer's)")
    if architecture not in bitwise.ARCHITECTURES:
        missing.append(f"an architecture in {bitwise.ARCHITECTURES} (got {architecture}: its other ops are not "
                       "measured bitwise)")
    compilation = dict(engine_kwargs.get("compilation_config") or {})
    custom_ops = compilation.get("custom_ops")
    if custom_ops is not None and list(custom_ops) != bitwise.CUSTOM_OPS:
        missing.append(f"compilation_config.custom_ops={bitwise.CUSTOM_OPS} (got {custom_ops!r})")
    needed = {"custom_ops": list(bitwise.CUSTOM_OPS)}
    if cuda:
        for key, value in bitwise.CUDA_COMPILATION.items():
            if key in compilation and compilation[key] != value:
                missing.append(f"compilation_config.{key}={value!r} (got {compilation[key]!r})")
        backend = (engine_kwargs.get("attention_config") or {}).get("backend")
        if backend not in (None, "TRITON_ATTN"):
            missing.append(f"attention_config.backend='TRITON_ATTN' (got {backend!r}: the trainer runs its kernel)")
        needed.update(bitwise.CUDA_COMPILATION)
    if missing:
        raise ValueError("numerics='bitwise': needs " + "; ".join(missing))
    out = {"compilation_config": {**compilation, **needed}}
    if cuda:
        out["attention_config"] = {**(engine_kwargs.get("attention_config") or {}), "backend": "TRITON_ATTN"}
    return out


_SET_BATCH_INVARIANT = {"by_us": False}


def _batch_invariant_env(numerics: str) -> None:
    """vLLM's batch-invariant mode for a bitwise CUDA engine, in the environment its processes inherit; off
    again for a later fast engine of this process (unless the user had set it)."""
    from rollout.bitwise import ENV_BATCH_INVARIANT

    if numerics == BITWISE and torch.cuda.is_available():
        if os.environ.get(ENV_BATCH_INVARIANT) != "1":
            os.environ[ENV_BATCH_INVARIANT] = "1"
            _SET_BATCH_INVARIANT["by_us"] = True
    elif _SET_BATCH_INVARIANT["by_us"]:
        os.environ.pop(ENV_BATCH_INVARIANT, None)
        _SET_BATCH_INVARIANT["by_us"] = False


def _preflight_plugin() -> None:
    """Run the plugin here, outside vLLM, so a broken entry point raises instead of being logged."""
    plugin.entry_point().load()()


ENV_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def _engine_core_placement(kwargs: dict):
    """Where the engine core (vLLM's scheduler) runs, set around `vllm.LLM(...)` (vLLM reads the variable
    while it builds the engine, and its processes inherit it).

    On CPU, in the calling process: vLLM CPU always runs the model in a worker process of its own (its
    `mp` executor, for the worker's OpenMP setup), so a separate engine-core process is a third process
    that only schedules and imports vLLM once more (about 9 s of every engine start on the 2-core test
    machine, and its memory); CPU scheduling is synchronous anyway (vLLM turns async scheduling off on
    CPU). The `mp` executor is then asked for explicitly, so the model still runs in its own worker
    process. On CUDA, vLLM's default: the engine core in a process of its own, overlapping scheduling
    with the GPU. A VLLM_ENABLE_V1_MULTIPROCESSING the user set is left as it is.
    """
    if torch.cuda.is_available() or ENV_MULTIPROCESSING in os.environ:
        yield
        return
    if kwargs.get("distributed_executor_backend") == "uni":  # what vLLM CPU turns into "mp" itself
        kwargs["distributed_executor_backend"] = "mp"
    os.environ[ENV_MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        os.environ.pop(ENV_MULTIPROCESSING, None)


class RolloutWorker:
    def __init__(self, model_dir: str | os.PathLike, moe_impl: str = "megamoe", *, dtype: str = "float32",
                 seed: int = 0, max_model_len: int = 512, kv_cache_memory_bytes: int = 256 << 20,
                 enforce_eager: bool | None = None, enable_prefix_caching: bool = False,
                 tensor_parallel_size: int = 1, bucket_bytes: int = weights.DEFAULT_BUCKET_BYTES,
                 weight_sync: str = "files", sleep_mode: bool = False, numerics: str = FAST,
                 return_routing: bool = False, **engine_kwargs):
        """Start a vLLM engine on the local checkpoint `model_dir` with its MoE layers on `moe_impl`.

        enforce_eager: None means vLLM's default (torch.compile, and CUDA graphs on a GPU) on CUDA, and
        eager on CPU and for moe_impl="reference" on GPU. On CPU, torch.compile adds about 30 s to every
        engine start for the tiny test models (45-85 s under load; vLLM CPU 0.32 fails to load its own
        compile cache, so every start traces again) for 1.13-1.18x the rollout tokens/s
        (benchmarks/bench_compile.py, 2026-12-05); False asks for it (the MoE runs as rollout.moe_method's opaque
        ops either way; a numerics="bitwise" CPU engine refuses it). `reference` is the unfused baseline:
        its grouped GEMMs read the per-expert row counts back to the host, which a CUDA-graph capture
        cannot contain (measured on the H200: "operation not permitted when stream is capturing"), so
        enforce_eager=False with it on GPU is refused.
        enable_prefix_caching: off by default because a prompt whose prefix comes from the cache is
        computed by a different kernel path than a fresh one, so its logprobs would depend on what the
        engine ran before (measured on CPU fp32: ~5e-7 differences for the same seed); a seeded
        generation is then bitwise reproducible. Turn it on for speed when that does not matter.
        weight_sync: how `update_weights` / the chunked protocol receive weights (rollout/sync.py):
        "files" (safetensors buckets in shared memory; any device), "ipc" (vLLM's CUDA IPC
        weight-transfer engine; the trainer on the same GPU) or "nccl" (vLLM's NCCL engine; the
        trainer on another GPU). sleep_mode: build the engine so that
        `sleep` can free its KV cache (and weights) while the trainer trains (CUDA only).
        return_routing: every sample of `generate` carries "routed_experts", the experts each of its tokens
        was routed to while this engine generated it (rollout/capture.py; rollout routing replay,
        docs/ROUTING_REPLAY.md); an engine whose MoE layers cannot report them is refused at start.
        numerics: "fast" (vLLM's own dense kernels) or "bitwise" (rollout/bitwise.py: the trainer's
        batch-invariant linears and attention; vLLM CPU, moe_impl="megamoe", one rank, the
        architectures in rollout.bitwise.ARCHITECTURES; anything else is refused here).
        engine_kwargs go to `vllm.LLM` unchanged.

        Sets MEGAMOE_MOE_IMPL in this process's environment (vLLM's processes inherit it), runs the
        plugin once here so that a broken hook raises in this process, and after start-up checks in
        the engine's worker process(es) that every MoE layer runs on `moe_impl`.
        """
        self.moe_impl = _check_moe_impl(moe_impl)
        if self.moe_impl == "reference" and enforce_eager is False and torch.cuda.is_available():
            raise ValueError("enforce_eager: expected True or None with moe_impl='reference' on a GPU (its unfused "
                             "grouped GEMMs synchronise with the host, which CUDA graphs cannot capture), got False")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: expected a non-negative int, got {seed!r}")
        if weight_sync not in STREAMED + ("files",):
            raise ValueError(f"weight_sync: expected one of {('files',) + STREAMED} (rollout/sync.py), "
                             f"got {weight_sync!r}")
        if (weight_sync in STREAMED or sleep_mode) and not torch.cuda.is_available():
            what = f"weight_sync={weight_sync!r}" if weight_sync in STREAMED else "sleep_mode=True"
            raise ValueError(f"{what}: needs a CUDA GPU (torch.cuda.is_available() is False); "
                             "use weight_sync='files', sleep_mode=False on CPU")
        self.weight_sync = weight_sync
        self.sleep_mode = bool(sleep_mode)
        self.numerics = numerics
        self._asleep: set[str] = set()  # vLLM memory tags ("weights", "kv_cache") now released (not the update's)
        self._weight_update = EngineUpdate()  # every fact of the streamed update (rollout/sync_engine.py)
        self._engine_params: dict | None = None  # megamoe_engine_params (the model's parameters do not change)
        self.tensor_parallel_size = tensor_parallel_size
        # The layout of a streamed update (records.weights.FORMATS; plan_weight_update): "auto" takes the
        # most direct one this engine can load, and the sync report says which and why not a more
        # direct one. Tests and benchmarks set one to compare them.
        self.sync_format = "auto"
        self.model_dir = str(os.fspath(model_dir))
        self.spec = weights.CheckpointSpec.from_dir(self.model_dir)
        self.seed = seed
        self.bucket_bytes = bucket_bytes
        self._calls = 0
        self.last_capture: dict | None = None  # the last generate's routing capture: engine steps, host seconds
        self.llm = None

        from rollout import adapter, archs

        archs.check_architectures([self.spec.architecture], where=f"model_dir {self.model_dir!r}")
        bitwise_kwargs = _check_numerics(numerics, self.moe_impl, self.spec.architecture, tensor_parallel_size,
                                         engine_kwargs, enforce_eager)
        # Before any vLLM process exists: every process the engine spawns inherits them.
        os.environ[plugin.ENV_VAR] = self.moe_impl
        os.environ[plugin.NUMERICS_ENV_VAR] = numerics
        _batch_invariant_env(numerics)
        if torch.cuda.is_available():
            # vLLM forks its engine process by default; a fork of a process that has touched CUDA
            # (a trainer or a test in the same process) cannot use CUDA ("Cannot re-initialize CUDA").
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        _preflight_plugin()
        from vllm import LLM

        if enforce_eager is None:
            enforce_eager = not torch.cuda.is_available() or self.moe_impl == "reference"
        kwargs = dict(model=self.model_dir, tokenizer=self.model_dir, dtype=dtype, seed=seed,
                      max_model_len=max_model_len, enforce_eager=enforce_eager,
                      enable_prefix_caching=enable_prefix_caching,
                      **adapter.engine_kwargs(kv_cache_memory_bytes=kv_cache_memory_bytes,
                                              tensor_parallel_size=tensor_parallel_size,
                                              max_model_len=max_model_len,
                                              weight_sync=weight_sync, sleep_mode=self.sleep_mode))
        kwargs.update(adapter.attention_kwargs(self.spec.architecture, dtype))
        kwargs.update(engine_kwargs)
        kwargs.update(bitwise_kwargs)
        if return_routing and self.moe_impl == "stock" and not enforce_eager:
            raise ValueError("return_routing=True (trainer.routing_replay) with moe_impl='stock': expected "
                             "enforce_eager=True (stock's routing is recorded in Python inside vLLM's MoE layer, "
                             "which torch.compile traces; megamoe / reference record it inside their opaque op), got "
                             f"enforce_eager={enforce_eager!r}")
        self.return_routing = bool(return_routing)
        # Read by the MoE ops in vLLM's processes (they inherit it): write the routing into their capture buffers.
        if self.return_routing:
            os.environ[moe_method.CAPTURE_ENV_VAR] = "1"
        else:
            os.environ.pop(moe_method.CAPTURE_ENV_VAR, None)
        with _engine_core_placement(kwargs):
            self.llm = LLM(**kwargs)
        try:
            self._check_engine()
        except BaseException:
            self.close()
            raise
        logger.info("RolloutWorker: %s on %s, MoE layers through moe_impl=%s (vLLM %s)",
                    self.spec.architecture, self.model_dir, self.moe_impl, adapter.VLLM_VERSION)

    def _check_engine(self) -> None:
        for rank, s in enumerate(self.status()):
            if not s["registered"] or s["impl"] != self.moe_impl:
                raise RuntimeError(f"vLLM worker {rank}: megamoe hook state {s}, expected impl {self.moe_impl!r}")
            if s["hooked_moe_layers"] == 0 or s["layer_impls"] != [self.moe_impl]:
                raise RuntimeError(f"vLLM worker {rank}: expected every MoE layer on moe_impl={self.moe_impl!r}, "
                                   f"found {s['hooked_moe_layers']} hooked layer(s) with {s['layer_impls']}")
            if s["numerics"] != self.numerics:
                raise RuntimeError(f"vLLM worker {rank}: numerics {s['numerics']!r}, expected {self.numerics!r}")
            ops = s["dense_ops"]
            if self.numerics == BITWISE and (ops["other_linears"] or ops["other_attention"] or ops["other_norms"]
                                             or not ops["bitwise_linears"] or not ops["bitwise_attention"]
                                             or not ops["bitwise_norms"]):
                raise RuntimeError(f"vLLM worker {rank}: numerics='bitwise' but not every dense op runs the "
                                   f"batch-invariant kernels: {ops}")
            # a fast engine must not carry this mode's registrations; vLLM's own batch-invariant kernels (a
            # user's VLLM_BATCH_INVARIANT=1 on CUDA) are not ours and compute a fast engine's ops fine
            ours = ops["bitwise_norms"] or (not ops["vllm_batch_invariant"]
                                            and (ops["bitwise_linears"] or ops["bitwise_attention"]))
            if self.numerics == FAST and ours:
                raise RuntimeError(f"vLLM worker {rank}: numerics='fast' but some dense ops run the bitwise "
                                   f"mode's kernels (registrations left from another engine?): {ops}")
            if self.return_routing:
                blockers = self.llm.collective_rpc("megamoe_routing_capture", args=("check",))[rank]["blockers"]
                if blockers:
                    raise ValueError(f"return_routing=True (trainer.routing_replay): vLLM worker {rank} (vLLM "
                                     f"{s['vllm_version']}) cannot return the routed experts of its MoE layers: "
                                     + "; ".join(blockers))
            if s["megamoe_router_gates"] < s["self_routed_moe_layers"]:
                # Routing megamoe.route on logits from vLLM's own gate would not be the trainer's routing.
                raise RuntimeError(f"vLLM worker {rank} (vLLM {s['vllm_version']}): {s['self_routed_moe_layers']} MoE "
                                   f"layer(s) route with megamoe.route but only {s['megamoe_router_gates']} gate(s) "
                                   "compute megamoe.router's logits; rollout/adapter.py and rollout/models.py do not "
                                   "cover this model's gates on this vLLM version")
        if self.return_routing:
            # On from now: each generate takes what its steps filed (one round trip per call, rollout/capture.py).
            self.llm.collective_rpc("megamoe_routing_capture", args=("start",))

    # -- engine introspection ------------------------------------------------------------------

    def status(self) -> list[dict]:
        """Per vLLM worker process: pid, vLLM version, hook state, number of hooked MoE layers, dtype."""
        return self.llm.collective_rpc("megamoe_status")

    def moe_calls(self) -> dict[str, int]:
        """MoE-layer calls per implementation, counted in vLLM's (first) worker process."""
        return self.llm.collective_rpc("megamoe_moe_calls")[0]

    def reset_moe_calls(self) -> None:
        self.llm.collective_rpc("megamoe_reset_moe_calls")

    def read_experts(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E,2I,H], w2 [E,H,I]) of one MoE layer as the engine's worker process holds them."""
        from safetensors.torch import load

        d = load(self.llm.collective_rpc("megamoe_read_experts", args=(layer_index,))[0])
        return d["w13"], d["w2"]

    # -- sampling ------------------------------------------------------------------------------

    def _sampling_params(self, n: int, sampling: Mapping, num_prompts: int):
        from vllm import SamplingParams

        if not isinstance(sampling, Mapping):
            raise TypeError(f"sampling: expected a dict, got {type(sampling).__name__}")
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"sampling: unknown key(s) {unknown}; expected a subset of {SAMPLING_KEYS}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected an int >= 1, got {n!r}")
        base = sampling.get("seed")
        if base is None:
            # Reproducible per worker: the c-th call of a worker built with seed s draws the same.
            base = self.seed * 1_000_003 + self._calls
        if isinstance(base, bool) or not isinstance(base, int):
            raise ValueError(f"sampling['seed']: expected an int, got {base!r}")
        opts = {k: v for k, v in sampling.items() if k != "seed"}
        params = []
        for i in range(num_prompts):
            # vLLM gives the j-th of n samples seed + j, so prompt i starts at base + i*n.
            seed = (base + i * n) % _SEED_RANGE
            params.append(SamplingParams(n=n, seed=seed, logprobs=0, **opts))
        return params

    def generate(self, prompts: list[str] | list[list[int]], n: int = 1, sampling: Mapping | None = None,
                 max_tokens: list[int] | None = None, *, offset: int = 0, policy_version: int = 0) -> list[Sample]:
        """n samples per prompt, prompt-major, as records.Sample: prompt_index counts from `offset` (the
        position of these prompts in the caller's batch), policy_version is `policy_version` (the version
        of the weights this engine holds, as the caller counts them; 0: model_dir's). Prompts are
        strings, or token-id lists given to the engine as they are (vLLM's TokensPrompt: multi-turn
        episodes, whose context holds the sampler's own earlier tokens, rl/episodes.py); max_tokens:
        one limit per prompt, overriding sampling['max_tokens']."""
        from vllm import TokensPrompt

        self._refuse_while_updating("sample")
        self._wake(None)
        as_ids = (not isinstance(prompts, str) and len(prompts) > 0
                  and all(isinstance(p, (list, tuple)) and p and all(type(t) is int for t in p) for p in prompts))
        if isinstance(prompts, str) or not (as_ids or all(isinstance(p, str) for p in prompts)):
            raise TypeError("prompts: expected a list of str or a list of non-empty token-id lists")
        for name, value in (("offset", offset), ("policy_version", policy_version)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
        params = self._sampling_params(n, sampling or {}, len(prompts))
        if max_tokens is not None:
            if len(max_tokens) != len(prompts) or any(type(m) is not int or m < 1 for m in max_tokens):
                raise ValueError(f"max_tokens: expected one int >= 1 per prompt ({len(prompts)}), got {max_tokens!r}")
            for p, m in zip(params, max_tokens):
                p.max_tokens = m
        self._calls += 1
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts] if as_ids else list(prompts)
        try:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        finally:
            got = self.llm.collective_rpc("megamoe_routing_capture", args=("take",))[0] if self.return_routing else None
        from rollout import adapter

        done = [(i, out, c) for i, out in enumerate(outputs) for c in sorted(out.outputs, key=lambda c: c.index)]
        routed = self._routing(done, n, got) if got is not None else [None] * len(done)
        return [Sample(prompt_index=offset + i, prompt_ids=list(out.prompt_token_ids), completion_ids=list(c.token_ids),
                       sampler_logprobs=adapter.sampled_logprobs(c), text=c.text, finish_reason=c.finish_reason,
                       policy_version=policy_version, routed_experts=r)
                for (i, out, c), r in zip(done, routed, strict=True)]

    def _routing(self, done: list, n: int, got: dict) -> list:
        """Each sample's routed_experts: the routing its tokens got while this engine generated them (numpy
        int16 [prompt + completion tokens, L MoE layers in layer order, k], rollout/capture.py; -1 rows for
        the last completion token, which is never fed back, and for prefix-cached prompt tokens). `done`:
        (prompt position, vLLM's RequestOutput, its CompletionOutput) per sample, prompt-major."""
        from rollout import capture

        # vLLM's request id of the j-th of n samples of a prompt is "<j>_<prompt's id>" (one request each).
        keys = [out.request_id if n == 1 else f"{c.index}_{out.request_id}" for _, out, c in done]
        lengths = [len(out.prompt_token_ids) + len(c.token_ids) for _, out, c in done]
        routed = capture.split_requests(got, keys, lengths)
        self.last_capture = {"steps": got["steps"], "read_s": got["read_s"]}
        return routed

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Log-probabilities (temperature 1, no filtering) of given completions under the engine."""
        from vllm import SamplingParams, TokensPrompt

        self._refuse_while_updating("score")
        self._wake(None)

        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"completion_ids: expected {len(prompt_ids)} lists (one per prompt), "
                             f"got {len(completion_ids)}")
        prompts = [TokensPrompt(prompt_token_ids=list(p) + list(c)) for p, c in zip(prompt_ids, completion_ids)]
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        result = []
        for p, c, out in zip(prompt_ids, completion_ids, outs):
            lps = out.prompt_logprobs
            result.append([float(lps[len(p) + j][tok].logprob) for j, tok in enumerate(c)])
        return result

    def _refuse_while_updating(self, what: str) -> None:
        refusal = self.weight_update.refusal(what)
        if refusal:
            raise RuntimeError(refusal)

    # -- weights -------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> dict:
        """Replace every weight of the engine's model in place, or none of them.

        Accepts the transformers state_dict names and shapes (fused experts) or the checkpoint's
        on-disk names. Validated completely, here and again in the worker process, before anything is
        applied: a missing, unexpected, mis-shaped or non-finite tensor raises ValueError/TypeError
        naming it, and the engine keeps serving its previous weights.
        """
        t0 = time.perf_counter()
        self.weight_update.require_not_streaming("update_weights")
        plan = weights.plan_update(self.spec, named_tensors)
        t_plan = time.perf_counter()
        self._wake(["weights"])
        nbytes = sum(t.numel() * t.element_size() for _, t in plan)
        folder = weights.bucket_folder(nbytes)
        try:
            paths = weights.write_buckets(plan, folder, self.bucket_bytes)
            t_pack = time.perf_counter()
            update_id = uuid.uuid4().hex
            try:
                for i, path in enumerate(paths):
                    self.llm.collective_rpc("megamoe_stage_weights", args=(update_id, i, path))
            except BaseException:
                self.llm.collective_rpc("megamoe_abort_weights", args=(update_id,))
                raise
            t_stage = time.perf_counter()
            results = self.llm.collective_rpc("megamoe_commit_weights", args=(update_id, len(paths)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        failed = [r for r in results if not r["ok"]]
        if failed:
            r = failed[0]
            if any(f["stage"] == "apply" for f in failed):
                self.weight_update.discarded(f"a weight update failed while being applied ({r['error']}); the model "
                                             "may hold a mix of old and new weights until update_weights succeeds")
                raise RuntimeError(self.weight_update.broken)
            raise ValueError(f"weight update rejected by the vLLM worker, nothing applied: {r['error']}")
        self.weight_update.applied_whole()
        # Cached KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        t_end = time.perf_counter()
        # Where the time goes (seconds): validate+translate here, pack into safetensors files in shared
        # memory, send their paths, and in the engine process read+validate+load (worker_* from there).
        return {"tensors": len(plan), "bytes": nbytes, "buckets": len(paths),
                "seconds": t_end - t0, "plan_s": t_plan - t0, "pack_s": t_pack - t_plan,
                "send_s": t_stage - t_pack, "commit_s": t_end - t_stage,
                **{k: v for k, v in results[0].items() if k.startswith("worker_")}}

    def take_weights(self, publication: Publication) -> dict:
        """Take a published version of the trainer's weights (records.weights.Publication), all or
        nothing, between two generate calls: files, its shared export through update_weights; ipc,
        the whole streamed update run here from the trainer's published buffer
        (`_take_published`). Returns the update's report with the version taken."""
        if not isinstance(publication, Publication):
            raise TypeError(f"publication: expected a records.weights.Publication, got {type(publication).__name__}")
        mode, version = publication.mode, publication.version
        if not (isinstance(version, int) and version >= 0):
            raise ValueError(f"publication: 'version' expected an int >= 0, got {version!r}")
        if mode == "files":
            return {"version": version, **self.update_weights(publication.payload)}
        if mode == "ipc":
            return {"version": version, **self._take_published(version, publication.payload)}
        raise ValueError(f"publication: mode {mode!r} cannot be taken by an engine (files and ipc publish; "
                         "docs/WEIGHT_SYNC.md)")

    def _take_published(self, version: int, published: dict) -> dict:
        """An ipc publication (records.weights.published_ipc) applied as one streamed update
        with this engine driving it: plan (E1, cached), the plan against the trainer's format and
        layout and every chunk checked (E4) before it starts, then the chunks read in place from
        the trainer's buffer. A refusal changes nothing; a failure while applying leaves the engine
        broken until an update completes (T6)."""
        from rollout import adapter

        if self.weight_sync != "ipc":
            raise ValueError(f"publication: mode 'ipc' needs a RolloutWorker built with weight_sync='ipc', this one "
                             f"has {self.weight_sync!r}")
        answer = self.plan_weight_update(published["metas"], start=False)
        if (answer.format, answer.layout) != (published["format"], published["layout"]):
            raise ValueError(f"publication: version {version} was packed in format {published['format']!r} with "
                             f"its layout, this engine plans {answer.format!r} (or another layout); nothing "
                             "applied")
        chunks = published["chunks"]
        check_publication(self.weight_update.plan, [(adapter.chunk_tensors(c), c.get("tensor_sizes", []))
                                                    for c in chunks])
        self.start_weight_update()
        done = None
        try:
            for chunk in chunks:
                done = self.update_weight_chunk(chunk)
        except BaseException as e:
            self.abort_weight_update(f"taking version {version} failed: {type(e).__name__}: {e}")
            raise
        if done is None:  # E4 holds every planned tensor in some chunk: the last one ended the update
            self._fail_update(f"version {version}: its chunks did not complete the update")
        return {"format": published["format"], **done}

    # -- streamed updates (weight_sync ipc / nccl; rollout/sync.py): plan and start, chunks -------
    # An update ends by itself when its last planned tensor arrives (the chunk call returns what
    # finish_weight_update would); abort_weight_update ends one that will not be completed.

    def _need_ipc(self, what: str) -> None:
        if self.weight_sync not in STREAMED:
            raise RuntimeError(f"{what}: this RolloutWorker was built with weight_sync={self.weight_sync!r}; "
                               f"the streamed protocol needs weight_sync in {STREAMED}")

    def init_weight_transfer_engine(self, join: dict) -> None:
        """Join the trainer's NCCL group (records.weights.nccl_join), through vLLM's NCCL
        weight-transfer engine; returns once this engine's workers joined. (An ipc engine makes its
        own init handshake before its first update session.)"""
        from rollout import adapter

        if self.weight_sync != "nccl":
            raise RuntimeError(f"init_weight_transfer_engine: this RolloutWorker was built with "
                               f"weight_sync={self.weight_sync!r}; joining a trainer's NCCL group needs 'nccl'")
        u = self.weight_update
        u.transfer_group = None
        self.llm.init_weight_transfer_engine({"init_info": adapter.nccl_init_info(join)})
        u.transfer_group = f"{join['address']}:{join['port']}"

    def plan_weight_update(self, metas: list, start: bool = False) -> EngineAnswer:
        """Check a whole update, described as (name, shape, dtype name) per trainer tensor, against
        the checkpoint before any byte moves (rollout/sync_engine.py, E1); raises naming the first
        bad tensor, changes nothing.

        Returns its records.weights.EngineAnswer: format is the layout the chunks must come in
        (records.weights.FORMATS: `sync_format`, or with "auto" the most direct one this engine can
        load), why says why each more direct one was not taken, layout (format "kernel") lists each
        engine parameter as [name, shape, dtype name, the trainer tensors it is made of,
        concatenated along dim 0] (rollout/kernel_format.py); kernel-format shapes and dtypes are
        checked against the engine's own parameters. workers: the engine's ranks in an NCCL group;
        transfer_group: the trainer's NCCL group it joined (address:port), or None. start: once the
        plan is accepted, start the update (start_weight_update) in the same call, one round trip
        less; a trainer that then refuses the update ends it with abort_weight_update."""
        self._need_ipc("plan_weight_update")
        u = self.weight_update
        u.require_plannable()
        if self.sync_format not in ("auto",) + FORMATS:
            raise ValueError(f"sync_format: expected one of {('auto',) + FORMATS}, got {self.sync_format!r}")
        # A run's syncs describe the same update every time: the checks of the last one are reused
        # when the description is equal (they depend on nothing else: the checkpoint is fixed).
        key = (self.sync_format, tuple((n, tuple(shape), str(dt)) for n, shape, dt in metas))
        plan = u.cached_plan(key) or EnginePlan(*self._choose_format(metas))
        u.planned(plan, key)
        if start:
            self.start_weight_update()
        return EngineAnswer(tensors=len(plan.tensors), bytes=plan.nbytes, format=plan.format, why=dict(plan.why),
                            layout=plan.layout, workers=self.tensor_parallel_size, transfer_group=u.transfer_group)

    def _engine(self) -> dict:
        if self._engine_params is None:
            self._engine_params = self.llm.collective_rpc("megamoe_engine_params")[0]
        return self._engine_params

    def _choose_format(self, metas: list) -> tuple:
        """(format, plan {update name: (shape, dtype)}, {update name: engine parameter} of the tensors
        copied in place, layout or None, {format: why not}) for `metas`; ValueError for an update
        that does not fit the checkpoint or, in kernel format, the engine's parameters."""
        why = {}
        if self.weight_sync != "ipc":
            why["kernel"] = why["experts"] = "vLLM's NCCL engine loads what it receives through load_weights"
        elif self.tensor_parallel_size != 1:
            why["kernel"] = why["experts"] = "tensor_parallel_size > 1: vLLM shards the weights as it loads them"
        else:
            engine = self._engine()
            blockers = engine["blockers"]
            if blockers:
                why["kernel"] = (f"{len(blockers)} layer(s) compute from their weights after loading, e.g. "
                                 f"{'; '.join(blockers[:2])}")
            if not engine["experts"]:
                why["experts"] = "vLLM computes the experts (moe_impl 'stock') and repacks them after loading"
        chosen = FORMATS if self.sync_format == "auto" else (self.sync_format,)
        for fmt in chosen:
            if fmt in why:
                if self.sync_format != "auto":
                    raise ValueError(f"sync_format: {fmt!r} cannot load into this engine: {why[fmt]}")
                continue
            if fmt == "checkpoint":
                return fmt, weights.plan_metadata(self.spec, metas), {}, None, why
            plan = weights.plan_metadata(self.spec, metas, kernel_experts=True)
            if fmt == "experts":
                return fmt, plan, self._expert_names(plan), None, why
            engine = self._engine()
            try:
                layout = kernel_format.kernel_layout(plan, engine["params"], engine["packed"])
            except ValueError as e:  # the engine's parameters are not this checkpoint's in kernel format
                if self.sync_format != "auto":
                    raise
                why["kernel"] = str(e)
                continue
            sources = weights.kernel_sources(self.spec, metas)
            plan = {name: (shape, dtype) for name, shape, dtype, _ in layout}
            layout = [[name, list(shape), dtype, [sources[u] for u in parts]] for name, shape, dtype, parts in layout]
            return fmt, plan, {n: n for n in plan}, layout, why
        raise AssertionError("checkpoint format is always possible")

    def _expert_names(self, plan: dict) -> dict[str, str]:
        """{update name `<experts prefix>.w13_weight`: the engine's parameter holding it}, checked in
        shape and dtype (rollout.kernel_format.expert_param)."""
        engine = self._engine()
        names = {}
        for name, want in plan.items():
            if not weights.is_kernel_expert_name(name):
                continue
            found = kernel_format.expert_param(name, engine["experts"])
            have = engine["params"][found]
            if tuple(have[0]) != tuple(want[0]) or have[1] != want[1]:
                raise ValueError(f"tensor {name!r}: the engine's {found!r} is {list(have[0])} {have[1]}, "
                                 f"the update brings {list(want[0])} {want[1]}")
            names[name] = found
        return names

    def start_weight_update(self) -> None:
        self._need_ipc("start_weight_update")
        u = self.weight_update
        u.started()
        self._timed("wake", lambda: self._wake(["weights"]))
        # The cached KV blocks hold the old weights' keys and values. Emptied here rather than at the
        # end: nothing samples while the update runs (_refuse_while_updating), and here it overlaps
        # the trainer's NaN/Inf check (rollout/sync.py).
        self._timed("reset_prefix_cache", self.llm.reset_prefix_cache)

    def abort_weight_update(self, why: str) -> None:
        """End a started update the trainer will not complete (it refused the update, or failed
        before sending it). With no chunk received the engine serves its previous weights; after
        one, it refuses to sample until a complete update. Without a started update: nothing."""
        self._need_ipc("abort_weight_update")
        if self.weight_update.aborted(why):
            self._end_session()

    def _timed(self, phase: str, fn):
        """fn(), its seconds added to this update's `phase` (finish_weight_update reports them)."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.weight_update.add_seconds(phase, time.perf_counter() - t0)

    def _fail_update(self, why: str) -> None:
        """A chunk failed after others may have been applied: refuse to serve until a complete update."""
        if self.weight_update.fail(why):
            self._end_session()
        raise RuntimeError(self.weight_update.broken)

    def _end_session(self) -> None:
        """End vLLM's update session of a broken update so that the next one can start."""
        try:
            self.llm.finish_weight_update()
        except Exception:  # noqa: BLE001 - vLLM may have ended it itself; the broken state stands
            pass

    def update_weight_chunk(self, chunk: dict) -> dict | None:
        """One chunk (records.weights.ipc_chunk / nccl_chunk: names, shapes, dtypes, and for
        ipc the sizes and the buffer's handle; for nccl the call receives the broadcast while the
        trainer sends; vLLM's update info is built from it here, rollout.adapter.vllm_update_info), checked
        against the plan (rollout/sync_engine.py, E2), then loaded: a chunk of kernel-format tensors
        straight into the engine's parameters, a chunk in checkpoint format through vLLM's update
        session (started at the first such chunk; kernel chunks must come before it, while the MoE
        layers hold their parameters). An update all in kernel format never opens vLLM's session.
        Returns None, or finish_weight_update's report when this chunk brought the last planned
        tensor (the update has then ended)."""
        import pickle

        from rollout import adapter

        self._need_ipc("update_weight_chunk")
        u = self.weight_update
        u.require_streaming("update_weight_chunk")
        try:
            if u.receive(adapter.chunk_tensors(chunk)):
                names = u.plan.kernel_names
                info = {**chunk, "names": [names[n] for n in chunk["names"]]}
                blob = pickle.dumps(info)
                mapped = self._timed("kernel", lambda: self.llm.collective_rpc("megamoe_receive_kernel_chunk",
                                                                              args=(blob,))[0])
                u.add_seconds("kernel_map", mapped["map_s"])
            else:
                if not u.session_open:
                    self._init_ipc_engine()
                    self._timed("session_start", self.llm.start_weight_update)
                    u.session_opened()
                blob = pickle.dumps(adapter.vllm_update_info(chunk))
                self._timed("reload", lambda: self.llm.collective_rpc("megamoe_update_weights", args=(blob,)))
        except Exception as e:  # noqa: BLE001 - reported with the broken state
            self._fail_update(f"{type(e).__name__}: {e}")
        return self.finish_weight_update() if u.all_received else None

    def _init_ipc_engine(self) -> None:
        """vLLM's IPC init handshake, once per engine, before its first update session (vLLM >= 0.32
        takes the packed flag there; 0.26 reads it from each chunk)."""
        from rollout import adapter

        u = self.weight_update
        if self.weight_sync == "ipc" and not u.ipc_initialized:
            init = adapter.ipc_init_info()
            if init is not None:
                self.llm.init_weight_transfer_engine({"init_info": init})
            u.ipc_initialized = True

    def finish_weight_update(self) -> dict:
        self._need_ipc("finish_weight_update")
        u = self.weight_update
        missing = u.missing()  # refused unless an update is streaming
        if missing:
            self._fail_update(f"{len(missing)} planned tensor(s) never arrived, e.g. {missing[0]!r}")
        if u.session_open:
            try:
                self._timed("session_finish", self.llm.finish_weight_update)
            except Exception as e:  # noqa: BLE001
                self._fail_update(f"{type(e).__name__}: {e}")
        return u.complete()

    # -- the update's state (rollout/sync_engine.py) -------------------------------------------

    @property
    def weight_update(self) -> EngineUpdate:
        """This engine's streamed-update state. Made in __init__, or at first use for a worker
        assembled without it (tests of the protocol over a fake engine)."""
        u = self.__dict__.get("_weight_update")
        if u is None:
            u = self._weight_update = EngineUpdate()
        return u

    # Read-only views of the update's state under the names the protocol's tests read.
    _plan = property(lambda self: self.weight_update.plan.tensors if self.weight_update.plan else None)
    _kernel_names = property(lambda self: getattr(self.weight_update.last_plan, "kernel_names", {}))
    _updating = property(lambda self: self.weight_update.state is State.STREAMING)
    _weights_broken = property(lambda self: self.weight_update.broken)

    # -- sleep mode (colocated: free the GPU memory the trainer needs) --------------------------

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep: level 1 frees the KV cache and moves the weights to host memory; level 2
        frees both (the next update must then deliver every weight, which a sync does)."""
        if not self.sleep_mode:
            raise RuntimeError("sleep: this RolloutWorker was built with sleep_mode=False")
        if level not in (1, 2):
            raise ValueError(f"level: expected 1 or 2, got {level!r}")
        if self._asleep:
            return
        self.llm.sleep(level=level)
        self._asleep = {"weights", "kv_cache"}
        if level == 2 and not self.weight_update.broken:
            self.weight_update.discarded("the engine slept at level 2, which discards its weights; an update "
                                         "restores them")

    def _wake(self, tags: list[str] | None) -> None:
        todo = sorted(self._asleep if tags is None else self._asleep & set(tags))
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep -= set(todo)

    def gpu_memory(self, reset_peak: bool = False) -> dict:
        """GPU memory from the engine's worker process (rollout.extension.megamoe_gpu_memory)."""
        return self.llm.collective_rpc("megamoe_gpu_memory", args=(reset_peak,))[0]

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine's processes down (also done when the object is collected)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm, engine, core
        gc.collect()

    def __del__(self):
        if getattr(self, "llm", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - at interpreter exit imports fail; vLLM reaps its processes
                pass
