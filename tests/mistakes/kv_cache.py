"""Mistakes learners make in the ``kv_cache`` assignment, as the code they would write."""

from . import Mistake

NO_DELEGATION = {
    "cached_attention_step": "the attention itself may come from gptlab (chapter 3); the task is the cache update "
                             "and the unmasked single query, which have no reference to call instead",
}

_CACHE = '''
class KVCache:
    def __init__(self):
        self.k = None
        self.v = None

    def update(self, k, v):
        if self.k is None:
            self.k, self.v = k, v
        else:
{body}
        return {ret}
'''


def _cache(body: str, ret: str = "self.k, self.v") -> str:
    return _CACHE.format(body=body, ret=ret)


_GEN = '''
def generate_cached(model, idx, n):
    tr, C, nh = model.transformer, model.config.n_embd, model.config.n_head
    caches = [KVCache() for _ in tr.h]
    out, new, start = idx, idx, 0
    with torch.no_grad():
        for _ in range(n):
            T = new.shape[1]
            x = tr.wte(new) + tr.wpe(torch.arange({positions}))
            mask = {mask}
            for block, cache in zip(tr.h, caches):
                q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
                q, k, v = split_heads(q, nh), split_heads(k, nh), split_heads(v, nh)
{attend}
                x = x + block.attn.c_proj(merge_heads(y))
                x = x + block.mlp(block.ln_2(x))
            nxt = model.lm_head(tr.ln_f(x[:, -1])).argmax(dim=-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            new, start = nxt, start + T
    return out
'''
_ATTEND = "                k_all, v_all = cache.update(k, v)\n                y = attention(q, k_all, v_all, mask)"


def _gen(positions="start, start + T", mask="causal_mask(T) if T > 1 else None", attend=_ATTEND) -> str:
    return _GEN.format(positions=positions, mask=mask, attend=attend)


_STEP = "def cached_attention_step(q, cache, k_new, v_new):\n{}\n"
_BYTES = "def kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem):\n    return {}\n"

