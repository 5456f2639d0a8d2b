"""gptlab.generate / stream / beam_search against Hugging Face generate on the same weights."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import torch

from gptlab import GPT, GPTConfig, beam_search, generate, stream
from gptlab.generation import beam_search_fn
from gptlab.sampling import process_logits

import transformers  # noqa: E402,F401  (the HF comparisons need it)
import scipy.stats as stats  # noqa: E402
from tiny_models import VARIANTS, WINDOWED, tiny_gpt  # noqa: E402

V = 50


def _model(seed: int = 0, scale: float = 8.0, **kw) -> GPT:
    """A tiny random GPT-2; weights scaled up so next-token distributions are peaked (no near-ties
    between the top candidates, which float rounding could flip between implementations)."""
    cfg = dict(vocab_size=V, block_size=48, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return tiny_gpt(seed, scale=scale, **cfg)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def hf(model):
    h = model.to_hf()
    h.generation_config.eos_token_id = None
    h.generation_config.bos_token_id = None
    h.generation_config.pad_token_id = None
    return h


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(1))


def _hf_generate(hf, idx, mask=None, **kw):
    mask = torch.ones_like(idx) if mask is None else mask
    with torch.no_grad():
        return hf.generate(idx, attention_mask=mask, **kw)


@pytest.mark.parametrize("use_cache,cache", [(True, "static"), (True, "concat"), (False, "static")])
def test_greedy_matches_hf(model, hf, prompts, use_cache, cache):
    ours = generate(model, prompts, 25, temperature=0, use_cache=use_cache, cache=cache)
    ref = _hf_generate(hf, prompts, max_new_tokens=25, do_sample=False)
    assert ours.shape == (3, 30)
    assert torch.equal(ours, ref)


def test_greedy_with_repetition_penalty_matches_hf(model, hf, prompts):
    ours = generate(model, prompts, 20, temperature=0, repetition_penalty=1.8)
    ref = _hf_generate(hf, prompts, max_new_tokens=20, do_sample=False, repetition_penalty=1.8)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, generate(model, prompts, 20, temperature=0))  # the penalty did something


def test_greedy_eos_matches_hf_and_pads_finished_rows(model, hf, prompts):
    free = generate(model, prompts, 20, temperature=0)
    eos = int(free[0, 5 + 3])  # a token row 0 really emits, early
    ours = generate(model, prompts, 20, temperature=0, eos_token_id=eos)
    ref = _hf_generate(hf, prompts, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(ours, ref)
    for row in ours[:, 5:]:
        hits = (row == eos).nonzero()
        if len(hits):  # after the first eos, the row only emits eos (the pad)
            assert (row[int(hits[0]):] == eos).all()
    assert (ours[0, 5:] == eos).any()


def test_generation_stops_when_every_row_is_done(model):
    idx = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(5))
    free = generate(model, idx, 20, temperature=0)
    eos = int(free[0, 4 + 2])
    first = int((free[0, 4:] == eos).nonzero()[0])
    never = next(t for t in range(V) if t not in free[0, 4:].tolist())  # a second eos id never emitted
    out = generate(model, idx, 20, temperature=0, eos_token_id=[eos, never])
    assert out.shape == (1, 4 + first + 1) and int(out[0, -1]) == eos
    assert [int(t[0, 0]) for t in stream(model, idx, 20, temperature=0, eos_token_id=eos)] == out[0, 4:].tolist()


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -1.0, 2.0])
def test_beam_search_matches_hf(model, hf, prompts, num_beams, length_penalty):
    ours = beam_search(model, prompts, 12, num_beams, length_penalty=length_penalty)
    ref = _hf_generate(hf, prompts, max_new_tokens=12, do_sample=False, num_beams=num_beams,
                       length_penalty=length_penalty)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("step", [1, 2, 4, 6])
def test_beam_search_with_an_eos_that_occurs_matches_hf(model, hf, step):
    idx = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(11))
    free = beam_search(model, idx, 14, 3)
    eos = int(free[0, 5 + step])  # the best beam emits this token at `step`
    ours = beam_search(model, idx, 14, 3, eos_token_id=eos)
    ref = _hf_generate(hf, idx, max_new_tokens=14, do_sample=False, num_beams=3, eos_token_id=eos, pad_token_id=eos)
    assert torch.equal(ours, ref)
    assert (ours[0, 5:] == eos).any()  # the eos path was exercised


def test_beam_search_batch_with_eos_and_lengths_matches_hf(model, hf, prompts):
    eos = int(beam_search(model, prompts, 10, 3)[1, 5 + 2])
    for lpen in (1.0, 3.0, -2.0):
        ours = beam_search(model, prompts, 10, 3, length_penalty=lpen, eos_token_id=eos)
        ref = _hf_generate(hf, prompts, max_new_tokens=10, do_sample=False, num_beams=3,
                           length_penalty=lpen, eos_token_id=eos, pad_token_id=eos)
        assert torch.equal(ours, ref)


def test_beam_search_one_beam_is_greedy_and_cache_does_not_matter(model, prompts):
    assert torch.equal(beam_search(model, prompts, 10, 1), generate(model, prompts, 10, temperature=0))
    assert torch.equal(beam_search(model, prompts, 10, 3), beam_search(model, prompts, 10, 3, use_cache=False))


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_on_a_step_function_is_the_same_search(model, prompts, early_stopping):
    """beam_search_fn runs beam_search's loop on ``ids -> logits`` (no cache): the same answers in
    every early-stopping mode, and every step searched (None) gives "never"'s answers."""
    def step_fn(ids):
        return model(ids, last_only=True)[0][:, -1, :]

    eos = int(beam_search(model, prompts, 12, 3)[0, 5 + 2])
    for lpen in (1.0, 2.0, -1.0):
        want = beam_search(model, prompts, 12, 3, length_penalty=lpen, eos_token_id=eos, early_stopping=early_stopping)
        with torch.no_grad():
            got = beam_search_fn(step_fn, prompts, 3, 12, eos, lpen, early_stopping=early_stopping)
            assert torch.equal(got, want), lpen
            if early_stopping == "never":
                assert torch.equal(beam_search_fn(step_fn, prompts, 3, 12, eos, lpen, early_stopping=None), want)


