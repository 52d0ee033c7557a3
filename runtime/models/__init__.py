"""Pretrained models the runtime can fetch for itself (the demo's SmolLM2-135M-Instruct).

A fetched model is an ordinary Hugging Face folder (``config.json``, safetensors, the
tokenizer and its chat template): a config names it in ``policy.model_name`` like any
other, and nothing here is imported while training.
"""
