"""sgl_kernel.utils as SGLang's CUDA path asks it: no programmatic dependent launch (PDL), which
only sglang-kernel's own CUDA kernels would use."""


def is_arch_support_pdl() -> bool:
    return False
