"""A nanoGPT-style model written in Python, for Trident's TorchScript tests.

  torchscript_gpt.py save OUT.pt [llama]    traces the model (fixed seed) and saves it; with
                                            `llama`, a Llama-style model (RMSNorm, rotary
                                            embeddings, grouped-query attention, SwiGLU)
  torchscript_gpt.py save_logits OUT.pt     the same model returning only logits (forward(idx))
  torchscript_gpt.py save_branching OUT.pt  a scripted model whose control flow reads its data
  torchscript_gpt.py train OUT.pt DATA_DIR STEPS [llama|untied] > losses.txt
                                            trains the same module eagerly with Trident's
                                            recipe and prints one loss per step; with
                                            `untied`, the GPT's head starts as a copy of
                                            the embedding and trains on its own
  torchscript_gpt.py tied|untied EXPORT.safetensors
                                            checks the exported head and embedding are
                                            equal (tied) or not (untied)
  torchscript_gpt.py compare A.safetensors B.safetensors
                                            checks two exports hold the same tensors (1e-5)

The recipe matches `train --noshuffle` with the flags in torchscript_test.sh:
global batch 8, AdamW (betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices
only), warmup then cosine decay, global-norm clipping at 1.0.
"""
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 256, 16, 32, 4, 2
KV_HEADS = 2  # the Llama model's key/value heads
BATCH, LR, MIN_LR, WARMUP = 8, 3e-3, 1e-4, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)
        self.ln_2 = nn.LayerNorm(EMBD)
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.mlp_proj = nn.Linear(4 * EMBD, EMBD)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // HEADS))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(BLOCK, EMBD),
            h=nn.ModuleList([Block() for _ in range(LAYERS)]), ln_f=nn.LayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    def forward(self, idx, targets):
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss  # nanoGPT's convention: the loss is the scalar output


class LogitsOnly(GPT):
    def forward(self, idx):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(0, idx.size(1), dtype=torch.long))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(EMBD))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        dim = EMBD // HEADS
        self.attention_norm = RMSNorm()
        self.wq = nn.Linear(EMBD, EMBD, bias=False)
        self.wk = nn.Linear(EMBD, KV_HEADS * dim, bias=False)
        self.wv = nn.Linear(EMBD, KV_HEADS * dim, bias=False)
        self.wo = nn.Linear(EMBD, EMBD, bias=False)
        self.ffn_norm = RMSNorm()
        self.w1 = nn.Linear(EMBD, 3 * EMBD, bias=False)
        self.w3 = nn.Linear(EMBD, 3 * EMBD, bias=False)
        self.w2 = nn.Linear(3 * EMBD, EMBD, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x, cos, sin):
        B, T, C = x.size()
        dim = C // HEADS
        h = self.attention_norm(x)
        q = rotate(self.wq(h).view(B, T, HEADS, dim).transpose(1, 2), cos, sin)
        k = rotate(self.wk(h).view(B, T, KV_HEADS, dim).transpose(1, 2), cos, sin)
        v = self.wv(h).view(B, T, KV_HEADS, dim).transpose(1, 2)
        # grouped-query attention as Hugging Face's repeat_kv writes it
        k = k[:, :, None, :, :].expand(B, KV_HEADS, HEADS // KV_HEADS, T, dim).reshape(B, HEADS, T, dim)
        v = v[:, :, None, :, :].expand(B, KV_HEADS, HEADS // KV_HEADS, T, dim).reshape(B, HEADS, T, dim)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(dim)
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.wo(y)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, EMBD)
        self.layers = nn.ModuleList([LlamaBlock() for _ in range(LAYERS)])
        self.norm = RMSNorm()
        self.output = nn.Linear(EMBD, VOCAB, bias=False)
        dim = EMBD // HEADS
        angles = torch.arange(BLOCK).float()[:, None] * (10000.0 ** (-torch.arange(0, dim, 2).float() / dim))
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.cos[:T], self.sin[:T])
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBD)
        self.head = nn.Linear(EMBD, VOCAB)

    def forward(self, idx, targets):
        x = self.embed(idx)
        if x.sum() > 0:  # decided by the data: a trace would record one branch
            x = torch.relu(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(arch="gpt"):
    torch.manual_seed(1234)
    return Llama() if arch == "llama" else GPT()


def save(path, arch):
    model = build(arch)
    example = (torch.zeros(2, BLOCK, dtype=torch.long), torch.zeros(2, BLOCK, dtype=torch.long))
    torch.jit.trace(model, example, check_trace=False).save(path)


def learning_rate(step, max_steps):
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / (max_steps - WARMUP))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def train(path, data_dir, steps, arch, untied):
    torch.set_num_threads(1)
    model = build(arch)  # the module Trident loads (traced from these weights), run eagerly
    if untied:  # Merak's no_tie_modules: the head gets its own matrix, from the tied values
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    tokens = np.fromfile(f"{data_dir}/train.bin", dtype="<u2").astype(np.int64)
    samples = (len(tokens) - 1) // BLOCK
    params = list(model.parameters())  # tied weights listed once
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": other, "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for step in range(steps):
        index = [(step * BATCH + j) % samples for j in range(BATCH)]
        x = torch.tensor(np.stack([tokens[k * BLOCK:(k + 1) * BLOCK] for k in index]))
        y = torch.tensor(np.stack([tokens[k * BLOCK + 1:(k + 1) * BLOCK + 1] for k in index]))
        optimizer.zero_grad()
        loss = model(x, y)
        loss = loss[1] if isinstance(loss, tuple) else loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        optimizer.step()
        print(repr(loss.item()))


def read_safetensors(path):
    """name -> raw bytes of each tensor (fp32 in these tests), and the header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    return {name: data[slice(*entry["data_offsets"])] for name, entry in header.items()
            if name != "__metadata__"}, header


def tied(path, expect_equal):
    tensors, _ = read_safetensors(path)
    equal = tensors["lm_head.weight"] == tensors["transformer.wte.weight"]
    assert equal == expect_equal, "tied weights differ" if expect_equal else "untied weights are equal"
    print("tied weights equal" if equal else "untied weights differ")


def compare(path_a, path_b):
    (a, header_a), (b, header_b) = read_safetensors(path_a), read_safetensors(path_b)
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for name in a:
        assert header_a[name]["shape"] == header_b[name]["shape"], name
        x, y = np.frombuffer(a[name], dtype="<f4"), np.frombuffer(b[name], dtype="<f4")
        worst = np.abs(x - y).max() / max(1.0, np.abs(x).max())
        assert worst <= 1e-5, (name, worst)
    print(f"{len(a)} tensors equal")


if __name__ == "__main__":
    command = sys.argv[1]
    arch = sys.argv[-1] if sys.argv[-1] == "llama" else "gpt"
    if command == "save":
        save(sys.argv[2], arch)
    elif command == "save_logits":
        torch.manual_seed(1234)
        torch.jit.trace(LogitsOnly(), (torch.zeros(2, BLOCK, dtype=torch.long),), check_trace=False).save(sys.argv[2])
    elif command == "save_branching":
        torch.jit.script(Branching()).save(sys.argv[2])
    elif command == "train":
        train(sys.argv[2], sys.argv[3], int(sys.argv[4]), arch, sys.argv[-1] == "untied")
    elif command == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        tied(sys.argv[2], command == "tied")
