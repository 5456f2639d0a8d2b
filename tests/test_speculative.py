"""Speculative decoding (gptlab.generation.speculative) is exact, and its speed-up model holds.

* Greedy: token for token the target's own greedy output (gptlab.generate, temperature 0) for
  several draft lengths, with a random (bad) draft and with the target as its own draft; and the
  same tokens and number of target passes as Hugging Face's assisted generation.
* Sampling: the joint distribution of the first generated tokens equals the target's exact
  distribution, computed by enumerating every continuation (chi-square tests, also with
  temperature, top-k and top-p).
* Speed model: with context-free models each guess is accepted independently with the known
  probability alpha = sum_x min(p(x), q(x)); the per-round accepted counts follow the truncated
  geometric law and the tokens per target pass match (1 - alpha^(g+1)) / (1 - alpha).

All models are tiny and random; every random draw comes from a seeded generator, so each test is
deterministic. Chi-square tests pass at p > 1e-3; the sample sizes and the deviations they detect
are stated in each test.
"""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from gptlab import GPT, GPTConfig
from gptlab.generation import generate
from gptlab.sampling import process_logits
import tiny_models
from gptlab.generation.speculative import (
    SpeculativeStats,
    expected_tokens_per_round,
    speculative_generate,
    verify_draft,
)

P_MIN = 1e-3  # a chi-square test fails below this p-value


def tiny_gpt(seed: int, vocab: int = 8, n_layer: int = 1, n_embd: int = 16, n_head: int = 2, std: float = 0.4) -> GPT:
    """A random GPT-2-style model whose next-token distributions are far from uniform (weights
    drawn with a large ``std``), so that target and draft disagree in a visible way."""
    return tiny_models.tiny_gpt(seed, std=std, vocab_size=vocab, block_size=64, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


def noisy_copy(model: GPT, rel_noise: float, seed: int) -> GPT:
    """A draft that mostly agrees with ``model``: its weights plus Gaussian noise of ``rel_noise``
    times each matrix's standard deviation."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * rel_noise)
    return draft


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of observed ``counts`` against cell probabilities ``probs``.

    Cells of probability 0 must be empty (asserted: such a sequence can never be sampled). Cells
    whose expected count is below 5 are pooled into one cell, the usual validity rule.
    """
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    assert counts[probs == 0].sum() == 0, "sampled a sequence that has probability 0 under the target"
    n = counts.sum()
    keep = probs * n >= 5
    obs = np.append(counts[keep], counts[~keep & (probs > 0)].sum())
    exp = np.append(probs[keep], probs[~keep & (probs > 0)].sum()) * n
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@torch.no_grad()
def exact_joint(target: GPT, prompt: list[int], n_tokens: int, **decoding) -> np.ndarray:
    """The target's exact probability of every continuation of ``n_tokens`` tokens, by enumeration:
    ``prod_t p(x_t | prompt, x_<t)`` with the same logits processing as decoding. Returns (V**n,)
    indexed by the continuation read as a base-V number."""
    V = target.config.vocab_size
    conts = torch.tensor(list(itertools.product(range(V), repeat=n_tokens)), dtype=torch.long)  # (V^n, n)
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)
    logits = target(ids)[0][:, len(prompt) - 1 : -1]  # (V^n, n, V): the distribution of each x_t
    probs = torch.softmax(process_logits(logits.reshape(-1, V).double(), **decoding), -1).reshape(len(conts), n_tokens, V)
    per_token = probs.gather(-1, conts[..., None]).squeeze(-1)  # (V^n, n)
    return per_token.prod(-1).numpy()


def speculative_counts(target, draft, prompt, n_tokens, n_samples, g, seed, **decoding) -> np.ndarray:
    V = target.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([prompt])
    counts = np.zeros(V**n_tokens)
    weights = V ** np.arange(n_tokens - 1, -1, -1)
    for _ in range(n_samples):
        out, _ = speculative_generate(target, draft, idx, n_tokens, num_draft_tokens=g, generator=gen, **decoding)
        counts[int((out[0, len(prompt) :].numpy() * weights).sum())] += 1
    return counts


# --------------------------------------------------------------------------- greedy: exact


