"""Catalogue of learners' mistakes for the ``sampling`` assignment (chapter 6, sampling strategies)."""

from __future__ import annotations

from . import Mistake

_T = "def apply_temperature(logits, temperature):\n{}\n"
_K = "def top_k_filter(logits, k):\n{}\n"
_P = "def top_p_filter(logits, p):\n{}\n"
_R = "def apply_repetition_penalty(logits, input_ids, penalty):\n{}\n"
_S = "def sample_next(logits, generator):\n{}\n"
_B = "def beam_search(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty=1.0):\n{}\n"

_NINF = "float('-inf')"

# A correct beam search with one line switchable, written as a learner would (lists of (seq, score)).
_BEAM = '''\
def beam_search(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty=1.0):
    beams = {start}
    finished = []
    for step in range(1, max_new_tokens + 1):
        logprobs = F.log_softmax(step_fn(torch.tensor([seq for seq, _ in beams])), dim=-1)
        V = logprobs.shape[-1]
        totals = {totals}
        order = torch.argsort(totals.flatten(), descending=True)
        live = []
        for rank, flat in enumerate(order.tolist()):
            b, tok = divmod(flat, V)
            seq, score = beams[b][0] + [tok], totals[b, tok].item()
            if tok == eos_token_id or step == max_new_tokens:
                if {finish}:
                    finished.append(({final}, seq))
            elif len(live) < {keep}:
                live.append((seq, score))
        beams = live
    return max(finished, key=lambda f: f[0])[1]
'''
_OK = dict(start="[(list(prompt), 0.0)]",
           totals="torch.tensor([score for _, score in beams])[:, None] + logprobs",
           finish="rank < num_beams", final="score / step ** length_penalty", keep="num_beams")


def _beam(**change):
    return _BEAM.format(**{**_OK, **change})


