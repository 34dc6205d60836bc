"""The sampling settings a load run can ask for, as the OpenAI request fields sent.

Clients rarely decode greedily: ``vllm bench serve`` and most SDKs send no
sampling field at all (the server's defaults: temperature 1), chat clients
often temperature 0.7 with top_p 0.9. A run names one of ``SAMPLING_SETTINGS``
(``--sampling``), so a benchmark measures what real traffic costs, not only
greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSetting:
    """A named set of sampling fields; a field left None is not sent at all."""

    name: str
    temperature: float | None = None
    top_p: float | None = None

    def fields(self) -> dict[str, float]:
        """The request body's sampling fields (those not None)."""
        sent = {"temperature": self.temperature, "top_p": self.top_p}
        return {key: value for key, value in sent.items() if value is not None}


GREEDY = SamplingSetting("greedy", temperature=0.0)
# Nothing sent: the server's defaults (temperature 1, no top_p/top_k).
NONE_GIVEN = SamplingSetting("none-given")
CHAT = SamplingSetting("t0.7-p0.9", temperature=0.7, top_p=0.9)
SAMPLING_SETTINGS: dict[str, SamplingSetting] = {s.name: s for s in (GREEDY, NONE_GIVEN, CHAT)}
