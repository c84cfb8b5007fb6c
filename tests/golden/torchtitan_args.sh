# memplan plan for "examples/gpt.py": dp 2 × tp 1 × pp 1 × cp 1, strategy ddp
# predicted peak per rank 22548578304 B (worst stage), step 1.500 s
# torchtitan 0.3.0 (--module/--config plus overrides; it reads no job TOML: for torchtitan 0.1.0 to 0.2.2 use --format torchtitan-toml)
# model: no torchtitan config is the planned model (3 blocks, parameters unknown); the closest is llama3_debugmodel (6 blocks, 6163712 parameters), which this command trains. torchtitan takes the model's shape from --config alone: register your model's Trainer.Config in a config_registry module and pass --module <that module> --config <its function> instead
# loss: torchtitan 0.3.0's llama3 configs run the head and the loss in 8 chunks of the sequence (ChunkedLossWrapper, --loss.num_chunks), and compile the loss with --compile.enable; the plan holds the loss your model file computes, so unless it calls memplan.run.losses.chunked_cross_entropy(hidden, head, targets, chunks=8) (or, compiled, compiled_cross_entropy) torchtitan holds less at the loss than planned
# --training.disable_cuda_graphs: torchtitan 0.3.0 otherwise captures each step in CUDA graphs and keeps every rank's gradients allocated between steps (zero_grad(set_to_none=False)), which the plan frees at zero_grad; without this flag add one rank's gradients (its shard of them under FSDP, in fp32) to the planned peak
# the step time is eager's (one kernel an op); with --compile.enable torchtitan fuses the memory-bound ops and runs faster than planned: probe with --device meta --compiled to plan the compiled step
# launch with 2 ranks: torchrun --nproc_per_node <gpus per node> -m torchtitan.train $TORCHTITAN_ARGS
TORCHTITAN_ARGS="--module llama3 \
    --config llama3_debugmodel \
    --parallelism.data_parallel_replicate_degree 2 \
    --parallelism.data_parallel_shard_degree 1 \
    --parallelism.tensor_parallel_degree 1 \
    --parallelism.pipeline_parallel_degree 1 \
    --parallelism.context_parallel_degree 1 \
    --training.disable_cuda_graphs \
    --training.local_batch_size 8 \
    --training.global_batch_size 64 \
    activation_checkpoint:full"
