"""Mistakes learners make in the ``blocks`` assignment (chapter 4), as the code they would write."""

from . import Mistake

_LN = "def layer_norm(x, weight, bias, eps=1e-5):\n    import torch\n{}\n"
_G = "def gelu(x):\n    import math\n    import torch\n{}\n"
_RMS = "def rms_norm(x, weight, eps=1e-5):\n    import torch\n{}\n"
_ROPE = "def apply_rope(x, cos, sin):\n    import torch\n    x1, x2 = x.chunk(2, dim=-1)\n{}\n"

_MLP = '''
class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return {mlp}
'''
_BLOCK = _MLP + '''

class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
{forward}
'''
_PRE = "        x = x + self.attn(self.ln_1(x))\n        x = x + self.mlp(self.ln_2(x))\n        return x"
_TANH = 'self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))'


def _block(forward: str = _PRE, mlp: str = _TANH) -> str:
    return _BLOCK.format(forward=forward, mlp=mlp)


MISTAKES = [
    # ---- layer_norm
    Mistake("layer_norm", "Bessel's correction (x.var default)",
            _LN.format("    mean = x.mean(dim=-1, keepdim=True)\n"
                       "    return (x - mean) / torch.sqrt(x.var(dim=-1, keepdim=True) + eps) * weight + bias"),
            "Bessel's correction"),
    Mistake("layer_norm", "eps outside the sqrt",
            _LN.format("    mean = x.mean(dim=-1, keepdim=True)\n"
                       "    std = x.std(dim=-1, keepdim=True, unbiased=False)\n"
                       "    return (x - mean) / (std + eps) * weight + bias"),
            "eps outside the square root"),
    Mistake("layer_norm", "normalised over the time dimension",
            _LN.format("    mean = x.mean(dim=1, keepdim=True)\n"
                       "    var = ((x - mean) ** 2).mean(dim=1, keepdim=True)\n"
                       "    return (x - mean) / torch.sqrt(var + eps) * weight + bias"),
            "wrong dimension (dim=1)"),
    Mistake("layer_norm", "normalised over everything",
            _LN.format("    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + eps) * weight + bias"),
            "all the numbers of the tensor at once"),
    Mistake("layer_norm", "no keepdim",
            _LN.format("    mean = x.mean(dim=-1)\n    var = ((x - mean) ** 2).mean(dim=-1)\n"
                       "    return (x - mean) / torch.sqrt(var + eps) * weight + bias"),
            "raised RuntimeError"),
    Mistake("layer_norm", "bias forgotten",
            _LN.format("    mean = x.mean(dim=-1, keepdim=True)\n"
                       "    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)\n"
                       "    return (x - mean) / torch.sqrt(var + eps) * weight"),
            "you forgot the bias"),
    Mistake("layer_norm", "no square root",
            _LN.format("    mean = x.mean(dim=-1, keepdim=True)\n"
                       "    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)\n"
                       "    return (x - mean) / (var + eps) * weight + bias"),
            "instead of the standard deviation"),
    Mistake("layer_norm", "in-place centring",
            _LN.format("    x -= x.mean(dim=-1, keepdim=True)\n"
                       "    return x / torch.sqrt((x ** 2).mean(dim=-1, keepdim=True) + eps) * weight + bias"),
            "changed its input"),
    Mistake("layer_norm", "delegates to F.layer_norm",
            "import torch.nn.functional as F\n\ndef layer_norm(x, weight, bias, eps=1e-5):\n"
            "    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)\n",
            "F.layer_norm", delegation=True),
    Mistake("layer_norm", "delegates to nn.LayerNorm",
            "import torch\n\ndef layer_norm(x, weight, bias, eps=1e-5):\n"
            "    ln = torch.nn.LayerNorm(x.shape[-1], eps=eps)\n"
            "    with torch.no_grad():\n        ln.weight.copy_(weight)\n        ln.bias.copy_(bias)\n"
            "    return ln(x).detach()\n",
            "nn.LayerNorm", delegation=True),
    Mistake("layer_norm", "delegates to gptlab",
            "from gptlab.layers import layer_norm as _ln\n\ndef layer_norm(x, weight, bias, eps=1e-5):\n"
            "    return _ln(x, weight, bias, eps)\n",
            "gptlab.layers.layer_norm", delegation=True),
    # ---- gelu
    Mistake("gelu", "exact GELU (erf)", _G.format("    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))"),
            "exact GELU"),
    Mistake("gelu", "no cubic term",
            _G.format("    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * x))"), "cubic term"),
    Mistake("gelu", "sqrt(2 pi)",
            _G.format("    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 * math.pi) * (x + 0.044715 * x ** 3)))"),
            "not sqrt(2 * pi)"),
    Mistake("gelu", "x squared", _G.format(
        "    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 2)))"), "x**2 instead"),
    Mistake("gelu", "no factor one half",
            _G.format("    return x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))"),
            "factor 0.5"),
    Mistake("gelu", "sigmoid approximation", _G.format("    return x * torch.sigmoid(1.702 * x)"),
            "sigmoid approximation"),
    Mistake("gelu", "ReLU", _G.format("    return torch.relu(x)"), "you wrote ReLU"),
    Mistake("gelu", "math.tanh on a tensor",
            _G.format("    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))"),
            "raised"),
    Mistake("gelu", "delegates to F.gelu",
            "import torch.nn.functional as F\n\ndef gelu(x):\n    return F.gelu(x, approximate='tanh')\n",
            "F.gelu", delegation=True),
    Mistake("gelu", "delegates to nn.GELU",
            "import torch.nn as nn\n\ndef gelu(x):\n    return nn.GELU(approximate='tanh')(x)\n",
            "nn.GELU", delegation=True),
    Mistake("gelu", "delegates to gptlab",
            "import gptlab.layers\n\ndef gelu(x):\n    return gptlab.layers.gelu(x)\n",
            "gptlab.layers.gelu", delegation=True),
    # ---- rms_norm
    Mistake("rms_norm", "mean subtracted",
            _RMS.format("    x = x - x.mean(dim=-1, keepdim=True)\n"
                        "    return x / torch.sqrt((x ** 2).mean(dim=-1, keepdim=True) + eps) * weight"),
            "you subtracted the mean"),
    Mistake("rms_norm", "eps outside the sqrt",
            _RMS.format("    return x / (torch.sqrt((x ** 2).mean(dim=-1, keepdim=True)) + eps) * weight"),
            "eps outside the square root"),
    Mistake("rms_norm", "Euclidean norm",
            _RMS.format("    return x / (x.norm(dim=-1, keepdim=True) + eps) * weight"), "Euclidean norm"),
    Mistake("rms_norm", "no square root",
            _RMS.format("    return x / ((x ** 2).mean(dim=-1, keepdim=True) + eps) * weight"),
            "forgot the square root"),
    Mistake("rms_norm", "weight forgotten",
            _RMS.format("    return x * torch.rsqrt((x ** 2).mean(dim=-1, keepdim=True) + eps)"),
            "forgot to multiply by weight"),
    Mistake("rms_norm", "normalised over the time dimension",
            _RMS.format("    return x / torch.sqrt((x ** 2).mean(dim=1, keepdim=True) + eps) * weight"),
            "wrong dimension (dim=1)"),
    Mistake("rms_norm", "delegates to F.rms_norm",
            "import torch.nn.functional as F\n\ndef rms_norm(x, weight, eps=1e-5):\n"
            "    return F.rms_norm(x, x.shape[-1:], weight, eps)\n",
            "F.rms_norm", delegation=True),
    Mistake("rms_norm", "delegates to gptlab",
            "from gptlab.layers import rms_norm as _r\n\ndef rms_norm(x, weight, eps=1e-5):\n    return _r(x, weight, eps)\n",
            "gptlab.layers.rms_norm", delegation=True),
    # ---- apply_rope
    Mistake("apply_rope", "interleaved pairs",
            "def apply_rope(x, cos, sin):\n    import torch\n    h = x.shape[-1] // 2\n"
            "    a, b = x[..., 0::2], x[..., 1::2]\n    c, s = cos[..., :h], sin[..., :h]\n"
            "    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)\n",
            "interleaved pairs"),
    Mistake("apply_rope", "interleaved pairs with the tables as given (rotate_every_two)",
            "def apply_rope(x, cos, sin):\n    import torch\n"
            "    rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)\n"
            "    return x * cos + rotated * sin\n",
            "interleaved pairs"),
    Mistake("apply_rope", "interleaved pairs, every other angle (Meta's table layout)",
            "def apply_rope(x, cos, sin):\n    import torch\n"
            "    a, b = x[..., 0::2], x[..., 1::2]\n    c, s = cos[..., 0::2], sin[..., 0::2]\n"
            "    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)\n",
            "interleaved pairs"),
    Mistake("apply_rope", "sin sign flipped",
            _ROPE.format("    return x * cos + torch.cat([x2, -x1], dim=-1) * sin"), "sign of the sine term"),
    Mistake("apply_rope", "minus forgotten",
            _ROPE.format("    return x * cos + torch.cat([x2, x1], dim=-1) * sin"), "you left out the minus"),
    Mistake("apply_rope", "cos and sin swapped",
            _ROPE.format("    return x * sin + torch.cat([-x2, x1], dim=-1) * cos"), "swapped cos and sin"),
    Mistake("apply_rope", "rotation only",
            _ROPE.format("    return torch.cat([-x2, x1], dim=-1) * sin"), "add x * cos"),
    Mistake("apply_rope", "in place",
            _ROPE.format("    rot = torch.cat([-x2, x1], dim=-1) * sin\n    x *= cos\n    return x + rot"),
            "changed its input"),
    Mistake("apply_rope", "delegates to gptlab",
            "from gptlab.rope import apply_rope as _ar\n\ndef apply_rope(x, cos, sin):\n    return _ar(x, cos, sin)\n",
            "gptlab.rope.apply_rope", delegation=True),
    # ---- Block
    Mistake("Block", "post-norm",
            _block("        x = self.ln_1(x + self.attn(x))\n        x = self.ln_2(x + self.mlp(x))\n        return x"),
            "post-norm"),
    Mistake("Block", "no attention residual",
            _block("        x = self.attn(self.ln_1(x))\n        x = x + self.mlp(self.ln_2(x))\n        return x"),
            "attention's residual connection is missing"),
    Mistake("Block", "no MLP residual",
            _block("        x = x + self.attn(self.ln_1(x))\n        return self.mlp(self.ln_2(x))"),
            "MLP's residual connection is missing"),
    Mistake("Block", "residual of the normalised x",
            _block("        x = self.ln_1(x)\n        x = x + self.attn(x)\n        x = x + self.mlp(self.ln_2(x))\n"
                   "        return x"),
            "you overwrote x with ln_1(x)"),
    Mistake("Block", "GELU missing", _block(mlp="self.c_proj(self.c_fc(x))"), "GELU is missing"),
    Mistake("Block", "GELU after c_proj", _block(mlp='F.gelu(self.c_proj(self.c_fc(x)), approximate="tanh")'),
            "GELU is in the wrong place (after c_proj)"),
    Mistake("Block", "exact GELU", _block(mlp="self.c_proj(F.gelu(self.c_fc(x)))"), "exact GELU"),
    Mistake("Block", "ReLU", _block(mlp="self.c_proj(F.relu(self.c_fc(x)))"), "you used ReLU"),
    Mistake("Block", "ln_1 twice",
            _block("        x = x + self.attn(self.ln_1(x))\n        x = x + self.mlp(self.ln_1(x))\n        return x"),
            "ln_1 before the MLP too"),
    Mistake("Block", "parallel attention and MLP",
            _block("        return x + self.attn(self.ln_1(x)) + self.mlp(self.ln_2(x))"), "in parallel"),
    Mistake("Block", "other submodule names",
            _block().replace("self.mlp = MLP(n_embd)", "self.ffn = MLP(n_embd)").replace("self.mlp(", "self.ffn("),
            "missing: ['mlp.c_fc.weight'"),
    Mistake("Block", "c_fc in and out swapped",
            _block().replace("nn.Linear(n_embd, 4 * n_embd)", "nn.Linear(4 * n_embd, n_embd)")
            .replace("nn.Linear(4 * n_embd, n_embd)\n\n", "nn.Linear(n_embd, 4 * n_embd)\n\n"),
            "did you swap in and out?"),
    Mistake("Block", "delegates to gptlab's Block",
            "import gptlab.model as _m\n\nclass Block(nn.Module):\n    def __init__(self, n_embd, n_head):\n"
            "        super().__init__()\n        cfg = _m.GPTConfig(n_embd=n_embd, n_head=n_head, n_layer=1)\n"
            "        b = _m.Block(cfg)\n        self.ln_1, self.attn, self.ln_2, self.mlp = b.ln_1, b.attn, b.ln_2, b.mlp\n\n"
            "    def forward(self, x):\n        x = x + self.attn(self.ln_1(x))\n        return x + self.mlp(self.ln_2(x))\n",
            "gptlab.model.Block", delegation=True),
]
