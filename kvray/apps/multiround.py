"""Multi-round QA, closed loop, on two engines: what kvray buys a chat service, measured.

The shape of LMCache's multi-round QA benchmark, sized to run in seconds: ``users``
users share a system prompt; each round a user asks a question, gets the answer, and asks
the next question only then (closed loop), with the whole conversation so far as the
prompt. Requests are spread over two engines without affinity (user ``u``'s round ``r``
goes to engine ``(u + r) % 2``, as a round-robin front end would), so a user's history was
often computed on the other engine.

Two contenders serve every request, back to back and in alternating order (neither always
runs on a warmer machine): the engines recomputing the whole prompt (no cache), and the
same engines on one shared kvray store (the history's pages computed by either engine are
loaded; only the new question is prefilled). Both answer greedily from the same weights,
so their replies must agree. The engines are two copies of a small random-weight Llama on
CPU, forwards on one thread (:mod:`kvray.engines.timing`), in this process.

Example::

    rows = multiround_qa(users=2, rounds=3)
    summary_line(rows)      # 'kvray bought: mean time to first token ...'
"""

from __future__ import annotations

import json
from contextlib import closing
from pathlib import Path
from statistics import fmean

import numpy as np
from rich.console import Console

from kvray.apps.chat import recompute
from kvray.core.config import StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.engines.hf import CachedCausalLM, model_layout
from kvray.engines.timing import torch_threads
from kvray.harness.tiny import tiny_llama
from kvray.report import format_duration, print_table

ENGINES = 2


def multiround_qa(
    users: int = 2,
    rounds: int = 4,
    system_tokens: int = 768,
    question_tokens: int = 64,
    answer_tokens: int = 16,
    page_tokens: int = 64,
    model_name: str = "tiny-llama",
    seed: int = 0,
) -> list[dict]:
    """Serve ``users`` x ``rounds`` requests with both contenders (see the module docstring);
    one dict per request, in the order served. Token ids are synthetic (KV reuse needs no
    tokenizer)."""
    engines = [tiny_llama(model_name, seed=seed) for _ in range(ENGINES)]  # same weights: two replicas
    layout = model_layout(engines[0].config, engines[0].dtype, page_tokens)
    store = PageStore(StoreConfig(layout=layout, model_name=model_name, tiers=TierSizes(host=4096)))
    cached = [CachedCausalLM(model, store) for model in engines]
    rng = np.random.default_rng(seed)
    vocab = engines[0].config.vocab_size
    system = rng.integers(3, vocab, system_tokens).astype(np.int32)
    histories = [system] * users
    rows = []
    with torch_threads(1), closing(store):
        warm = rng.integers(3, vocab, 2 * page_tokens + 1).astype(np.int32)  # keys no question shares
        for model, lm in zip(engines, cached):  # untimed: a first call pays for allocation and lazy setup
            recompute(model, system, 1)
            lm.generate(warm, 1)  # computes and stores
            lm.generate(warm, 1)  # loads
        for round_ in range(1, rounds + 1):
            for user in range(users):
                engine = (user + round_) % ENGINES
                prompt = np.concatenate([histories[user], rng.integers(3, vocab, question_tokens).astype(np.int32)])
                if (user + round_) % 2:
                    plain_reply, plain_ttft = recompute(engines[engine], prompt, answer_tokens)
                    reply, first = cached[engine].generate(prompt, answer_tokens)
                else:
                    reply, first = cached[engine].generate(prompt, answer_tokens)
                    plain_reply, plain_ttft = recompute(engines[engine], prompt, answer_tokens)
                rows.append(
                    {
                        "round": round_,
                        "user": user,
                        "engine": engine,
                        "prompt_tokens": int(prompt.size),
                        "cached_tokens": first.cached_tokens,
                        "ttft_no_cache_ms": plain_ttft * 1e3,
                        "ttft_kvray_ms": first.seconds * 1e3,
                        "same_reply": reply == plain_reply,
                    }
                )
                histories[user] = np.concatenate([prompt, np.asarray(reply, dtype=np.int32)])
    return rows