def _left_pad(seqs, pad=0):
    T = max(len(s) for s in seqs)
    idx = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        idx[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return idx, mask


@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_equals_each_prompt_alone(model, hf, use_cache):
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (3, 8, 5, 1)]
    idx, mask = _left_pad(seqs, pad=7)
    out = generate(model, idx, 15, temperature=0, attention_mask=mask, use_cache=use_cache,
                   repetition_penalty=1.3)
    for i, s in enumerate(seqs):
        alone = generate(model, s[None], 15, temperature=0, use_cache=use_cache, repetition_penalty=1.3)
        assert torch.equal(out[i, idx.shape[1]:], alone[0, len(s):]), f"row {i}"
    ref = _hf_generate(hf, idx, mask, max_new_tokens=15, do_sample=False)
    assert torch.equal(generate(model, idx, 15, temperature=0, attention_mask=mask), ref)


def test_left_padded_beam_search_matches_hf(model, hf):
    g = torch.Generator().manual_seed(3)
    idx, mask = _left_pad([torch.randint(0, V, (n,), generator=g) for n in (2, 6, 4)])
    ours = beam_search(model, idx, 8, 3, attention_mask=mask)
    assert torch.equal(ours, _hf_generate(hf, idx, mask, max_new_tokens=8, do_sample=False, num_beams=3))


