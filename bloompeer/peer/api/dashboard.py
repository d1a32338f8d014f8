"""The swarm dashboard: GET / is a page that polls GET /api/swarm (the same data as `bloompeer
status --json`, plus this client's measured latency to each server) and redraws itself.

The page's HTML, script and style ship in the package (static/), so it works offline.
"""

from __future__ import annotations

from pathlib import Path

from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from .swarm_state import fetch_swarm_state

__all__ = ["add_dashboard_routes", "STATIC_DIR"]

STATIC_DIR = Path(__file__).resolve().parent / "static"


def add_dashboard_routes(app, state) -> None:
    @app.get("/", include_in_schema=False)
    async def dashboard() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/api/swarm")
    async def swarm() -> dict:
        return await fetch_swarm_state(state.model)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
