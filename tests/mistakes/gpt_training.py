"""Mistakes learners make in the ``gpt_training`` assignment, as the code they would write.

The ``train`` entries each train a small model: the loops that do not learn at all (learning rate
0, targets not shifted, gradients never zeroed, delegation) fail in the check's 40-step probe; the
evaluation left in train mode needs the whole graded run (about 20 s of one core)."""

from . import Mistake

# ---------------------------------------------------------------------------------------- GPT

_GPT = '''
class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
{wpe}            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
{tie}
    def forward(self, idx):
        B, T = idx.shape
        tr = self.transformer
{check}        x = tr.drop({embed})
        for block in tr.h:
            x = block(x)
        return self.lm_head({final})
'''
_WPE = "            wpe=nn.Embedding(block_size, n_embd),\n"
_TIE = "        self.lm_head.weight = self.transformer.wte.weight\n"
_CHECK = ("        if T > self.block_size:\n"
          "            raise ValueError(f'T = {T} > block_size = {self.block_size}')\n")
_EMBED = "tr.wte(idx) + tr.wpe(torch.arange(T, device=idx.device))"
# GPT-2's layout with the embeddings, blocks and final norm directly on the model (no self.transformer)
_FLAT = '''
class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f'T = {T} > block_size = {self.block_size}')
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
'''


def _gpt(wpe=_WPE, tie=_TIE, check=_CHECK, embed=_EMBED, final="tr.ln_f(x)") -> str:
    return _GPT.format(wpe=wpe, tie=tie, check=check, embed=embed, final=final)


# ------------------------------------------------------------------------------ count_params

_COUNT = '''
def count_params(vocab_size, block_size, n_layer, n_embd):
    C = n_embd
    per_block = {block}
    return {total}
'''
_BLOCK = "2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)"
_TOTAL = "vocab_size * C + block_size * C + n_layer * per_block + 2 * C"


def _count(block=_BLOCK, total=_TOTAL) -> str:
    return _COUNT.format(block=block, total=total)


# ------------------------------------------------------------------------------------- lr_at

_LR = '''
def lr_at(step, max_lr, min_lr, warmup, total):
    if step < warmup:
        return {warm}
    if step >= total:
        return min_lr
    progress = {progress}
    return {decay}
'''


def _lr(warm="max_lr * (step + 1) / (warmup + 1)", progress="(step - warmup) / (total - warmup)",
        decay="min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)") -> str:
    return _LR.format(warm=warm, progress=progress, decay=decay)


# ------------------------------------------------------------------------------------- train

_TRAIN = '''
def train(model, data, steps, batch_size=32, block_size=64, max_lr=1e-2, min_lr=1e-3, warmup=20,
          weight_decay=0.1, grad_clip=1.0, val_data=None, eval_every=100, device="cpu", seed=0):
    model.to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{{"params": decay, "weight_decay": weight_decay}},
                                   {{"params": no_decay, "weight_decay": 0.0}}], lr={lr0}, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(seed)
    history = {{"train_loss": [], "val_loss": []}}

    def evaluate():
        xs, ys = val_windows(val_data, block_size)
{eval_mode}        with torch.no_grad():
            logits = model(xs.to(device))
            loss = F.cross_entropy(logits.flatten(0, 1), ys.to(device).flatten()).item()
        model.train()
        return loss

    model.train()
    for step in range(steps):
{set_lr}        x, y = get_batch(data, batch_size, block_size, generator=g, device=device)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), {target}.flatten())
{zero}        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        history["train_loss"].append(loss.item())
        if val_data is not None and ((step + 1) % eval_every == 0 or step + 1 == steps):
            history["val_loss"].append((step + 1, evaluate()))
    return history
'''
_SET_LR = ("        lr = lr_at(step, max_lr, min_lr, warmup, steps)\n"
           "        for group in optimizer.param_groups:\n"
           "            group['lr'] = lr\n")


def _train(lr0="max_lr", eval_mode="        model.eval()\n", set_lr=_SET_LR, target="y",
           zero="        optimizer.zero_grad()\n") -> str:
    return _TRAIN.format(lr0=lr0, eval_mode=eval_mode, set_lr=set_lr, target=target, zero=zero)


