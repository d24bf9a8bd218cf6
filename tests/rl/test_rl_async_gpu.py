"""GPU: fixed-lag async RL with the CUDA IPC weight sync (rollout.weight_sync=ipc, the pull model of
docs/WEIGHT_SYNC.md) end to end on one GPU, in run.numerics=bitwise, where "sampled by exactly its version"
is checkable: the trainer's logprobs equal the sampler's bit for bit when both hold the same weights.

    python -m pytest -q -s -m gpu tests/rl/test_rl_async_gpu.py            # one CUDA GPU, vLLM + Ray
    bash benchmarks/device/h200_stack.sh async_gpu                          # the same, as a device stage

Three `megamoe-rl train` runs of configs/tiny.yaml's model made 4 layers H=256 E=16 k=2 in bf16 (the shape the
`bitwise` stage's consistency runs on CUDA), trainer and engine colocated on the GPU, an eager engine:
- k = 0, 4 steps: every batch's mismatch exactly 0 (each publication taken before the next generation);
- k = 1, 5 steps: the batch of step t by version max(0, t-2), its mismatch exactly 0 where no update moved the
  weights since its version (step 1) and above 0 at every step where one did (tests/rl/test_rl_async.py's
  check_sampled_by_version, which the CPU async runs go through with fp32 bounds);
- the same k = 1 run with its RolloutWorker killed while step 4's batch is queued on it: the run goes on, the
  replacement takes version 2 from the trainer's kept buffer and regenerates that batch; every result equals
  the uninterrupted run's, value for value (the same bits need the same weights). Five publications into
  run.max_async_steps + 1 = 2 buffers: a buffer not released after every engine took its version refuses the
  next publish into it (rollout.sync.PublishedSlots), so finishing the run is the check that the dead worker's
  failed take released it.
Three runs of ~1.5 minutes (Ray, the trainer, an eager engine; the killed run starts a second engine): 4 passed in
254 s on one H100 (2026-12-07; benchmarks/RESULTS.md). The checks also ran on CPU: `train_runs` with
files and bitwise fp32 (run.numerics=bitwise rollout.temperature=0.8) in place of GPU_IPC passed all of them, and
a replay that regenerates the lost batch with model_dir's weights failed check_killed at step 4 (check_lag_1 alone
cannot see it: that batch is stale either way).
"""

from __future__ import annotations

import pytest

from test_rl_async import bitwise_off_policy, check_sampled_by_version, result_differences
from test_rl_loop import SMALL, TINY, explain, run_train, write_reward_module
from rl.metrics import read_jsonl


GPU_IPC = ("model.dtype=bfloat16", "model.make.layers=4", "model.make.hidden=256", "model.make.experts=16",
           "model.make.topk=2", "model.make.intermediate=128", "rollout.gpus_per_worker=0.5",
           "trainer.gpus_per_rank=0.5", "rollout.weight_sync=ipc", "run.numerics=bitwise",
           "rollout.kv_cache_bytes=1073741824",
           "rollout.engine_kwargs={gpu_memory_utilization: 0.3, attention_config: {backend: TRITON_ATTN}, "
           "enforce_eager: true}",
           "run.plot=false", "run.export_final=false", "run.tensorboard=false", "run.samples_every=1")
SAMPLES_PER_STEP = 16  # test_rl_loop.SMALL: 4 prompts x 4 samples


def test_the_runs_config_loads_as_bitwise_ipc_on_one_gpu():
    """The runs' overrides load on any machine (a typo would otherwise cost a GPU call to find): ipc between a
    trainer rank and an engine sharing one GPU, bitwise numerics, at both lags."""
    from rl import config as C

    for k in (0, 1):
        cfg = C.load(TINY, [*SMALL, *GPU_IPC, "run.steps=5", f"run.max_async_steps={k}"])
        assert C.resolve_weight_sync(cfg) == "ipc" and cfg.run.numerics == "bitwise" and cfg.run.max_async_steps == k
        assert cfg.rollout.engine_kwargs["enforce_eager"] is True and cfg.model.dtype == "bfloat16"