MISTAKES = [
    # ---- apply_temperature
    Mistake("apply_temperature", "multiplies", _T.format("    return logits * temperature"),
            "you multiplied by the temperature"),
    Mistake("apply_temperature", "returns probabilities",
            _T.format("    return torch.softmax(logits / temperature, dim=-1)"), "return the scaled logits"),
    Mistake("apply_temperature", "no check for zero", _T.format("    return logits / temperature"),
            "instead of raising ValueError"),
    Mistake("apply_temperature", "in place",
            _T.format("    if temperature <= 0:\n        raise ValueError('temperature must be > 0')\n"
                      "    logits /= temperature\n    return logits"), "in place"),
    Mistake("apply_temperature", "delegates to gptlab",
            "from gptlab.sampling import apply_temperature as _t\n\n"
            "def apply_temperature(logits, temperature):\n    return _t(logits, temperature)\n",
            "gptlab.sampling.apply_temperature", delegation=True),
    Mistake("apply_temperature", "delegates to transformers",
            "from transformers import TemperatureLogitsWarper\n\n"
            "def apply_temperature(logits, temperature):\n"
            "    return TemperatureLogitsWarper(temperature)(None, logits)\n",
            "transformers.TemperatureLogitsWarper", delegation=True),
    # ---- top_k_filter
    Mistake("top_k_filter", "breaks ties",
            _K.format("    k = min(k, logits.shape[-1])\n    values, idx = torch.topk(logits, k, dim=-1)\n"
                      f"    return torch.full_like(logits, {_NINF}).scatter(-1, idx, values)"),
            "tied with the k-th"),
    Mistake("top_k_filter", "keeps the smallest",
            _K.format("    k = min(k, logits.shape[-1])\n    kth = torch.topk(logits, k, dim=-1, largest=False).values[..., -1:]\n"
                      f"    return logits.masked_fill(logits > kth, {_NINF})"),
            "k SMALLEST"),
    Mistake("top_k_filter", "removes the k-th",
            _K.format("    k = min(k, logits.shape[-1])\n    kth = torch.topk(logits, k, dim=-1).values[..., -1:]\n"
                      f"    return logits.masked_fill(logits <= kth, {_NINF})"),
            "you removed the k-th token too"),
    Mistake("top_k_filter", "zero instead of -inf",
            _K.format("    k = min(k, logits.shape[-1])\n    kth = torch.topk(logits, k, dim=-1).values[..., -1:]\n"
                      "    return logits.masked_fill(logits < kth, 0.0)"),
            "instead of float('-inf')"),
    Mistake("top_k_filter", "k larger than V",
            _K.format("    kth = torch.topk(logits, k, dim=-1).values[..., -1:]\n"
                      f"    return logits.masked_fill(logits < kth, {_NINF})"),
            "min(k, logits.shape[-1])"),
    Mistake("top_k_filter", "in place",
            _K.format("    k = min(k, logits.shape[-1])\n    kth = torch.topk(logits, k, dim=-1).values[..., -1:]\n"
                      f"    logits[logits < kth] = {_NINF}\n    return logits"),
            "in place"),
    Mistake("top_k_filter", "delegates to gptlab",
            "import gptlab.sampling\n\ndef top_k_filter(logits, k):\n    return gptlab.sampling.top_k_filter(logits, k)\n",
            "gptlab.sampling.top_k_filter", delegation=True),
    Mistake("top_k_filter", "delegates to transformers",
            "def top_k_filter(logits, k):\n    from transformers import TopKLogitsWarper\n"
            "    return TopKLogitsWarper(k)(None, logits)\n",
            "transformers.TopKLogitsWarper", delegation=True),
    # ---- top_p_filter
    Mistake("top_p_filter", "drops the crossing token",
            _P.format("    s, order = torch.sort(logits, dim=-1, descending=True)\n"
                      "    remove_sorted = torch.softmax(s, dim=-1).cumsum(dim=-1) > p\n"
                      "    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)\n"
                      f"    return logits.masked_fill(remove, {_NINF})"),
            "crosses p"),
    Mistake("top_p_filter", "sorts ascending",
            _P.format("    s, order = torch.sort(logits, dim=-1)\n"
                      "    remove_sorted = torch.softmax(s, dim=-1).cumsum(dim=-1) > p\n"
                      "    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)\n"
                      f"    return logits.masked_fill(remove, {_NINF})"),
            "ascending order"),
    Mistake("top_p_filter", "mask left in sorted order",
            _P.format("    s, order = torch.sort(logits, dim=-1, descending=True)\n"
                      "    remove = torch.softmax(s, dim=-1).cumsum(dim=-1) > p\n"
                      "    remove[..., 1:] = remove[..., :-1].clone()\n    remove[..., 0] = False\n"
                      f"    return logits.masked_fill(remove, {_NINF})"),
            "SORTED order"),
    Mistake("top_p_filter", "returns probabilities",
            _P.format("    s, order = torch.sort(logits, dim=-1, descending=True)\n"
                      "    probs = torch.softmax(s, dim=-1)\n    remove_sorted = probs.cumsum(dim=-1) - probs >= p\n"
                      "    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)\n"
                      f"    return torch.softmax(logits.masked_fill(remove, {_NINF}), dim=-1)"),
            "you returned probabilities"),
    Mistake("top_p_filter", "delegates to gptlab",
            "from gptlab import sampling\n\ndef top_p_filter(logits, p):\n    return sampling.top_p_filter(logits, p)\n",
            "gptlab.sampling.top_p_filter", delegation=True),
    Mistake("top_p_filter", "delegates to transformers",
            "from transformers.generation.logits_process import TopPLogitsWarper\n\n"
            "def top_p_filter(logits, p):\n    return TopPLogitsWarper(p)(None, logits)\n",
            "transformers.TopPLogitsWarper", delegation=True),
    # ---- apply_repetition_penalty
    Mistake("apply_repetition_penalty", "divides negative logits",
            _R.format("    present = torch.zeros_like(logits, dtype=torch.bool).scatter(1, input_ids, True)\n"
                      "    return torch.where(present, logits / penalty, logits)"),
            "negative ones too"),
    Mistake("apply_repetition_penalty", "every token",
            _R.format("    return torch.where(logits < 0, logits * penalty, logits / penalty)"),
            "every token of the vocabulary"),
    Mistake("apply_repetition_penalty", "once per occurrence",
            _R.format("    out = logits.clone()\n    for b in range(logits.shape[0]):\n"
                      "        for t in input_ids[b].tolist():\n"
                      "            out[b, t] = out[b, t] * penalty if out[b, t] < 0 else out[b, t] / penalty\n"
                      "    return out"),
            "once per occurrence"),
    Mistake("apply_repetition_penalty", "other rows' tokens",
            _R.format("    present = torch.zeros(logits.shape[-1], dtype=torch.bool)\n    present[input_ids.flatten()] = True\n"
                      "    return torch.where(present, torch.where(logits < 0, logits * penalty, logits / penalty), logits)"),
            "OTHER rows"),
    Mistake("apply_repetition_penalty", "in place (HF's scatter_ on the input)",
            _R.format("    score = torch.gather(logits, 1, input_ids)\n"
                      "    score = torch.where(score < 0, score * penalty, score / penalty)\n"
                      "    return logits.scatter_(1, input_ids, score)"),
            "in place"),
    Mistake("apply_repetition_penalty", "delegates to gptlab",
            "from gptlab.sampling import apply_repetition_penalty as _rp\n\n"
            "def apply_repetition_penalty(logits, input_ids, penalty):\n    return _rp(logits, input_ids, penalty)\n",
            "gptlab.sampling.apply_repetition_penalty", delegation=True),
    Mistake("apply_repetition_penalty", "delegates to transformers",
            "from transformers import RepetitionPenaltyLogitsProcessor\n\n"
            "def apply_repetition_penalty(logits, input_ids, penalty):\n"
            "    return RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())\n",
            "transformers.RepetitionPenaltyLogitsProcessor", delegation=True),
    # ---- sample_next
    Mistake("sample_next", "argmax", _S.format("    return logits.argmax(dim=-1)"), "arg-max"),
    Mistake("sample_next", "softmax over the batch",
            _S.format("    probs = torch.softmax(logits, dim=0)\n"
                      "    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)"),
            "over the batch"),
    Mistake("sample_next", "samples from the logits",
            _S.format("    return torch.multinomial(logits, 1, generator=generator).squeeze(-1)"),
            "from the logits themselves"),
    Mistake("sample_next", "ignores the generator",
            _S.format("    return torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(-1)"),
            "seeded alike"),
    Mistake("sample_next", "shape (B, 1)",
            _S.format("    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)"),
            "squeeze the last axis"),
    Mistake("sample_next", "delegates to gptlab",
            "from gptlab.sampling import sample_next as _draw\n\n"
            "def sample_next(logits, generator):\n    return _draw(logits, generator).squeeze(-1)\n",
            "gptlab.sampling.sample_next", delegation=True),
    # ---- beam_search
    Mistake("beam_search", "adds probabilities", _beam(totals="torch.tensor([score for _, score in beams])[:, None] + logprobs.exp()"),
            "you added probabilities"),
    Mistake("beam_search", "no accumulation", _beam(totals="logprobs + 0.0 * torch.tensor([score for _, score in beams])[:, None]"),
            "did not accumulate"),
    Mistake("beam_search", "duplicated start beams", _beam(start="[(list(prompt), 0.0)] * num_beams"),
            "copies of the prompt"),
    Mistake("beam_search", "length penalty ignored", _beam(final="score"), "ignored the length penalty"),
    Mistake("beam_search", "length counts the prompt", _beam(final="score / len(seq) ** length_penalty"),
            "counts the prompt"),
    Mistake("beam_search", "every eos finishes", _beam(finish="rank < num_beams or tok == eos_token_id"),
            "ranked among the best num_beams"),
    Mistake("beam_search", "greedy", _beam(keep="1", finish="rank < 1"), "single beam"),
    Mistake("beam_search", "delegates to gptlab",
            "from gptlab.grading.sampling import reference_beam_search\n\n"
            "def beam_search(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty=1.0):\n"
            "    return reference_beam_search(step_fn, prompt, num_beams, max_new_tokens, eos_token_id, length_penalty, 10)\n",
            "gptlab.beam_search", delegation=True),
]
