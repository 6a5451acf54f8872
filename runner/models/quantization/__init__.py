"""Quantised checkpoints: which schemes load (FP8, block-wise or per-tensor), and how a model holds them.

``scheme.py`` reads ``config.json``'s ``quantization_config`` (and refuses every other scheme by name),
``fp8_linear.py`` is the linear layer that keeps FP8 weights with their scales, ``convert.py`` decides which of a
built model's layers become FP8 (from the checkpoint's tensor names, or all of them for ``--quantization fp8``
on a bf16 checkpoint) and quantises a bf16 checkpoint's tensors as they are read.
"""
