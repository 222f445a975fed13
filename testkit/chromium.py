"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol, for tests that
look at a live page for a while (``--dump-dom`` and ``--screenshot`` see one moment at load).

Use::

    async with Browser(tmp_path / "profile") as b:
        await b.open("http://127.0.0.1:8000/dashboard", width=1100, height=1400)
        ...                                   # the page runs in real time meanwhile
        n = await b.evaluate("document.querySelectorAll('.cell').length")
        png = await b.screenshot()

One page per browser; every call waits for its answer (``timeout_s``). The browser process is
killed on exit, its profile directory left to the caller.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

from testkit.procs import terminate

#: Flags of a headless Chromium run in tests (no sandbox: root in a container).
HEADLESS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
FLAGS = [*HEADLESS, "--remote-debugging-port=0"]


def _launch(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


class BrowserError(RuntimeError):
    """Chromium is missing, did not start, or a DevTools call failed."""


class Browser:
    def __init__(self, profile: Path, timeout_s: float = 60.0) -> None:
        self.profile, self.timeout_s = profile, timeout_s
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None

    async def __aenter__(self) -> Browser:
        exe = shutil.which("chromium") or shutil.which("chromium-browser")
        if exe is None:
            raise BrowserError("chromium is not installed (scripts/test.sh installs it)")
        self.profile.mkdir(parents=True, exist_ok=True)
        self._proc = _launch([exe, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"])
        self._http = aiohttp.ClientSession()
        try:
            port = await self._port()
            async with self._http.get(f"http://127.0.0.1:{port}/json/list") as r:
                pages = [t for t in await r.json() if t.get("type") == "page"]
            self._ws = await self._http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self._proc is not None:
            await asyncio.to_thread(terminate, self._proc, 5.0)

    async def _port(self) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self._proc.returncode}")
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            await asyncio.sleep(0.1)
        raise BrowserError("chromium did not open its DevTools port")

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; returns its ``result`` (events in between are skipped)."""
        assert self._ws is not None
        i = next(self._ids)
        await self._ws.send_json({"id": i, "method": method, "params": params})
        async with asyncio.timeout(self.timeout_s):
            while True:
                msg = await self._ws.receive_json()
                if msg.get("id") == i:
                    if "error" in msg:
                        raise BrowserError(f"{method}: {msg['error']}")
                    return dict(msg.get("result", {}))

    async def open(self, url: str, width: int = 1100, height: int = 900) -> None:
        """Size the viewport, navigate, and wait until the document has loaded."""
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        await self.call("Page.navigate", url=url)
        deadline = time.monotonic() + self.timeout_s
        while await self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} did not load")
            await asyncio.sleep(0.1)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable values)."""
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise BrowserError(f"{expression}: {out['exceptionDetails']}")
        return out["result"].get("value")

    async def screenshot(self) -> bytes:
        """A PNG of the viewport."""
        out = await self.call("Page.captureScreenshot", format="png")
        return base64.b64decode(out["data"])
