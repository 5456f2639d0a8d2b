"""Mistakes learners make in the ``lm_basics`` assignment, as the code they would write."""

from . import Mistake

_E = "def encode(text, stoi):\n{}\n"
_D = "def decode(ids, itos):\n{}\n"
_B = "def next_token_batch(ids, block_size, starts):\n    import torch\n    T = block_size\n{}\n"
_CE = ("def cross_entropy(logits, targets):\n    import torch\n    N = logits.shape[0]\n"
       "    rows = torch.arange(N)\n{}\n")
_LOGP = ("    z = logits - logits.max(dim=1, keepdim=True).values\n"
         "    logp = z - z.exp().sum(dim=1, keepdim=True).log()\n")
_P = "def perplexity(mean_nll):\n    import math\n{}\n"

MISTAKES = [
    # ---- encode
    Mistake("encode", "off-by-one ids", _E.format("    return [stoi[c] + 1 for c in text]"), "off by one"),
    Mistake("encode", "skips unknown characters", _E.format("    return [stoi[c] for c in text if c in stoi]"),
            "must raise KeyError"),
    Mistake("encode", "unknown characters to 0", _E.format("    return [stoi.get(c, 0) for c in text]"),
            "stoi.get(c, 0)"),
    Mistake("encode", "own sorted vocabulary",
            _E.format("    chars = sorted(stoi)\n    return [chars.index(c) for c in text]"), "not stoi's ids"),
    Mistake("encode", "set of characters", _E.format("    return [stoi[c] for c in set(text)]"),
            "each distinct character once"),
    Mistake("encode", "words split", _E.format("    return [stoi[c] for w in text.split() for c in w]"),
            "skipped the spaces"),
    Mistake("encode", "returns a tensor",
            _E.format("    import torch\n    return torch.tensor([stoi[c] for c in text])"), "returned a tensor"),
    Mistake("encode", "ValueError for unknown",
            _E.format("    for c in text:\n        if c not in stoi:\n            raise ValueError(c)\n"
                      "    return [stoi[c] for c in text]"), "should raise KeyError"),
    Mistake("encode", "delegates to gptlab",
            _E.format("    from gptlab.tokenizers import CharTokenizer\n"
                      "    return CharTokenizer(list(stoi)).encode(text)"), "CharTokenizer.encode", delegation=True),
    # ---- decode
    Mistake("decode", "joined with spaces", _D.format("    return ' '.join(itos[i] for i in ids)"), "with spaces"),
    Mistake("decode", "off-by-one lookup", _D.format("    return ''.join(itos[i + 1] for i in ids)"), "off by one"),
    Mistake("decode", "returns the list", _D.format("    return [itos[i] for i in ids]"), "''.join"),
    Mistake("decode", "unknown ids dropped", _D.format("    return ''.join(itos.get(i, '') for i in ids)"),
            "must raise KeyError"),
    Mistake("decode", "reversed", _D.format("    return ''.join(itos[i] for i in reversed(ids))"), "reverse order"),
    Mistake("decode", "forgot return", _D.format("    s = ''.join(itos[i] for i in ids)"), "forget a return"),
    Mistake("decode", "delegates to gptlab",
            _D.format("    from gptlab.tokenizers import CharTokenizer\n"
                      "    return CharTokenizer([itos[i] for i in range(len(itos))]).decode(ids)"),
            "CharTokenizer.decode", delegation=True),
    # ---- next_token_batch
    Mistake("next_token_batch", "targets not shifted",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts])\n    return x, x.clone()"),
            "targets are not shifted"),
    Mistake("next_token_batch", "shifted the wrong way",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts])\n"
                      "    y = torch.stack([ids[s - 1 : s + T - 1] for s in starts])\n    return x, y"),
            "shifted the wrong way"),
    Mistake("next_token_batch", "y one short at the end",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts])\n"
                      "    y = torch.stack([ids[s + 1 : s + T] for s in starts])\n    return x, y"),
            "block_size - 1 columns"),
    Mistake("next_token_batch", "x takes block_size + 1",
            _B.format("    x = torch.stack([ids[s : s + T + 1] for s in starts])\n"
                      "    y = torch.stack([ids[s + 1 : s + T + 1] for s in starts])\n    return x, y"),
            "block_size + 1 columns"),
    Mistake("next_token_batch", "x and y swapped",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts])\n"
                      "    y = torch.stack([ids[s + 1 : s + T + 1] for s in starts])\n    return y, x"),
            "swapped"),
    Mistake("next_token_batch", "both one late",
            _B.format("    x = torch.stack([ids[s + 1 : s + T + 1] for s in starts])\n"
                      "    y = torch.stack([ids[s + 2 : s + T + 2] for s in starts])\n    return x, y"),
            "x starts one token late"),
    Mistake("next_token_batch", "shifted by two",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts])\n"
                      "    y = torch.stack([ids[s + 2 : s + T + 2] for s in starts])\n    return x, y"),
            "shifted by 2"),
    Mistake("next_token_batch", "stacked along dim 1",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts], dim=1)\n"
                      "    y = torch.stack([ids[s + 1 : s + T + 1] for s in starts], dim=1)\n    return x, y"),
            "the transpose of (B, T)"),
    Mistake("next_token_batch", "float ids",
            _B.format("    x = torch.stack([ids[s : s + T] for s in starts]).float()\n"
                      "    y = torch.stack([ids[s + 1 : s + T + 1] for s in starts]).float()\n    return x, y"),
            "integer token ids"),
    Mistake("next_token_batch", "delegates to gptlab",
            _B.format("    from gptlab.data import batch_at\n    return batch_at(ids, starts, T)"),
            "gptlab.data.batch_at", delegation=True),
    Mistake("next_token_batch", "delegates to TokenDataset",
            _B.format("    from gptlab.data import TokenDataset\n    ds = TokenDataset(ids, T)\n"
                      "    pairs = [ds[int(s)] for s in starts]\n"
                      "    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])"),
            "gptlab.data.TokenDataset", delegation=True),
    # ---- cross_entropy
    Mistake("cross_entropy", "no log-sum-exp shift",
            _CE.format("    logp = logits - logits.exp().sum(dim=1, keepdim=True).log()\n"
                       "    return -logp[rows, targets].mean()"), "not numerically stable"),
    Mistake("cross_entropy", "log of softmax",
            _CE.format("    p = torch.softmax(logits, dim=1)\n    return -p[rows, targets].log().mean()"),
            "never log(softmax)"),
    Mistake("cross_entropy", "sum instead of mean", _CE.format(_LOGP + "    return -logp[rows, targets].sum()"),
            "summed the losses"),
    Mistake("cross_entropy", "softmax over the wrong dim",
            _CE.format("    z = logits - logits.max(dim=0, keepdim=True).values\n"
                       "    logp = z - z.exp().sum(dim=0, keepdim=True).log()\n"
                       "    return -logp[rows, targets].mean()"), "wrong dimension"),
    Mistake("cross_entropy", "picks the argmax",
            _CE.format(_LOGP + "    return -logp[rows, logits.argmax(dim=1)].mean()"), "(argmax)"),
    Mistake("cross_entropy", "sign flipped", _CE.format(_LOGP + "    return logp[rows, targets].mean()"),
            "sign is flipped"),
    Mistake("cross_entropy", "logp[:, targets]", _CE.format(_LOGP + "    return -logp[:, targets].mean()"),
            "(N, N) block"),
    Mistake("cross_entropy", "no mean", _CE.format(_LOGP + "    return -logp[rows, targets]"),
            "one loss per row"),
    Mistake("cross_entropy", "item()", _CE.format(_LOGP + "    return -logp[rows, targets].mean().item()"),
            "Python number"),
    Mistake("cross_entropy", "rebuilt as a new tensor",
            _CE.format(_LOGP + "    return torch.tensor(-logp[rows, targets].mean().item())"),
            "cut off from the logits"),
    Mistake("cross_entropy", "log base 2",
            _CE.format("    import math\n" + _LOGP + "    return -logp[rows, targets].mean() / math.log(2)"),
            "log base 2"),
    Mistake("cross_entropy", "delegates to F.cross_entropy",
            _CE.format("    import torch.nn.functional as F\n    return F.cross_entropy(logits, targets)"),
            "F.cross_entropy", delegation=True),
    Mistake("cross_entropy", "delegates to nn.CrossEntropyLoss",
            "from torch import nn\n\ndef cross_entropy(logits, targets):\n"
            "    return nn.CrossEntropyLoss()(logits, targets)", "nn.CrossEntropyLoss", delegation=True),
    Mistake("cross_entropy", "delegates to F.nll_loss",
            _CE.format("    import torch.nn.functional as F\n"
                       "    return F.nll_loss(torch.log_softmax(logits, 1), targets)"),
            "must be written by hand", delegation=True),
    Mistake("cross_entropy", "uses torch.logsumexp",
            _CE.format("    logp = logits - torch.logsumexp(logits, dim=1, keepdim=True)\n"
                       "    return -logp[rows, targets].mean()"), "torch.logsumexp", delegation=True),
    Mistake("cross_entropy", "uses the log_softmax method",
            _CE.format("    return -logits.log_softmax(dim=-1)[rows, targets].mean()"), "log_softmax",
            delegation=True),
    # ---- perplexity
    Mistake("perplexity", "base 2", _P.format("    return 2 ** mean_nll"), "base 2"),
    Mistake("perplexity", "base 10", _P.format("    return 10 ** mean_nll"), "base 10"),
    Mistake("perplexity", "exp of minus the loss", _P.format("    return math.exp(-mean_nll)"), "exp(-loss)"),
    Mistake("perplexity", "returns the loss", _P.format("    return mean_nll"), "returned the loss itself"),
    Mistake("perplexity", "returns a tensor",
            _P.format("    import torch\n    return torch.exp(torch.tensor(mean_nll))"), "returned a tensor"),
    Mistake("perplexity", "delegates to gptlab",
            _P.format("    from gptlab.bigram import perplexity as ppl\n    return ppl(mean_nll)"),
            "gptlab.bigram.perplexity", delegation=True),
]
