"""The models a trainer rank trains: loading them, LoRA adapters, their optimizer (AdamW, schedule, clipping, fp16
loss scaling) and optimizer step, and checkpoints of them."""
