"""Independent references: plain NumPy (float64) definitions from the papers.

Nothing here imports eqgpt or follows its code; `tests/test_references.py` checks
eqgpt against these. Each function states the definition it implements.
"""

from __future__ import annotations

import math

import numpy as np

# ----------------------------------------------------------------------------- masks
# Each mask is a boolean array `[q, k]` (or `[batch, q, k]`): True where query
# position i may attend key position j. Combine them with `&`.


def causal_mask(q_pos, k_pos):
    """Causal (GPT): j <= i."""
    i, j = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
    return j <= i


def sliding_window_mask(q_pos, k_pos, window: int):
    """Sliding window (Longformer/Mistral): the last `window` keys, i - window < j <= i."""
    i, j = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
    return (i - window < j) & (j <= i)


def document_mask(q_seg, k_seg):
    """Packed documents: same segment id. `[batch, q]`, `[batch, k]` -> `[batch, q, k]`."""
    return np.asarray(q_seg)[:, :, None] == np.asarray(k_seg)[:, None, :]


# ------------------------------------------------------------------------- attention


def _expand_kv(x, heads: int):
    """GQA: kv head `g` serves query heads `g * r .. g * r + r - 1`, `r = heads // kv_heads`
    (each kv head repeated `r` times in place, as `repeat_interleave`)."""
    return np.repeat(x, heads // x.shape[2], axis=2)


def _mask_bhts(mask, b: int):
    mask = np.asarray(mask, bool)
    return np.broadcast_to(mask if mask.ndim == 3 else mask[None], (b, *mask.shape[-2:]))[:, None]


def attention(q, k, v, mask, scale=None):
    """`softmax(q k^T * scale, masked) v` per head, in float64.

    `q: [b, t, h, d]`, `k, v: [b, s, g, d]` with `h % g == 0` (GQA); `mask: [t, s]` or
    `[b, t, s]`; `scale` defaults to `d ** -0.5`. A query with no allowed key gets zeros.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    h, d = q.shape[2], q.shape[3]
    scale = d**-0.5 if scale is None else scale
    probs = _probs(q, _expand_kv(k, h), _mask_bhts(mask, q.shape[0]), scale)
    return np.einsum("bhts,bshd->bthd", probs, _expand_kv(v, h))


def _probs(q, k, mask, scale):
    s = np.einsum("bthd,bshd->bhts", q, k) * scale
    s = np.where(mask, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def attention_grads(q, k, v, mask, d_out, scale=None):
    """Gradients `(dq, dk, dv)` of `sum(attention(q, k, v, mask) * d_out)`, float64.

    The softmax backward: with `P` the probabilities and `dP = dO V^T`,
    `dS = P * (dP - rowsum(P * dP))`; `dQ = dS K scale`, `dK = dS^T Q scale`,
    `dV = P^T dO`. A kv head's gradient sums those of the query heads it serves.
    """
    q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
    b, _, h, d = q.shape
    g = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    p = _probs(q, ke, _mask_bhts(mask, b), scale)
    dv = np.einsum("bhts,bthd->bshd", p, d_out)
    dp = np.einsum("bthd,bshd->bhts", d_out, ve)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, ke) * scale
    dk = np.einsum("bhts,bthd->bshd", ds, q) * scale

    def fold(x):  # [b, s, h, d] -> [b, s, g, d]: sum the query heads sharing a kv head
        return x.reshape(x.shape[0], x.shape[1], g, h // g, d).sum(axis=3)

    return dq, fold(dk), fold(dv)


# ----------------------------------------------------------------------- MoE router


def softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def logsumexp(x, axis=-1):
    x = np.asarray(x, np.float64)
    top = np.max(x, axis=axis, keepdims=True)
    return np.log(np.sum(np.exp(x - top), axis=axis)) + np.squeeze(top, axis)


def top_k_experts(router_logits, k: int):
    """Each token's `k` experts by descending router probability, `[..., k]`."""
    return np.argsort(-np.asarray(router_logits, np.float64), axis=-1, kind="stable")[..., :k]


def load_balancing_loss(router_logits, k: int, convention: str = "assignments"):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4), `E * sum_e f_e P_e`,
    for each sequence of `router_logits: [batch, seq, E]`, then averaged over sequences.

    `P_e`: the mean over the sequence's tokens of the router probability of expert `e`.
    `f_e` depends on `convention`:

    - "top1" (the paper, top-1 routing): the fraction of tokens whose argmax is `e`.
    - "assignments" (eqgpt's stated convention for top-k, `MoEStats.balance`): the
      fraction of all `seq * k` top-k assignments that go to `e`, so `sum_e f_e = 1`
      and perfect balance gives 1 for any `k` (not `k`, as HF's Mixtral loss gives).
      With `k = 1` the two agree.

    Scope: `f` and `P` per sequence, the loss averaged over sequences, as eqgpt states
    (`MoEStats.balance`). The paper takes them over the whole batch; pass the batch as
    one sequence (`[1, batch * seq, E]`) for that. The two differ unless the sequences
    route alike.
    """
    logits = np.asarray(router_logits, np.float64)
    b, t, e = logits.shape
    probs = softmax(logits)
    chosen = top_k_experts(logits, 1 if convention == "top1" else k)
    if convention not in ("top1", "assignments"):
        raise ValueError(convention)
    counts = np.stack([np.bincount(chosen[i].reshape(-1), minlength=e) for i in range(b)])
    f = counts / chosen[0].size
    p = probs.mean(axis=1)
    return float(np.mean(e * np.sum(f * p, axis=-1)))


def router_z_loss(router_logits):
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over tokens of
    `logsumexp(router logits)^2`."""
    lse = logsumexp(router_logits)
    return float(np.mean(lse**2))


def expert_capacity(seq: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert and sequence: `ceil(capacity_factor * seq * k / num_experts)`."""
    return math.ceil(capacity_factor * seq * k / num_experts)


def capacity_kept(experts, num_experts: int, capacity: int):
    """Which assignments get a slot, `[batch, seq, k]` bool, given each token's chosen
    experts `[batch, seq, k]` (choice rank along the last axis).

    Per sequence, assignments are served one at a time: all first choices in order of
    position, then all second choices, and so on; an assignment is kept while its expert
    has served fewer than `capacity`, else dropped.
    """
    experts = np.asarray(experts)
    b, t, k = experts.shape
    kept = np.zeros(experts.shape, bool)
    for row in range(b):
        served = np.zeros(num_experts, int)
        for rank in range(k):
            for pos in range(t):
                e = experts[row, pos, rank]
                if served[e] < capacity:
                    kept[row, pos, rank] = True
                    served[e] += 1
    return kept


def gelu_tanh(x):
    """GELU, tanh approximation (Hendrycks & Gimpel 2016): `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def moe_output(x, router, up, down, k: int, kept=None, renormalize: bool = True):
    """Top-k MoE layer (Shazeer et al. 2017; Mixtral's renormalised weights), float64:
    `y_t = sum over kept choices r of w_{t,r} * down_e(gelu(up_e(x_t)))`, `e` the r-th choice,
    `w` the chosen router probabilities (divided by their sum when `renormalize`).

    `x: [b, t, d]`, `router: [d, E]`, `up: [E, d, f]`, `down: [E, f, d]`, `kept: [b, t, k]`
    (default: all kept, dropless).
    """
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router, np.float64)
    probs = softmax(logits)
    chosen = top_k_experts(logits, k)
    w = np.take_along_axis(probs, chosen, axis=-1)
    if renormalize and k > 1:
        w = w / w.sum(axis=-1, keepdims=True)
    if kept is not None:
        w = w * kept
    up, down = np.asarray(up, np.float64), np.asarray(down, np.float64)
    every = np.einsum("efd,btef->bted", down, gelu_tanh(np.einsum("btd,edf->btef", x, up)))  # [b, t, E, d]
    return np.einsum("btkd,btk->btd", np.take_along_axis(every, chosen[..., None], axis=2), w)


# --------------------------------------------------------------------- cross-entropy


def cross_entropy(logits, targets, loss_mask=None, z_weight: float = 0.0):
    """Masked mean of `nll + z_weight * lse^2` over positions (PaLM's z-loss), float64.

    `nll = lse(logits) - logits[target]`. Returns `(loss, mean nll, mean lse^2)`; the
    means divide by the mask's sum (at least 1).
    """
    logits = np.asarray(logits, np.float64)
    targets = np.asarray(targets)
    m = np.ones(targets.shape) if loss_mask is None else np.asarray(loss_mask, np.float64)
    lse = logsumexp(logits)
    nll = lse - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    count = max(float(m.sum()), 1.0)
    nll_mean, z_mean = float((nll * m).sum() / count), float((lse**2 * m).sum() / count)
    return nll_mean + z_weight * z_mean, nll_mean, z_mean


def cross_entropy_logit_grad(logits, targets, loss_mask=None, z_weight: float = 0.0):
    """Gradient of `cross_entropy(...)[0]` in the logits: per position
    `m * (softmax * (1 + 2 z_weight lse) - onehot(target)) / sum(m)`."""
    logits = np.asarray(logits, np.float64)
    targets = np.asarray(targets)
    m = np.ones(targets.shape) if loss_mask is None else np.asarray(loss_mask, np.float64)
    lse = logsumexp(logits)
    onehot = np.eye(logits.shape[-1])[targets]
    grad = softmax(logits) * (1 + 2 * z_weight * lse)[..., None] - onehot
    return grad * m[..., None] / max(float(m.sum()), 1.0)


# --------------------------------------------------------------------------- ZeRO-2


def zero2_shard(replica_grads, index: int, dim: int):
    """ZeRO-2's reduce-scatter (Rajbhandari et al. 2020): device `index` holds block
    `index` (of `n` equal blocks along `dim`) of the gradient averaged over the `n`
    data-parallel replicas, `mean_r g_r`."""
    avg = np.mean(np.stack([np.asarray(g, np.float64) for g in replica_grads]), axis=0)
    return np.split(avg, len(replica_grads), axis=dim)[index]


# ------------------------------------------------------------------- layers and a whole model


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    """LayerNorm (Ba et al. 2016): `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis."""
    x = np.asarray(x, np.float64)
    centred = x - x.mean(-1, keepdims=True)
    y = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


def rms_norm(x, weight, eps: float = 1e-6):
    """RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x^2) + eps) * weight` over the last axis."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def rope(x, positions, theta: float):
    """RoPE (Su et al. 2021) in the rotate-half pairing (GPT-NeoX, Llama): `x: [b, t, h, d]`, pair
    `i < d/2` is `(x[i], x[i + d/2])`, turned by `p * theta^(-2i/d)` at position `p`
    (`positions`: `[t]`, or `[b, t]` per row)."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    angle = np.asarray(positions, np.float64)[..., None] * theta ** (-2.0 * np.arange(d // 2) / d)
    angle = angle[None, :, None, :] if angle.ndim == 2 else angle[:, :, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], axis=-1)


def silu(x):
    """SiLU / swish (Elfwing et al. 2018): `x * sigmoid(x)`."""
    return x / (1.0 + np.exp(-x))


def swiglu(x, gate, up, down):
    """SwiGLU feed-forward (Shazeer 2020): `(silu(x W_gate) * (x W_up)) W_down`, weights `[in, out]`."""
    x = np.asarray(x, np.float64)
    g, u = x @ np.asarray(gate, np.float64), x @ np.asarray(up, np.float64)
    return (silu(g) * u) @ np.asarray(down, np.float64)


def gelu_mlp(x, up, up_bias, down, down_bias):
    """GPT-2's MLP: `gelu_tanh(x W_up + b_up) W_down + b_down`."""
    x = np.asarray(x, np.float64)
    return gelu_tanh(x @ np.asarray(up, np.float64) + up_bias) @ np.asarray(down, np.float64) + down_bias


def transformer_logits(p: dict, tokens, *, heads: int, kind: str, eps: float, theta: float = 10000.0,
                       segment_ids=None, doc_positions=None, window: int | None = None):
    """Logits `[b, t, vocab]` of a pre-norm decoder (Radford et al. 2019; Touvron et al. 2023), float64.

    `kind`: "gpt2" (LayerNorm with biases, learned positions, GELU MLP, biased projections,
    tied head) or "llama" (RMSNorm, RoPE, SwiGLU, no biases, own head). `p` holds NumPy arrays:
    `embed [V, D]`, `pos [T, D]` (gpt2), `head [D, V]` (llama), `final_norm` (`w`, `b`), and
    `layers`, a list of dicts `attn_norm`, `mlp_norm` (`w`, `b`), `q, k, v, o` (`w [in, out]`,
    `b`), and `mlp` (`gate, up, down` or `up, up_b, down, down_b`). Each layer:
    `x += attn(norm(x)); x += mlp(norm(x))`. Attention is causal (sliding with `window`), within
    segments when `segment_ids` are given; `doc_positions` (`[b, t]`) replace `0..t-1` for the
    position embedding / rotation.
    """
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    pos = np.arange(t)
    rot = pos if doc_positions is None else np.asarray(doc_positions)
    mask = causal_mask(pos, pos) if window is None else sliding_window_mask(pos, pos, window)
    mask = np.broadcast_to(mask, (b, t, t))
    if segment_ids is not None:
        mask = mask & document_mask(segment_ids, segment_ids)
    gpt2 = kind == "gpt2"

    def norm(x, n):
        return layer_norm(x, n["w"], n["b"], eps) if gpt2 else rms_norm(x, n["w"], eps)

    def proj(x, w):
        return x @ w["w"] + (w["b"] if gpt2 else 0.0)

    x = np.asarray(p["embed"], np.float64)[tokens]
    if gpt2:
        x = x + np.asarray(p["pos"], np.float64)[np.broadcast_to(rot, (b, t))]
    for layer in p["layers"]:
        h = norm(x, layer["attn_norm"])
        d = x.shape[-1] // heads
        q, k, v = (proj(h, layer[n]).reshape(b, t, -1, d) for n in "qkv")
        if not gpt2:
            q, k = rope(q, rot, theta), rope(k, rot, theta)
        x = x + proj(attention(q, k, v, mask).reshape(b, t, -1), layer["o"])
        h, m = norm(x, layer["mlp_norm"]), layer["mlp"]
        x = x + (gelu_mlp(h, m["up"], m["up_b"], m["down"], m["down_b"]) if gpt2
                 else swiglu(h, m["gate"], m["up"], m["down"]))
    x = norm(x, p["final_norm"])
    return x @ np.asarray(p["embed"], np.float64).T if gpt2 else x @ np.asarray(p["head"], np.float64)


# ------------------------------------------------------------------------------------ AdamW


def adamw(params: dict, grads_per_step: list[dict], lr, *, decays: dict, b1: float, b2: float, eps: float,
          weight_decay: float, clip: float | None):
    """AdamW (Loshchilov & Hutter 2019) after clipping by the global norm, float64: per step `t`
    (from 1) `g <- g * c / ||g||` if `||g|| >= c`; `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`;
    `p <- p - lr(t - 1) * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p)`, the
    decay term only where `decays[name]`. `params`, `grads`: `{name: array}`; `lr`: a function of the step."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        g = {k: np.asarray(x, np.float64) for k, x in grads.items()}
        norm = math.sqrt(sum(float(np.sum(x**2)) for x in g.values()))
        if clip is not None and norm >= clip:
            g = {k: x * clip / norm for k, x in g.items()}
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
            step = m[k] / (1 - b1**t) / (np.sqrt(v2[k] / (1 - b2**t)) + eps)
            p[k] = p[k] - lr(t - 1) * (step + (weight_decay * p[k] if decays[k] else 0.0))
    return p