def test_first_sampled_token_follows_the_filtered_model_distribution(model):
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(9))
    n = 6000
    with torch.no_grad():
        logits = model(prompt)[0][:, -1]
    kw = dict(temperature=2.5, top_k=12, top_p=0.95)
    probs = torch.softmax(process_logits(logits, **kw), -1)[0].double()
    out = generate(model, prompt.expand(n, -1), 1, generator=torch.Generator().manual_seed(0), **kw)
    counts = torch.bincount(out[:, -1], minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    assert support.sum() > 3
    expected = probs[support] / probs[support].sum() * n
    assert stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_sampling_is_reproducible_and_cache_independent(model, prompts):
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, frequency_penalty=0.3, presence_penalty=0.2)
    a = generate(model, prompts, 20, generator=torch.Generator().manual_seed(5), **kw)
    b = generate(model, prompts, 20, generator=torch.Generator().manual_seed(5), use_cache=False, **kw)
    c = generate(model, prompts, 20, generator=torch.Generator().manual_seed(6), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stream_yields_what_generate_returns(model, prompts):
    kw = dict(temperature=0.7, top_k=5)
    full = generate(model, prompts, 12, generator=torch.Generator().manual_seed(1), **kw)
    toks = list(stream(model, prompts, 12, generator=torch.Generator().manual_seed(1), **kw))
    assert len(toks) == 12 and all(t.shape == (3, 1) for t in toks)
    assert torch.equal(torch.cat([prompts, *toks], dim=1), full)


def test_beyond_block_size_cached_equals_uncached():
    m = _model(block_size=16)
    idx = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    a = generate(m, idx, 30, temperature=0)
    b = generate(m, idx, 30, temperature=0, use_cache=False)
    assert a.shape == (2, 35) and torch.equal(a, b)


# tests/test_kvcache.py runs every variant's greedy tokens through every cache; here, on generate's
# peaked (scale 8) model, the three whose caches differ most from GPT-2's.
GENERATE_CACHE_VARIANTS = ["window", "mqa", "llama"]


@pytest.mark.parametrize("variant", GENERATE_CACHE_VARIANTS)
def test_sliding_window_and_gqa_models_cached_equal_uncached(variant):
    """Greedy generate gives the same tokens with every cache the variant can use as without one
    (the sliding-window cache only for a windowed model)."""
    m = _model(**VARIANTS[variant])
    idx = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    ref = generate(m, idx, 20, temperature=0, use_cache=False)
    for cache in ("static", "concat") + (("sliding",) if variant in WINDOWED else ()):
        assert torch.equal(generate(m, idx, 20, temperature=0, cache=cache), ref), cache


def test_generate_restores_training_mode(model, prompts):
    model.train()
    try:
        generate(model, prompts, 3, temperature=0)
        assert model.training
    finally:
        model.eval()


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        (dict(idx=torch.zeros(5, dtype=torch.long)), ValueError),
        (dict(idx=torch.zeros(1, 3)), TypeError),
        (dict(idx=torch.full((1, 3), V)), ValueError),
        (dict(temperature=-1.0), ValueError),
        (dict(top_k=0), ValueError),
        (dict(top_p=0.0), ValueError),
        (dict(max_new_tokens=-1), ValueError),
        (dict(attention_mask=torch.tensor([[1, 1, 0]])), ValueError),  # right padding
        (dict(attention_mask=torch.tensor([[1, 1]])), ValueError),
        (dict(cache="paged"), ValueError),
    ],
)
def test_bad_arguments(model, kwargs, exc):
    args = dict(idx=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(exc):
        generate(model, args.pop("idx"), args.pop("max_new_tokens"), **args)
    with pytest.raises(ValueError):
        beam_search(model, torch.zeros(1, 3, dtype=torch.long), 4, 0)
    with pytest.raises(ValueError):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, temperature=0.0, cache="sliding")


def test_cli_sample_help():
    from gptlab.__main__ import main

    buf = io.StringIO()
    with redirect_stdout(buf), pytest.raises(SystemExit) as e:
        main(["sample", "--help"])
    assert e.value.code == 0
    for opt in ("--ckpt", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p",
                "--repetition-penalty", "--seed", "--num-samples", "--no-stream", "--draft", "--num-draft-tokens"):
        assert opt in buf.getvalue()


def test_cli_sample_streams_from_a_checkpoint(tmp_path):
    from gptlab.train import checkpoint
    from gptlab.__main__ import main
    from gptlab.tokenizers import CharTokenizer

    tok = CharTokenizer.from_text("abcdefgh ijklmnop\nqrstuvwxyz")
    m = _model(vocab_size=tok.vocab_size)
    checkpoint.save_checkpoint(tmp_path, m, tokenizer=tok)
    outs = []
    for extra in ([], ["--no-stream"]):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = main(["sample", "--ckpt", str(tmp_path), "--prompt", "abc", "--max-new-tokens", "15",
                       "--temperature", "0", "--device", "cpu", *extra])
        assert rc == 0
        outs.append(buf.getvalue().strip())
    expected = tok.decode(generate(m, torch.tensor([tok.encode("abc")]), 15, temperature=0)[0].tolist())
    assert outs[0] == outs[1] == expected.strip()
    assert json.loads((tmp_path / "config.json").read_text())  # a real checkpoint was read


def test_bench_generate_quick_smoke(tmp_path):
    """The benchmark runs, checks its contenders agree, and writes JSON and a plot (no timing asserted)."""
    from gptlab.__main__ import main

    out_json, out_png = tmp_path / "gen.json", tmp_path / "gen.png"
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", "generate", "--quick", "--no-hf", "--no-native", "--lengths", "4,8",
                   "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["machine"] and data["machine"] in buf.getvalue()
    assert set(data["cpu_settings"]) == {"MKL_CBWR", "ATEN_CPU_CAPABILITY", "torch_cpu_capability"}
    assert all(data["same_tokens"][k] for k in ("gptlab_uncached", "gptlab_concat", "gptlab_static_fwd"))
    assert data["results"]["gptlab_cached"]["tokens_per_s_best"] > 0
    assert out_png.stat().st_size > 1000


