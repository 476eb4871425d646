"""Embedding and dense kernels: Triton implementations and their pure-torch references."""
