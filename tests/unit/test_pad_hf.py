"""The agent's padding (agent/pad/) on real Hugging Face `transformers` models, built from tiny
configs with random weights (fp32, CPU): each case exact or refused, never a padded answer the
checks did not cover. What a user would notice: the returned KV cache's length, one decoding
step from it, the logits and hidden states against the same model unpadded."""
import pytest
import torch

from torch_watchdog.agent import pad, settings, watch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DynamicCache") or not hasattr(transformers.DynamicCache(),
                                                               "layers"):
    pytest.skip("a transformers without DynamicCache.layers (before 4.56)",
                allow_module_level=True)
transformers.logging.set_verbosity_error()

VOCAB, BUCKETS = 100, (16, 32, 64)


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=128, bos_token_id=0,
        eos_token_id=0))


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))


def bert():
    return transformers.BertModel(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=128))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0))


class Compiled:
    """Stands for torch.compile(model) without its compile time: serves the calls, recording
    the token shapes it was given; the checks run on `_orig_mod` (the model itself), as they
    do on a compiled model's."""

    def __init__(self, model):
        self._orig_mod = model
        self.shapes: set = set()

    def __call__(self, *args, **kwargs):
        for k in ("input_ids", "decoder_input_ids"):
            if isinstance(kwargs.get(k), torch.Tensor):
                self.shapes.add((k, tuple(kwargs[k].shape)))
        if args:
            self.shapes.add(("input_ids", tuple(args[0].shape)))
        return self._orig_mod(*args, **kwargs)


@pytest.fixture
def emitted():
    got: list = []
    settings.configure(emit=got.append)
    yield got
    settings.reset()


def ids(n: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, n))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def served(build, **plan):
    torch.manual_seed(0)
    eager = build().eval()
    compiled = Compiled(eager)
    return eager, compiled, watch(compiled, build.__name__,
                                  pad=pad.Tokens(buckets=BUCKETS, **plan))


@pytest.mark.parametrize("build", [gpt2, llama])
def test_a_causal_lm_cache_comes_back_at_the_real_length_and_decodes_exactly(emitted, build):
    eager, compiled, model = served(build)
    with torch.no_grad():
        for n in (5, 37, 20, 9, 3):
            x = ids(n)
            kw = {"position_ids": torch.arange(n)[None]} if build is llama else {}
            out, want = model(x, use_cache=True, **kw), eager(x, use_cache=True, **kw)
            assert out.logits.shape == (1, n, VOCAB) and rel(out.logits, want.logits) < 1e-5
            cache = out.past_key_values
            assert cache.get_seq_length() == n
            assert all(layer.keys.shape[-2] == layer.values.shape[-2] == n
                       for layer in cache.layers)
            step = ids(1)
            after = eager(step, past_key_values=cache, use_cache=True)
            expected = eager(step, past_key_values=want.past_key_values, use_cache=True)
            assert rel(after.logits, expected.logits) < 1e-5
    assert model.on and not [e for e in emitted if e.kind == "mitigation"]
    assert {s for _, s in compiled.shapes} <= {(1, b) for b in BUCKETS}
    # per bucket its first call's check and one at its most padding (1, 17, 33): 9 and 3 are
    # covered
    assert model.checks == 6


def test_a_call_that_brings_its_cache_is_served_as_it_comes(emitted):
    eager, compiled, model = served(gpt2)
    with torch.no_grad():
        out = model(ids(7), use_cache=True)
        step = model(ids(1), past_key_values=out.past_key_values, use_cache=True)
    assert step.logits.shape == (1, 1, VOCAB) and step.past_key_values.get_seq_length() == 8
    assert ("input_ids", (1, 1)) in compiled.shapes and model.on


def test_a_batch_of_uneven_lengths_with_a_mask_is_exact(emitted):
    eager, compiled, model = served(llama)
    mask = torch.ones(4, 23, dtype=torch.long)
    for row, n in enumerate((23, 11, 17, 2)):
        mask[row, n:] = 0
    x = ids(23, batch=4)
    with torch.no_grad():
        out, want = model(x, attention_mask=mask), eager(x, attention_mask=mask)
    real = mask.bool()
    assert rel(out.logits[real], want.logits[real]) < 1e-5 and model.on
    assert compiled.shapes == {("input_ids", (4, 32))}


def test_bert_with_a_mask_is_exact_at_any_padding_after_one_check_per_bucket(emitted):
    eager, compiled, model = served(bert)
    with torch.no_grad():
        for n in (30, 17, 40, 33, 10, 60):
            x = ids(n)
            kw = {"attention_mask": torch.ones(1, n, dtype=torch.long),
                  "token_type_ids": torch.zeros(1, n, dtype=torch.long)}
            out, want = model(x, **kw), eager(x, **kw)
            assert out.last_hidden_state.shape == (1, n, 32)
            assert rel(out.last_hidden_state, want.last_hidden_state) < 1e-5
            assert rel(out.pooler_output, want.pooler_output) < 1e-5
    # the padded positions are masked: the first check of each bucket covers the rest
    assert model.on and model.checks == 3


