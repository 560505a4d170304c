"""A request's end-of-session hint, as a vLLM client sends it: in the request's ``kv_transfer_params``.

A client that knows a request is its session's last (an agent's final step, a pipeline's last
call, a conversation the user closed) says so, and from which prompt token on the prompt is the
session's own (no other session's request shares it: the shared system prompt or document ends
there)::

    # OpenAI-compatible server: "kv_transfer_params": {"kvray_ends_session_from_token": 1024}
    SamplingParams(extra_args={"kv_transfer_params": {SESSION_END_PARAM: 1024}})

The connector tells the node's store of the request once, with every full page of its prompt
and the hint as the page index of that token (a page holding any of the session's own tokens is
the session's own, since a page's key binds every token before it), and a node policy that
takes hints (``lru-session-end``, ``reuse-session-end``: :mod:`kvray.policy.session_end`)
stores none of those pages and lets the ones already cached go first. A value that is not a token index is logged and ignored: a hint
saves cache space or costs misses, never a request.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

SESSION_END_PARAM = "kvray_ends_session_from_token"


def session_end_page(params: Mapping[str, Any] | None, page_tokens: int, pages: int, request_id: str = "") -> int:
    """The first of a request's ``pages`` full prompt pages its hint names as the session's own,
    from its ``kv_transfer_params``; -1 without a hint, with a bad one (logged), or with one
    naming no page among them."""
    if not params or SESSION_END_PARAM not in params:
        return -1
    token = params[SESSION_END_PARAM]
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        log.warning(
            "request %s: kv_transfer_params[%r] = %r is not a prompt token index (an integer >= 0); no end-of-session hint",
            request_id,
            SESSION_END_PARAM,
            token,
        )
        return -1
    page = token // page_tokens
    return page if page < pages else -1