@pytest.mark.parametrize("g", [1, 2, 3, 5, 8])
def test_greedy_equals_target_greedy(g):
    """A random (bad) draft, which the target almost never agrees with, and a noisy copy of the
    target, which it often does: either way the output is the target's greedy output."""
    target = tiny_gpt(0, vocab=32, n_layer=2, n_embd=32, std=0.8)
    for draft, name in ((tiny_gpt(1, vocab=32, std=0.8), "random"), (noisy_copy(target, 0.1, seed=1), "noisy copy")):
        for prompt in ([3], [1, 5, 7, 2, 9]):
            idx = torch.tensor([prompt])
            want = generate(target, idx, 30, temperature=0)
            got, st = speculative_generate(target, draft, idx, 30, num_draft_tokens=g, temperature=0)
            assert torch.equal(got, want), f"{name} draft, prompt {prompt}"
            assert st.new_tokens == 30 == sum(st.accepted) + st.rounds
            assert 0 <= st.acceptance_rate < 1  # some guesses were rejected: rollbacks happened


def test_greedy_noisy_draft_is_accepted_often():
    target = tiny_gpt(0, vocab=32, n_layer=2, n_embd=32, std=0.8)
    _, good = speculative_generate(target, noisy_copy(target, 0.1, seed=1), torch.tensor([[3]]), 40, num_draft_tokens=3, temperature=0)
    _, bad = speculative_generate(target, tiny_gpt(1, vocab=32, std=0.8), torch.tensor([[3]]), 40, num_draft_tokens=3, temperature=0)
    assert good.acceptance_rate > 0.2 > bad.acceptance_rate
    assert good.rounds < bad.rounds


@pytest.mark.parametrize("g", [1, 4, 7])
def test_greedy_with_the_target_as_draft_accepts_everything(g):
    target = tiny_gpt(0, vocab=32, n_layer=2, n_embd=32, std=0.8)
    idx = torch.tensor([[4, 2]])
    got, st = speculative_generate(target, target, idx, 29, num_draft_tokens=g, temperature=0)
    assert torch.equal(got, generate(target, idx, 29, temperature=0))
    assert st.acceptance_rate == 1.0 and st.alpha == 1.0
    assert st.rounds == math.ceil(29 / (g + 1))  # every round yields g + 1 tokens (the last fewer)
    assert st.target_forwards == st.rounds + 1  # + the prompt prefill


def test_greedy_equals_hf_assisted_generation():
    """Same tokens and the same number of target passes as transformers' assisted generation
    (constant schedule of g assistant tokens, no early exit on low draft confidence)."""
    target = tiny_gpt(0, vocab=32, n_layer=2, n_embd=32, std=0.8)
    draft = noisy_copy(target, 0.1, seed=1)
    hf_target, hf_draft = target.to_hf().eval(), draft.to_hf().eval()
    for m in (hf_target, hf_draft):
        m.config.bos_token_id = m.config.eos_token_id = None
        m.generation_config.bos_token_id = m.generation_config.eos_token_id = None
    idx = torch.tensor([[1, 5, 7, 3]])
    for g in (1, 3, 6):
        hf_draft.generation_config.num_assistant_tokens = g
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
        hf_draft.generation_config.assistant_confidence_threshold = 0.0
        calls = []
        hook = hf_target.register_forward_hook(lambda *_: calls.append(1))
        try:
            want = hf_target.generate(idx, attention_mask=torch.ones_like(idx), assistant_model=hf_draft,
                                      do_sample=False, max_new_tokens=30, pad_token_id=0)
        finally:
            hook.remove()
        got, st = speculative_generate(target, draft, idx, 30, num_draft_tokens=g, temperature=0)
        assert torch.equal(got, want), f"g={g}"
        assert len(calls) == st.rounds, f"g={g}: HF made {len(calls)} target passes, gptlab {st.rounds} rounds"
        assert 0 < st.acceptance_rate < 1


# --------------------------------------------------------------------------- sampling: exact


