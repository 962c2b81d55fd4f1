"""`tokenmill serve` flags: command line over YAML file over defaults (no model loaded)."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from tests.server_utils import REPO, free_port
from tests.test_planner import write_gguf
from tokenmill.serve import cli as serve_cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenmill")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cli.register(sub)
    return parser.parse_args(["serve", *argv])


def parse(argv: list[str]) -> argparse.Namespace:
    return serve_cli.resolve_settings(parse_args(argv))


def test_defaults_without_flags():
    settings = parse([])
    assert (settings.host, settings.port, settings.model, settings.api_key) == ("127.0.0.1", 8000, None, None)
    # 25 s: the drain and closing fit Kubernetes' default 30 s grace period (issue 31).
    assert settings.shutdown_timeout == 25.0 and settings.max_queued_requests == 1024
    assert settings.header_timeout == 20.0 and settings.stream_send_timeout == 60.0
    assert settings.max_num_seqs == 64 and settings.enable_prefix_caching is True


def test_positional_model_and_flags():
    settings = parse(["/models/x.gguf", "--port", "9001", "--served-model-name", "a", "b", "--api-key", "k"])
    assert settings.model == "/models/x.gguf"
    assert settings.port == 9001 and settings.served_model_name == ["a", "b"] and settings.api_key == "k"


def test_command_line_wins_over_the_yaml_file_which_wins_over_defaults(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "port: 9100\nmax-model-len: 512\nkv_cache_memory: 64MiB\nserved-model-name: friendly\n"
        "no-prefix-caching: true\nshutdown-timeout: 5\n"
    )
    settings = parse(["--config", str(config), "--port", "9200"])
    assert settings.port == 9200  # command line
    assert settings.max_model_len == 512 and settings.kv_cache_memory == "64MiB"  # file
    assert settings.served_model_name == ["friendly"] and settings.enable_prefix_caching is False
    assert settings.shutdown_timeout == 5.0
    assert settings.max_num_seqs == 64  # default
    # A flag given explicitly at its default value still wins over the file.
    assert parse(["--port", "8000", "--config", str(config)]).port == 8000


@pytest.mark.parametrize(("text", "message"), [
    ("no_such_flag: 1\n", "unknown setting"),
    ("port: eighty\n", "port must be of type int"),
    ("- a list\n", "mapping"),
])
def test_bad_yaml_files_are_refused_by_name(tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse(["--config", str(config)])


def test_non_default_settings_are_logged_with_secrets_masked(caplog):
    args = parse_args(["--port", "9300", "--api-key", "s3cret"])
    with caplog.at_level(logging.INFO, logger="tokenmill.serve"):
        serve_cli.log_settings(serve_cli.resolve_settings(args), args._serve_defaults)
    assert "port=9300" in caplog.text and "s3cret" not in caplog.text and "api_key='***'" in caplog.text


# ----- start-up refusals and logs (issue 31) ---------------------------------------------------


def run_serve(*args: str) -> subprocess.CompletedProcess:
    port = free_port()
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("model", ["missing", "unsupported"])
def test_serve_refuses_a_bad_model_in_one_line_before_binding(tmp_path, model):
    if model == "missing":
        path, message = "/no/such/path", "does not exist"
    else:
        path, message = str(tmp_path / "odd.gguf"), "unsupported architecture 'mamba'"
        write_gguf(path, "mamba", {"block_count": 1}, {"token_embd.weight": (8, 4)})
    result = run_serve(path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert "Uvicorn running" not in result.stderr and "Started server" not in result.stderr


def test_library_http_logs_stay_at_warning():
    from tokenmill.cli import configure_logging

    configure_logging()
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("tokenmill.serve").getEffectiveLevel() == logging.INFO
    configure_logging("debug")
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.DEBUG
    configure_logging()


def test_the_start_up_line_names_the_weights_as_loaded():
    from tokenmill.runner.worker import DtypePlan

    plan = DtypePlan(compute="float32", weights="bfloat16", kv="bfloat16")
    assert str(plan) == "bfloat16 weights and KV cache, float32 compute"
    # A Q4_1 GGUF served as stored: its blocks, not bfloat16, are the weights.
    assert plan.describe("q4-g32 (q8-g32 head)") == "q4-g32 (q8-g32 head) weights, bfloat16 KV cache, float32 compute"