MISTAKES = [
    # ---- GPT
    Mistake("GPT", "position embedding unused", _gpt(embed="tr.wte(idx)"), "no position embedding"),
    Mistake("GPT", "no position embedding at all", _gpt(wpe="", embed="tr.wte(idx)"), "no position embedding transformer.wpe"),
    Mistake("GPT", "untied head", _gpt(tie=""), "not tied to the token embedding"),
    Mistake("GPT", "final norm unused", _gpt(final="x"), "no final norm"),
    Mistake("GPT", "returns probabilities",
            _gpt().replace("return self.lm_head(tr.ln_f(x))",
                           "return torch.softmax(self.lm_head(tr.ln_f(x)), dim=-1)"),
            "returned probabilities"),
    Mistake("GPT", "long sequences not rejected", _gpt(check=""), "was not rejected by your code"),
    Mistake("GPT", "no transformer ModuleDict", _FLAT, "GPT has no attribute 'transformer'"),
    Mistake("GPT", "delegates to gptlab", '''
from gptlab.model import GPT as _GPT, GPTConfig

class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0):
        super().__init__()
        self.inner = _GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                                    n_head=n_head, n_embd=n_embd, dropout=dropout))

    def forward(self, idx):
        return self.inner(idx)[0]
''', "must be written by hand", delegation=True),
    # ---- count_params
    Mistake("count_params", "head counted twice", _count(total=_TOTAL + " + vocab_size * C"), "counted the output head"),
    Mistake("count_params", "biases forgotten", _count(block="2 * 2 * C + 3 * C * C + C * C + 4 * C * C + 4 * C * C"),
            "forgot the biases"),
    Mistake("count_params", "norms forgotten",
            _count(block="(3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)",
                   total="vocab_size * C + block_size * C + n_layer * per_block"), "forgot the layer norms"),
    Mistake("count_params", "final layer norm forgotten",
            _count(total="vocab_size * C + block_size * C + n_layer * per_block"), "forgot the final layer norm"),
    Mistake("count_params", "position embedding forgotten", _count(total="vocab_size * C + n_layer * per_block + 2 * C"),
            "forgot the position embedding"),
    Mistake("count_params", "builds gptlab's model", '''
import torch
from gptlab.model import GPT as _GPT, GPTConfig

def count_params(vocab_size, block_size, n_layer, n_embd):
    with torch.device("meta"):
        m = _GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=1, n_embd=n_embd))
    return m.num_params()
''', "must be written by hand", delegation=True),
    # ---- lr_at
    Mistake("lr_at", "warmup from zero", _lr(warm="max_lr * step / warmup"), "warmup starts at lr = 0"),
    Mistake("lr_at", "warmup one step short", _lr(warm="max_lr * (step + 1) / warmup"), "one step early"),
    Mistake("lr_at", "cosine to zero", _lr(decay="0.5 * (1.0 + math.cos(math.pi * progress)) * max_lr"),
            "decays to 0"),
    Mistake("lr_at", "progress over total", _lr(progress="(step - warmup) / total"),
            "does not reach min_lr at step total"),
    Mistake("lr_at", "decay starts at step 0", _lr(progress="step / total"), "decay starts at step 0"),
    Mistake("lr_at", "gptlab's schedule", '''
from gptlab.train import lr_at as _lr_at

def lr_at(step, max_lr, min_lr, warmup, total):
    return _lr_at(step, max_lr, min_lr, warmup, total)
''', "must be written by hand", delegation=True),
    # ---- train (the first entry is the one the tampering test uses: it fails in the probe)
    Mistake("train", "learning rate never warmed up", _train(lr0="0.0", set_lr="        lr = lr_at(step, max_lr, min_lr, warmup, steps)\n"),
            "never warmed up"),
    Mistake("train", "targets not shifted", _train(target="x"), "targets are not shifted"),
    Mistake("train", "no zero_grad", _train(zero=""), "gradients are never zeroed"),
    Mistake("train", "evaluation in train mode", _train(eval_mode=""), "evaluation ran in train mode"),
    Mistake("train", "gptlab's schedule", _train(set_lr=_SET_LR.replace("lr = lr_at(", "lr = _lr_at(")).replace(
        "def train(", "from gptlab.train import lr_at as _lr_at\n\ndef train(", 1), "must be written by hand", delegation=True),
]