def test_verify_draft_first_token_follows_p():
    """One round of the acceptance rule, with fixed p and q: the first emitted token (accepted
    guess, or the residual draw after a rejection) is distributed as p[0], and the first guess is
    accepted with probability sum_x min(p0, q0). 8,000 rounds, V=5: the chi-square test detects a
    deviation of Cohen's w >= 0.071 with power 0.99 (w^2 = sum (observed - expected)^2 / expected
    over N^2; drawing the correction from p instead of the residual gives w ~ 0.3 here)."""
    gen = torch.Generator().manual_seed(0)
    V, g, N = 5, 2, 8_000
    p = torch.softmax(torch.randn(g + 1, V, generator=gen) * 1.5, -1).double()
    q = torch.softmax(torch.randn(g, V, generator=gen) * 1.5, -1).double()
    first, accepted_first = np.zeros(V), 0
    guesses = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=gen) for i in range(g)], 1)
    for n in range(N):
        k, token = verify_draft(guesses[n], q, p, generator=gen)
        first[int(guesses[n, 0]) if k >= 1 else int(token)] += 1
        accepted_first += k >= 1
    assert chi2_pvalue(first, p[0].numpy()) > P_MIN
    alpha = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted_first / N - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / N)


def test_verify_draft_greedy_and_residual_rules():
    p = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])  # the target is sure of token 2
    q = torch.tensor([[0.0, 1.0, 0.0]])  # the draft is sure of token 1
    k, tok = verify_draft(torch.tensor([1]), q, p, generator=torch.Generator().manual_seed(0))
    assert (k, int(tok)) == (0, 2)  # rejected (p/q = 0); the residual max(0, p - q) is all on 2
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])  # argmax 1, 0, 2
    assert [(k, int(t)) for k, t in [verify_draft(torch.tensor(d), None, logits) for d in ([1, 0], [1, 2], [0, 0])]] == [
        (2, 2),  # both guesses are the argmax: bonus token 2
        (1, 0),  # the second guess is wrong: the target's argmax 0 replaces it
        (0, 1),
    ]
    with pytest.raises(ValueError, match="g \\+ 1"):
        verify_draft(torch.tensor([1, 0]), None, logits[:2])


@pytest.mark.parametrize(
    "decoding",
    [pytest.param(dict(temperature=1.0), marks=pytest.mark.slow), dict(temperature=0.7, top_k=4, top_p=0.9)],
    ids=["t1", "t0.7-topk4-topp0.9"],
)
def test_sampling_matches_target_distribution_first_two_tokens(decoding):
    """1,500 speculative samples of the first two tokens (V=8: 64 cells; round one drafts one
    guess, so accepting, rejecting with a residual draw, and the bonus token are all exercised)
    against the target's exact joint distribution. With 63 degrees of freedom the test detects a
    deviation of Cohen's w >= 0.24 with power 0.99; the real bugs it guards against (correction
    from p instead of the residual, processing only one model's logits) give w ~ 0.3-1 here."""
    target, draft = tiny_gpt(0), tiny_gpt(1)
    prompt = [3, 1, 4]
    probs = exact_joint(target, prompt, 2, **decoding)
    counts = speculative_counts(target, draft, prompt, 2, 1_500, g=3, seed=1, **decoding)
    assert chi2_pvalue(counts, probs) > P_MIN


@pytest.mark.slow
@pytest.mark.parametrize(
    "decoding, g",
    [(dict(temperature=1.0), 2), (dict(temperature=1.3, top_p=0.8), 3), (dict(temperature=0.8, top_k=3), 2)],
    ids=["t1-g2", "t1.3-topp0.8-g3", "t0.8-topk3-g2"],
)
def test_sampling_matches_target_distribution_first_three_tokens(decoding, g):
    """6,000 samples of the first three tokens (V=6: 216 cells). Round one drafts two guesses, so
    runs of accepted guesses, rejections at the second guess and cache rollback before round two
    are all in the joint law. Detects Cohen's w >= 0.15 with power 0.99 (215 d.o.f.)."""
    target, draft = tiny_gpt(2, vocab=6, n_layer=2), tiny_gpt(3, vocab=6)
    prompt = [0, 5]
    probs = exact_joint(target, prompt, 3, **decoding)
    counts = speculative_counts(target, draft, prompt, 3, 6_000, g=g, seed=2, **decoding)
    assert chi2_pvalue(counts, probs) > P_MIN


