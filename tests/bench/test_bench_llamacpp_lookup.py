"""bench/llamacpp_lookup.py: how it reads llama-server's answers (samples captured from llama.cpp 0.3.36's
vendored server), that it stops with a clear message when the build is missing, and its whole run against a
stand-in ``llama-server`` (no llama.cpp build needed)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from bench import llamacpp_lookup
from bench.llamacpp_lookup import SpecCounters, parse_completion, parse_spec_counters

# llama-server's answer to a /completion of the first grounded prompt (16 tokens, --spec-type ngram-simple
# --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4), less its "generation_settings" and "prompt"
COMPLETION = (
    '{"index": 0, "content": "The committee met on Tuesday to discuss the new budjet, after a long debate", '
    '"tokens": [], "id_slot": 0, "stop": true, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", '
    '"tokens_predicted": 16, "tokens_evaluated": 117, "has_new_line": false, "truncated": false, '
    '"stop_type": "limit", "stopping_word": "", "tokens_cached": 132, "timings": {"cache_n": 0, '
    '"prompt_n": 117, "prompt_ms": 3448.475, "prompt_per_token_ms": 29.4741452991453, '
    '"prompt_per_second": 33.92804065565214, "predicted_n": 16, "predicted_ms": 1372.969, '
    '"predicted_per_token_ms": 91.53126666666667, "predicted_per_second": 10.925228464735913, '
    '"draft_n": 4, "draft_n_accepted": 1}}'
)
# its /metrics after that request (the other counters and gauges left out)
METRICS = """\
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 16
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 4
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 1
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 1
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 10.9252
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 1
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0
"""


def test_a_completion_gives_its_text_tokens_and_decode_time() -> None:
    completion = parse_completion(json.loads(COMPLETION))
    assert completion.content.startswith("The committee met on Tuesday")
    assert (completion.tokens, completion.decode_ms) == (16, 1372.969)


def test_the_speculative_counters_are_read_from_metrics() -> None:
    counters = parse_spec_counters(METRICS)
    assert counters == SpecCounters(drafts=1, draft_tokens=4, accepted_tokens=1)
    assert counters - SpecCounters(1, 0, 1) == SpecCounters(0, 4, 0)
    with pytest.raises(ValueError, match="no llamacpp:spec_decode_num_drafts_total"):  # an older server
        parse_spec_counters(METRICS.split("# HELP llamacpp:spec_decode_num_draft_tokens_total")[0])


def test_a_missing_server_binary_stops_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        llamacpp_lookup.main(["--llama-dir", str(tmp_path)])
    assert stop.value.code == 2
    assert f"no executable llama-server in {tmp_path}: build llama.cpp's server" in capsys.readouterr().err
    (tmp_path / "llama-server").write_text("not a program")  # there, but not executable
    with pytest.raises(SystemExit):
        llamacpp_lookup.main(["--llama-dir", str(tmp_path)])
    assert "no executable llama-server" in capsys.readouterr().err


# A stand-in for llama-server: /health, /completion (the text names the prompt's length; each request's
# speculation adds n_predict / 2 verify steps, 2 n_predict drafted and n_predict accepted tokens when
# started with --spec-type) and /metrics in llama.cpp's format; it appends its argv to $FAKE_LLAMA_ARGV.
FAKE_SERVER = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
with open(os.environ["FAKE_LLAMA_ARGV"], "a") as f:
    f.write(json.dumps(argv) + "\\n")
speculating = "--spec-type" in argv
counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0}


class Handler(BaseHTTPRequestHandler):
    def reply(self, body, kind="application/json"):
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self.reply(json.dumps({"status": "ok"}))
        lines = []
        for name, key in [("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted")]:
            lines += [f"# TYPE llamacpp:spec_decode_num_{name}_total counter",
                      f"llamacpp:spec_decode_num_{name}_total {counters[key]}"]
        self.reply("\\n".join(lines) + "\\n", "text/plain; version=0.0.4")

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = request["n_predict"]
        if speculating:
            counters["drafts"] += n // 2
            counters["draft_tokens"] += 2 * n
            counters["accepted"] += n
        body = {"content": f"answer to {len(request['prompt'])} tokens", "tokens_predicted": n,
                "timings": {"predicted_n": n, "predicted_ms": 10.0 * n}}
        self.reply(json.dumps(body))

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.mark.slow  # starts processes
def test_each_round_starts_one_server_per_system_and_counts_only_the_measured_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(argv_log))
    out = tmp_path / "rows.json"
    argv = ["--llama-dir", str(tmp_path), "--rounds", "2", "--prompts", "1", "--new-tokens", "16"]
    assert llamacpp_lookup.main([*argv, "--systems", "ngram-simple-K", "--json", str(out)]) == 0

    launches = [json.loads(line) for line in argv_log.read_text().splitlines()]
    assert [("--spec-type" in a) for a in launches] == [False, True, False, True]  # in turn, every round
    for a in launches:
        assert {"--metrics", "--no-repack"} <= set(a) and a[a.index("--parallel") + 1] == "1"
    assert " ".join(launches[1]).endswith(
        "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4"
    )
    plain, lookup = json.loads(out.read_text())
    assert plain["system"] == "llama.cpp plain" and plain["ratio"] == 1.0 and "draft_tokens" not in plain
    assert lookup["system"] == "llama.cpp ngram-simple-K" and lookup["output_tokens"] == [16, 16]
    assert lookup["decode_tok_s"] == 100.0  # 16 tokens in 160 ms
    # 2 rounds of one 16-token request: the warm-up requests' drafts are not counted
    assert lookup["draft_tokens"] == 2 * 2 * 16
    assert lookup["mean_acceptance_length"] == 3.0 and lookup["accepted_fraction"] == 0.5
    assert lookup["same_text_as_plain"] is True
