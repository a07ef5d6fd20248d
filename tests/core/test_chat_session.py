"""``plinth chat``: replies stream, Ctrl-C stops a reply (in a real process on a pseudo-terminal), and a
conversation that outgrows the context is trimmed instead of ending the session."""

from __future__ import annotations

import gc
import io
import os
import pty
import re
import select
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from plinth import LLM, SamplingParams
from plinth.chat_session import QUIT_HINT, STOPPED, ChatSession
from plinth.cli import main
from plinth.runtime.engine import InvalidRequest

sys.path.insert(0, str(Path(__file__).parent / "runtime" / "engine"))
from engine_helpers import save_tiny_folder  # noqa: E402 - a helper module beside the engine's tests

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_folder("llama", path)
    return path


@pytest.fixture(autouse=True)
def _thaw_gc() -> Iterator[None]:
    """``main(["chat", ...])`` freezes start-up's objects out of the cyclic GC; the session goes on."""
    yield
    gc.enable()
    gc.unfreeze()


class _Recorder(io.StringIO):
    """An output stream that remembers each write, to see a reply arrive in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        if s:
            self.writes.append(s)
        return super().write(s)


def test_replies_stream_and_long_conversations_are_trimmed(folder: Path) -> None:
    llm = LLM(model=str(folder), backend="cpu", max_model_len=96, num_kv_blocks=32, block_size=16)
    out, err = _Recorder(), io.StringIO()
    session = ChatSession(llm, GREEDY, system="be brief", out=out, err=err)
    assert session.capacity == 96 and session.reply_room == 16

    first = session.send("hello there", prefix="assistant> ")
    assert first.output is not None and len(first.output.outputs[0].token_ids) == 16
    assert out.writes[0] == "assistant> "
    assert len(out.writes) > 4  # the prefix, the reply in pieces as it was generated, the final newline

    for i in range(6):  # every exchange adds ~25 tokens: the history passes 80 prompt tokens soon
        reply = session.send(f"tell me more about the number {i} please")
        assert reply.output is not None  # the session never ends
        prompt_len = len(reply.output.prompt_token_ids)
        assert prompt_len <= session.prompt_budget == 80
    assert "dropped the oldest" in err.getvalue()
    assert session.messages[0] == {"role": "system", "content": "be brief"}  # the system prompt stays
    assert session.messages[-2]["content"] == "tell me more about the number 5 please"
    assert "hello there" not in [m["content"] for m in session.messages]  # the oldest went first

    kept = list(session.messages)
    with pytest.raises(InvalidRequest, match=r"the message is \d+ tokens .* the context holds 96"):
        session.send("word " * 200)  # too long even alone: refused, the history unchanged
    assert session.messages == kept
    assert session.send("and now?").output is not None


def test_chat_command_trims_instead_of_ending_the_session(
    folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [f"this is message number {i} of a long conversation" for i in range(6)]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join([*lines, "word " * 300, "last one"]) + "\n"))
    argv = ["chat", "--model", str(folder), "--max-model-len", "96", "--max-tokens", "12", "--ignore-eos"]
    assert main(argv) == 0  # at the end of the input (Ctrl-D)
    captured = capsys.readouterr()
    assert captured.out.count("assistant> ") == len(lines) + 1  # each message answered but the refused one
    assert "[the conversation outgrew the context (96 tokens): dropped the oldest" in captured.err
    assert "plinth: error: the message is" in captured.err and "send a shorter one" in captured.err


class _Terminal:
    """``plinth chat`` on a pseudo-terminal: the child's controlling terminal, so Ctrl-C (0x03 typed
    on it) is SIGINT as from a keyboard."""

    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: nothing but exec
            os.environ["TERM"] = "dumb"  # readline without escape sequences
            # as a shell starts a foreground job: SIGINT at its default, whatever this test process
            # inherited (an ignored SIGINT survives exec, and Python then never raises
            # KeyboardInterrupt). A suite started with `&` from a non-interactive shell, as CI
            # scripts do, runs with SIGINT ignored: bash ignores it in background jobs without job
            # control, and that is what made Ctrl-C at the prompt do nothing in full runs.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execv(sys.executable, [sys.executable, *argv])
        self.seen = ""  # what no expect() has consumed yet
        self.transcript = ""  # everything

    def expect(self, pattern: str, timeout: float = 120.0) -> str:
        """Read until ``pattern`` (a regex) appears after what was matched before; the text up to it."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.seen)
            if match:
                before, self.seen = self.seen[: match.start()], self.seen[match.end() :]
                return before
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"no {pattern!r} in the output; got {self.seen[-2000:]!r}")

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # the child exited: EIO
            return False
        text = data.decode(errors="replace").replace("\r\n", "\n")
        self.seen += text
        self.transcript += text
        return bool(data)

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    @staticmethod
    def settle() -> None:
        """Let the child reach its wait for input. CPython's readline loop sees a SIGINT only when it
        interrupts that select(): one that lands while readline is busy (drawing the prompt, taking a
        character) is noticed at the next key, so a Ctrl-C typed at once after output could hang here,
        though a person never types that fast."""
        time.sleep(0.3)

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.2)  # drain, so the child never blocks writing
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"plinth chat did not exit; output {self.seen[-2000:]!r}")


def test_ctrl_c_stops_a_streaming_reply_and_returns_to_the_prompt(folder: Path) -> None:
    term = _Terminal(["-m", "plinth", "chat", "--model", str(folder), "--max-tokens", "400", "--ignore-eos"])
    try:
        term.expect(r"you> ")
        for message in ("hello", "and again"):
            term.type(message + "\r")
            term.expect(r"assistant> ")
            term.expect(r"\S|\n")  # the reply has begun to stream; 400 tokens take far longer than this
            term.type("\x03")
            partial = term.expect(re.escape(STOPPED))
            assert len(partial) < 400  # stopped early (the tiny model writes a character or two a token)
            term.expect(r"you> ")  # back at the prompt, the engine ready for the next message
        term.type("not sent")
        term.expect("not sent")  # echoed: readline has taken the characters
        term.settle()
        term.type("\x03")  # Ctrl-C at the prompt: the line is dropped, a new prompt
        term.expect(re.escape(QUIT_HINT))
        term.expect(r"you> ")
        term.settle()
        term.type("\x03")  # twice in a row: quit
        status = term.wait()
    except BaseException:
        os.kill(term.pid, signal.SIGKILL)
        os.waitpid(term.pid, 0)
        raise
    finally:
        os.close(term.fd)
    assert status == 0
    assert "Traceback" not in term.transcript
