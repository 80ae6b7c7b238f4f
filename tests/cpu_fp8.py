"""Whether fp8 trains here, for the tests that train in emulated fp8 on the CPU.

torchao's float8 training runs its matmuls through ``torch._scaled_mm``; on the CPU that is
oneDNN's fp8 matmul, which exists only where the CPU has AVX-512 FP16 (Xeon Sapphire Rapids
and later). Elsewhere such a test is skipped with the reason, and what autoprec does there
instead (``--emulate fp8`` refused in one line) is tested in `tests/test_cpu_fp8.py` under
``ONEDNN_MAX_CPU_ISA=AVX2``, on any x86-64 CPU.
"""

from __future__ import annotations

import pytest

from autoprec.devices import cpu_scaled_mm_error

MISSING = cpu_scaled_mm_error()

trains_fp8 = pytest.mark.skipif(
    MISSING is not None,
    reason=f"fp8 training on this CPU: torch._scaled_mm has no kernel here ({MISSING})",
)
