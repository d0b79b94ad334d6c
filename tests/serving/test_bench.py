"""serving.bench against the in-process test server (admission limit 2)."""

import json
import math

import pytest

from serving import bench
from tests.serving.conftest import API_KEY

# One worker runs every test of the shared server (tests/serving/conftest.py), so it
# starts once (pyproject: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("serving-server")


def test_bench_measures_ttft_and_cache_hits_of_a_repeated_context(server, tmp_path):
    out = tmp_path / "bench.json"
    code = bench.main(["--url", server.url, "--api-key", API_KEY, "--requests", "2",
                       "--rate", "inf", "--context-len", "300", "--repeat-context",
                       "--max-tokens", "6", "--ignore-eos", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["completed"] == 2 and result["errors"] == 0
    assert result["lost"] == 0 and result["output_tokens"] == 12
    assert result["prompt_tokens_mean"] == 301  # 300 bytes + BOS
    assert result["cached_tokens_mean"] == 256 / 2  # the second request hit 4 blocks of 64
    assert result["ttft_ms"]["p50"] > 0 and result["ttft_first_ms"] > 0
    assert result["inter_token_latency_ms"]["p99"] > 0 and result["output_tokens_per_s"] > 0


def test_bench_counts_rejected_requests_as_errors(server, capsys):
    code = bench.main(["--url", server.url, "--api-key", API_KEY, "--requests", "5",
                       "--rate", "inf", "--context-len", "50", "--max-tokens", "100",
                       "--ignore-eos"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and result["completed"] == 2
    assert result["errors_by_kind"] == {"HTTP 503": 3} and result["lost"] == 0


def test_poisson_prompts_are_seeded_and_sized():
    a = bench.make_prompts(3, 200, repeat_context=False, seed=1)
    assert a == bench.make_prompts(3, 200, repeat_context=False, seed=1)
    assert all(len(p) == 200 for p in a) and len(set(a)) == 3
    shared = bench.make_prompts(3, 200, repeat_context=True, seed=1)
    assert len({p[:150] for p in shared}) == 1
    assert math.isclose(bench.percentile([1, 2, 3, 4], 50), 2.5)