def test_sampling_is_reproducible_and_draft_equal_to_target_accepts_all():
    target, draft = tiny_gpt(0, n_layer=2), tiny_gpt(1)
    idx = torch.tensor([[1, 2]])
    runs = [speculative_generate(target, draft, idx, 20, generator=torch.Generator().manual_seed(5))[0] for _ in range(2)]
    assert torch.equal(*runs)
    _, st = speculative_generate(target, target, idx, 40, num_draft_tokens=4, generator=torch.Generator().manual_seed(5))
    assert st.acceptance_rate > 0.99  # p == q up to float rounding between the two passes


# --------------------------------------------------------------------------- the speed-up model


def unigram_gpt(seed: int, vocab: int = 10, std: float = 0.3) -> GPT:
    """A GPT whose next-token distribution ignores the context: every token embedding is the same
    vector and there are no position embeddings, so every position has the same hidden state and
    the same logits. Its distribution is softmax(model(any)[0, -1])."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=256, n_layer=1, n_head=1, n_embd=8, tie_weights=False))
    with torch.no_grad():
        model.transformer.wte.weight.copy_(torch.randn(1, 8).expand(vocab, 8))
        model.transformer.wpe.weight.zero_()
        model.lm_head.weight.normal_(0.0, std)
    return model.eval()


def test_tokens_per_round_follow_the_iid_acceptance_model():
    """Context-free target and draft: every guess is accepted independently with probability
    alpha = sum_x min(p(x), q(x)) (exact, from the two distributions). Over ~500 full rounds:

    * the estimated alpha (SpeculativeStats.alpha) is within 4 standard errors of the exact one;
    * the accepted counts per round follow the truncated geometric law P(k) = alpha^k (1 - alpha)
      for k < g, P(g) = alpha^g (chi-square);
    * the mean tokens per target pass is within 4 standard errors of (1 - a^(g+1)) / (1 - a) at
      the exact alpha, and within 0.1 of the same formula at the measured alpha
      (SpeculativeStats.predicted_tokens_per_target_forward);
    * the generated tokens are i.i.d. draws from p (chi-square on their frequencies).
    """
    target, draft = unigram_gpt(0), unigram_gpt(1)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([[0]]))[0][0, -1].double(), -1)
        q = torch.softmax(draft(torch.tensor([[0]]))[0][0, -1].double(), -1)
    alpha = float(torch.minimum(p, q).sum())
    assert 0.4 < alpha < 0.9  # a regime where both accepts and rejects are frequent
    g = 3
    gen = torch.Generator().manual_seed(0)
    runs = [speculative_generate(target, draft, torch.tensor([[0]]), 200, num_draft_tokens=g, generator=gen) for _ in range(6)]
    st = SpeculativeStats.combine([s for _, s in runs])
    full = [(a, d) for a, d in zip(st.accepted, st.drafted) if d == g]
    k = np.array([a for a, _ in full])
    R = len(k)
    assert R > 400

    decisions = sum(a + (a < d) for a, d in zip(st.accepted, st.drafted))
    assert abs(st.alpha - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / decisions)

    law = np.array([alpha**j * (1 - alpha) for j in range(g)] + [alpha**g])
    assert chi2_pvalue(np.bincount(k, minlength=g + 1), law) > P_MIN

    tokens = k + 1.0
    expected = expected_tokens_per_round(alpha, g)
    assert abs(tokens.mean() - expected) < 4 * tokens.std() / math.sqrt(R)
    assert abs(st.tokens_per_target_forward - st.predicted_tokens_per_target_forward) < 0.1

    new = torch.cat([out[0, 1:] for out, _ in runs]).numpy()
    assert chi2_pvalue(np.bincount(new, minlength=len(p)), p.numpy()) > P_MIN


def test_expected_tokens_per_round_formula():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    for a, g in ((0.3, 1), (0.8, 5), (0.95, 8)):  # the geometric sum 1 + a + ... + a^g
        assert expected_tokens_per_round(a, g) == pytest.approx(sum(a**j for j in range(g + 1)))
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_round(1.5, 2)


def test_stats_bookkeeping():
    target, draft = tiny_gpt(0, vocab=16, n_layer=2, n_embd=32), tiny_gpt(1, vocab=16)
    target.train()
    _, st = speculative_generate(target, draft, torch.tensor([[1, 2, 3]]), 25, num_draft_tokens=4, temperature=0)
    assert target.training and not draft.training  # modes restored
    assert st.new_tokens == 25 == sum(a + 1 for a in st.accepted)
    assert all(0 <= a <= d <= 4 for a, d in zip(st.accepted, st.drafted))
    assert st.draft_forwards == sum(st.drafted) + 1 and st.target_forwards == st.rounds + 1
    assert st.tokens_per_target_forward == pytest.approx(25 / st.rounds)
    assert st.acceptance_rate == pytest.approx(sum(st.accepted) / sum(st.drafted))
    assert set(st.summary()) >= {"acceptance_rate", "tokens_per_target_forward", "target_forwards", "draft_forwards"}


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    target, draft = tiny_gpt(0), tiny_gpt(1)
    idx = torch.tensor([[1, 2]])
    cases = [
        (dict(draft=tiny_gpt(1, vocab=9)), ValueError, "share a vocabulary"),
        (dict(idx=torch.tensor([[1, 2], [3, 4]])), ValueError, "batch size 1"),
        (dict(idx=torch.tensor([[1, 99]])), ValueError, "outside"),
        (dict(idx=torch.tensor([[1.0, 2.0]])), TypeError, "integer"),
        (dict(num_draft_tokens=0), ValueError, "num_draft_tokens"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(max_new_tokens=100), ValueError, "block_size"),
        (dict(draft="not a model"), TypeError, "GPT"),
    ]
    for change, err, match in cases:
        kw = dict(target=target, draft=draft, idx=idx, max_new_tokens=5)
        kw.update(change)
        with pytest.raises(err, match=match):
            speculative_generate(kw.pop("target"), kw.pop("draft"), kw.pop("idx"), kw.pop("max_new_tokens"), **kw)
    out, st = speculative_generate(target, draft, idx, 0)
    assert torch.equal(out, idx) and st.rounds == 0


# --------------------------------------------------------------------------- the benchmark


def test_bench_speculative_quick_smoke(tmp_path):
    """The benchmark trains its (quick) target, distils its draft from it, checks greedy outputs
    equal the target's own, and writes JSON and a plot (no timing asserted)."""
    import io
    import json
    from contextlib import redirect_stdout
    from pathlib import Path

    from gptlab.__main__ import main

    out_json, out_png = tmp_path / "spec.json", tmp_path / "spec.png"
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(["bench", "speculative", "--preset", "quick", "--models", str(tmp_path / "models"), "--gs", "2,3",
                   "--new-tokens", "24", "--prompts", "1", "--rounds", "1", "--threads", "1", "--no-native",
                   "--verification", "block,token", "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["machine"] in buf.getvalue()
    assert data["verification"] == ["block", "token"]  # both rules, interleaved
    assert data["decode_steps"]["draft"].startswith("the Python decode step")  # the test suite's default
    assert data["models"]["draft"]["distilled"] and not data["models"]["target"]["distilled"]
    # the draft's two stages: the KL for 60 steps, then the total variation for 20, from those weights
    draft = data["models"]["draft"]
    assert draft["train_steps"] == 80 and draft["distilled_by"] == "tv"
    stage2 = json.loads((Path(draft["dir"]) / "bench_done.json").read_text())["train_config"]
    stage1 = json.loads((Path(stage2["init_from"]) / "bench_done.json").read_text())["train_config"]
    assert (stage1["max_steps"], stage1["distill_divergence"], stage1["init_from"]) == (60, "kl", None)
    for mode, rules in (("greedy", ["block"]), ("T=1", ["block", "token"])):  # greedy: the rule changes nothing
        rows = data["modes"][mode]["rows"]
        assert [(r["verification"], r["g"]) for r in rows] == [(v, g) for v in rules for g in (2, 3)]
        assert all(0 <= r["acceptance_rate"] <= 1 and r["speedup_best"] > 0 for r in rows)
        # the baseline is the faster way of running the target alone: packed as calibrated, or unpacked
        m = data["modes"][mode]
        ways = {"packed as calibrated": m["target_packed_ms_per_token_best"], "unpacked": m["target_unpacked_ms_per_token_best"]}
        assert m["target_baseline"] == min(ways, key=ways.get) and m["target_ms_per_token_best"] == min(ways.values())
    assert "verifications: " in buf.getvalue() and "the faster of packed as calibrated" in buf.getvalue()
    assert "best (token verification)" in buf.getvalue() and "best (block verification)" in buf.getvalue()
    assert out_png.stat().st_size > 1000


def test_speculative_step_pieces():
    """accept_prob = min(1, p/q) at the guess; the residual is normalised max(0, p - q); one step
    returns the accepted guesses plus the target's token; the pass formula at its limits."""
    from gptlab.generation.speculative import accept_prob, expected_tokens_per_pass, residual_distribution, speculative_step

    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.25, 0.6, 0.15], [0.1, 0.1, 0.8]])
    torch.testing.assert_close(accept_prob(p, q, torch.tensor([0, 1])), torch.tensor([1.0, 0.1 / 0.1]))
    torch.testing.assert_close(accept_prob(p[0], q[0], torch.tensor(1)), torch.tensor(0.5))
    r = residual_distribution(p[0], q[0])
    torch.testing.assert_close(r, torch.tensor([0.25, 0.0, 0.05]) / 0.30)
    torch.testing.assert_close(residual_distribution(p[1], q[1]), p[1])  # p == q: falls back on p
    # greedy: the guesses are kept while they are the target's argmax, then the target's own token
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    toks, k = speculative_step(logits, None, torch.tensor([1, 2]))
    assert k == 1 and toks.tolist() == [1, 0]
    toks, k = speculative_step(logits, None, torch.tensor([1, 0]))
    assert k == 2 and toks.tolist() == [1, 0, 2]
    # sampled: a guess the target gives probability 1 and the draft too is always accepted
    one = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    toks, k = speculative_step(one, one[:1], torch.tensor([1]), torch.Generator().manual_seed(0))
    assert k == 1 and toks.tolist() == [1, 1]
    # a guess the target rules out is always rejected, and the correction comes from the residual
    p2 = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    toks, k = speculative_step(p2, torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([0]), torch.Generator().manual_seed(0))
    assert k == 0 and toks.tolist() == [2]
    assert expected_tokens_per_pass(1.0, 3) == 4.0 and expected_tokens_per_pass(0.0, 3) == 1.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)


