"""The server's settings and the chat-template rule, without a model or a socket."""
from __future__ import annotations

import pytest

from stallfree.model.tokenizer import chat_prompt_ids
from stallfree.server import DEFAULT_SERVED_MODEL_NAME, ServerConfig
from stallfree.server.config import RequestLimits, parse_port, parse_positive_int


def test_defaults_and_served_names(monkeypatch):
    monkeypatch.setenv("STALLFREE_API_KEY", "from-env")
    config = ServerConfig()
    assert (config.host, config.port, config.api_key, config.served_model_name,
            config.max_waiting_requests, config.iteration_log, config.uvicorn_log_level) == \
        ("127.0.0.1", 8000, "from-env", None, 1024, None, "info")
    assert config.limits() == RequestLimits() and not config.public_metrics
    assert config.served_names(None) == [DEFAULT_SERVED_MODEL_NAME]
    assert config.served_names("/m/model.gguf") == ["/m/model.gguf"]
    named = ServerConfig(served_model_name=["a", "b"])
    assert named.served_names("/m/model.gguf") == ["a", "b"]
    assert ServerConfig(served_model_name="a").served_model_name == ["a"]
    monkeypatch.delenv("STALLFREE_API_KEY")
    assert ServerConfig().api_key is None


@pytest.mark.parametrize("field,value", [
    ("port", 70000), ("port", -1), ("port", "8000"), ("host", ""),
    ("served_model_name", []), ("served_model_name", ["a", ""]),
    ("max_waiting_requests", 0), ("max_waiting_requests", True),
    ("iteration_log", 3), ("uvicorn_log_level", "loud"), ("api_key", 42),
    ("max_body_bytes", 0), ("max_prompts", -1), ("max_sequences", 1.5),
    ("max_stop_strings", 17), ("max_stop_length", 0), ("max_stop_token_ids", True),
    ("max_logprobs", 21), ("max_logprobs", -1), ("tokenizer_threads", 0),
    ("body_timeout", 0), ("max_connections", 0), ("header_timeout", True)])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_flag_parsers():
    assert parse_port("0") == 0 and parse_port("65535") == 65535
    for text, message in (("x", "not a port number"), ("65536", r"\[0, 65535\]")):
        with pytest.raises(ValueError, match=message):
            parse_port(text)
    assert parse_positive_int("3") == 3
    for text, message in (("x", "not an integer"), ("0", ">= 1")):
        with pytest.raises(ValueError, match=message):
            parse_positive_int(text)


class _Tokenizer:
    """Returns what newer transformers do: a BatchEncoding-like mapping."""

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=True):
        assert tokenize
        ids = [len(m["content"]) for m in conversation] + ([99] if add_generation_prompt else [])
        return {"input_ids": ids}


def test_chat_prompt_ids_unwraps_and_validates():
    conversation = [{"role": "user", "content": "abc"}]
    assert chat_prompt_ids(_Tokenizer(), conversation) == [3, 99]
    assert chat_prompt_ids(_Tokenizer(), conversation, add_generation_prompt=False) == [3]
    for bad in ([], [{"role": "user"}], ["hi"]):
        with pytest.raises(ValueError, match="messages"):
            chat_prompt_ids(_Tokenizer(), bad)


def test_connection_cap_fits_the_open_file_limit():
    from stallfree.server.config import ConnectionLimits
    from stallfree.server.connections import FD_RESERVE, accept_backlog, fitted_limits

    limits = ServerConfig(max_connections=5000, header_timeout=3).connection_limits()
    assert limits == ConnectionLimits(max_connections=5000, header_timeout=3)
    assert fitted_limits(limits, 1 << 20) == limits
    small = fitted_limits(limits, 1024)  # room for the reserve and one accept batch
    assert small.max_connections == 1024 - FD_RESERVE - accept_backlog(1024)
    assert small.header_timeout == 3
