"""Sliding-window caches: a layer with a window keeps only the tokens a later query can see (window + min(window, 64)
rows allocated, whatever max_len), and gives what the whole sequence through the window mask gives.

Oracles: tests/reference.py's GQA with its window, in float64; for storages, the same module with a cache that
keeps every token (the rows are quantised one token at a time, so dropping old ones changes nothing); for the
generation loop, transformers' own Gemma 3 (its sliding layers keep their window in its own cache).
"""
import pytest
import torch

from attnlab import GroupedQueryAttention
from attnlab.convert import gqa_to_mla, gqa_to_mla_decoupled
from attnlab.modules.storage import fp8_supported
from conftest import F64, gqa_ref, randomize
from reference import rel_err

W = 3  # the window; sequences of 17 tokens
SCHEDULES = {  # chunk sizes fed one call after another (17 tokens each)
    "one at a time": [1] * 17,
    "a prompt past the room, then steps": [9] + [1] * 8,
    "chunks": [2, 5, 1, 4, 1, 3, 1],
}


def _gqa(window=W):
    torch.manual_seed(0)
    g = GroupedQueryAttention(64, 4, 2, head_dim=16, grouping="strided", rope_base=100.0, qk_norm_eps=1e-5,
                              softmax_scale=0.3, sliding_window=window, dtype=F64)
    return randomize(g, std=0.3).eval()


def _modules():
    """The GQA, its exact MLA and its keys-whole compressed MLA (full rank: exact too), each with the window."""
    g = _gqa()
    exact, _ = gqa_to_mla(g)
    whole, _ = gqa_to_mla_decoupled(g, 2 * 16, 8)
    return {"gqa": g, "exact mla": exact.eval(), "keys-whole mla": whole.eval()}


def _fed(m, x, schedule, cache=None, **kw):
    """x fed in chunks through one cache; (outputs (B, L, dim), the cache)."""
    cache = cache if cache is not None else m.init_cache(x.shape[0], x.shape[1])
    out, t = [], 0
    for n in schedule:
        out.append(m(x[:, t:t + n], cache=cache, is_causal=True, **kw))
        t += n
        assert cache.held <= cache.capacity
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["gqa", "exact mla", "keys-whole mla"])
def test_a_window_cache_gives_the_whole_sequence_through_the_window(name, schedule):
    """Fed in chunks through its window cache, each module gives the reference GQA's output over the whole
    sequence with the window (float64, <= 1e-10), on every path (the MLAs' expanded and absorbed), while its
    cache allocates 2 x window rows for 17 tokens and ends holding no more than that."""
    torch.manual_seed(1)
    x = torch.randn(2, 17, 64, dtype=F64)
    m = _modules()[name]
    want = gqa_ref(_modules()["gqa"], x, causal=True)
    paths = [{}] if name == "gqa" else [{"absorbed": False}, {"absorbed": True}]
    if name == "exact mla":  # RoPE after the up-projection: the absorbed path does not exist there
        paths = [{}, {"absorbed": False}]
    with torch.no_grad():
        for kw in paths:
            got, cache = _fed(m, x, SCHEDULES[schedule], **kw)
            assert rel_err(got, want) <= 1e-10, kw
            assert cache.window == W and cache.capacity == 2 * W and cache.length == 17
            assert cache.key_start > 0 and cache.held < 17  # it did drop tokens


@pytest.mark.parametrize("name, kv_dtype", [("gqa", "int8"), ("gqa", "fp8"), ("gqa", "int4/g16"), ("keys-whole mla", "int8"),
                                             ("keys-whole mla", "int4/g32+r8"), ("keys-whole mla", "int4/g32+c4")])
def test_stored_rows_are_the_same_whether_old_ones_were_dropped_or_not(name, kv_dtype):
    """With a quantised storage, the window cache gives what a cache keeping every token gives (its mask applying
    the window), exactly: each token is quantised alone. A "+c4" storage (the rope key per channel over groups of
    64 tokens) cannot drop a token at a time: its module keeps every token and the mask applies the window."""
    if kv_dtype == "fp8" and not fp8_supported():
        pytest.skip("this torch build has no float8_e4m3fn")
    m = _modules()[name]
    m.kv_dtype = kv_dtype
    torch.manual_seed(2)
    x = torch.randn(2, 17, 64, dtype=F64)
    with torch.no_grad():
        whole, full = _fed(m, x, SCHEDULES["chunks"], cache=m.init_cache(2, 17, sliding=False))
        got, cache = _fed(m, x, SCHEDULES["chunks"])
    assert full.window is None
    assert rel_err(got, whole) <= 1e-10
    assert cache.window == (None if "+c4" in kv_dtype else W)


