"""Mistakes learners make in the ``speculative`` assignment, as the code they would write."""

from . import Mistake

_ACC = "def accept_prob(p, q, token):\n    return {}\n"
_RES = "def residual_distribution(p, q):\n{}\n"
_EXP = "def expected_tokens_per_pass(alpha, g):\n{}\n"

_STEP = '''
def speculative_step(target_probs, draft_probs, draft_tokens, generator):
    g = draft_tokens.shape[0]
    for i in range(g):
        token = int(draft_tokens[i])
        r = torch.rand(1, generator=generator).item()
        if r >= {accept}:
            fix = torch.multinomial({residual}, 1, generator=generator)
            return torch.cat([draft_tokens[:i], fix]), i
    {end}
'''
_OK_ACCEPT = "accept_prob(target_probs[i], draft_probs[i], token)"
_OK_RES = "residual_distribution(target_probs[i], draft_probs[i])"
_OK_END = "bonus = torch.multinomial(target_probs[g], 1, generator=generator)\n    return torch.cat([draft_tokens, bonus]), g"


def _step(accept=_OK_ACCEPT, residual=_OK_RES, end=_OK_END) -> str:
    return _STEP.format(accept=accept, residual=residual, end=end)


MISTAKES = [
    # ---- accept_prob
    Mistake("accept_prob", "ratio inverted", _ACC.format("min(1.0, (q[token] / p[token]).item())"), "upside down"),
    Mistake("accept_prob", "no min with 1", _ACC.format("(p[token] / q[token]).item()"), "forgot the min(1, ...)"),
    Mistake("accept_prob", "difference", _ACC.format("max(0.0, (p[token] - q[token]).item())"),
            "difference instead of the ratio"),
    Mistake("accept_prob", "whole vectors", _ACC.format("torch.clamp(p / q, max=1.0)"), "should be one number"),
    Mistake("accept_prob", "calls gptlab",
            "from gptlab.generation.speculative import accept_prob as _ap\n\ndef accept_prob(p, q, token):\n"
            "    return _ap(p, q, torch.tensor(token)).item()\n",
            "must be written by hand", delegation=True),
    # ---- residual_distribution
    Mistake("residual_distribution", "not renormalised", _RES.format("    return torch.clamp(p - q, min=0.0)"),
            "did not renormalise"),
    Mistake("residual_distribution", "q minus p",
            _RES.format("    r = torch.clamp(q - p, min=0.0)\n    return r / r.sum()"), "wrong way round"),
    Mistake("residual_distribution", "absolute difference",
            _RES.format("    r = (p - q).abs()\n    return r / r.sum()"), "|p - q|"),
    Mistake("residual_distribution", "no clamp", _RES.format("    r = p - q\n    return r / r.sum()"), "must be finite"),
    Mistake("residual_distribution", "calls gptlab",
            "import gptlab.generation.speculative\n\ndef residual_distribution(p, q):\n"
            "    return gptlab.generation.speculative.residual_distribution(p, q)\n",
            "must be written by hand", delegation=True),
    # ---- expected_tokens_per_pass
    Mistake("expected_tokens_per_pass", "accepted only",
            _EXP.format("    if alpha == 1.0:\n        return float(g)\n    return (alpha - alpha ** (g + 1)) / (1 - alpha)"),
            "accepted guesses only"),
    Mistake("expected_tokens_per_pass", "exponent off by one",
            _EXP.format("    if alpha == 1.0:\n        return float(g)\n    return (1 - alpha ** g) / (1 - alpha)"),
            "exponent is off by one"),
    Mistake("expected_tokens_per_pass", "alpha = 1 divides by zero",
            _EXP.format("    return (1 - alpha ** (g + 1)) / (1 - alpha)"), "raised ZeroDivisionError"),
    Mistake("expected_tokens_per_pass", "infinite series",
            _EXP.format("    return 1 / (1 - alpha) if alpha < 1 else float('inf')"), "infinite sum"),
    Mistake("expected_tokens_per_pass", "calls gptlab",
            "from gptlab.generation import speculative\n\ndef expected_tokens_per_pass(alpha, g):\n"
            "    return speculative.expected_tokens_per_pass(alpha, g)\n",
            "must be written by hand", delegation=True),
    # ---- speculative_step
    Mistake("speculative_step", "ratio inverted",
            _step(accept="min(1.0, (draft_probs[i][token] / target_probs[i][token].clamp_min(1e-12)).item())"),
            "upside down"),
    Mistake("speculative_step", "residual q - p",
            _step(residual="torch.clamp(draft_probs[i] - target_probs[i], min=0.0)"), "max(0, q - p)"),
    Mistake("speculative_step", "resamples from the target",
            _step(residual="target_probs[i]"), "drew from the target's p itself"),
    Mistake("speculative_step", "no bonus token", _step(end="return draft_tokens.clone(), g"), "bonus token"),
    Mistake("speculative_step", "continues after a rejection",
            '''
def speculative_step(target_probs, draft_probs, draft_tokens, generator):
    g = draft_tokens.shape[0]
    out, n = [], 0
    for i in range(g):
        token = int(draft_tokens[i])
        if torch.rand(1, generator=generator).item() < accept_prob(target_probs[i], draft_probs[i], token):
            out.append(token)
            n += 1
        else:
            fix = torch.multinomial(residual_distribution(target_probs[i], draft_probs[i]), 1, generator=generator)
            out.append(int(fix))
    out.append(int(torch.multinomial(target_probs[g], 1, generator=generator)))
    return torch.tensor(out), n
''',
            "after a rejection"),
    Mistake("speculative_step", "keeps every guess",
            _step(accept="1.1"), "you keep every guess"),
    Mistake("speculative_step", "comparison the wrong way round",
            _step(accept="1.0 - accept_prob(target_probs[i], draft_probs[i], token)"), "comparison is the wrong way round"),
    Mistake("speculative_step", "rejects every guess", _step(accept="0.0"), "you never keep a guess"),
    Mistake("speculative_step", "bonus from the last guess's row",
            _step(end="bonus = torch.multinomial(target_probs[g - 1], 1, generator=generator)\n"
                      "    return torch.cat([draft_tokens, bonus]), g"),
            "target_probs[g]"),
    Mistake("speculative_step", "calls gptlab",
            "import gptlab.generation.speculative as S\n\ndef speculative_step(target_probs, draft_probs, draft_tokens, generator):\n"
            "    return S.speculative_step(target_probs, draft_probs, draft_tokens, generator)\n",
            "must be written by hand", delegation=True),
]
