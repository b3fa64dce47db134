"""Trainer internals shared by the trainer engines: the model's training step (``train_model``),
sequence packing (``packing``), the decoupled PPO loss (``loss``) and the FlashAttention-4 operators
with their launch replay (``fa4_ops``, ``launch_replay``). Heavy: imports torch."""
