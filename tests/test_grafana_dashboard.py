"""The Grafana dashboard kvflow ships (examples/grafana/kvflow.json) reads only series a live server exposes.

Every metric name its PromQL names (panel `expr`s and the `model_name` variable's query) must be a sample name on
the real /metrics page, with the label values its matchers ask for (`$model_name` set to the served name): a
renamed metric, a counter without its `_total`, a histogram queried without `_bucket` or a wrong label fails.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.config import EngineConfig
from kvflow.server.testing import ServerThread
from tiny_models import make_tiny_hf_model

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "kvflow.json"
MODEL = "tiny"
# the series vLLM's own example dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries: the
# one many people still run, with the pre-0.11 name of the inter-token latency
VLLM_EXAMPLE_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]

# ---- just enough PromQL: the vector selectors of an expression ------------------------------------------------
_STRING = r'"(?:[^"\\]|\\.)*"'
_SELECTOR = re.compile(r'(?<![\w:$])([a-zA-Z_:][\w:]*)\s*(\{(?:[^{}"]|' + _STRING + r')*\})?')
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!=|!~|=)\s*(' + _STRING + ')')
# clauses whose parentheses hold label names, not expressions
_LABEL_LISTS = re.compile(r'\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)')
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric name, {label: value} of its `=` matchers) for every vector selector in a PromQL expression."""
    expr = _LABEL_LISTS.sub(" ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)            # range and subquery durations ($__rate_interval too)
    out = []
    for m in _SELECTOR.finditer(expr):
        name, matchers = m.group(1), m.group(2) or ""
        rest = expr[m.end():].lstrip()
        if name in _KEYWORDS or (not matchers and rest.startswith("(")):     # a function or an operator
            continue
        labels = {k: json.loads(v) for k, op, v in _MATCHER.findall(matchers) if op == "="}
        out.append((name, labels))
    return out


def test_the_promql_reader_finds_metric_names():
    expr = ('histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name='
            '"$model_name"}[$__rate_interval])))\n/\nsum without(engine) (vllm:num_requests_running) '
            'and on(reason) kvflow:x{a="b", c=~"d.*"}')
    assert selectors(expr) == [("vllm:e2e_request_latency_seconds_bucket", {"model_name": "$model_name"}),
                               ("vllm:num_requests_running", {}), ("kvflow:x", {"a": "b"})]


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows' nested panels too) and variable queries."""
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", query)
            assert m, query
            exprs.append(m.group(1) + "{" + m.group(2) + '="$model_name"}')   # the series must carry the label
    return exprs


@pytest.fixture(scope="module")
def metrics_page(tmp_path_factory) -> str:
    path = make_tiny_hf_model(tmp_path_factory.mktemp("tiny-grafana"), family="llama", seed=2)
    cfg = EngineConfig(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                       served_model_name=MODEL)
    with ServerThread(cfg) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
                                       temperature=0.8)
        server.wait_idle()
        return httpx.get(server.url + "/metrics").text


def exposed_series(page: str) -> dict[str, list[dict[str, str]]]:
    """{sample name as Prometheus stores it (`_total`, `_bucket`, `_sum`, `_count` included): [its label sets]}."""
    series: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            series.setdefault(s.name, []).append(s.labels)
    return series


def missing(exprs: list[str], series: dict[str, list[dict[str, str]]]) -> list[str]:
    """The selectors no exposed series satisfies (name, and each `=` matcher with $model_name filled in)."""
    out = []
    for expr in exprs:
        for name, labels in selectors(expr):
            want = {k: v.replace("$model_name", MODEL) for k, v in labels.items()}
            if not any(all(have.get(k) == v for k, v in want.items()) for have in series.get(name, [])):
                out.append(f"{name}{want or ''}")
    return out


@pytest.mark.slow
def test_every_series_the_dashboard_queries_is_on_a_live_server(metrics_page):
    dashboard = json.loads(DASHBOARD.read_text())
    assert "model_name" in {v["name"] for v in dashboard["templating"]["list"]}
    exprs = dashboard_queries(dashboard)
    names = {name for e in exprs for name, _ in selectors(e)}
    # the panels cover the metrics vLLM's dashboards chart
    for name in ("vllm:iteration_tokens_total_bucket", "vllm:num_requests_waiting_by_reason", "vllm:cache_config_info",
                 "vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum",
                 "vllm:request_inference_time_seconds_sum", "vllm:request_num_preemptions_sum",
                 "vllm:request_max_num_generation_tokens_sum", "vllm:inter_token_latency_seconds_bucket"):
        assert name in names, name
    series = exposed_series(metrics_page)
    assert missing(exprs, series) == []
    # every vLLM-named query is scoped to the chosen model, except the cache config (no model_name, as vLLM's)
    for expr in exprs:
        for name, labels in selectors(expr):
            if name.startswith(("vllm:", "kvflow:")) and name != "vllm:cache_config_info":
                assert labels.get("model_name") == "$model_name", (name, expr)


@pytest.mark.slow
def test_the_check_fails_on_a_renamed_metric_or_a_wrong_suffix(metrics_page):
    series = exposed_series(metrics_page)
    assert missing(['rate(vllm:iteration_tokens_bucket{model_name="$model_name"}[5m])',   # lost its _total
                    'rate(vllm:prompt_tokens{model_name="$model_name"}[5m])',             # a counter without _total
                    'vllm:request_params_n{model_name="$model_name"}',                   # a histogram's bare name
                    'vllm:num_requests_running{model_name="other"}',                     # no such model
                    'sum by(reason) (vllm:num_requests_waiting_by_reason{reason="busy"})'], series) == [
        "vllm:iteration_tokens_bucket{'model_name': 'tiny'}", "vllm:prompt_tokens{'model_name': 'tiny'}",
        "vllm:request_params_n{'model_name': 'tiny'}", "vllm:num_requests_running{'model_name': 'other'}",
        "vllm:num_requests_waiting_by_reason{'reason': 'busy'}"]


@pytest.mark.slow
def test_the_series_vllms_example_dashboard_queries_are_there(metrics_page):
    series = exposed_series(metrics_page)
    assert [name for name in VLLM_EXAMPLE_DASHBOARD_SERIES if name not in series] == []
    assert [s["model_name"] for s in series["vllm:time_per_output_token_seconds_count"]] == [MODEL]
