"""The kernel floor of one gpt2-124m bf16 training step on a GPU: each kernel a
step needs, timed alone in PyTorch with CUDA events (median of 20 after 5
warm-up runs, fresh random inputs), summed over the model's layers. A step
cannot run faster than this sum with these kernels; Trident's profiled step
(`--profile_step`) is read against it. Also measures the card's two ceilings:
a large bf16 matrix product and a device-to-device copy.

  python3 tools/gpu/kernel_floor.py --batch=32
Prints one row per kernel group (ms per step) and the total.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F


def timed(fn, runs=20, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def linear_ms(tokens, fan_in, fan_out, bias=True):
    """Forward x @ w.T (+ b), and backward's two products (and bias reduction)."""
    x = torch.randn(tokens, fan_in, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(fan_out, fan_in, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(fan_out, device="cuda", dtype=torch.bfloat16) if bias else None
    dy = torch.randn(tokens, fan_out, device="cuda", dtype=torch.bfloat16)
    forward = timed(lambda: F.linear(x, w, b))
    backward = timed(lambda: (dy @ w, dy.t() @ x, dy.sum(0) if bias else None))
    return forward, backward, 6.0 * tokens * fan_in * fan_out


def attention_ms(batch, heads, block, head_dim, backend):
    from torch.nn.attention import sdpa_kernel
    q, k, v = (torch.randn(batch, heads, block, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dy = torch.randn(batch, heads, block, head_dim, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(backend):
        forward = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        both = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                 (q, k, v), dy))
    return forward, both - forward


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    args = parser.parse_args()
    torch.manual_seed(0)
    n, c, tokens = args.n_layer, args.n_embd, args.batch * args.block
    print(torch.cuda.get_device_name(), "torch", torch.__version__)

    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / timed(lambda: big @ big) / 1e9
    blob = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    copy = 2 * blob.numel() * 4 / timed(lambda: blob.clone()) / 1e9  # bytes per ms / 1e9: TB/s
    del big, blob
    print(f"ceilings: bf16 8192^3 product {peak:.0f} TFLOP/s; copy {copy:.2f} TB/s (read + write)")

    rows = []
    flops = 0.0
    for name, fan_in, fan_out in (("qkv", c, 3 * c), ("attn proj", c, c), ("fc", c, 4 * c), ("mlp proj", 4 * c, c)):
        f, b, fl = linear_ms(tokens, fan_in, fan_out)
        rows.append((f"linear {name} fwd / bwd", n * f, n * b, n * fl))
        flops += n * fl
    f, b, fl = linear_ms(tokens, c, args.vocab, bias=False)
    rows.append(("head fwd / bwd (no bias)", f, b, fl))
    flops += fl
    from torch.nn.attention import SDPBackend
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            f, b = attention_ms(args.batch, args.n_head, args.block, c // args.n_head, backend)
            rows.append((f"attention {backend.name.lower()}", n * f, n * b, 0))
        except RuntimeError as error:
            print(f"attention {backend.name}: {str(error).splitlines()[0]}")

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, c, device="cuda", dtype=dtype, requires_grad=True)
        ln = torch.nn.LayerNorm(c, device="cuda", dtype=dtype)
        dy = torch.randn(tokens, c, device="cuda", dtype=dtype)
        f = timed(lambda: ln(x))
        both = timed(lambda: torch.autograd.grad(ln(x), (x, ln.weight, ln.bias), dy))
        rows.append((f"layer norm {str(dtype)[6:]} fwd / bwd x{2 * n + 1}", (2 * n + 1) * f, (2 * n + 1) * (both - f), 0))
    h = torch.randn(tokens, 4 * c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dh = torch.randn_like(h)
    f = timed(lambda: F.gelu(h, approximate="tanh"))
    both = timed(lambda: torch.autograd.grad(F.gelu(h, approximate="tanh"), h, dh))
    rows.append(("gelu tanh bf16 fwd / bwd", n * f, n * (both - f), 0))
    r = torch.randn(tokens, c, device="cuda")
    a = torch.randn(tokens, c, device="cuda", dtype=torch.bfloat16)
    f = timed(lambda: r + a)
    rows.append(("residual add fp32 + bf16 (x2 per layer)", 2 * n * f, 2 * n * f, 0))
    cast = timed(lambda: r.to(torch.bfloat16))
    rows.append(("cast fp32 -> bf16 of a residual (x2 per layer)", 2 * n * cast, 2 * n * cast, 0))
    logits = torch.randn(tokens, args.vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(args.vocab, (tokens,), device="cuda")
    f = timed(lambda: F.cross_entropy(logits.float(), target))
    both = timed(lambda: torch.autograd.grad(F.cross_entropy(logits.float(), target), logits))
    rows.append(("cross-entropy (PyTorch, fp32 upcast)", f, both - f, 0))
    del logits
    params = [torch.randn(c * 4 * c, device="cuda") for _ in range(124_000_000 // (4 * c * c))]
    grads = [torch.randn_like(p) for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    for p, g in zip(params, grads):
        p.grad = g
    rows.append(("fused AdamW, 124M fp32 parameters", 0, timed(opt.step), 0))

    print(f"{'kernel group (ms per step, batch %d)' % args.batch:<52} {'fwd':>8} {'bwd':>8}")
    for name, f, b, _ in rows:
        print(f"{name:<52} {f:8.2f} {b:8.2f}")
    product = sum(f + b for name, f, b, _ in rows if name.startswith(("linear", "head")))
    print(f"products: {flops / 1e12:.1f} TFLOP in {product:.1f} ms = {flops / product / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
