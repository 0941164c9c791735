"""The same GPT as Trident's `gpt` model, trained in PyTorch eager mode: the peer
that benchmarks/peer/compare.sh measures `train` against.

Run with Debian's python3-torch (the same LibTorch build the C++ side links):
  /usr/bin/python3 gpt_eager.py --data=DIR --threads=1 --steps=60
On a GPU (tools/gpu/validate.sh), gpt2-124m in bf16 autocast:
  python3 gpt_eager.py --data=DIR --device=cuda --precision=bf16 --vocab=50257 \
    --n_layer=12 --n_head=12 --n_embd=768 --block=1024 --batch=8 --attention=sdpa
Prints one line: "tokens_per_s <median over the steps after warm-up>".
"""
import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, n_embd, n_head, sdpa):
        super().__init__()
        self.n_head = n_head
        self.sdpa = sdpa
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.sdpa:  # PyTorch 2's fused (flash) attention
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, n_embd, sdpa=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, sdpa) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--attention", choices=["manual", "sdpa"], default="manual")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    tokens = np.memmap(f"{args.data}/train.bin", dtype=np.uint16, mode="r")
    model = GPT(args.vocab, args.block, args.n_layer, args.n_head, args.n_embd,
                args.attention == "sdpa").to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
        **({"fused": True} if device.type == "cuda" else {"foreach": True}))
    samples = (len(tokens) - 1) // args.block
    rates = []
    for step in range(args.steps):
        start = time.perf_counter()
        rows = [((step * args.batch + j) % samples) * args.block for j in range(args.batch)]
        chunk = np.stack([tokens[r:r + args.block + 1] for r in rows]).astype(np.int64)
        x = torch.from_numpy(chunk[:, :-1]).to(device)
        y = torch.from_numpy(chunk[:, 1:]).to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss.item()
        if step >= args.warmup:
            rates.append(args.batch * args.block / (time.perf_counter() - start))
    print(f"tokens_per_s {statistics.median(rates):.1f}")


if __name__ == "__main__":
    main()
