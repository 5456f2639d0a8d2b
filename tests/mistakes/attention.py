"""Mistakes learners make in the ``attention`` assignment, as the code they would write."""

from . import Mistake

_W = ("def attention_weights(q, k, mask=None):\n    d = q.shape[-1]\n{}\n")
_SCORES = "    scores = q @ k.transpose(-2, -1) / math.sqrt(d)\n"
_MASKED = _SCORES + "    if mask is not None:\n        scores = scores.masked_fill(~mask, float('-inf'))\n"
_A = "def attend(q, k, v, mask=None):\n{}\n"
_S = "def split_heads(x, n_head):\n    B, T, C = x.shape\n{}\n"
_M = "def merge_heads(x):\n    B, H, T, d = x.shape\n{}\n"

_CSA = '''
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd{attn_bias})
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        {qkv} = self.c_attn(x).split(C, dim=-1)
        q, k, v = split_heads(q, self.n_head), split_heads(k, self.n_head), split_heads(v, self.n_head)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = attend(q, k, v, {mask})
        return {out}
'''


def _csa(qkv="q, k, v", mask="mask", out="self.c_proj(merge_heads(y))", attn_bias=""):
    return _CSA.format(qkv=qkv, mask=mask, out=out, attn_bias=attn_bias)


_CSA_BY_HAND = '''
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, C = x.shape
        H, d = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=-1)
        q, k, v = {split}
        s = q @ k.transpose(-2, -1) {scale}
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float('-inf'))
        y = torch.softmax(s, dim=-1) @ v
        return self.c_proj({merge})
'''
_SPLIT = "(t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))"
_MERGE = "y.transpose(1, 2).reshape(B, T, C)"


def _by_hand(split=_SPLIT, scale="/ math.sqrt(d)", merge=_MERGE):
    return _CSA_BY_HAND.format(split=split, scale=scale, merge=merge)


