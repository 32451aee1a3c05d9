"""Plain Python-loop references for the algos tests: one sample, one token at a time, floats.

Written from the definitions (papers, verl's documented semantics), independent of the
vectorised code under test. Inputs are nested lists (rows of floats).
"""

from __future__ import annotations

import math

Rows = list[list[float]]


def whiten(rows: Rows, mask: Rows) -> Rows:
    """(x - mean) / sqrt(var + 1e-8) over valid entries (unbiased var); 0 elsewhere."""
    vals = [x for r, m in zip(rows, mask, strict=True) for x, v in zip(r, m, strict=True) if v]
    n = len(vals)
    mean = sum(vals) / max(n, 1)
    var = sum((x - mean) ** 2 for x in vals) / max(n - 1, 1)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [
        [(x - mean) * scale if v else 0.0 for x, v in zip(r, m, strict=True)]
        for r, m in zip(rows, mask, strict=True)
    ]


def gae(rewards: Rows, values: Rows, mask: Rows, gamma: float, lam: float) -> tuple[Rows, Rows]:
    """Raw (unwhitened) GAE advantages and returns; masked tokens are skipped (carry through)."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask, strict=True):
        next_v, last = 0.0, 0.0
        a = [0.0] * len(r)
        for t in reversed(range(len(r))):
            if m[t]:
                delta = r[t] + gamma * next_v - v[t]
                last = delta + gamma * lam * last
                next_v = v[t]
                a[t] = last
        advs.append(a)
        rets.append([a[t] + v[t] if m[t] else 0.0 for t in range(len(r))])
    return advs, rets


def discounted_returns(rewards: Rows, mask: Rows, gamma: float) -> Rows:
    out = []
    for r, m in zip(rewards, mask, strict=True):
        run = 0.0
        g = [0.0] * len(r)
        for t in reversed(range(len(r))):
            if m[t]:
                run = r[t] + gamma * run
                g[t] = run
        out.append(g)
    return out


def group_relative(scores: list[float], groups: list[int], mode: str) -> list[float]:
    """mode: grpo (std), dr_grpo (none), rloo (leave-one-out), centred (s - mean)."""
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if groups[j] == groups[i]]
        n = len(members)
        if n == 1:
            out.append(s)
            continue
        if max(members) == min(members):
            out.append(0.0)
            continue
        mean = sum(members) / n
        if mode == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
            out.append((s - mean) / (std + 1e-6))
        elif mode == "rloo":
            others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
            out.append(s - sum(others) / len(others))
        else:
            out.append(s - mean)
    return out


def ppo_token(
    logp: float, old: float, adv: float, low: float, high: float, dual_c: float | None
) -> tuple[float, bool, bool]:
    """(loss, clipped, dual-clipped) of one token, by verl's branch definitions."""
    ratio = math.exp(max(min(logp - old, 20.0), -20.0))
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped)
    lower = dual_c is not None and adv < 0 and loss > -adv * dual_c
    if lower:
        loss = -adv * dual_c
    return loss, clipped > unclipped, lower


def gspo_rows(logp: Rows, old: Rows, adv: Rows, mask: Rows, low: float, high: float) -> Rows:
    out = []
    for lp, od, a, m in zip(logp, old, adv, mask, strict=True):
        n = max(sum(m), 1)
        s = math.exp(min(sum((x - y) * v for x, y, v in zip(lp, od, m, strict=True)) / n, 10.0))
        out.append([max(-ai * s, -ai * min(max(s, 1 - low), 1 + high)) for ai in a])
    return out


def aggregate(loss: Rows, mask: Rows, mode: str, max_len: int) -> float:
    """The mean the trainer should report for a whole batch (verl's agg_loss definitions)."""
    if mode == "token-mean":
        num = sum(
            x for r, m in zip(loss, mask, strict=True) for x, v in zip(r, m, strict=True) if v
        )
        return num / sum(v for m in mask for v in m)
    rows = [(r, m) for r, m in zip(loss, mask, strict=True) if sum(m) > 0]
    per = []
    for r, m in rows:
        s = sum(x for x, v in zip(r, m, strict=True) if v)
        if mode == "seq-mean-token-mean":
            s /= sum(m)
        elif mode == "seq-mean-token-sum-norm":
            s /= max_len
        per.append(s)
    return sum(per) / len(per)