# --------------------------------------------------------------------------- block verification


def _round_law(p_of, q_of, g: int, V: int, verification: str) -> tuple[dict, float]:
    """One round's exact output law, by enumerating every block of guesses: ``{tokens: prob}`` over
    the round's output continued by the target alone to g + 1 tokens, and the expected number of
    guesses kept. ``p_of(prefix)``, ``q_of(prefix)``: (V,) float64 distributions after a tuple of tokens.
    It runs the package's own pieces (block_accept_probs, accept_prob, residual_distribution)."""
    from gptlab.generation.speculative import accept_prob, block_accept_probs, residual_distribution

    law: dict = {}
    kept = 0.0
    for block in itertools.product(range(V), repeat=g):
        x = torch.tensor(block)
        p = torch.stack([p_of(block[:i]) for i in range(g + 1)])  # (g + 1, V)
        q = torch.stack([q_of(block[:i]) for i in range(g)])  # (g, V)
        p_block = float(q.gather(-1, x[:, None]).prod())
        if verification == "block":
            h, w = block_accept_probs(p, q, x)
            stop = [float(h[i - 1]) if i else 1.0 for i in range(g + 1)]  # tau = the last i with U_i < h_i
            law_k = [stop[i] * float(torch.prod(1 - h[i:])) for i in range(g + 1)]
        else:
            a = accept_prob(p[:g], q, x)
            w = torch.ones(g + 1, dtype=p.dtype)
            law_k = [float(a[:i].prod() * (1 - a[i] if i < g else 1)) for i in range(g + 1)]
        for k, pk in enumerate(law_k):
            kept += p_block * pk * k
            last = p[g] if k == g else residual_distribution(p[k], q[k], float(w[k]))
            for y in range(V):
                head = block[:k] + (y,)
                for tail in itertools.product(range(V), repeat=g - k):  # the target alone after the round
                    seq, pr = head + tail, p_block * pk * float(last[y])
                    for j in range(k + 1, g + 1):
                        pr *= float(p_of(seq[:j])[seq[j]])
                    law[seq] = law.get(seq, 0.0) + pr
    return law, kept


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_verification_is_exact_and_keeps_more_by_enumeration(seed):
    """Block verification (Sun et al., ICLR 2025) leaves the output law exactly the target's: every
    block of g = 3 guesses over V = 3 tokens enumerated, with distributions that depend on the
    whole prefix (and, after one prefix, a target equal to the draft, the 0/0 case of h). Its law
    of g + 1 tokens equals the target's to 1e-12, and it keeps more guesses on average than token
    verification (which the same enumeration also finds exact). The residual without the block's
    weight w (``max(0, p - q)``) is off by 5e-5 to 2e-3 on these three tables."""
    gen = torch.Generator().manual_seed(seed)
    V, g = 3, 3
    tables: dict = {}

    def table(kind: str, prefix: tuple) -> torch.Tensor:
        if (kind, prefix) not in tables:
            tables[kind, prefix] = torch.softmax(torch.randn(V, generator=gen, dtype=torch.float64) * 1.5, -1)
        return tables[kind, prefix]

    p_of = lambda pre: table("q" if pre == (1,) else "p", pre)  # noqa: E731  (p = q after the prefix (1,))
    q_of = lambda pre: table("q", pre)  # noqa: E731
    want = {s: math.prod(float(p_of(s[:j])[s[j]]) for j in range(g + 1)) for s in itertools.product(range(V), repeat=g + 1)}
    kept = {}
    for verification in ("token", "block"):
        law, kept[verification] = _round_law(p_of, q_of, g, V, verification)
        assert max(abs(law.get(s, 0.0) - pr) for s, pr in want.items()) < 1e-12
    assert kept["block"] > kept["token"] + 1e-3


