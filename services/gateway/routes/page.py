"""The web chat page at `/`: static HTML/JS/CSS from services/gateway/static, no build step."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
router = APIRouter(include_in_schema=False)


@router.get("/")
async def chat_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")
