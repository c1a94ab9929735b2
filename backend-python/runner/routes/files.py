"""`POST /file-to-text`: the text of an attached file, as RWKV-Runner's chat attachment button asks.

Multipart form with the file in `file_data`; `file_name` and `file_encoding` (default utf-8) come
as query parameters (the GUI puts `file_name` in the URL) or form fields. `.txt` and `.pdf` are
read (`.pdf` with pypdf, one page each); any other type is 400. The body limit (`--max-body-bytes`)
bounds the upload like every other body.

    {"pages": [{"page_content": "...", "metadata": {"source": "a.pdf", "page": 0, "total_pages": 2, ...}}]}
"""

from __future__ import annotations

import asyncio
import codecs
import io
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from fastapi import APIRouter, Request
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from runner.errors import ApiError

router = APIRouter()

Page = dict[str, Any]


def text_pages(data: bytes, name: str, encoding: str) -> list[Page]:
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"{name} is not valid {encoding} text: {exc}", "file_encoding") from exc
    return [{"page_content": text, "metadata": {"source": name}}]


def pdf_pages(data: bytes, name: str, encoding: str) -> list[Page]:
    from pypdf import PdfReader  # lazy: only this route needs it

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise ApiError(400, f"{name} is encrypted", "file_data")
        info = {str(key).lstrip("/"): value for key, value in (reader.metadata or {}).items() if isinstance(value, (str, int))}
        total = len(reader.pages)
        return [
            {"page_content": page.extract_text() or "", "metadata": {"source": name, "file_path": name, "page": number, "total_pages": total, **info}}
            for number, page in enumerate(reader.pages)
        ]
    except ApiError:
        raise
    except Exception as exc:  # a malformed file can raise almost anything inside the parser
        raise ApiError(400, f"{name} could not be read as a PDF: {exc}", "file_data") from exc


PARSERS: dict[str, Callable[[bytes, str, str], list[Page]]] = {".txt": text_pages, ".pdf": pdf_pages}


def _field(form: Any, request: Request, name: str) -> str | None:
    value = request.query_params.get(name)
    if value is None:
        value = form.get(name)
    return value if isinstance(value, str) else None


@router.post("/file-to-text")
async def file_to_text(request: Request) -> dict[str, list[Page]]:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(400, "send the file as multipart/form-data in the field file_data", "file_data")
    try:
        form = await request.form()
    except (ApiError, StarletteHTTPException):  # e.g. 413 from the body limit
        raise
    except Exception as exc:  # a malformed multipart body
        raise ApiError(400, f"invalid multipart body: {exc}", "file_data") from exc
    try:
        upload = form.get("file_data")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "file_data: a file is required", "file_data")
        name = upload.filename or _field(form, request, "file_name")
        if not name:
            raise ApiError(422, "file_name: required when the upload has no file name", "file_name")
        encoding = _field(form, request, "file_encoding") or "utf-8"
        try:
            codecs.lookup(encoding)
        except (LookupError, ValueError) as exc:  # ValueError: a name with a NUL in it
            raise ApiError(422, f"file_encoding: unknown encoding {encoding!r}", "file_encoding") from exc
        parser = PARSERS.get(PurePath(name).suffix.lower())
        if parser is None:
            raise ApiError(400, f"file type not supported: {name!r} (supported: {', '.join(PARSERS)})", "file_name")
        data = await upload.read()
        return {"pages": await asyncio.to_thread(parser, data, name, encoding)}
    finally:
        await form.close()