def test_block_step_keeps_up_to_the_last_test_passed():
    """``speculative_step(..., verification="block")`` keeps the first k guesses with probability
    ``h_k prod_(j > k) (1 - h_j)`` (h_0 = 1): 6,000 rounds with fixed guesses, chi-square against
    the law from block_accept_probs (g = 4: 5 cells; detects Cohen's w >= 0.06 with power 0.99).
    Stopping at the first failed test instead, as token verification does, gives w ~ 0.5 here."""
    from gptlab.generation.speculative import block_accept_probs, speculative_step

    gen = torch.Generator().manual_seed(9)  # a table where every k has probability >= 0.08
    V, g, N = 6, 4, 6_000
    p = torch.softmax(torch.randn(g + 1, V, generator=gen), -1).double()
    q = torch.softmax(torch.randn(g, V, generator=gen), -1).double()
    x = (p[:g] / q - 0.7).abs().argmin(-1)  # guesses with p/q near 0.7: every k has a real chance
    h, _ = block_accept_probs(p, q, x)
    law = np.array([(float(h[k - 1]) if k else 1.0) * float(torch.prod(1 - h[k:])) for k in range(g + 1)])
    assert law.sum() == pytest.approx(1.0) and law.min() > 0.02
    counts = np.zeros(g + 1)
    for _ in range(N):
        tokens, k = speculative_step(p, q, x, gen, verification="block")
        assert tokens[:k].tolist() == x[:k].tolist() and len(tokens) == k + 1
        counts[k] += 1
    assert chi2_pvalue(counts, law) > P_MIN


