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

from rollout import adapter, bitwise, moe_method, weights  # noqa: E402


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
            "numerics": plugin.STATE["numerics"],
            "dense_ops": bitwise.census(model),
            "compilation": adapter.compilation_state(self),
        }

    def megamoe_moe_calls(self) -> dict[str, int]:
        return moe_method.moe_calls()

    def megamoe_reset_moe_calls(self) -> None:
        moe_method.reset_moe_calls()

    def megamoe_routing_capture(self, action: str) -> dict:
        """Routing capture during generation (rollout/capture.py: "check", "start", "take")."""
        from rollout import capture

        blockers = adapter.routing_capture_blockers(adapter.worker_model(self)) if action == "check" else ()
        return capture.routing_capture(self, action, blockers)

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

    def megamoe_update_weights(self, blob: bytes) -> None:
        """One update of a streamed sync into vLLM's weight-transfer engine (`Worker.update_weights`):
        a chunk of the trainer's CUDA IPC buffer (ipc), or the receive of the trainer's broadcast
        (nccl, returning once the whole stream arrived).

        The update info (names, shapes, dtypes; for ipc the handle's rebuild arguments) travels
        pickled as bytes: collective_rpc's msgpack carries bytes, not the handle's Python types
        (vLLM would need VLLM_ALLOW_INSECURE_SERIALIZATION=1 for the whole engine). The bytes come
        from RolloutWorker.update_weight_chunk, in the process that started this engine."""
        import pickle

        self.update_weights(pickle.loads(blob))
        # vLLM's consumer copies the chunk out of the trainer's buffer on this process's stream; the
        # trainer overwrites the buffer with the next chunk as soon as this call returns.
        torch.cuda.current_stream().synchronize()

    def megamoe_param_digests(self) -> dict[str, str]:
        """{parameter name: SHA-1 of its bytes} of the whole model as the engine holds it (tests:
        two engines hold the same weights exactly when these are equal)."""
        import hashlib

        out = {}
        for name, p in adapter.worker_model(self).named_parameters():
            data = p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
            out[name] = hashlib.sha1(data.tobytes()).hexdigest()
        return out

    def megamoe_engine_params(self) -> dict:
        """What a kernel-format update may write (rollout/kernel_format.py): {"params": {name: (shape,
        dtype name)} of every parameter, "experts": the names of the routed experts' `w13_weight` /
        `w2_weight` of the MoE layers megamoe computes ([] when vLLM repacks them after loading,
        moe_impl stock, which only checkpoint format handles), "packed": the model's
        packed_modules_mapping, "blockers": the layers that compute from their weights after loading
        (rollout.adapter.kernel_format_blockers; none: the whole update may come in kernel format)}."""
        model = adapter.worker_model(self)
        params = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()}
        layers = adapter.hooked_moe_layers(model)
        experts = [] if "stock" in layers.values() else [
            f"{name}.{attr}" for name in layers for attr in weights.KERNEL_EXPERT_SUFFIXES.values()]
        return {"params": params, "experts": [n for n in experts if n in params],
                "packed": adapter.engine_packed_modules(model), "blockers": adapter.kernel_format_blockers(model)}

    def megamoe_receive_kernel_chunk(self, blob: bytes) -> dict:
        """One chunk of kernel-format tensors from the trainer's IPC buffer, each copied straight into
        the engine parameter of its name (what vLLM's reload_weights(is_checkpoint_format=False) does
        per tensor, without its warning that lists every parameter a partial update leaves alone); a
        tensor with fewer rows than its parameter (a padded vocabulary) fills the leading rows. Runs
        before vLLM's update session of the same sync, if there is one (its layer-wise reload takes
        the MoE layers' parameters off the device until it finishes, then puts these back).
        Returns {"map_s": seconds spent mapping the buffer (0 once it is mapped)}."""
        import pickle
        import time

        info = pickle.loads(blob)
        model = adapter.worker_model(self)
        params = dict(model.named_parameters())
        device_index = next(iter(params.values())).device.index
        t0 = time.perf_counter()
        buf = self._megamoe_mapped_buffer(info["ipc_handles"], device_index)
        mapped = time.perf_counter() - t0
        offset = 0
        with torch.no_grad():
            for name, shape, dtype, size in zip(info["names"], info["shapes"], info["dtype_names"],
                                                info["tensor_sizes"]):
                src = buf[offset:offset + size].view(getattr(torch, dtype)).view(shape)
                dst = params[name]
                if src.dim() and src.shape[0] != dst.shape[0]:
                    dst = dst[:src.shape[0]]
                dst.copy_(src)
                offset += size
        torch.cuda.current_stream().synchronize()  # the trainer overwrites the buffer once this returns
        _quiet_moe_reload_warning(model)
        return {"map_s": mapped}

    def _megamoe_mapped_buffer(self, handles: dict, device_index: int) -> torch.Tensor:
        """The trainer's IPC buffer mapped into this process, kept from chunk to chunk and sync to
        sync (the trainer holds one buffer for its run); a chunk from another buffer replaces it.
        Mapping it anew per chunk costs a CUDA IPC open and close each time, and releases torch's
        export of the buffer (one reduce_tensor on the trainer's side) once per chunk instead of
        once, which vLLM's own importer keeps one slot for as well (vLLM 0.32's
        PackedBufferImporter)."""
        held = getattr(self, "_megamoe_ipc", None)
        if held is None or held[0] != handles:
            self._megamoe_ipc = None  # the old mapping is released before the new one is made
            self._megamoe_ipc = (handles, adapter.rebuild_ipc_buffer(handles, device_index))
        return self._megamoe_ipc[1]

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

    def megamoe_capture_ops(self, action: str) -> bytes:
        """"start": hook every op boundary of the model; "collect": the activations recorded since
        (safetensors bytes), hooks removed. rl/divergence.py drives it; see rollout.probe."""
        from rollout import probe

        return probe.capture_ops_in_worker(self, action)


class _ExpectedMoEFallback:
    """Drops vLLM's layer-wise reload warning "<class>: Failed to load weights" for the MoE layer
    classes whose experts this engine receives in kernel format: the reload session of the same
    sync carries no expert tensors by design and puts the freshly written ones back."""

    def __init__(self, classes: set[str]):
        self.classes = classes

    def filter(self, record) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] in self.classes)


def _quiet_moe_reload_warning(model) -> None:
    import logging

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if any(isinstance(f, _ExpectedMoEFallback) for f in log.filters):
        return
    classes = {type(model.get_submodule(n)).__name__ for n in adapter.hooked_moe_layers(model)}
    log.addFilter(_ExpectedMoEFallback(classes))
