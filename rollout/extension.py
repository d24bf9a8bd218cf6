"""vLLM worker extension (`worker_extension_cls`): collective_rpc methods that run in the process
that holds the model.

vLLM mixes this class into its worker class; every method is reachable from the driver with
`llm.collective_rpc("megamoe_...", args=...)`. Names carry the `megamoe_` prefix because vLLM
refuses an extension attribute that the worker already has.

Importing this module fails when the megamoe plugin did not run in this process (vLLM swallowed
an import error of the entry point, or VLLM_PLUGINS left it out): vLLM imports the extension while
it initialises the worker, outside any try, so the engine does not start.
"""

from __future__ import annotations

import os
import time

from rollout import plugin

if not plugin.STATE["registered"]:
    raise RuntimeError(
        f"megamoe plugin did not register its MoE hook in this vLLM process (pid {os.getpid()}): "
        f"plugin state {plugin.STATE}, {plugin.ENV_VAR}={os.environ.get(plugin.ENV_VAR)!r}, "
        f"VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r}. vLLM logs and swallows entry-point import "
        "errors ('Failed to load plugin megamoe' above); fix that error or the configuration")

import torch  # noqa: E402

from rollout import adapter, moe_method, weights  # noqa: E402


class MegaMoEWorkerExtension:
    """Mixed into vLLM's worker; `self` is the worker (model_runner, vllm_config, reload_weights)."""

    def megamoe_status(self) -> dict:
        model = adapter.worker_model(self)
        layers = adapter.hooked_moe_layers(model)
        return {
            "pid": os.getpid(),
            "vllm_version": adapter.VLLM_VERSION,
            "impl": plugin.STATE["impl"],
            "registered": plugin.STATE["registered"],
            "architectures": list(self.vllm_config.model_config.architectures or []),
            "hooked_moe_layers": len(layers),
            "self_routed_moe_layers": adapter.self_routed_moe_layers(model),
            "megamoe_router_gates": adapter.megamoe_router_gates(model),
            "layer_impls": sorted(set(layers.values())),
            "dtype": str(next(model.parameters()).dtype),
        }

    def megamoe_moe_calls(self) -> dict[str, int]:
        return moe_method.moe_calls()

    def megamoe_reset_moe_calls(self) -> None:
        moe_method.reset_moe_calls()

    def megamoe_read_experts(self, layer_index: int) -> bytes:
        """w13_weight [E,2I,H] and w2_weight [E,H,I] of one MoE layer, as the hook sees them (safetensors)."""
        from safetensors.torch import save

        model = adapter.worker_model(self)
        layers = list(adapter.hooked_moe_layers(model))  # model order: layer 0 first
        if not 0 <= layer_index < len(layers):
            raise IndexError(f"layer_index: expected 0 <= layer_index < {len(layers)} (hooked MoE layers), "
                             f"got {layer_index}")
        layer = model.get_submodule(layers[layer_index])
        return save({"w13": layer.w13_weight.detach().cpu().contiguous().clone(),
                     "w2": layer.w2_weight.detach().cpu().contiguous().clone()})

    # -- weight updates: stage every bucket, then validate all and apply (or nothing) -------------

    def megamoe_stage_weights(self, update_id: str, index: int, path: str) -> int:
        """Remember bucket `index` of an update: the path of a file `weights.write_buckets` wrote."""
        staged = self.__dict__.setdefault("_megamoe_staged", {})
        if staged and update_id not in staged:
            staged.clear()  # an earlier update that never committed
        staged.setdefault(update_id, {})[index] = path
        return index

    def megamoe_abort_weights(self, update_id: str) -> None:
        self.__dict__.setdefault("_megamoe_staged", {}).pop(update_id, None)

    def megamoe_commit_weights(self, update_id: str, num_buckets: int) -> dict:
        """Validate the staged update completely, then apply it. Returns {"ok", "stage", "error", ...}.

        Failures come back as data, not exceptions, so that the driver can tell a rejected update
        (stage "validate": nothing applied) from one that broke while being applied (stage "apply").
        """
        t0 = time.perf_counter()
        try:
            staged = self.__dict__.setdefault("_megamoe_staged", {}).pop(update_id, None)
            if staged is None or sorted(staged) != list(range(num_buckets)):
                have = sorted(staged) if staged else []
                raise ValueError(f"weight update {update_id!r}: expected buckets 0..{num_buckets - 1}, staged {have}")
            named = weights.read_buckets([staged[i] for i in range(num_buckets)])
            spec = self.__dict__.get("_megamoe_spec")
            if spec is None:
                spec = weights.CheckpointSpec.from_dir(self.vllm_config.model_config.model)
                self._megamoe_spec = spec
            # The values were checked by RolloutWorker.update_weights before these files were
            # written from them; the engine re-checks names and shapes only (the value check was
            # a second full pass over the model's bytes on the host).
            plan = weights.plan_update(spec, named, check_values=False)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it
            return {"ok": False, "stage": "validate", "error": f"{type(e).__name__}: {e}"}
        t_validated = time.perf_counter()
        try:
            with torch.no_grad():
                adapter.load_weights_in_place(self, plan)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported to the driver, which raises it
            return {"ok": False, "stage": "apply", "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "stage": "done", "error": None, "tensors": len(plan),
                "worker_validate_s": t_validated - t0, "worker_load_s": time.perf_counter() - t_validated}

    def megamoe_receive_ipc_chunk(self, blob: bytes) -> None:
        """One chunk of a CUDA IPC update into vLLM's weight-transfer engine (`Worker.update_weights`).

        The chunk's update info (names, shapes, dtypes, the IPC handle's rebuild arguments) travels
        pickled as bytes: collective_rpc's msgpack carries bytes, not the handle's Python types
        (vLLM would need VLLM_ALLOW_INSECURE_SERIALIZATION=1 for the whole engine). The bytes come
        from RolloutWorker.update_weight_chunk, in the process that started this engine."""
        import pickle

        self.update_weights(pickle.loads(blob))

    def megamoe_gpu_memory(self, reset_peak: bool = False) -> dict:
        """GPU memory seen from the engine's worker process: the device's used bytes (every process
        on it) and what this process's torch allocator holds now and at its peak since the last
        reset (vLLM's sleep-mode pool, which holds weights and KV cache with sleep mode on, is
        outside the torch allocator)."""
        if not torch.cuda.is_available():
            return {}
        free, total = torch.cuda.mem_get_info()
        out = {"device_used_bytes": total - free, "device_total_bytes": total,
               "torch_allocated_bytes": torch.cuda.memory_allocated(),
               "torch_peak_allocated_bytes": torch.cuda.max_memory_allocated()}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return out

    # -- consistency probes (rl/consistency.py) --------------------------------------------------

    def megamoe_probe_moe(self, blob: bytes) -> bytes:
        """Run every MoE block on the given hidden states (safetensors bytes); see rollout.probe."""
        from rollout import probe

        return probe.probe_in_worker(self, blob)
