"""A multi-turn conversation served by a real (small, random-weight) Llama, with and without kvray.

Each turn's prompt is the whole conversation so far, so without a KV cache the model
recomputes every earlier turn; with kvray the history's pages are loaded and only the new
user message is computed. Forwards run on one thread (see :mod:`kvray.engines.timing`).
Both servers produce the reply greedily from the same weights, and the table says whether
the replies agree (they must).

The timing is fair to both: one untimed forward first (the first call of a model pays for
allocation and lazy setup), and the two servers take turns going first, so neither always
runs on a warmer cache. A turn where kvray supplied no tokens has no speed-up to report.

Example::

    rows = conversation_demo(turns=4)        # prints a rich table, returns one dict per turn
    rows[-1]["ttft_kvray_ms"], rows[-1]["cached_tokens"]
"""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.engines.hf import CachedCausalLM, greedy_decode, model_layout
from kvray.engines.timing import torch_threads
from kvray.harness.tiny import tiny_llama
from kvray.report import format_duration, print_table


@torch.inference_mode()
def recompute(model, tokens: np.ndarray, max_new_tokens: int) -> tuple[list[int], float]:
    """Reply and TTFT of a server without any KV reuse: the whole prompt is prefilled."""
    t0 = time.perf_counter()
    out = model(input_ids=torch.from_numpy(tokens.astype(np.int64))[None], use_cache=True, logits_to_keep=1)
    ttft = time.perf_counter() - t0
    reply, _ = greedy_decode(model, out.logits[0, -1], out.cache, max_new_tokens)
    return reply, ttft


def conversation_demo(
    model_name: str = "tiny-llama",
    turns: int = 6,
    system_tokens: int = 1024,
    user_tokens: int = 192,
    reply_tokens: int = 32,
    page_tokens: int = 64,
    seed: int = 0,
    console: Console | None = None,
    plot: Path | None = None,
) -> list[dict]:
    """Serve ``turns`` turns of one conversation twice (recompute vs kvray); print and return
    TTFT per turn, and save it as a chart to ``plot`` if given. Token ids are synthetic
    (no tokenizer is needed for KV reuse)."""
    model = tiny_llama(model_name, seed=seed)
    layout = model_layout(model.config, model.dtype, page_tokens)
    store = PageStore(StoreConfig(layout=layout, model_name=model_name, tiers=TierSizes(host=4096)))
    lm = CachedCausalLM(model, store)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    history = rng.integers(3, vocab, system_tokens).astype(np.int32)
    rows = []
    with torch_threads(1), closing(store):
        recompute(model, history, 1)  # warm-up, untimed
        for turn in range(1, turns + 1):
            prompt = np.concatenate([history, rng.integers(3, vocab, user_tokens).astype(np.int32)])
            if turn % 2:
                plain_reply, plain_ttft = recompute(model, prompt, reply_tokens)
                reply, first = lm.generate(prompt, reply_tokens)
            else:
                reply, first = lm.generate(prompt, reply_tokens)
                plain_reply, plain_ttft = recompute(model, prompt, reply_tokens)
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": int(prompt.size),
                    "cached_tokens": first.cached_tokens,
                    "ttft_recompute_ms": plain_ttft * 1e3,
                    "ttft_kvray_ms": first.seconds * 1e3,
                    "same_reply": reply == plain_reply,
                }
            )
            history = np.concatenate([prompt, np.asarray(reply, dtype=np.int32)])
    _print(rows, model_name, console or Console())
    if plot is not None:
        _plot(rows, model_name, Path(plot))
    return rows


def speed_up(row: dict) -> str:
    """Recompute's TTFT over kvray's, or "—" for a turn kvray supplied no tokens to: any
    ratio there is noise between two identical full prefills, not something kvray bought."""
    return f"{row['ttft_recompute_ms'] / row['ttft_kvray_ms']:.1f}x" if row["cached_tokens"] else "—"


def _print(rows: list[dict], model_name: str, console: Console) -> None:
    columns = ("turn", "prompt tokens", "from kvray", "TTFT recompute", "TTFT kvray", "speed-up", "same reply")
    cells = [
        (
            str(row["turn"]),
            str(row["prompt_tokens"]),
            str(row["cached_tokens"]),
            format_duration(row["ttft_recompute_ms"] / 1e3),
            format_duration(row["ttft_kvray_ms"] / 1e3),
            speed_up(row),
            "[green]yes[/]" if row["same_reply"] else "[red]NO[/]",
        )
        for row in rows
    ]
    print_table(console, f"Multi-turn conversation on {model_name}: time to first token per turn", columns, cells)


def _plot(rows: list[dict], model_name: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(turns, [r["ttft_recompute_ms"] for r in rows], "o-", label="recompute the history")
    ax.plot(turns, [r["ttft_kvray_ms"] for r in rows], "o-", label="history from kvray")
    ax.set(xlabel="turn", ylabel="time to first token (ms)", title=f"{model_name}: multi-turn conversation")
    ax.set_xticks(turns)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
