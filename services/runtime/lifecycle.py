"""Process runtime for one service: logging, uvloop, signals, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


def setup_logging(service: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
        force=True,
    )


def run_service(
    service: str, log_level: str, serve: Callable[[asyncio.Event], Awaitable[None]]
) -> None:
    """Run ``serve(stop_event)`` on uvloop until SIGINT/SIGTERM sets ``stop_event``.

    ``serve`` owns its graceful shutdown: it returns after the event is set and
    it has drained its servers and streams.
    """
    import uvloop

    setup_logging(service, log_level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)
        logger.info("%s stopped", service)

    uvloop.run(main())
