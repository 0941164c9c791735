"""A Llama written in Python the way Hugging Face's modeling_llama writes it
(RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, untied head, the
loss inside forward), traced and saved with torch.jit.save: what a user hands
`train --model=torchscript:PATH`. Its shape is the zoo's preset of the same
name, so Trident's setup of the two can be compared.

  python3 python_llama.py OUT.pt [PRESET] [BLOCK] [VOCAB]
  python3 python_llama.py /tmp/llama.pt llama-1b 128 256
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

# layers, heads, width, key/value heads, MLP width (models/models.cc's presets)
PRESETS = {
    "llama-tiny": (4, 4, 256, 2, 688),
    "llama-160m": (12, 12, 768, 4, 2048),
    "llama-1b": (22, 32, 2048, 4, 5632),
    "llama-3b": (28, 24, 3072, 8, 8192),
}


class RMSNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.dim, bias=False)
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        q = rotate(self.q_proj(x).view(B, T, self.heads, self.dim).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(B, T, self.kv_heads, self.dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k = k[:, :, None].expand(B, self.kv_heads, repeat, T, self.dim).reshape(B, self.heads, T, self.dim)
        v = v[:, :, None].expand(B, self.kv_heads, repeat, T, self.dim).reshape(B, self.heads, T, self.dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True) if hasattr(F, "scaled_dot_product_attention") \
            else self.attend(q, k, v, T)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    def attend(self, q, k, v, T):
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.dim)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        return F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v


class MLP(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, width, heads, kv_heads, hidden):
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = Attention(width, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, layers, heads, width, kv_heads, hidden, vocab, block):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList([DecoderLayer(width, heads, kv_heads, hidden) for _ in range(layers)])
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        dim = width // heads
        angles = torch.arange(block).float()[:, None] * (10000.0 ** (-torch.arange(0, dim, 2).float() / dim))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    out = sys.argv[1]
    preset = sys.argv[2] if len(sys.argv) > 2 else "llama-1b"
    block = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    vocab = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    torch.manual_seed(0)
    with torch.no_grad():
        model = Llama(*PRESETS[preset], vocab, block)
        example = (torch.zeros(1, block, dtype=torch.long), torch.zeros(1, block, dtype=torch.long))
        torch.jit.trace(model, example, check_trace=False).save(out)
    print(f"{out}: {preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, block {block}")


if __name__ == "__main__":
    main()
