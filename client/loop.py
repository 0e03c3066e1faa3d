"""A private asyncio loop on a daemon thread, so the synchronous client API can drive async network code."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    """Owns one event loop thread; `run` executes a coroutine on it and waits for the result."""

    def __init__(self, name: str = "chainswarm-client") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Gives the coroutine's result, raising what it raised; `timeout` bounds the wait."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BackgroundLoop.run called from its own loop thread (would deadlock)")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        """Stops the loop and joins its thread."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
