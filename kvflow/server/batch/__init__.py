"""The Batch API: files, batches, their SQLite store and worker, the batch line runner (shared with
`kvflow run-batch`) and `kvflow batch report`."""