def test_the_bytes_of_a_window_cache_stop_at_its_window():
    """A window cache allocates 2 x window rows (window + min(window, 64)) whatever max_len (bytes measured from its
    tensors), stores the same bytes per token held as a full cache, and its bytes per token of a context are
    those rows spread over the context; a window of 100 allocates 164 rows."""
    g = _gqa()
    full, window = g.init_cache(1, 1000, sliding=False), g.init_cache(1, 1000)
    allocated = [sum(t.numel() * t.element_size() for t in c.tensors()) for c in (full, window)]
    assert allocated[1] * 1000 == allocated[0] * 2 * W
    assert window.bytes_per_token == full.bytes_per_token
    assert full.bytes_at(4096) == full.bytes_per_token
    assert window.bytes_at(2) == window.bytes_per_token
    assert window.bytes_at(4096) == window.bytes_per_token * 2 * W / 4096
    assert _gqa(window=100).init_cache(1, 1000).capacity == 164 and _gqa(window=100).init_cache(1, 150).capacity == 150


def test_going_back_is_allowed_only_as_far_as_the_tokens_kept():
    """truncate() to the last token and feeding it again gives the same output; going back past what was dropped is
    refused, naming the positions, and so is a fixed-shape view (which needs every slot)."""
    g = _gqa()
    torch.manual_seed(3)
    x = torch.randn(1, 17, 64, dtype=F64)
    with torch.no_grad():
        out, cache = _fed(g, x, SCHEDULES["one at a time"])
        cache.truncate(16)
        again = g(x[:, 16:], cache=cache)
    assert rel_err(again, out[:, 16:]) <= 1e-12
    with pytest.raises(ValueError, match=r"dropped the tokens before \d+; going back to 2 needs them from 0"):
        cache.truncate(2)
    with pytest.raises(ValueError, match="a fixed-shape step needs every slot"):
        cache.fixed_slot(torch.zeros(1, dtype=torch.int64))


def test_the_generation_loop_keeps_the_window_and_transformers_tokens():
    """attnlab's own loop on a tiny random Gemma 3 (a sliding layer of window 4, a global one) allocates the sliding
    layer's window only and greedily generates transformers' own tokens, 40 past the window."""
    import transformers as T

    from attnlab import models as hf
    from attnlab.generation import Generator, generate

    cfg = T.Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                             query_pre_attn_scalar=20, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(4)
    theirs = T.Gemma3ForCausalLM(cfg).eval()
    ours = T.Gemma3ForCausalLM(cfg).eval()
    ours.load_state_dict(theirs.state_dict())
    hf.to_attnlab(ours)
    prompt = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        want = theirs.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
        assert [c.capacity for c in Generator(ours, max_batch_size=2, max_len=64).caches] == [8, 64]
        assert [c.capacity for c in Generator(ours, 2, 64, fixed_shape=True).caches] == [64, 64]
        every = Generator(ours, 2, 64, sliding=False)
        assert [c.capacity for c in every.caches] == [64, 64]
        assert torch.equal(generate(ours, prompt, max_new_tokens=40, generator=every), want)
        got = generate(ours, prompt, max_new_tokens=40)
    assert torch.equal(got, want)


def test_a_model_states_its_bytes_at_a_context_where_layers_slide():
    """kv_bytes_per_token(context=T) counts a sliding layer's cache as min(T, 2 x window) rows spread over T (bytes
    written out here: one KV head of 16, K and V, 2 bytes each, a layer of window 4 and a global one); the
    context a report states them at is the model's max_position_embeddings, and none where nothing slides."""
    import transformers as T

    from attnlab import models as hf

    cfg = T.Gemma3TextConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                             query_pre_attn_scalar=20, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"])
    model = hf.to_attnlab(T.Gemma3ForCausalLM(cfg).eval())
    per_layer = 2 * 16 * 2
    assert hf.kv_bytes_per_token(model, torch.bfloat16) == 2 * per_layer
    for context in (1, 4, 64, 1000):
        want = per_layer * min(context, 8) / context + per_layer
        assert hf.kv_bytes_per_token(model, torch.bfloat16, context=context) == pytest.approx(want, rel=1e-12)
    assert hf.sliding_context(model) == 128
    for m in hf.attnlab_modules(model):
        m.sliding_window = None
    assert hf.sliding_context(model) is None
