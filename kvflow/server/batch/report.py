"""`kvflow batch report BATCH_ID [--batch-dir DIR] [--cost-per-hour X]`: what one batch of the online Batch API
did, read from its SQLite store (no server needed; one may be running on the same directory): status, requests,
wall time, throughput, tokens, errors by kind, and with `--cost-per-hour` (the machine's price) the cost of the
batch, per successful request and per million output tokens. Markdown on stdout.

Wall time is from `in_progress_at` (validated, first line may start) to the batch's end (`completed_at`,
`cancelled_at`, `expired_at`), or to now while it runs; a server restart in between counts as time spent.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter

from kvflow.server.batch.store import BatchStore
from kvflow.server.common.config import DEFAULT_BATCH_DIR

ENDS = ("completed_at", "cancelled_at", "expired_at", "failed_at")


def add_batch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("batch", help="inspect the online Batch API's batches (the server's --batch-dir)")
    bsub = p.add_subparsers(dest="batch_command", required=True)
    r = bsub.add_parser("report", help="a finished (or running) batch's throughput, tokens, errors and cost",
                        description="Report on one batch from the Batch API's store: throughput, tokens, errors, "
                                    "wall time and, given the machine's price, cost per successful request.")
    r.add_argument("batch_id", metavar="BATCH_ID")
    r.add_argument("--batch-dir", default=DEFAULT_BATCH_DIR, help="the server's --batch-dir (default: %(default)s)")
    r.add_argument("--cost-per-hour", type=float, default=None, metavar="X",
                   help="what the machine costs per hour (any currency): adds the batch's cost, per successful "
                        "request and per million output tokens")
    r.set_defaults(func=report_command)
    return p


def report_command(args) -> int:
    if args.cost_per_hour is not None and args.cost_per_hour < 0:
        raise ValueError(f"--cost-per-hour must be >= 0, got {args.cost_per_hour}")
    if not BatchStore.exists(args.batch_dir):
        raise FileNotFoundError(f"no batch store in {args.batch_dir} (the server's --batch-dir)")
    store = BatchStore(args.batch_dir)
    try:
        b = store.get_batch(args.batch_id)
        if b is None:
            raise ValueError(f"no batch {args.batch_id!r} in {args.batch_dir}")
        print(render(b, failures(store, args.batch_id), args.cost_per_hour))
    finally:
        store.close()
    return 0


def failures(store: BatchStore, batch_id: str) -> Counter:
    """(status code, error code, first message) -> lines, for the lines that did not succeed."""
    kinds: Counter = Counter()
    first: dict = {}
    for text in store.results(batch_id, ok=False):
        rec = json.loads(text)
        resp = rec.get("response") or {}
        err = ((resp.get("body") or {}).get("error") or rec.get("error") or {})
        key = (resp.get("status_code"), err.get("code"))
        first.setdefault(key, err.get("message") or "")
        kinds[key] += 1
    return Counter({(*k, first[k]): n for k, n in kinds.items()})


def render(b: dict, failed: Counter, cost_per_hour: float | None) -> str:
    start = b["in_progress_at"]
    end = next((b[k] for k in ENDS if b[k] is not None), None)
    wall = None if start is None else max(0.0, (end or time.time()) - start)
    done, ok, bad, total = b["completed"] + b["failed"], b["completed"], b["failed"], b["total"]
    inp, cached, out = b["input_tokens"], b["cached_tokens"], b["output_tokens"]

    def rate(x: float) -> str:
        return f"{x / wall:,.2f}/s" if wall else "-"

    rows = [("status", b["status"] + ("" if end or b["status"] in ("validating", "failed") else " (running)")),
            ("endpoint", b["endpoint"]), ("model", b["model"] or "-"),
            ("requests", f"{total:,} total: {ok:,} completed, {bad:,} failed, {total - done:,} not run"),
            ("wall time", "-" if wall is None else f"{wall:,.3f} s"),
            ("throughput", f"{rate(done)} requests, {rate(ok)} successful"),
            ("tokens", f"{inp:,} input ({cached:,} from the prefix cache), {out:,} output, {inp + out:,} total"),
            ("token throughput", f"{rate(out)} output, {rate(inp + out)} total")]
    if cost_per_hour is not None and wall is not None:
        cost = cost_per_hour * wall / 3600
        rows.append(("cost", f"{cost:,.6g} at {cost_per_hour:g}/hour"))
        rows.append(("cost per successful request", f"{cost / ok:,.6g}" if ok else "- (none succeeded)"))
        rows.append(("cost per million output tokens", f"{cost / out * 1e6:,.6g}" if out else "-"))
    lines = [f"# Batch {b['id']}", "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)]
    if b["errors"]:
        lines += ["", "## Validation errors (nothing ran)", "", "| line | code | message |", "| --- | --- | --- |"]
        lines += [f"| {e.get('line') or '-'} | {e.get('code')} | {e.get('message')} |" for e in b["errors"]["data"]]
    if failed:
        lines += ["", "## Failed requests", "", "| lines | status | code | first message |", "| --- | --- | --- | --- |"]
        for (status, code, message), n in failed.most_common():
            lines.append(f"| {n:,} | {status or '-'} | {code or '-'} | {message.replace('|', '/')[:200]} |")
    return "\n".join(lines)
