"""OpenAI's Batch API, online: `/v1/batches` create, retrieve, list (newest first, `after` / `limit`),
cancel; the Batch object's shape. The worker that runs the batches is server/batch_worker.py; the store is
server/batch_store.py.

What kvflow adds or differs in, all visible in the object:
- `usage`: tokens of the committed lines ({input_tokens, input_tokens_details.cached_tokens, output_tokens,
  output_tokens_details.reasoning_tokens (0), total_tokens}), as OpenAI's newer batch objects carry it; wall time is
  `in_progress_at` to `completed_at` / `cancelled_at` / `expired_at` (`kvflow batch report` reads both).
- `completion_window`: "24h" as OpenAI, or any `<N>s|m|h|d` (a shorter window for a job that is stale after it).
- Refused with a 400 naming the field: `output_expires_after` (kvflow keeps files until they are deleted).
"""
from __future__ import annotations

import asyncio
import re
import time

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict

from kvflow.server.batch.store import StoreHandle, new_batch_id
from kvflow.server.batch.worker import BatchWorker
from kvflow.server.common.config import ServerConfig
from kvflow.server.batch.files import check_free_space, list_page, no_such_file
from kvflow.server.common.errors import APIError
from kvflow.server.batch.runner import URLS

WINDOW = re.compile(r"^([1-9][0-9]*)([smhd])$")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
FINAL = ("completed", "failed", "expired", "cancelled")


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")     # a field kvflow does not know is a 400 naming it

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None


def window_seconds(window: str) -> int:
    m = WINDOW.match(window)
    if not m:
        raise APIError(400, f"completion_window must be '24h' (or kvflow's <N>s, <N>m, <N>h, <N>d), got {window!r}",
                       param="completion_window", code="invalid_value")
    return int(m.group(1)) * SECONDS[m.group(2)]


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return
    if len(metadata) > 16:
        raise APIError(400, f"metadata holds at most 16 key-value pairs, got {len(metadata)}", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64 or len(v) > 512:
            raise APIError(400, f"metadata key {k[:64]!r}: keys hold at most 64 characters and values 512",
                           param="metadata")


def _ts(x: float | None) -> int | None:
    return None if x is None else int(x)


def batch_object(b: dict) -> dict:
    inp, out = b["input_tokens"], b["output_tokens"]
    return {
        "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "model": b["model"], "errors": b["errors"],
        "input_file_id": b["input_file_id"], "completion_window": b["completion_window"], "status": b["status"],
        "output_file_id": b["output_file_id"], "error_file_id": b["error_file_id"],
        "created_at": _ts(b["created_at"]), "in_progress_at": _ts(b["in_progress_at"]),
        "expires_at": _ts(b["expires_at"]), "finalizing_at": _ts(b["finalizing_at"]),
        "completed_at": _ts(b["completed_at"]), "failed_at": _ts(b["failed_at"]), "expired_at": _ts(b["expired_at"]),
        "cancelling_at": _ts(b["cancelling_at"]), "cancelled_at": _ts(b["cancelled_at"]),
        "request_counts": {"total": b["total"], "completed": b["completed"], "failed": b["failed"]},
        "metadata": b["metadata"],
        "usage": {"input_tokens": inp, "input_tokens_details": {"cached_tokens": b["cached_tokens"]},
                  "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": inp + out},
    }


def no_such_batch(batch_id: str, param: str = "batch_id") -> APIError:
    return APIError(404, f"No such Batch object: {batch_id}", param=param)


def batches_router(handle: StoreHandle, worker: BatchWorker, config: ServerConfig) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/batches", response_model=None)
    async def create_batch(req: BatchCreateRequest):
        if req.output_expires_after is not None:
            raise APIError(400, "output_expires_after is not supported by kvflow: output files are kept until "
                                "deleted", param="output_expires_after")
        if req.endpoint not in URLS:
            raise APIError(400, f"endpoint {req.endpoint!r} is not supported: kvflow's batches run "
                                f"{', '.join(URLS)}", param="endpoint", code="invalid_value")
        window = window_seconds(req.completion_window)
        check_metadata(req.metadata)
        store = handle.get()
        f = store.get_file(req.input_file_id)
        if f is None:
            raise no_such_file(req.input_file_id, "input_file_id")
        if f["purpose"] != "batch":
            raise APIError(400, f"file {req.input_file_id} has purpose {f['purpose']!r}: a batch's input file must "
                                "be uploaded with purpose 'batch'", param="input_file_id", code="invalid_value")
        # its results will need about as much again, and more: keep --batch-min-free-space free
        check_free_space(store.dir, 2 * f["bytes"], config.batch_min_free_space)
        batch_id = new_batch_id()
        b = await asyncio.to_thread(store.create_batch, batch_id, req.endpoint, req.input_file_id,
                                    req.completion_window, time.time() + window, req.metadata)
        worker.wake()
        return batch_object(b)

    @router.get("/v1/batches", response_model=None)
    async def list_batches(after: str | None = None, limit: int = Query(20, ge=1, le=100)):
        try:
            rows, more = await asyncio.to_thread(handle.get().list_batches, after=after, limit=limit)
        except ValueError:
            raise no_such_batch(after, "after") from None
        return list_page([batch_object(b) for b in rows], more)

    @router.get("/v1/batches/{batch_id}", response_model=None)
    async def retrieve_batch(batch_id: str):
        b = handle.get().get_batch(batch_id)
        if b is None:
            raise no_such_batch(batch_id)
        return batch_object(b)

    @router.post("/v1/batches/{batch_id}/cancel", response_model=None)
    async def cancel_batch(batch_id: str):
        store = handle.get()
        b = store.get_batch(batch_id)
        if b is None:
            raise no_such_batch(batch_id)
        if b["status"] in FINAL and b["status"] != "cancelled":
            raise APIError(400, f"Cannot cancel a batch with status '{b['status']}'.", param="batch_id",
                           code="invalid_state")
        await worker.cancel(store, batch_id)
        return batch_object(store.get_batch(batch_id))

    return router
