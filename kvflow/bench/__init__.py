"""`kvflow bench`: a streaming load generator for any OpenAI-compatible server, its statistics and reports.

workloads.py  what to send (random, shared-prefix, haiku, jsonl)
client.py     one streamed request, timed token by token
runner.py     warm-up, closed-loop concurrency / Poisson arrivals, sweeps
metrics_sampler.py  the server's /metrics sampled during a run
stats.py      throughput, latency percentiles, goodput, cost
summary.py    a run's summaries, typed: the client's statistics and the server's /metrics
result.py     results.json, typed: a benchmark's meta and runs, an experiment's variants
report.py, plots.py  Markdown, self-contained HTML and the JSON file from a result; compare
launcher.py, experiment.py  start server variants and compare them
cli.py        the command line
"""
