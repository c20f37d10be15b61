"""eqgpt against PyTorch eager: training-step time of the same GPT, in alternating runs.

The PyTorch model is written here, layer for layer the model eqgpt builds: learned
positions, pre-LayerNorm blocks without biases, causal softmax attention written
out (scores, mask, fp32 softmax, weighted sum: the algorithm of eqgpt's `reference`
kernel; `--sdpa` uses `torch.nn.functional.scaled_dot_product_attention` instead),
a tanh-GELU MLP, a tied head, fp32 cross-entropy, global-norm clipping at 1 and
AdamW with decay on matrices only. eqgpt runs `make_train_step` with its
`reference` kernel and its layers unrolled, as the recipe runs them
(`GPTConfig.scan_layers=False`; `--scan-layers` times the scanned layers instead).

Each measurement is a fresh process (eqgpt, then PyTorch, then eqgpt, ...), so
neither's thread pool disturbs the other; each times `--steps` steps after two
warm-up steps and reports the median. The ratio is eqgpt / PyTorch per pair, and
the table shows the median of the pairs (3 by default).

Needs PyTorch: `pip install 'eqgpt[bench]'`. Without it the script says so and exits 0.
Run: `python benchmarks/vs_pytorch.py [--sizes issue,nano] [--pairs 3] [--steps 5] [--glibc-tunables]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from eqgpt.launch import GLIBC_MALLOC_TUNABLES

# name -> (layers, heads, embed, seq, batch, vocab)
SIZES = {
    "issue": (4, 4, 256, 256, 8, 256),   # the configuration of the speed issue
    "nano": (4, 4, 128, 128, 32, 256),   # the default recipe's model and batch
    "wide": (4, 8, 512, 256, 8, 256),
    "deep": (8, 4, 256, 256, 8, 256),
}


def time_steps(step, steps: int) -> tuple[float, float]:
    """Median wall seconds of `steps` calls of `step()` after two warm-up calls, and mean CPU seconds
    (user + system, all threads of the process) per call."""
    step()
    step()
    times = []
    cpu0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), (time.process_time() - cpu0) / steps


def run_eqgpt(size, steps: int, cache_dir: str, scan_layers: bool) -> tuple[float, float]:
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    import eqgpt
    from eqgpt.data.batch import Batch
    from eqgpt.nn import GPT
    from eqgpt.train import Strategy, TrainState, make_optimizer, make_train_step

    layers, heads, embed, seq, batch, vocab = size
    cfg = eqgpt.GPTConfig(vocab_size=vocab, seq_len=seq, num_layers=layers, num_heads=heads, embed_dim=embed,
                          use_bias=False, tie_embeddings=True, attention_kernel="reference",
                          scan_layers=scan_layers)
    strategy = Strategy()
    opt = make_optimizer(1e-3, weight_decay=0.1, clip_norm=1.0)
    model = strategy.init_model(lambda k: GPT(cfg, key=k), jax.random.key(0))
    box = [TrainState(model, strategy.init_opt_state(opt, model), rng=jax.random.key(1))]
    step = make_train_step(opt)
    rng = np.random.default_rng(0)
    batches = [strategy.batch(Batch.from_windows(rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)))
               for _ in range(4)]
    i = [0]

    def one():
        box[0], metrics = step(box[0], batches[i[0] % 4])
        i[0] += 1
        jax.block_until_ready(metrics)

    return time_steps(one, steps)


def torch_model(size, sdpa: bool):
    import torch
    import torch.nn.functional as F
    from torch import nn

    layers, heads, embed, seq, batch, vocab = size

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(embed, embed, bias=False) for _ in range(4))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (p(x).view(b, t, heads, d // heads).transpose(1, 2) for p in (self.q, self.k, self.v))
            if sdpa:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
                o = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
            return self.o(o.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(embed, bias=False), nn.LayerNorm(embed, bias=False)
            self.attn = Attention()
            self.up, self.down = nn.Linear(embed, 4 * embed, bias=False), nn.Linear(4 * embed, embed, bias=False)

        def forward(self, x):
            x = x + self.attn(self.n1(x))
            return x + self.down(F.gelu(self.up(self.n2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, embed), nn.Embedding(seq, embed)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(embed, bias=False)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.01 if name.startswith("pos") else 0.02
                    if name.endswith(("o.weight", "down.weight")):
                        std /= math.sqrt(2 * layers)
                    nn.init.normal_(p, std=std)

        def forward(self, tokens, targets):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            logits = self.norm(x) @ self.tok.weight.T  # the tied head
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return GPT()


def run_torch(size, steps: int, sdpa: bool) -> tuple[float, float]:
    import torch

    torch.manual_seed(0)
    layers, heads, embed, seq, batch, vocab = size
    model = torch_model(size, sdpa)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok", "pos"))]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("tok", "pos")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    rng = np.random.default_rng(0)
    windows = [torch.from_numpy(rng.integers(0, vocab, (batch, seq + 1)).astype(np.int64)) for _ in range(4)]
    i = [0]

    def one():
        w = windows[i[0] % 4]
        i[0] += 1
        opt.zero_grad(set_to_none=True)
        loss = model(w[:, :-1], w[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()

    return time_steps(one, steps)


def worker(args) -> None:
    size = SIZES[args.size]
    if args.worker == "eqgpt":
        seconds, cpu = run_eqgpt(size, args.steps, args.cache_dir, args.scan_layers)
    else:
        seconds, cpu = run_torch(size, args.steps, args.sdpa)
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu}))


def measure(which: str, size: str, args, cache_dir: str) -> tuple[float, float]:
    cmd = ([sys.executable, __file__, "--worker", which, "--size", size, "--steps", str(args.steps),
            "--cache-dir", cache_dir] + (["--sdpa"] if args.sdpa else [])
           + (["--scan-layers"] if args.scan_layers else []))
    env = dict(os.environ)
    if args.glibc_tunables:  # the allocator settings for both frameworks (docs/profiling_results.md, "Page faults")
        env["GLIBC_TUNABLES"] = GLIBC_MALLOC_TUNABLES
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode:
        raise RuntimeError(f"{which} worker failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["seconds"], result["cpu_seconds"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="issue,nano", help=f"comma-separated, from {sorted(SIZES)}")
    p.add_argument("--pairs", type=int, default=3, help="alternating eqgpt/PyTorch pairs per size")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (after 2 warm-up steps)")
    p.add_argument("--sdpa", action="store_true", help="PyTorch attention by scaled_dot_product_attention")
    p.add_argument("--scan-layers", action="store_true", help="eqgpt's layers as one lax.scan (default: unrolled)")
    p.add_argument("--glibc-tunables", action="store_true",
                   help="run both workers with the malloc settings train_gpt.py uses (keep freed memory mapped)")
    p.add_argument("--worker", choices=("eqgpt", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed, so there is nothing to compare against: "
              "pip install 'eqgpt[bench]' (or torch) and run again.")
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    print(f"PyTorch {torch.__version__} ({torch.get_num_threads()} threads), attention "
          f"{'SDPA' if args.sdpa else 'written out'}; eqgpt layers {'scanned' if args.scan_layers else 'unrolled'}; "
          f"{args.pairs} alternating pairs, median of {args.steps} steps "
          f"each; load average {os.getloadavg()[0]:.1f}; GLIBC_TUNABLES {'set' if args.glibc_tunables else 'unset'}")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:  # eqgpt compiles once per size, then reads the cache
        for size in sizes:
            eq, pt, eq_cpu, pt_cpu = [], [], [], []
            for _ in range(args.pairs):
                for which, wall, cpu in (("eqgpt", eq, eq_cpu), ("torch", pt, pt_cpu)):
                    w, c = measure(which, size, args, cache_dir)
                    wall.append(w)
                    cpu.append(c)
            ratios = [a / b for a, b in zip(eq, pt, strict=True)]
            cpu_ratio = float(np.median([a / b for a, b in zip(eq_cpu, pt_cpu, strict=True)]))
            rows.append((size, SIZES[size], np.median(eq), np.median(pt), np.median(ratios), min(ratios), max(ratios),
                         cpu_ratio))
            print(f"  {size}: eqgpt {[round(x * 1e3) for x in eq]} ms (CPU {[round(x * 1e3) for x in eq_cpu]}), "
                  f"PyTorch {[round(x * 1e3) for x in pt]} ms (CPU {[round(x * 1e3) for x in pt_cpu]})", flush=True)
    print()
    print(f"{'size':<6} {'L':>2} {'H':>2} {'D':>4} {'T':>4} {'B':>3}  {'eqgpt ms':>9} {'torch ms':>9} "
          f"{'eqgpt/torch':>11} {'(min-max)':>12} {'CPU-time ratio':>14}")
    for size, (layers, heads, embed, seq, batch, _), eq, pt, r, lo, hi, cr in rows:
        print(f"{size:<6} {layers:>2} {heads:>2} {embed:>4} {seq:>4} {batch:>3}  {eq * 1e3:9.0f} {pt * 1e3:9.0f} "
              f"{r:11.2f} {f'({lo:.2f}-{hi:.2f})':>12} {cr:14.2f}")
    print("\neqgpt/torch: wall-time ratio per pair, median; CPU-time ratio: user + system seconds per step "
          "(both use every core: on a busy machine the wall ratio moves with the load, the CPU ratio less).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
