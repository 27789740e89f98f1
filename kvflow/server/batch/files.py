"""OpenAI's Files API for the Batch API: `/v1/files` upload (multipart, purpose "batch"), list, retrieve,
content, delete; FileObject's shape. The bytes are files under `--batch-dir` (server/batch_store.py); a batch's
output and error files are listed here too (purpose "batch_output").

Limits: `--max-batch-file-size` (413, code `file_too_large`; from Content-Length before the body is read where the
multipart body as a whole is over it, the body-size middleware's 413), and free disk space in `--batch-dir`
(`--batch-min-free-space` must remain after the upload: 507, code `insufficient_storage`), checked before anything
is written there.
"""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse
from starlette.datastructures import UploadFile

from kvflow.server.batch.store import StoreHandle, new_file_id
from kvflow.server.common.config import ServerConfig
from kvflow.server.common.errors import APIError

# what a multipart envelope adds to the file's bytes (boundaries, part headers, the purpose field), at most
MULTIPART_SLACK = 64 * 1024
PURPOSES = ("batch",)
CHUNK = 1 << 20


def list_page(data: list[dict], has_more: bool) -> dict:
    """OpenAI's cursor page (files.list, batches.list): the objects, the first and last ids, whether more follow."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def no_such_file(file_id: str, param: str = "id") -> APIError:
    return APIError(404, f"No such File object: {file_id}", param=param)


def check_free_space(directory: Path, incoming: int, min_free: int) -> None:
    """507 unless `incoming` more bytes leave at least `min_free` free where the store is."""
    free = shutil.disk_usage(directory).free
    if free - incoming < min_free:
        raise APIError(507, f"not enough disk space for {incoming} more bytes in the batch directory: {free} bytes "
                            f"free, {min_free} must remain (--batch-min-free-space)", type="server_error",
                       code="insufficient_storage")


def too_large(config: ServerConfig, nbytes: int | None = None) -> APIError:
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return APIError(413, f"The file{size} is larger than this server's limit of {config.max_batch_file_size} bytes "
                         "(--max-batch-file-size).", param="file", code="file_too_large")


def files_router(handle: StoreHandle, config: ServerConfig) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/files", response_model=None)
    async def create_file(raw: Request):
        length = raw.headers.get("content-length", "")
        if length.isdigit() and int(length) > config.max_batch_file_size + MULTIPART_SLACK:
            raise too_large(config)
        store = handle.get()
        if not raw.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "upload the file as multipart/form-data with the fields `file` and `purpose`",
                           param="file")
        try:
            form = await raw.form()
        except APIError:
            raise
        except Exception as e:        # a malformed multipart body
            raise APIError(400, f"could not read the multipart body: {e}", param="file") from None
        try:
            extra = sorted(set(form.keys()) - {"file", "purpose"})
            if extra:    # e.g. expires_after[anchor]: kvflow keeps files until they are deleted
                raise APIError(400, f"{extra[0]} is not supported by kvflow: leave it unset", param=extra[0])
            purpose = form.get("purpose")
            if not isinstance(purpose, str) or not purpose:
                raise APIError(400, "Missing required parameter: 'purpose'.", param="purpose",
                               code="missing_required_parameter")
            if purpose not in PURPOSES:
                raise APIError(400, f"purpose {purpose!r} is not supported: kvflow stores files for the Batch API "
                                    "(purpose 'batch')", param="purpose", code="invalid_value")
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise APIError(400, "Missing required parameter: 'file'.", param="file",
                               code="missing_required_parameter")
            if upload.size is not None and upload.size > config.max_batch_file_size:
                raise too_large(config, upload.size)
            # before anything is stored in --batch-dir (the form parser spools the part to a temporary file)
            check_free_space(store.dir, upload.size or int(length or 0), config.batch_min_free_space)
            file_id = new_file_id()

            def chunks():
                upload.file.seek(0)
                n = 0
                while chunk := upload.file.read(CHUNK):
                    n += len(chunk)
                    if n > config.max_batch_file_size:
                        raise too_large(config)
                    yield chunk

            try:
                row = await asyncio.to_thread(store.write_file, file_id, chunks(), upload.filename or "upload.jsonl",
                                              purpose)
            except APIError:
                store.file_path(file_id).with_name(file_id + ".part").unlink(missing_ok=True)
                raise
            return file_object(row)
        finally:
            await form.close()

    @router.get("/v1/files", response_model=None)
    async def list_files(after: str | None = None, limit: int = Query(10_000, ge=1, le=10_000),
                         order: str = Query("desc", pattern="^(asc|desc)$"), purpose: str | None = None):
        store = handle.get()
        try:
            rows, more = await asyncio.to_thread(store.list_files, after=after, limit=limit, order=order,
                                                 purpose=purpose)
        except ValueError:
            raise no_such_file(after, "after") from None
        return list_page([file_object(r) for r in rows], more)

    @router.get("/v1/files/{file_id}", response_model=None)
    async def retrieve_file(file_id: str):
        row = handle.get().get_file(file_id)
        if row is None:
            raise no_such_file(file_id)
        return file_object(row)

    @router.get("/v1/files/{file_id}/content", response_model=None)
    async def file_content(file_id: str):
        store = handle.get()
        row = store.get_file(file_id)
        if row is None or not store.file_path(file_id).exists():
            raise no_such_file(file_id)
        return FileResponse(store.file_path(file_id), media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}", response_model=None)
    async def delete_file(file_id: str):
        if not await asyncio.to_thread(handle.get().delete_file, file_id):
            raise no_such_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router
