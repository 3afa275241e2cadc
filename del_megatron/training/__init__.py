"""The training loop: megatron-core model, DeepSpeed engine, numeric loss, metrics, eval."""
