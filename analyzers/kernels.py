"""GPU kernel classes by name: the one definition the overlap analyzer and the kernel breakdown share.

HolisticTraceAnalysis's classes (its temporal breakdown and ``get_comm_comp_overlap``), with AMD's and Huawei's
collective libraries added:
- communication: names starting ``nccl…Kernel``, ``rccl`` or ``hccl``;
- memory: names starting ``Memcpy``, ``Memset`` or ``dma``;
- computation: every kernel that is neither communication nor a copy/set (``Memcpy``/``Memset`` anywhere in the
  name) nor a synchronisation (``Sync`` in the name).

dtprof's finer classes of what the GPU spends its time on (``kernel_class``; docs/metrics.md "GPU time"), by name,
the first that matches: ``communication`` and ``memory`` as above; ``attention`` (FlashAttention, cuDNN and
PyTorch's memory-efficient fused attention: ``fmha``, ``flash``, ``attention``, ``mha``); ``matmul`` (GEMMs and
convolutions: cuBLAS/CUTLASS/cuDNN ``gemm``, ``xmma``, ``nvjet``, ``Kernel2``, ROCm's Tensile ``Cijk_``, implicit-GEMM
convolutions, Inductor's ``triton_tem`` templates); ``elementwise_norm`` (elementwise, reduction, normalisation,
softmax, activation, copy and optimizer ``multi_tensor_apply`` kernels, Inductor's fused ``triton_poi/per/red``:
the memory-bound work that fusion removes); ``other`` (every other kernel: synchronisation, sorts, unnamed
custom kernels).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

COMM_KERNEL_RE = r"^(?:nccl.*Kernel|rccl|hccl)"
MEMORY_KERNEL_RE = r"^(?:Memcpy|Memset|dma)"
NOT_COMPUTE_KERNEL_RE = r"^(?:nccl.*Kernel|rccl|hccl|.*(?:Memcpy|Memset)|.*Sync)"


def kernel_classes(names: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(is communication, is computation) per kernel name."""
    names = names.astype(str)
    return (names.str.contains(COMM_KERNEL_RE, regex=True).to_numpy(),
            ~names.str.contains(NOT_COMPUTE_KERNEL_RE, regex=True).to_numpy())


def kernel_category(names: pd.Series) -> np.ndarray:
    """"communication" / "memory" / "computation" / "other" (synchronisation) per kernel name."""
    names = names.astype(str)
    comm = names.str.contains(COMM_KERNEL_RE, regex=True).to_numpy()
    memory = names.str.contains(MEMORY_KERNEL_RE, regex=True).to_numpy()
    compute = ~names.str.contains(NOT_COMPUTE_KERNEL_RE, regex=True).to_numpy()
    return np.select([comm, memory, compute], ["communication", "memory", "computation"], "other")


KERNEL_CLASSES = ("matmul", "attention", "elementwise_norm", "communication", "memory", "other")
ATTENTION_KERNEL_RE = r"(?i)fmha|flash|attention|_mha|mha_|sdpa"
MATMUL_KERNEL_RE = (r"(?i)gemm|gemv|matmul|xmma|nvjet|cublas|cutlass::Kernel|Cijk_|implicit_?gemm|conv2d|convolution|"
                    r"fprop|dgrad|wgrad|scudnn|triton_tem")
ELEMENTWISE_NORM_KERNEL_RE = (r"(?i)elementwise|vectorized|unrolled|reduce|norm|softmax|gelu|relu|silu|dropout|"
                              r"fill|copy|cat|multi_tensor_apply|foreach|adam|triton_(?:poi|per|red)|pointwise|"
                              r"bn_|GammaBeta|clamp|nchwToNhwc|nhwcToNchw|pool|embedding|index|scatter|gather|cross_entropy|"
                              r"nll_loss")


# Tensor-core GEMMs built for operands aligned to 1 or 2 elements (CUTLASS names its kernels
# ``..._tensorop_..._alignN``, N the elements a vector load moves: 8 for 16-bit operands on 16-byte boundaries).
# cuBLAS picks them when a matrix dimension is not a multiple of 8 (GPT-2's vocabulary of 50,257); SIMT kernels
# (``simt_sgemm``) say align1 whatever the shapes, so they are not counted.
MISALIGNED_MATMUL_RE = r"(?i)tensorop.*_align[12](?!\d)"


def misaligned_matmul(names: pd.Series) -> np.ndarray:
    """Per kernel name: a tensor-core GEMM built for misaligned operands (MISALIGNED_MATMUL_RE)."""
    return names.astype(str).str.contains(MISALIGNED_MATMUL_RE, regex=True).to_numpy(bool)


def kernel_class(names: pd.Series) -> np.ndarray:
    """One of KERNEL_CLASSES per kernel name (module docstring), by one regular-expression pass per class over the
    distinct names."""
    names = names.astype(str)
    uniq, inverse = np.unique(names.to_numpy(), return_inverse=True)
    u = pd.Series(uniq, dtype=object)

    def has(pattern: str) -> np.ndarray:
        return u.str.contains(pattern, regex=True).to_numpy(bool) if len(u) else np.zeros(0, bool)

    cls = np.select([has(COMM_KERNEL_RE), has(MEMORY_KERNEL_RE), has(ATTENTION_KERNEL_RE), has(MATMUL_KERNEL_RE),
                     has(ELEMENTWISE_NORM_KERNEL_RE)],
                    ["communication", "memory", "attention", "matmul", "elementwise_norm"], "other")
    return cls[inverse.ravel()] if len(u) else np.zeros(0, object)
