"""Shim (tests only): SGLang falls back to its native rotary embedding when this raises."""


def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("vllm custom ops are not available in rltrain's CPU test shim")
