# memplan plan for "examples/gpt.py": dp 2 × tp 1 × pp 1 × cp 1, strategy ddp
# predicted peak per rank 22548578304 B (worst stage)
# Launch with 2 ranks: torchrun ... pretrain_gpt.py $MEMPLAN_ARGS <model args>
MEMPLAN_ARGS="--tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 \
    --context-parallel-size 1 \
    --micro-batch-size 8 \
    --global-batch-size 64 \
    --bf16 \
    --recompute-granularity full \
    --recompute-method block \
    --recompute-num-layers 3"
