"""The policy model as both trainer and rollout see it: loading a Hugging Face folder and the decoder's
layout (``modeling``), and the tiny default model's character tokenizer (``tokenizer``)."""
