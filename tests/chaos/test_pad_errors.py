"""One bad request does not turn padding off (issue 37, item 4). Before: token ids beyond the
vocabulary raised IndexError padded, padding went off for good, and every later request ran
unpadded, bringing back a graph per length. Now the same error unpadded says it was the
caller's: raised to the caller as without padding, padding stays on, told once."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_pad import VOCAB, TinyGPT, emitted, ids  # noqa: F401  (the fixture)
from torch_watchdog.agent import pad, watch


def test_requests_with_token_ids_beyond_the_vocabulary_leave_padding_on(emitted):  # noqa: F811
    torch.manual_seed(0)
    eager = TinyGPT().eval()
    model = watch(torch.compile(eager, backend="eager"), "gpt",
                  pad=pad.Tokens(value=0, buckets=(16, 32)))
    with torch.inference_mode():
        for n in (5, 20):  # padded to each bucket and checked
            x = ids(n)
            torch.testing.assert_close(model(x), eager(x), rtol=1e-4, atol=1e-5)
        padded_before = model.padded_calls
        for n in (3, 9, 27, 12):  # bad requests, routine in production (counted as served)
            bad = ids(n)
            bad[0, -1] = VOCAB + 1000
            with pytest.raises(IndexError):
                model(bad)
        assert model.on and not model.off_signatures and model.caller_errors == 4
        for n in (7, 30):  # later requests are padded still
            x = ids(n)
            torch.testing.assert_close(model(x), eager(x), rtol=1e-4, atol=1e-5)
    assert model.padded_calls == padded_before + 4 + 2
    told = [e for e in emitted if e.kind == "mitigation"]
    assert [e.action for e in told] == ["caller_error"], [(e.action, e.detail) for e in told]
    assert "IndexError" in told[0].detail and "padding stays on" in told[0].detail
