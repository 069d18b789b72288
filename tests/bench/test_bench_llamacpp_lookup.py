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
