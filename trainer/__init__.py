"""trainer: FSDP2 training of Hugging Face MoE models whose experts run on megamoe.

    config.py      the typed settings, each defined once with its description: TrainerSettings (every
                   rank's), TrainerConfig (the run config's `trainer` section), TrainerWorkerConfig
                   (what one TrainerWorker rank gets: rl.config.trainer_worker_config builds it)
    experts.py     megamoe in transformers' experts registry; Fp32Router (fp32 logits, megamoe.route)
    model.py       load_model(dir, moe_impl, numerics=): checkpoint checks (names, shapes), experts, router
    bitwise.py     numerics="bitwise": InvariantLinear and the batch-invariant attention function (the
                   kernels vLLM's side shares, megamoe.invariant)
    replay.py      rollout routing replay (R3): the sampler's experts in Fp32Router, routing and load metrics
    batch.py       a records.TrainBatch's rows checked against the model (vocabulary, max_seq_len, truncation),
                   rank shards, padded micro-batches
    packing.py     packed micro-batches (trainer.packing): one row, position ids restarting per sequence
    lora.py        LoRA (trainer.lora): factors beside the frozen weights, the merge the forward and every
                   export share, PEFT's adapter format
    loss.py        the policy losses (grpo, gspo, cispo, dr_grpo; KL to a reference), mismatch correction
                   and metrics (pure functions; the advantages come from rl/advantages.py)
    fsdp.py        fully_shard per decoder layer + root; full weights streamed one tensor at a time
    checkpoint.py  atomic DCP checkpoints (model, optimizer, counters, RNG); latest_checkpoint
    worker.py      TrainerWorker: one rank (rl/ wraps it with ray.remote)
    testing.py     seeded batches and weight comparisons for the tests
"""
