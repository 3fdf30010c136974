"""On a real GPU: the padding checks' private pool (agent/pad/memory.py) keeps the caching
allocator's reserved memory flat after warm-up, and only the checking thread allocates into it.

Run on the GPU machine:  python -m pytest -q -m gpu tests/gpu/test_gpu_pad_memory.py
"""
from __future__ import annotations

import random
import threading

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from torch_watchdog.agent import pad, watch  # noqa: E402


def causal_model(vocab: int = 4096, d: int = 256, max_len: int = 1024):
    nn = torch.nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
            self.layer = nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            n = ids.shape[1]
            x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
            mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
            return self.head(self.layer(x, src_mask=mask, is_causal=True))

    torch.manual_seed(0)
    return M().eval().cuda()


@pytest.mark.skipif(pad.pool_unavailable() is not None, reason="no thread-scoped MemPool")
def test_checks_leave_reserved_memory_flat_after_warm_up():
    model, max_len = causal_model(), 1024
    fn = watch(model, "pool", pad=pad.Tokens(buckets=(max_len,), max_buckets=1, sample=1.0,
                                             check_share=1.0))
    rng = random.Random(0)
    reserved = []
    with torch.inference_mode():
        for n in [max_len - 1] + [rng.randint(8, max_len - 1) for _ in range(30)]:
            ids = torch.randint(0, 4096, (1, n), device="cuda")
            fn(ids)  # exactness is the agent's own check: fn.on below (no eager run here,
            # it would allocate in the shared allocator at a new length)
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    # the first call's check, its bucket at the most padding (1 padded to 1024), 30 sampled
    assert fn.on and fn.checks == 32 and fn.memory.skipped == 0
    assert fn.memory.mode == "released"  # torch >= 2.8: ~MemPool empties that pool alone
    assert fn.memory.pool_bytes > 0      # the checks did allocate, in their own pool
    assert fn.memory.left == 0 and fn.memory.stopped is None
    # every call's reference run and comparison, at 30 new lengths: not a byte kept
    assert max(reserved) == reserved[0] == reserved[-1], reserved


@pytest.mark.skipif(pad.pool_unavailable() is not None, reason="no thread-scoped MemPool")
def test_another_threads_allocations_stay_out_of_the_checks_pool():
    pool = torch.cuda.MemPool()
    got = {}

    def serve():
        got["t"] = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    with torch.cuda.use_mem_pool(pool):
        mine = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        worker = threading.Thread(target=serve)
        worker.start()
        worker.join()
    in_pool = sum(s["total_size"] for s in pool.snapshot())
    assert 32 << 20 <= in_pool < (64 + 32) << 20  # the checking thread's 32 MiB only
    del mine, got["t"]
