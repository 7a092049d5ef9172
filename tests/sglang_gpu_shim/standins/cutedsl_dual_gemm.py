"""Stand-in for SGLang's CuTe-DSL dual GEMM (needs nvidia-cutlass-dsl, not carried): the same
names, and `can_use_dual_gemm` says no, so SGLang's MLP runs its gate-up and down GEMMs apart."""

from enum import IntEnum

MAX_DUAL_GEMM_DECODE_TOKENS = 0


class DualGemmQuantMode(IntEnum):
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4

    @property
    def is_quantized(self) -> bool:
        return self is not DualGemmQuantMode.UNQUANT


def can_use_dual_gemm(*args, **kwargs) -> bool:
    return False