MISTAKES = [
    # ---- attention_weights
    Mistake("attention_weights", "no scaling",
            _W.format("    scores = q @ k.transpose(-2, -1)\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "you did not divide the scores by sqrt(d)"),
    Mistake("attention_weights", "divides by d",
            _W.format("    scores = q @ k.transpose(-2, -1) / d\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "divided the scores by d instead of sqrt(d)"),
    Mistake("attention_weights", "sqrt of the number of keys",
            _W.format("    scores = q @ k.transpose(-2, -1) / math.sqrt(k.shape[-2])\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "square root of the wrong size"),
    Mistake("attention_weights", "sqrt of the number of queries",
            _W.format("    scores = q @ k.transpose(-2, -1) / q.shape[-2] ** 0.5\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "square root of the wrong size"),
    Mistake("attention_weights", "k not transposed",
            _W.format("    scores = q @ k / math.sqrt(d)\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "you did not transpose k"),
    Mistake("attention_weights", "k transposed on the wrong axes",
            _W.format("    scores = q @ k.transpose(-1, -3) / math.sqrt(d)\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "raised RuntimeError"),
    Mistake("attention_weights", "softmax over queries", _W.format(_MASKED + "    return torch.softmax(scores, dim=-2)"),
            "softmax over the queries"),
    Mistake("attention_weights", "mask after the softmax",
            _W.format(_SCORES + "    w = torch.softmax(scores, dim=-1)\n    return w if mask is None else w * mask"),
            "mask after the softmax"),
    Mistake("attention_weights", "fills with 0",
            _W.format(_SCORES + "    if mask is not None:\n        scores = scores.masked_fill(~mask, 0.0)\n"
                      "    return torch.softmax(scores, dim=-1)"),
            "instead of -inf"),
    Mistake("attention_weights", "mask inverted",
            _W.format(_SCORES + "    if mask is not None:\n        scores = scores.masked_fill(mask, float('-inf'))\n"
                      "    return torch.softmax(scores, dim=-1)"),
            "mask is inverted"),
    Mistake("attention_weights", "mask ignored", _W.format(_SCORES + "    return torch.softmax(scores, dim=-1)"),
            "you ignored the mask"),
    Mistake("attention_weights", "returns the scores", _W.format(_MASKED + "    return scores"),
            "you returned the scores"),
    Mistake("attention_weights", "in place",
            _W.format("    q /= math.sqrt(d)\n    scores = q @ k.transpose(-2, -1)\n    if mask is not None:\n"
                      "        scores = scores.masked_fill(~mask, float('-inf'))\n    return torch.softmax(scores, dim=-1)"),
            "in place"),
    Mistake("attention_weights", "transposed result",
            _W.format("    return torch.softmax(k @ q.transpose(-2, -1) / math.sqrt(d), dim=-1)"),
            "columns are keys"),
    Mistake("attention_weights", "delegates to SDPA weights",
            "import torch.nn.functional as F\n\ndef attention_weights(q, k, mask=None):\n"
            "    eye = torch.eye(k.shape[-2]).expand(*k.shape[:-2], k.shape[-2], k.shape[-2])\n"
            "    return F.scaled_dot_product_attention(q, k, eye, attn_mask=mask)\n",
            "F.scaled_dot_product_attention", delegation=True),
    Mistake("attention_weights", "delegates to gptlab",
            "from gptlab.attention import attention_weights as _aw\n\ndef attention_weights(q, k, mask=None):\n"
            "    return _aw(q, k, mask)\n",
            "gptlab.attention.attention_weights", delegation=True),
    Mistake("attention_weights", "delegates to nn.MultiheadAttention",
            "def attention_weights(q, k, mask=None):\n    B, H, T, d = q.shape\n"
            "    mha = nn.MultiheadAttention(d, 1, batch_first=True)\n"
            "    _, w = mha(q.reshape(B * H, T, d), k.reshape(B * H, -1, d), k.reshape(B * H, -1, d))\n"
            "    return w.reshape(B, H, T, -1)\n",
            "nn.MultiheadAttention", delegation=True),
    # ---- attend
    Mistake("attend", "returns the weights", _A.format("    return attention_weights(q, k, mask)"),
            "multiply them by v"),
    Mistake("attend", "mask not passed on", _A.format("    return attention_weights(q, k) @ v"),
            "forgot to pass the mask on"),
    Mistake("attend", "transposed weights", _A.format("    return attention_weights(q, k, mask).transpose(-2, -1) @ v"),
            "transposed weights"),
    Mistake("attend", "unscaled weights by hand",
            _A.format("    s = q @ k.transpose(-2, -1)\n    if mask is not None:\n"
                      "        s = s.masked_fill(~mask, float('-inf'))\n    return torch.softmax(s, dim=-1) @ v"),
            "your weights are wrong: you did not divide the scores by sqrt(d)"),
    Mistake("attend", "q scaled again before attention_weights",
            _A.format("    d = q.shape[-1]\n    return attention_weights(q / math.sqrt(d), k, mask) @ v"),
            "divided the scores by sqrt(d) twice"),
    Mistake("attend", "returns a tuple", _A.format("    w = attention_weights(q, k, mask)\n    return w @ v, w"),
            "got a tuple"),
    Mistake("attend", "delegates to SDPA",
            "import torch.nn.functional as F\n\n" + _A.format("    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)"),
            "F.scaled_dot_product_attention", delegation=True),
    Mistake("attend", "delegates to gptlab",
            "import gptlab.attention\n\n" + _A.format("    return gptlab.attention.attention(q, k, v, mask)"),
            "gptlab.attention.attention", delegation=True),
    # ---- split_heads
    Mistake("split_heads", "view without transpose", _S.format("    return x.view(B, n_head, T, C // n_head)"),
            "without a transpose"),
    Mistake("split_heads", "reshape without transpose", _S.format("    return x.reshape(B, n_head, T, -1)"),
            "without a transpose"),
    Mistake("split_heads", "strided heads",
            _S.format("    return x.view(B, T, C // n_head, n_head).permute(0, 3, 1, 2)"),
            "every n_head-th feature"),
    Mistake("split_heads", "no transpose at all", _S.format("    return x.view(B, T, n_head, C // n_head)"),
            "add .transpose(1, 2)"),
    Mistake("split_heads", "wrong axis order",
            _S.format("    return x.view(B, T, n_head, C // n_head).permute(0, 3, 1, 2)"),
            "axes are in the wrong order"),
    Mistake("split_heads", "delegates to gptlab",
            "from gptlab import attention as _a\n\n" + _S.format("    return _a.split_heads(x, n_head)"),
            "gptlab.attention.split_heads", delegation=True),
    # ---- merge_heads
    Mistake("merge_heads", "reshape without transpose", _M.format("    return x.reshape(B, T, H * d)"),
            "without a transpose"),
    Mistake("merge_heads", "view after transpose", _M.format("    return x.transpose(1, 2).view(B, T, H * d)"),
            "not contiguous in memory"),
    Mistake("merge_heads", "features in the wrong order",
            _M.format("    return x.permute(0, 2, 3, 1).reshape(B, T, H * d)"), "wrong order (d, H)"),
    Mistake("merge_heads", "merged the wrong axes", _M.format("    return x.reshape(B, H, T * d)"),
            "You merged the wrong axes"),
    Mistake("merge_heads", "delegates to gptlab",
            "import gptlab.attention as _a\n\n" + _M.format("    return _a.merge_heads(x)"),
            "gptlab.attention.merge_heads", delegation=True),
    # ---- CausalSelfAttention
    Mistake("CausalSelfAttention", "k, q, v order", _csa(qkv="k, q, v"), "in the wrong order"),
    Mistake("CausalSelfAttention", "v, k, q order", _csa(qkv="v, k, q"), "in the wrong order"),
    Mistake("CausalSelfAttention", "no causal mask", _csa(mask="None"), "did not apply the causal mask"),
    Mistake("CausalSelfAttention", "no output projection", _csa(out="merge_heads(y)"), "forgot the output projection"),
    Mistake("CausalSelfAttention", "no scaling", _by_hand(scale=""), "did not divide the scores by sqrt(head_dim)"),
    Mistake("CausalSelfAttention", "scaled by sqrt(n_embd)", _by_hand(scale="/ math.sqrt(C)"),
            "divided the scores by sqrt(n_embd)"),
    Mistake("CausalSelfAttention", "heads merged without transpose", _by_hand(merge="y.reshape(B, T, C)"),
            "heads are merged wrong"),
    Mistake("CausalSelfAttention", "heads split without transpose",
            _by_hand(split="(t.reshape(B, H, T, d) for t in (q, k, v))"), "heads are split wrong"),
    Mistake("CausalSelfAttention", "no bias", _csa(attn_bias=", bias=False"), "has no bias"),
    Mistake("CausalSelfAttention", "separate q, k, v layers",
            "class CausalSelfAttention(nn.Module):\n    def __init__(self, n_embd, n_head):\n        super().__init__()\n"
            "        self.n_head = n_head\n        self.q = nn.Linear(n_embd, n_embd)\n        self.k = nn.Linear(n_embd, n_embd)\n"
            "        self.v = nn.Linear(n_embd, n_embd)\n        self.c_proj = nn.Linear(n_embd, n_embd)\n\n"
            "    def forward(self, x):\n        q, k, v = self.q(x), self.k(x), self.v(x)\n"
            "        return self.c_proj(merge_heads(attend(*(split_heads(t, self.n_head) for t in (q, k, v)))))\n",
            "has no attribute 'c_attn'"),
    Mistake("CausalSelfAttention", "c_attn of the wrong size",
            _csa().replace("nn.Linear(n_embd, 3 * n_embd)", "nn.Linear(3 * n_embd, n_embd)"), "self.c_attn.weight has shape"),
    Mistake("CausalSelfAttention", "delegates to SDPA",
            _csa().replace("y = attend(q, k, v, mask)",
                           "y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)"),
            "F.scaled_dot_product_attention", delegation=True),
    Mistake("CausalSelfAttention", "subclasses gptlab's layer",
            "from gptlab.attention import CausalSelfAttention as _Ref\nfrom gptlab.model import GPTConfig\n\n"
            "class CausalSelfAttention(_Ref):\n    def __init__(self, n_embd, n_head):\n"
            "        super().__init__(GPTConfig(n_embd=n_embd, n_head=n_head))\n",
            "gptlab.attention.CausalSelfAttention", delegation=True),
    Mistake("CausalSelfAttention", "delegates to nn.MultiheadAttention",
            "class CausalSelfAttention(nn.Module):\n    def __init__(self, n_embd, n_head):\n        super().__init__()\n"
            "        self.mha = nn.MultiheadAttention(n_embd, n_head, batch_first=True)\n"
            "        self.c_attn = nn.Linear(n_embd, 3 * n_embd)\n        self.c_proj = self.mha.out_proj\n\n"
            "    def forward(self, x):\n        T = x.shape[1]\n"
            "        m = ~torch.ones(T, T, dtype=torch.bool).tril()\n        return self.mha(x, x, x, attn_mask=m)[0]\n",
            "nn.MultiheadAttention", delegation=True),
]
