"""GPU kernel classes by name: the one definition the overlap analyzer and the kernel breakdown share.

HolisticTraceAnalysis's classes (its temporal breakdown and ``get_comm_comp_overlap``), with AMD's and Huawei's
collective libraries added:
- communication: names starting ``nccl…Kernel``, ``rccl`` or ``hccl``;
- memory: names starting ``Memcpy``, ``Memset`` or ``dma``;
- computation: every kernel that is neither communication nor a copy/set (``Memcpy``/``Memset`` anywhere in the
  name) nor a synchronisation (``Sync`` in the name).
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