def test_cli_sample_with_a_draft_decodes_speculatively(tmp_path, capsys):
    """``sample --draft``: greedy speculative output is the target's own greedy output, and the
    statistics are reported; a draft with another vocabulary is a clear error."""
    from gptlab.train import checkpoint
    from gptlab.__main__ import main
    from gptlab.tokenizers import CharTokenizer

    tok = CharTokenizer.from_text("abcdefgh ijklmnop\nqrstuvwxyz")
    target = _model(vocab_size=tok.vocab_size)
    torch.manual_seed(5)
    draft = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    checkpoint.save_checkpoint(tmp_path / "t", target, tokenizer=tok)
    checkpoint.save_checkpoint(tmp_path / "d", draft, tokenizer=tok)
    rc = main(["sample", "--ckpt", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--prompt", "abc",
               "--max-new-tokens", "15", "--temperature", "0", "--device", "cpu"])
    assert rc == 0
    out, err = capsys.readouterr()
    expected = tok.decode(generate(target, torch.tensor([tok.encode("abc")]), 15, temperature=0)[0].tolist())
    assert out.strip() == expected.strip()
    assert "guesses accepted" in err and "tokens per target forward pass" in err
    other = GPT(GPTConfig(vocab_size=tok.vocab_size + 3, block_size=64, n_layer=1, n_head=2, n_embd=16))
    checkpoint.save_checkpoint(tmp_path / "o", other)
    rc = main(["sample", "--ckpt", str(tmp_path / "t"), "--draft", str(tmp_path / "o"), "--prompt", "abc",
               "--max-new-tokens", "5", "--device", "cpu"])
    assert rc == 2 and "vocabulary" in capsys.readouterr().err  # a usage error: one line, exit 2


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_beam_search_early_stopping_modes_match_hf(model, hf, prompts, early_stopping):
    """transformers' three early-stopping modes, with eos ids the beams really emit (so rows finish
    hypotheses at different steps) and several length penalties."""
    outs = {}
    for step in (1, 3):
        eos = int(beam_search(model, prompts, 12, 3)[0, 5 + step])
        for lpen in (1.0, 2.0, -1.0):
            ours = beam_search(model, prompts, 12, 3, length_penalty=lpen, eos_token_id=eos,
                               early_stopping=early_stopping)
            ref = _hf_generate(hf, prompts, max_new_tokens=12, do_sample=False, num_beams=3, length_penalty=lpen,
                               eos_token_id=eos, pad_token_id=eos, early_stopping=early_stopping)
            assert torch.equal(ours, ref), (step, lpen)
            outs[step, lpen] = ours
    # the modes really differ on these inputs (else this test would not tell them apart)
    others = [m for m in (False, True, "never") if m != early_stopping]
    assert any(
        not torch.equal(outs[key], beam_search(model, prompts, 12, 3, length_penalty=key[1],
                                               eos_token_id=int(beam_search(model, prompts, 12, 3)[0, 5 + key[0]]),
                                               early_stopping=other))
        for key in outs for other in others
    )
    with pytest.raises(ValueError, match="early_stopping"):
        beam_search(model, prompts, 4, 2, early_stopping="sometimes")


def test_eos_and_pad_outside_the_vocabulary_are_errors(model, prompts):
    for kw in (dict(eos_token_id=V), dict(eos_token_id=[3, -1]), dict(pad_token_id=V)):
        with pytest.raises(ValueError, match=rf"must be in \[0, {V}\)"):
            generate(model, prompts, 3, temperature=0, **kw)
        with pytest.raises(ValueError, match=rf"must be in \[0, {V}\)"):
            beam_search(model, prompts, 3, 2, **kw)
        with pytest.raises(ValueError, match=rf"must be in \[0, {V}\)"):
            next(stream(model, prompts, 3, temperature=0, **kw))


def test_token_ids_outside_the_vocabulary_are_named(model):
    bad = torch.tensor([[1, 2, V + 3, 4]])
    for call in (lambda: model(bad), lambda: generate(model, bad, 2), lambda: beam_search(model, bad, 2, 2)):
        with pytest.raises(ValueError, match=rf"token id {V + 3} at idx\[0, 2\] is outside the vocabulary \[0, {V}\)"):
            call()
    with pytest.raises(ValueError, match=r"token id -1 at idx\[0, 0\] is outside the vocabulary"):
        model(torch.tensor([[-1, 2]]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("poison", ["nan", "-inf"])
def test_nan_or_all_masked_logits_raise_instead_of_token_0(temperature, poison):
    """A diverged model (NaN weights) or logits with no finite value: generation stops with a clear
    error, as torch.multinomial would, instead of emitting token 0 forever."""
    m = _model(seed=3)
    with torch.no_grad():
        if poison == "nan":
            m.transformer.h[1].mlp.c_proj.weight[0, 0] = float("nan")
    if poison == "-inf":  # every logit -inf
        m.lm_head.register_forward_hook(lambda mod, inp, out: torch.full_like(out, float("-inf")))
    idx = torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="no distribution to pick a token from"):
        generate(model=m, idx=idx, max_new_tokens=4, temperature=temperature)
