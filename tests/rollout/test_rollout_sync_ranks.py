"""The streamed weight sync with two trainer ranks (real processes, gloo, CPU): a failure on one
rank raises on both, with the engines' update aborted, instead of leaving the other rank waiting.

Each rank runs rollout.sync.send_ipc (or sync_nccl.send_nccl) over its own IPC buffer, here a CPU
tensor (no CUDA: the handle is empty), and rank 0 drives a recording client in place of the
engines; vLLM's update-info builder is replaced by the chunk itself (what it adds is tested in
test_rollout_sync.py). The scenarios run one after another in the same two processes and process
group, so each also checks that the ranks left the previous one in step: the last is a sync that
completes. A rank left waiting fails the test through the process group's timeout or the spawn's.

    .venv/bin/python -m pytest -q tests/rollout/test_rollout_sync_ranks.py
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megamoe.testing import run_processes
from records.weights import EngineAnswer

WORLD = 2
N_TENSORS, ROWS, COLS = 6, 32, 16          # fp32: 2 KiB each
BUCKET_BYTES = 2 * ROWS * COLS * 4          # two tensors per chunk: three chunks per sync
PG_TIMEOUT_S, SPAWN_TIMEOUT_S = 30, 150     # a rank left waiting fails within these

SCENARIOS = [
    ("ok", {}),
    ("engine fails at chunk 1", {"engine_fails_at": 1}),
    ("rank 1's stream fails at tensor 3", {"stream_fails": (1, 3)}),
    ("rank 0's stream fails at its last tensor", {"stream_fails": (0, N_TENSORS - 1)}),
    ("nccl: rank 0 cannot join the engines' group", {"nccl_join_fails": True}),
    ("ok again", {}),
]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"model.layers.{i}.mlp.proj.weight": torch.randn(ROWS, COLS, generator=g) for i in range(N_TENSORS)}


class _Trainer:
    """What send_ipc / send_nccl ask of a trainer rank; its stream may raise at one tensor."""

    def __init__(self, rank: int, fails_at: int | None):
        self.rank, self.fails_at, self.state = rank, fails_at, _state()

    def sync_dtype(self, dtype):
        return dtype

    def weight_metadata(self, dtype):
        return [(n, list(t.shape), "float32") for n, t in self.state.items()]

    def nonfinite_weights(self, dtype):
        return []

    def iter_device_weights(self, select=None, names=None):
        for i, (n, t) in enumerate(self.state.items()):
            if i == self.fails_at:
                raise RuntimeError(f"injected: rank {self.rank} could not gather {n}")
            yield n, t


class _Client:
    """Rank 0's engines, one of them, recorded: its plan, the chunks it received, an abort."""

    engines = 1

    def __init__(self, fails_at: int | None):
        self.fails_at, self.calls, self.received = fails_at, [], []

    def plan(self, metas):
        self.calls.append("plan_weight_update")
        total = N_TENSORS * ROWS * COLS * 4
        return [EngineAnswer(format="checkpoint", layout=None, why={}, bytes=total, workers=1)]

    def wait(self, pending):
        return pending

    def update_weights(self, info):
        if len(self.received) == self.fails_at:
            raise RuntimeError("injected: the engine died")
        self.calls.append("update_weights")
        self.received.append(list(info["names"]))
        return [None]

    def finish_weight_update(self):
        self.calls.append("finish_weight_update")
        return {"seconds": {}}

    def abort_weight_update(self, why):
        self.calls.append(f"abort: {why}")