def test_block_verification_through_speculative_generate():
    """``speculative_generate(..., verification="block")``: 6,000 samples of the first three tokens
    (V = 6, two guesses in round one) against the target's exact joint law (as the token tests
    above); greedy decoding ignores the setting; a bad value is refused naming the choices."""
    from gptlab.generation import GenerationConfig
    from gptlab.generation.speculative import speculative_step

    target, draft = tiny_gpt(2, vocab=6, n_layer=2), tiny_gpt(3, vocab=6)
    prompt = [0, 5]
    probs = exact_joint(target, prompt, 3, temperature=1.0)
    counts = speculative_counts(target, draft, prompt, 3, 6_000, g=2, seed=4, temperature=1.0, verification="block")
    assert chi2_pvalue(counts, probs) > P_MIN
    idx = torch.tensor([prompt])
    want = generate(target, idx, 12, temperature=0)
    out, _ = speculative_generate(target, draft, idx, 12, num_draft_tokens=3, temperature=0, verification="block")
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="verification must be 'token' or 'block', got 'blocks'"):
        GenerationConfig(verification="blocks")
    with pytest.raises(ValueError, match="verification must be one of"):
        speculative_step(probs_row := torch.full((2, 3), 1 / 3), probs_row[:1], torch.tensor([0]), verification="tree")
