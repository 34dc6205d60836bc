"""The bench client's SSE line splitting: only CR LF, LF and CR end a line."""

from __future__ import annotations

import asyncio
import json

import httpx

from kvmesh.services.cli.bench.sse import sse_lines


def _lines(chunks: list[bytes]) -> list[str]:
    async def collect() -> list[str]:
        response = httpx.Response(200, stream=httpx.ByteStream(b""))
        response.stream = _Chunks(chunks)
        return [line async for line in sse_lines(response)]

    return asyncio.run(collect())


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def __aiter__(self):  # type: ignore[override]
        for chunk in self._chunks:
            yield chunk


def test_unicode_separators_inside_json_stay_in_their_line() -> None:
    # json.dumps(ensure_ascii=False) leaves U+2028, U+0085 and 0x1C raw, as servers send them.
    text = "a\u2028b\x85c\x1cd\u2029e"
    event = "data: " + json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)
    body = (event + "\n\n" + "data: [DONE]\n\n").encode()
    lines = _lines([body[:13], body[13:29], body[29:]])
    assert lines == [event, "", "data: [DONE]", ""]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
    # httpx's own aiter_lines splits that event apart: why sse_lines exists.
    assert len(event.splitlines()) > 1


def test_cr_lf_split_across_chunks_is_one_line_end() -> None:
    assert _lines([b"data: 1\r", b"\ndata: 2\r\n\r\n"]) == ["data: 1", "data: 2", ""]
    assert _lines([b"data: 1\rdata: 2\n", b"data: 3"]) == ["data: 1", "data: 2", "data: 3"]
