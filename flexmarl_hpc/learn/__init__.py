"""The learning math, device-agnostic: the decoder model, batched sampling, GRPO, HF <-> megatron conversion."""