MISTAKES = [
    # ---- KVCache
    Mistake("KVCache", "heads axis",
            _cache("            self.k = torch.cat([self.k, k], dim=1)\n            self.v = torch.cat([self.v, v], dim=1)"),
            "heads axis"),
    Mistake("KVCache", "last axis",
            _cache("            self.k = torch.cat([self.k, k], dim=-1)\n            self.v = torch.cat([self.v, v], dim=-1)"),
            "last axis"),
    Mistake("KVCache", "overwrites",
            _cache("            self.k, self.v = k, v"), "only the new chunk"),
    Mistake("KVCache", "returns before appending",
            "class KVCache:\n    def __init__(self):\n        self.k = None\n        self.v = None\n\n"
            "    def update(self, k, v):\n        if self.k is None:\n            self.k, self.v = k, v\n            return k, v\n"
            "        old = (self.k, self.v)\n        self.k = torch.cat([self.k, k], dim=2)\n"
            "        self.v = torch.cat([self.v, v], dim=2)\n        return old\n",
            "BEFORE this call"),
    Mistake("KVCache", "returns the concatenation without storing it",
            _cache("            return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)"),
            "never stores it"),
    Mistake("KVCache", "values and keys swapped",
            _cache("            self.k = torch.cat([self.k, k], dim=2)\n            self.v = torch.cat([self.v, v], dim=2)",
                   ret="self.v, self.k"),
            "return the keys first"),
    Mistake("KVCache", "returns one tensor",
            _cache("            self.k = torch.cat([self.k, k], dim=2)\n            self.v = torch.cat([self.v, v], dim=2)",
                   ret="torch.stack([self.k, self.v])"),
            "should return a pair"),
    Mistake("KVCache", "wraps gptlab's cache",
            "from gptlab.kvcache import ConcatKVCache\n\nclass KVCache:\n    def __init__(self):\n"
            "        self.inner = ConcatKVCache(1)\n\n    def update(self, k, v):\n"
            "        k_all, v_all, _ = self.inner.update(0, k, v)\n        return k_all, v_all\n",
            "must be written by hand", delegation=True),
    # ---- cached_attention_step
    Mistake("cached_attention_step", "attends before the update",
            _STEP.format("    k_old, v_old = cache.update(k_new[:, :, :0], v_new[:, :, :0])\n"
                         "    y = attention(q, k_old, v_old)\n    cache.update(k_new, v_new)\n    return y"),
            "called cache.update 2 times"),
    Mistake("cached_attention_step", "causal mask sliced from the top",
            _STEP.format("    k_all, v_all = cache.update(k_new, v_new)\n    S = k_all.shape[2]\n"
                         "    mask = causal_mask(S)[:1]\n    return attention(q, k_all, v_all, mask)"),
            "see only the first cached key"),
    Mistake("cached_attention_step", "only its own key",
            _STEP.format("    cache.update(k_new, v_new)\n    return attention(q, k_new, v_new)"),
            "only to the new token's own key"),
    Mistake("cached_attention_step", "no scaling",
            _STEP.format("    k_all, v_all = cache.update(k_new, v_new)\n"
                         "    w = torch.softmax(q @ k_all.transpose(-2, -1), dim=-1)\n    return w @ v_all"),
            "divide the scores by sqrt(d)"),
    Mistake("cached_attention_step", "softmax over the query",
            _STEP.format("    k_all, v_all = cache.update(k_new, v_new)\n"
                         "    s = q @ k_all.transpose(-2, -1) / q.shape[-1] ** 0.5\n"
                         "    return torch.softmax(s, dim=-2) @ v_all"),
            "over the query axis"),
    Mistake("cached_attention_step", "forgets the cache",
            _STEP.format("    return attention(q, k_new, v_new)"), "never called cache.update"),
    # ---- generate_cached
    Mistake("generate_cached", "positions restart at 0", _gen(positions="T"), "positions restart at 0"),
    Mistake("generate_cached", "one new token sees position 0 only",
            _gen(mask="causal_mask(T) if T > 1 else causal_mask(start + 1)[:1]"), "see only the first key"),
    Mistake("generate_cached", "attends before updating",
            _gen(attend="                if cache.k is None:\n                    k_att, v_att = cache.update(k, v)\n"
                        "                else:\n                    k_att, v_att = cache.k, cache.v\n"
                        "                    cache.update(k, v)\n                y = attention(q, k_att, v_att, mask)"),
            "BEFORE adding its own key"),
    Mistake("generate_cached", "prefill without a causal mask", _gen(mask="None"), "without a causal mask"),
    Mistake("generate_cached", "recomputes everything (no cache)",
            _gen(positions="0, out.shape[1]", mask="causal_mask(out.shape[1])",
                 attend="                y = attention(q, k, v, mask)").replace("x = tr.wte(new)", "x = tr.wte(out)"),
            "recomputes the prefix"),
    Mistake("generate_cached", "calls the model",
            "def generate_cached(model, idx, n):\n    out = idx\n    for _ in range(n):\n"
            "        logits, _ = model(out)\n        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], 1)\n"
            "    return out\n",
            "must be written by hand", delegation=True),
    Mistake("generate_cached", "calls gptlab.generate",
            "import gptlab\n\ndef generate_cached(model, idx, n):\n    return gptlab.generate(model, idx, n, temperature=0.0)\n",
            "gptlab.generate", delegation=True),
    # ---- kv_cache_bytes
    Mistake("kv_cache_bytes", "keys only", _BYTES.format("n_layer * n_kv_head * head_dim * seq_len * batch * bytes_per_elem"),
            "keys only"),
    Mistake("kv_cache_bytes", "elements, not bytes", _BYTES.format("2 * n_layer * n_kv_head * head_dim * seq_len * batch"),
            "not bytes"),
    Mistake("kv_cache_bytes", "no batch", _BYTES.format("2 * n_layer * n_kv_head * head_dim * seq_len * bytes_per_elem"),
            "left out the batch"),
    Mistake("kv_cache_bytes", "no layers", _BYTES.format("2 * n_kv_head * head_dim * seq_len * batch * bytes_per_elem"),
            "left out the layers"),
    Mistake("kv_cache_bytes", "float result",
            _BYTES.format("2.0 * n_layer * n_kv_head * head_dim * seq_len * batch * bytes_per_elem"), "return an int"),
    Mistake("kv_cache_bytes", "calls gptlab",
            "from gptlab import kvcache\n\ndef kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem):\n"
            "    return kvcache.kv_cache_bytes(n_layer, n_kv_head, head_dim, seq_len, batch, bytes_per_elem)\n",
            "must be written by hand", delegation=True),
]