def per_round(rows: list[dict]) -> list[dict]:
    """Means over the users of each round."""
    out = []
    for round_ in sorted({r["round"] for r in rows}):
        of = [r for r in rows if r["round"] == round_]
        out.append(
            {
                "round": round_,
                "prompt_tokens": fmean(r["prompt_tokens"] for r in of),
                "cached_tokens": fmean(r["cached_tokens"] for r in of),
                "ttft_no_cache_ms": fmean(r["ttft_no_cache_ms"] for r in of),
                "ttft_kvray_ms": fmean(r["ttft_kvray_ms"] for r in of),
                "same_reply": all(r["same_reply"] for r in of),
            }
        )
    return out


def print_rounds(rows: list[dict], console: Console) -> None:
    users = len({r["user"] for r in rows})
    columns = ("round", "prompt tokens", "from kvray", "TTFT no cache", "TTFT kvray", "speed-up", "same replies")
    cells = [
        (
            str(r["round"]),
            f"{r['prompt_tokens']:.0f}",
            f"{r['cached_tokens']:.0f}",
            format_duration(r["ttft_no_cache_ms"] / 1e3),
            format_duration(r["ttft_kvray_ms"] / 1e3),
            f"{r['ttft_no_cache_ms'] / r['ttft_kvray_ms']:.1f}x" if r["cached_tokens"] else "—",
            "[green]yes[/]" if r["same_reply"] else "[red]NO[/]",
        )
        for r in per_round(rows)
    ]
    title = f"Multi-round QA, closed loop, {users} users on {ENGINES} engines: mean time to first token per round"
    print_table(console, title, columns, cells)


def plot_rounds(rows: list[dict], path: Path) -> None:
    """TTFT per round of both contenders, both axes from 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = per_round(rows)
    rounds = [r["round"] for r in means]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(rounds, [r["ttft_no_cache_ms"] for r in means], "o-", label="no cache: recompute the conversation")
    ax.plot(rounds, [r["ttft_kvray_ms"] for r in means], "o-", label="kvray: history's pages loaded")
    ax.set(xlabel="round", ylabel="mean time to first token (ms)", title="multi-round QA, closed loop, 2 engines")
    ax.set_xticks(rounds)
    ax.set_xlim(0, rounds[-1] + 0.5)
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_line(rows: list[dict]) -> str:
    """One line: what kvray bought over every request served, and how it was measured."""
    plain, kvray = fmean(r["ttft_no_cache_ms"] for r in rows), fmean(r["ttft_kvray_ms"] for r in rows)
    rounds, users = max(r["round"] for r in rows), len({r["user"] for r in rows})
    same = "the same replies" if all(r["same_reply"] for r in rows) else "DIFFERENT replies"
    ratio = f"{plain / kvray:.1f}x faster" if plain >= kvray else f"{kvray / plain:.1f}x SLOWER: was the machine busy?"
    return (
        f"kvray bought: mean time to first token {plain:.0f} ms -> {kvray:.0f} ms ({ratio}) "
        f"with {same}; measured on {users} users x {rounds} rounds of multi-round QA ({len(rows)} requests), "
        f"closed loop, {ENGINES} tiny-llama engines on CPU sharing one kvray store, "
        "every request served without and with kvray back to back, order alternating"
    )


def run_multiround(users: int, rounds: int, out_dir: Path, console: Console) -> list[dict]:
    """The demo's first part: run, print the table, save ``multiround.json`` and the plot,
    naming both."""
    console.print(f"multi-round QA: {users} users x {rounds} rounds on {ENGINES} engines, no cache vs kvray")
    rows = multiround_qa(users=users, rounds=rounds)
    print_rounds(rows, console)
    out_dir.mkdir(parents=True, exist_ok=True)
    data, plot = out_dir / "multiround.json", out_dir / "multiround_ttft.png"
    data.write_text(json.dumps({"requests": rows, "rounds": per_round(rows)}, indent=2))
    plot_rounds(rows, plot)
    console.print(f"saved {data} and the plot {plot}", soft_wrap=True)
    return rows
