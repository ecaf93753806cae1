"""The HTTP server's parts, each alone in this process: its command line, chat templates (the sandbox too),
tokens to text with stop strings, the limits on what is admitted, and the one line a missing extra gets."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("jinja2", reason="the serve extra is not installed")
pytest.importorskip("pydantic", reason="the serve extra is not installed")

from metrale_model_engine import serve
from metrale_model_engine.serve.api.chat import ChatTemplate, ChatTemplateError
from metrale_model_engine.serve.api.text import TextStream
from metrale_model_engine.serve.args import parse_args
from metrale_model_engine.serve.limits import Limits
from metrale_model_engine.serve.protocol import ApiError

TEMPLATE = "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" + (
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# -- the command line ----------------------------------------------------------------------------------------


def test_the_servers_own_options_and_their_defaults() -> None:
    args = parse_args([])
    assert (args.host, args.port, args.served_model_name, args.max_waiting) == ("127.0.0.1", 8000, None, 256)
    assert (args.chat_template, args.drain_timeout, args.slots, args.world_size) == (None, 30.0, 16, 1)
    given = parse_args(["--port", "0", "--served-model-name", "m", "--max-waiting", "0", "--drain-timeout", "0.5"])
    assert (given.port, given.served_model_name, given.max_waiting, given.drain_timeout) == (0, "m", 0, 0.5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "65536"], "error: argument --port: must be at most 65535, got 65536"),
        (["--port", "x"], "error: argument --port: must be a whole number, got 'x'"),
        (["--max-waiting", "-1"], "error: argument --max-waiting: must be at least 0, got -1"),
        (["--drain-timeout", "-1"], "error: argument --drain-timeout: must be in [0, 86400], got -1"),
        (
            ["--chat-template", "/nonexistent.jinja"],
            "error: argument --chat-template: '/nonexistent.jinja' is not a file",
        ),
    ],
)
def test_a_bad_argument_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(message), line


def test_without_the_serve_extra_the_server_says_which_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # its import now raises ImportError
    assert serve.main(["--help"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: the server needs the 'serve' extra (uvicorn is missing): "
        "pip install 'metrale-model-engine[torch,serve]'"
    )


# -- chat templates ------------------------------------------------------------------------------------------


def write(directory: Path, name: str, text: str) -> Path:
    (directory / name).write_text(text, encoding="utf-8")
    return directory / name


def test_a_template_is_found_given_first_then_its_file_then_tokenizer_config(tmp_path: Path) -> None:
    assert ChatTemplate.find(tmp_path) is None
    config = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    write(tmp_path, "tokenizer_config.json", json.dumps({**config, "bos_token": {"content": "<s>"}}))
    found = ChatTemplate.find(tmp_path)
    assert (
        found is not None and found.render([]) == "D" and found.origin.endswith("tokenizer_config.json: chat_template")
    )
    write(tmp_path, "chat_template.jinja", TEMPLATE)
    found = ChatTemplate.find(tmp_path)
    assert found is not None and found.origin == str(tmp_path / "chat_template.jinja")
    assert found.render([{"role": "user", "content": "hi"}]) == "<s><user>hi<assistant>"
    assert found.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s><user>hi"
    given = write(tmp_path, "mine.jinja", "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    found = ChatTemplate.find(tmp_path, given)
    assert found is not None and found.render([{"role": "user", "content": "hi"}]) == "[hi]"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{% set _ = messages.append(1) %}",
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_a_template_that_reaches_for_python_is_refused_by_the_sandbox(source: str) -> None:
    with pytest.raises(ChatTemplateError, match=r"the chat template failed: .*(unsafe|not safely callable)"):
        ChatTemplate(source, "test").render([{"role": "user", "content": "hi"}])


def test_a_template_may_refuse_messages_and_a_broken_one_is_named(tmp_path: Path) -> None:
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", "test")
    with pytest.raises(ChatTemplateError, match=r"^roles must alternate$"):
        refusing.render([])
    with pytest.raises(ChatTemplateError, match=r"^test: not a jinja2 template \("):
        ChatTemplate("{% for %}", "test")
    with pytest.raises(ChatTemplateError, match=r"mine.jinja: cannot be read \(No such file or directory\)"):
        ChatTemplate.find(tmp_path, tmp_path / "mine.jinja")
    write(tmp_path, "tokenizer_config.json", "[not json")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json: not a JSON object"):
        ChatTemplate.find(tmp_path)


# -- tokens to text, stop strings ----------------------------------------------------------------------------


def byte_decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode(errors="replace")


def streamed(tokens: bytes, stops: Sequence[str], prompt: bytes = b"x") -> tuple[list[str], str, bool]:
    text = TextStream(byte_decode, list(prompt), stops)
    pieces = [text.add(token) for token in tokens]
    return pieces, text.finish(), text.stopped


def test_text_comes_token_by_token_and_a_partial_character_waits_for_its_end() -> None:
    pieces, rest, stopped = streamed("a é!".encode(), [])
    assert pieces == ["a", " ", "", "é", "!"] and rest == "" and not stopped  # é is two bytes: shown with the second


def test_a_stop_string_spanning_tokens_is_held_back_then_cut() -> None:
    pieces, rest, stopped = streamed(b"one STOP two", ["STOP"])
    assert "".join(pieces) == "one " and rest == "" and stopped
    assert pieces[:5] == ["", "", "", "o", "n"]  # three characters held: a stop string of 4 could begin there


def test_text_held_back_for_a_stop_string_that_never_came_is_given_at_the_end() -> None:
    pieces, rest, stopped = streamed(b"one ST", ["STOP", "zz"])
    assert "".join(pieces) + rest == "one ST" and not stopped and rest == " ST"  # the last 3: "STOP" could begin


def test_the_earliest_of_several_stop_strings_wins_and_nothing_follows_it() -> None:
    text = TextStream(byte_decode, [], ["cd", "b"])
    shown = "".join(text.add(token) for token in b"abcdef")
    assert shown == "a" and text.text == "a" and text.stopped and text.add(ord("g")) == "" and text.finish() == ""


def test_the_prompts_last_tokens_are_context_so_a_leading_space_survives() -> None:
    def strip_first(ids: Sequence[int]) -> str:  # as a decoder that drops the space a text starts with
        return byte_decode(ids).removeprefix(" ")

    text = TextStream(strip_first, list(b"Hello"), [])
    assert "".join(text.add(token) for token in b" world") == " world"


# -- limits --------------------------------------------------------------------------------------------------

LIMITS = Limits(max_seq_len=10, vocab_size=100, slots=2, max_waiting=1, kv_positions=64)  # a pool beyond the context


def refused(call: object) -> ApiError:
    with pytest.raises(ApiError) as error:
        assert callable(call)
        call()
    return error.value


def test_new_tokens_are_what_is_asked_or_what_the_context_leaves() -> None:
    assert LIMITS.new_tokens([1, 2, 3], 7, "max_tokens") == 7
    assert LIMITS.new_tokens([1, 2, 3], None, "max_tokens") == 7


@pytest.mark.parametrize(
    ("prompt", "most", "param", "message"),
    [
        ([], 1, "prompt", "prompt: the prompt is empty: it needs at least one token"),
        ([1, 100], 1, "prompt", "prompt: token 1 is 100, outside the vocabulary (0 ..= 99)"),
        ([1, -1], 1, "prompt", "prompt: token 1 is -1, outside the vocabulary (0 ..= 99)"),
        ([1] * 10, None, "prompt", "prompt: the prompt has 10 tokens; this model's context is 10 tokens, which "),
        ([1] * 3, 8, "max_tokens", "max_tokens: 8 new tokens and a prompt of 3 make 11, more than this model's "
         "context of 10 tokens (at most 7 here)"),
    ],
)  # fmt: skip
def test_a_request_that_does_not_fit_is_a_400_with_the_numbers(
    prompt: list[int], most: int | None, param: str, message: str
) -> None:
    error = refused(lambda: LIMITS.new_tokens(prompt, most, "max_tokens"))
    assert (error.status, error.param) == (400, param) and error.message.startswith(message)


def test_the_queue_takes_slots_plus_max_waiting_then_says_503_with_retry_after() -> None:
    LIMITS.admit(0, 3)
    LIMITS.admit(2, 1)
    full = refused(lambda: LIMITS.admit(3, 1))
    assert (full.status, full.retry_after, full.param) == (503, 1, None)
    assert "the server is full: 3 requests running or waiting, at most 3 (2 slots + --max-waiting 1)" in full.message
    never = refused(lambda: LIMITS.admit(0, 4))
    assert (never.status, never.param) == (400, "n") and "makes 4 sequences" in never.message
    assert full.body()["error"]["type"] == "service_unavailable" and never.body()["error"]["param"] == "n"