def _rank(rank: int, model_dir: str, out_dir: str) -> None:
    from rollout import sync, sync_nccl

    init = os.path.join(out_dir, "pg_init")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    buf = object.__new__(sync.IPCBuffer)
    buf.__dict__.update(nbytes=BUCKET_BYTES, tensor=torch.empty(BUCKET_BYTES, dtype=torch.uint8), handle={},
                        multi_rank=True)
    sync.ipc_buffer = lambda nbytes: buf

    def no_group(client, decision, address):
        raise RuntimeError("injected: the engines' NCCL rendezvous timed out")

    sync_nccl._nccl_group = no_group
    results = {}
    for name, case in SCENARIOS:
        fails_rank, fails_at = case.get("stream_fails", (None, None))
        trainer = _Trainer(rank, fails_at if fails_rank == rank else None)
        client = _Client(case.get("engine_fails_at")) if rank == 0 else None
        send = sync_nccl.send_nccl if case.get("nccl_join_fails") else sync.send_ipc
        try:
            out = send(trainer, client, model_dir=model_dir, dtype=None, bucket_bytes=BUCKET_BYTES)
            outcome = {"chunks": out.chunks, "sent_bytes": out.sent_bytes}
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            outcome = {"raised": f"{type(e).__name__}: {e}"}
        if client is not None:
            outcome.update(calls=client.calls, received=client.received)
        results[name] = outcome
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    d = tmp_path_factory.mktemp("ranks")
    model = d / "m"
    model.mkdir()
    save_file(_state(), str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps({"architectures": ["TestForCausalLM"]}))
    run_processes(_rank, (str(model), str(d)), WORLD, SPAWN_TIMEOUT_S, "trainer rank")
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(WORLD)]


NAMES = list(_state())
CHUNKS = [NAMES[i:i + 2] for i in range(0, N_TENSORS, 2)]


@pytest.mark.parametrize("name", ["ok", "ok again"])
def test_a_sync_completes_on_both_ranks_chunk_by_chunk(outcomes, name):
    rank0, rank1 = (o[name] for o in outcomes)
    assert rank0["received"] == CHUNKS
    assert rank0["calls"] == ["plan_weight_update"] + ["update_weights"] * 3 + ["finish_weight_update"]
    assert {k: rank0[k] for k in ("chunks", "sent_bytes")} == rank1 == {"chunks": 3, "sent_bytes": 3 * BUCKET_BYTES}


@pytest.mark.parametrize("name, at_rank0, at_rank1, received", [
    ("engine fails at chunk 1",
     "RuntimeError: injected: the engine died",
     "RuntimeError: weight sync: trainer rank 0 failed handing a chunk to the engines: "
     "RuntimeError: injected: the engine died", CHUNKS[:1]),
    ("rank 1's stream fails at tensor 3",
     f"RuntimeError: weight sync: trainer rank 1 failed packing a chunk: "
     f"RuntimeError: injected: rank 1 could not gather {NAMES[3]}",
     f"RuntimeError: injected: rank 1 could not gather {NAMES[3]}", CHUNKS[:1]),
    ("rank 0's stream fails at its last tensor",
     f"RuntimeError: injected: rank 0 could not gather {NAMES[-1]}",
     f"RuntimeError: weight sync: trainer rank 0 failed packing a chunk: "
     f"RuntimeError: injected: rank 0 could not gather {NAMES[-1]}", CHUNKS[:2]),
])
def test_an_ipc_failure_on_one_rank_raises_on_both_and_aborts_the_engines(outcomes, name, at_rank0, at_rank1,
                                                                         received):
    rank0, rank1 = (o[name] for o in outcomes)
    assert rank0["raised"] == at_rank0 and rank1 == {"raised": at_rank1}
    assert rank0["received"] == received  # what reached the engines before the failure, nothing after
    assert rank0["calls"][-1] == f"abort: the trainer's stream failed: {at_rank0}"
    assert "finish_weight_update" not in rank0["calls"]


def test_an_nccl_join_failure_on_rank_0_raises_on_both_before_the_stream(outcomes):
    rank0, rank1 = (o["nccl: rank 0 cannot join the engines' group"] for o in outcomes)
    err = "RuntimeError: injected: the engines' NCCL rendezvous timed out"
    assert rank0["raised"] == err and rank1 == {"raised": f"RuntimeError: rank 0: {err}"}
    assert rank0["calls"] == ["plan_weight_update", f"abort: the trainer could not join the engines' NCCL group: {err}"]