def test_bert_without_a_mask_never_answers_beyond_the_tolerance_then_refuses(emitted):
    eager, compiled, model = served(bert)
    worst = 0.0
    with torch.no_grad():
        for n in (63, 62, 60, 55, 50, 45, 40, 35):  # ever more padding in bucket 64
            x = ids(n)
            out, want = model(x), eager(x)
            worst = max(worst, rel(out.last_hidden_state, want.last_hidden_state))
    assert worst <= pad.TOLERANCE[torch.float32]
    assert not model.on
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert event.action == "refused" and "padded to 64" in event.detail
    assert event.error > pad.TOLERANCE[torch.float32]


def test_a_check_with_a_mask_does_not_vouch_for_a_call_without(emitted):
    eager, compiled, model = served(bert)
    with torch.no_grad():
        for n in (40, 35, 50):
            model(ids(n), attention_mask=torch.ones(1, n, dtype=torch.long))
        checks = model.checks
        x = ids(45)
        out, want = model(x), eager(x)  # no mask: another signature, checked first
    assert model.checks > checks
    assert rel(out.last_hidden_state, want.last_hidden_state) <= pad.TOLERANCE[torch.float32]


def test_hidden_states_asked_after_a_check_without_them_come_back_at_the_real_length(emitted):
    eager, compiled, model = served(gpt2)
    with torch.no_grad():
        model(ids(10))
        x = ids(12)
        out = model(x, output_hidden_states=True)
        want = eager(x, output_hidden_states=True)
    assert len(out.hidden_states) == len(want.hidden_states) == 3
    for got, expected in zip(out.hidden_states, want.hidden_states):
        assert got.shape == expected.shape == (1, 12, 32) and rel(got, expected) < 1e-5
    assert model.checks == 4 and model.on  # 10 and 1, then 12 and 1 with hidden states


def test_t5_pads_encoder_and_decoder_to_their_buckets_and_its_caches_decode_exactly(emitted):
    eager, compiled, model = served(t5)
    with torch.no_grad():
        for n, k in ((5, 3), (20, 7), (40, 12), (9, 2)):
            kw = {"input_ids": ids(n), "attention_mask": torch.ones(1, n, dtype=torch.long),
                  "decoder_input_ids": ids(k), "use_cache": True}
            out, want = model(**kw), eager(**kw)
            assert out.logits.shape == (1, k, VOCAB) and rel(out.logits, want.logits) < 1e-5
            assert out.encoder_last_hidden_state.shape == (1, n, 32)
            cache = out.past_key_values
            assert cache.self_attention_cache.get_seq_length() == k
            assert {layer.keys.shape[-2] for layer in cache.cross_attention_cache.layers} == {n}
            step = {"attention_mask": kw["attention_mask"], "decoder_input_ids": ids(1)}
            after = eager(encoder_outputs=(out.encoder_last_hidden_state,),
                          past_key_values=cache, **step)
            expected = eager(encoder_outputs=(want.encoder_last_hidden_state,),
                             past_key_values=want.past_key_values, **step)
            assert rel(after.logits, expected.logits) < 1e-5
    assert model.on and not [e for e in emitted if e.kind == "mitigation"]
    assert {s for _, s in compiled.shapes} <= {(1, b) for b in BUCKETS}


def test_a_real_compile_returns_its_cache_sliced(emitted):
    """torch.compile rebuilds the DynamicCache it returns: that one is cut back too."""
    torch.manual_seed(0)
    eager = gpt2().eval()
    model = watch(torch.compile(eager, backend="eager"), "compiled-gpt2",
                  pad=pad.Tokens(buckets=(16,)))
    with torch.no_grad():
        x = ids(11)
        out, want = model(x, use_cache=True), eager(x, use_cache=True)
    assert out.past_key_values.get_seq_length() == 11 and model.on
    assert rel(out.logits, want.logits) < 1e-5


def test_a_cache_with_state_of_its_own_is_refused_with_the_unpadded_answer(emitted):
    """A sliding-window cache counts the tokens it saw: slicing its tensors would leave that
    count padded. Refused at the first check, naming the layer; the caller gets the unpadded
    cache."""
    torch.manual_seed(0)
    eager = transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, sliding_window=8,
        bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    model = watch(eager, "mistral", pad=pad.Tokens(buckets=BUCKETS))
    x = ids(11)
    with torch.no_grad():
        out, want = model(x, use_cache=True), eager(x, use_cache=True)
    assert out.past_key_values.get_seq_length() == 11 and not model.on
    assert torch.equal(out.logits, want.logits)
    (event,) = [e for e in emitted if e.kind == "mitigation"]
    assert "DynamicSlidingWindowLayer" in event.detail