def train_runs(work, overrides) -> dict:
    """The three runs (module docstring) under `work` with `overrides` (GPU_IPC here): {name: {"proc", "dir",
    "records", "rows"}}. Rewards: the test module's first_char_is_answer (it counts its calls, which times the
    kill: its 3rd, during step 3) and alnum_share, whose partial credit gives every step's groups a signal, so
    every update moves the weights and the stale batches are stale."""
    first = write_reward_module(work)
    rewards = ("--reward", first, "--reward", "loop_test_rewards:alnum_share")
    out = {}
    for name, k, steps, action in (("on_policy", 0, 4, ""), ("lagged", 1, 5, ""), ("killed", 1, 5, "kill_rollout@3")):
        run_dir = work / name
        proc = run_train(run_dir, *overrides, f"run.steps={steps}", f"run.max_async_steps={k}", *rewards,
                         action=action, cwd=work)
        records = read_jsonl(run_dir / "metrics.jsonl") if proc.returncode == 0 else []
        for r in records:
            print(f"[async-gpu {name}] step {r['step']}: version {r['async/policy_version']} lag {r['async/lag']} "
                  f"max |dlogp| {r['mismatch/abs_logp_diff_max']} k3 {r['mismatch/k3_kl']} grad {r['train/grad_norm']:.3g} "
                  f"sync {r['time/weight_sync_s']:.3f} s step {r['time/step_s']:.2f} s")
        out[name] = {"proc": proc, "dir": run_dir, "records": records,
                     "rows": read_jsonl(run_dir / "samples.jsonl") if records else []}
    return out


def check_on_policy(run: dict) -> None:
    """k = 0: every batch's mismatch exactly 0."""
    assert run["proc"].returncode == 0, explain(run["proc"])
    records = run["records"]
    # Non-vacuous: updates moved the weights, so an engine that missed a take would sample by older ones.
    assert any(r["train/grad_norm"] > 0 for r in records[:-1]), [r["train/grad_norm"] for r in records]
    assert check_sampled_by_version(records, run["rows"], 0, bitwise_off_policy, SAMPLES_PER_STEP) == []


def check_lag_1(run: dict) -> None:
    """k = 1: mismatch exactly 0 where the batch is not stale, above 0 where it is."""
    assert run["proc"].returncode == 0, explain(run["proc"])
    stale = check_sampled_by_version(run["records"], run["rows"], 1, bitwise_off_policy, SAMPLES_PER_STEP)
    # Non-vacuous: at least steps 3-5 are stale (every update from the first nonzero gradient on moves the weights).
    assert stale[-3:] == [3, 4, 5], [(r["step"], r["train/grad_norm"]) for r in run["records"]]


def check_killed(lagged: dict, killed: dict) -> None:
    """The run whose rollout worker died mid-queue went on and equals the uninterrupted one."""
    assert killed["proc"].returncode == 0, explain(killed["proc"])
    assert lagged["proc"].returncode == 0, explain(lagged["proc"])
    assert killed["records"][-1]["rollout/restarts_total"] == 1
    assert "restarting it with its queue of weights and generations" in (killed["dir"] / "train.log").read_text()
    differ = result_differences(lagged["records"], killed["records"])
    # Steps 1-3 were trained before the kill could change anything: a difference there is not the replacement's.
    early = [d for d in differ if d[0] <= 3]
    assert early == [], ("the two runs differ before the kill: training on this GPU is not run-to-run "
                         "deterministic here, so the replacement's batch cannot be compared by value", early[:5])
    assert differ == [], differ[:5]
    assert [r["completion"] for r in lagged["rows"]] == [r["completion"] for r in killed["rows"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("rl_async_gpu"), GPU_IPC)


@pytest.mark.gpu
@pytest.mark.slow
def test_ipc_on_policy_every_batch_bitwise_equal_to_the_trainers(runs):
    check_on_policy(runs["on_policy"])


@pytest.mark.parametrize("name", ["lagged", "killed"])
@pytest.mark.gpu
@pytest.mark.slow
def test_ipc_lag_1_each_batch_sampled_by_exactly_its_version(runs, name):
    check_lag_1(runs[name])


@pytest.mark.gpu
@pytest.mark.slow
def test_ipc_rollout_worker_killed_mid_queue_regenerates_its_batch_by_its_version(runs):
    check_killed(runs["lagged"], runs["killed"])
