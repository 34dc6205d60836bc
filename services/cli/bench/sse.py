"""Server-sent-event lines as the SSE specification splits them.

httpx's ``aiter_lines`` splits with ``str.splitlines``, which also breaks at
U+2028, U+2029, U+0085 and the ASCII separators 0x1C-0x1E. JSON leaves those
characters unescaped, and a server streaming sampled or random-token text
emits them inside a ``data:`` line, so a ``splitlines`` client sees half an
event and fails to parse it. The SSE specification ends a line only at CR LF,
LF or CR; this does exactly that (as the OpenAI SDK's decoder does).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx

_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The response body's lines, split only at CR LF, LF or CR."""
    pending = b""
    async for chunk in response.aiter_bytes():
        pending += chunk
        # A CR at the very end may be the first half of a CR LF: keep it for the next chunk.
        cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
        *lines, rest = _LINE_END.split(pending[:cut])
        pending = rest + pending[cut:]
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    for line in _LINE_END.split(pending):
        if line:
            yield line.decode("utf-8", errors="replace")
