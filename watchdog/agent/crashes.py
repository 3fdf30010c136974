"""Which failed watched calls are OOMs: allocator errors, GPU errors on a nearly full GPU."""
from __future__ import annotations

import sys
from typing import Any, Optional

from torch_watchdog.agent.signature import MAX_NESTED, arguments


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or the CUDA error that bypasses the allocator: a nearly full
    GPU can fail with `cudaErrorMemoryAllocation`, which is no OutOfMemoryError and which the
    allocator's OOM observer never sees (docs/agent.md)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)[:2000]
        return "cudaErrorMemoryAllocation" in text or "out of memory" in text
    return False


# A crash on a nearly full GPU is an OOM by another name: the first failure can be cuDNN
# attention's `RuntimeError: Expected mha_graph.execute(...) is_good() to be true`, not an OOM
# error; cuBLAS and CUDA errors do the same when a workspace cannot be allocated. Such an error
# on a GPU with under NEARLY_FULL of its memory free (or whose free memory cannot be read any
# more, as after a sticky CUDA error) is reported as an `oom` of source "crash".
GPU_CRASH_MARKERS = ("CUDA error", "cudaError", "CUDA driver error", "CUBLAS_STATUS",
                     "CUDNN", "cuDNN", "mha_graph", "AcceleratorError", "CUFFT_", "CUSOLVER_",
                     "CUSPARSE_STATUS", "NCCL error")
NEARLY_FULL = 0.05


def crash_text(exc: BaseException) -> str:
    """The exception's class name and message, as the markers are looked for in."""
    return f"{type(exc).__name__}: {str(exc)[:2000]}"


def is_gpu_crash(text: str) -> bool:
    return any(marker in text for marker in GPU_CRASH_MARKERS)


def crash_is_oom(text: str, free: Optional[int], total: Optional[int]) -> bool:
    """Report a failed call as an OOM? A CUDA/cuDNN/cuBLAS error while its GPU had less than
    NEARLY_FULL of its memory free, or while free memory was unknown."""
    if not is_gpu_crash(text):
        return False
    if free is None or not total or total <= 0:
        return True
    return free < NEARLY_FULL * total


def _cuda() -> Any:
    """torch.cuda if torch is imported (the server's; never imported here), else None."""
    return getattr(sys.modules.get("torch"), "cuda", None)


def gpu_memory(args: tuple[Any, ...], kwargs: dict[str, Any], tensor_type: type[Any]
               ) -> Optional[tuple[Optional[int], Optional[int], Optional[int]]]:
    """(device, free, total) of the GPU a failed call used: the first CUDA tensor argument's,
    else the current device; free and total None if they cannot be read. None when CUDA is not
    initialised (never initialised by us: that breaks servers that fork later)."""
    cuda = _cuda()
    if cuda is None or not cuda.is_initialized():
        return None
    device = None
    for a in arguments(args, kwargs)[:MAX_NESTED]:
        try:
            if isinstance(a, tensor_type) and a.is_cuda:
                device = a.device.index
                break
        except Exception:
            continue
    try:
        if device is None:
            device = cuda.current_device()
        free, total = cuda.mem_get_info(device)
        return device, int(free), int(total)
    except Exception:  # the context may be broken by the very error we are looking at
        return device, None, None

