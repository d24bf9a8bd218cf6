"""The files transport of the weight sync (rollout/sync.py is the seam): anywhere, the CPU's one.

    FilesSender(model_dir=..., dtype=None, bucket_bytes=...).send(trainer, client)   # -> SyncReport

Every trainer rank gathers the full weights (a collective: `TrainerWeights.export_weights`); rank 0
holds them on the host and hands them to every engine at once (`Engines.load_whole`: over Ray the
tensors go into the object store once and every engine reads that one copy). Each engine
(RolloutWorker.update_weights) checks the whole update (names, shapes, dtypes, NaN/Inf; F1 in
rollout/sync_engine.py), writes it as safetensors buckets in /dev/shm and loads them in place in
vLLM's worker process, all or nothing per engine. Nothing of vLLM is imported on this side.

`publish(weights, engines, version)` makes the same export once as a Publication that each engine
takes later with RolloutWorker.take_weights (the pull model: docs/WEIGHT_SYNC.md).

Not streamed: no plan-and-start round trip, no chunks. An engine that fails while applying refuses
to sample until a later update lands (rollout/sync_engine.py `discarded`); one that refuses the update
(ValueError) keeps its weights. Engines are independent here: every engine is called and one refusing
does not stop the others; the first failure is raised (over Ray as soon as it comes back, the other
engines finishing their own update). A dead engine is the caller's to restart and give the weights
(rl/loop.py's push_weights).
"""

from __future__ import annotations

from records.weights import Publication, SyncReport
from rollout.sync_interface import Engines, Sender, TrainerWeights
from rollout.sync_stream import Clock

# What one engine's update_weights reports, as its seconds per phase (the engine's own, engine_*).
_ENGINE_PHASES = ("plan_s", "pack_s", "send_s", "commit_s")


class FilesSender(Sender):
    """Rank 0's weights through host memory into every engine (see the module docstring).
    `bucket_bytes` is unused (each engine cuts its own buckets, RolloutWorker.bucket_bytes)."""

    mode = "files"

    def send(self, weights: TrainerWeights, engines: Engines | None) -> SyncReport:
        clock = Clock()
        dtype = weights.sync_dtype(self.dtype)
        named = weights.export_weights(dtype)  # every rank gathers; rank 0 holds the full tensors
        clock.lap("export")
        if weights.rank != 0:
            return SyncReport(seconds={**clock.laps, "total": clock.total()}, bytes=0, sent_bytes=0, chunks=0,
                              format="checkpoint", why={})
        answers = engines.load_whole(named)
        clock.lap("send")
        first = answers[0] if answers else {}
        engine = {f"engine_{k[:-2]}": v for k, v in first.items()
                  if k.endswith("_s") and (k in _ENGINE_PHASES or k.startswith("worker_"))}
        nbytes = int(first.get("bytes", 0))
        return SyncReport(seconds={**clock.laps, **engine, "total": clock.total()}, bytes=nbytes,
                          sent_bytes=nbytes * len(answers), chunks=int(first.get("buckets", 0)),
                          format="checkpoint", why={})

    def publish(self, weights: TrainerWeights, engines: Engines | None, version: int) -> Publication | None:
        """Version `version` for the engines to take later (RolloutWorker.take_weights, queued behind
        their generations): rank 0's export, shared once (`engines.share`: Ray's object store). The
        trainer keeps nothing; the caller holds the Publication until every engine took it."""
        named = weights.export_weights(weights.sync_dtype(self.dtype))  # every rank gathers
        if weights.rank != 0:
            return None
        return Publication(version=version, mode=self.mode, payload=engines.share(named))

