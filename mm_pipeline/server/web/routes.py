"""``GET /``: the upload page, and ``GET /web/<file>``: its scripts and styles.

The page is static files shipped inside the package (``mm_pipeline/server/web/``, package data): plain
HTML, CSS and ES modules that talk to the same ``/v1`` API as any client, so there is nothing to
build and nothing fetched from elsewhere.  The Content-Security-Policy header holds the page to
that: only this origin for scripts, styles and requests; ``blob:`` for previews of local files.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from mm_pipeline.server.errors import APIError

# file name -> media type; nothing else in this folder is served
WEB_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "api.js": "text/javascript; charset=utf-8",
    "cards.js": "text/javascript; charset=utf-8",
    "table.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_CSP = ("default-src 'self'; img-src 'self' blob: data:; media-src 'self' blob:; object-src 'none'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# no-cache: a browser revalidates after a server upgrade instead of mixing old and new modules
_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def read_web_files() -> dict[str, bytes]:
    """The page's files from the installed package (read once, at app creation)."""
    root = resources.files("mm_pipeline.server.web")
    return {name: root.joinpath(name).read_bytes() for name in WEB_FILES}


def install_web_routes(app: FastAPI) -> None:
    """Add ``GET /`` and ``GET /web/{name}`` (outside ``/v1``: the page loads without an API key
    and asks for one itself)."""
    files = read_web_files()

    def serve(name: str) -> Response:
        return Response(files[name], media_type=WEB_FILES[name], headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return serve("index.html")

    @app.get("/web/{name}", include_in_schema=False)
    async def web_file(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"no page file {name!r}")
        return serve(name)
