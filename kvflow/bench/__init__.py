"""`kvflow bench`: a streaming load generator for any OpenAI-compatible server, its statistics and reports.

workloads.py  what to send (random, shared-prefix, haiku, jsonl)
client.py     one streamed request, timed token by token
runner.py     warm-up, closed-loop concurrency / Poisson arrivals, sweeps
metrics_sampler.py  the server's /metrics sampled during a run
stats.py      throughput, latency percentiles, goodput, cost
report.py, plots.py  JSON, Markdown, self-contained HTML; compare
launcher.py, experiment.py  start server variants and compare them
cli.py        the command line
"""
