"""Tensor, expert and data parallelism, applied to plain model_zoo models after they are built.

collectives.py: the autograd-aware collectives every plan is made of (Megatron's f/g operators).
"""
