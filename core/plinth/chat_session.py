"""``plinth chat``: a conversation on the terminal, its replies streamed as they are generated.

- Ctrl-C during a reply stops it between two engine steps (the engine is never left mid-step) and
  returns to the prompt; the part already shown stays in the history. A second Ctrl-C before the
  step ends interrupts at once (the offline API then forgets the half-done step).
- Ctrl-C at the prompt drops what was typed and prompts again; a second one in a row, Ctrl-D or
  ``/exit`` ends the session with status 0.
- A conversation that outgrows the context loses its oldest exchanges (the system prompt stays), and
  the session says so; a message that does not fit even alone is refused, and the session goes on.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from plinth.llm import LLM
    from plinth.runtime.outputs import RequestOutput
    from plinth.sampling_params import SamplingParams

#: Shown after a reply that Ctrl-C stopped.
STOPPED = "[stopped]"
#: Shown after a first Ctrl-C at the prompt.
QUIT_HINT = "(to quit: Ctrl-C again, Ctrl-D or /exit)"
_DEFAULT_REPLY_ROOM = 256  # tokens kept free for a reply when max_tokens is None


class _Stopped(Exception):
    """Raised from the streaming callback to end a reply that Ctrl-C stopped."""


class _SigintFlag:
    """While active, a first SIGINT only sets ``hit`` (checked between engine steps); a second raises
    KeyboardInterrupt, so a step that takes long can still be interrupted."""

    def __init__(self) -> None:
        self.hit = False
        self._active = False
        self._previous: Callable[[int, FrameType | None], object] | int | None = None

    def __enter__(self) -> _SigintFlag:
        if threading.current_thread() is threading.main_thread():  # only it may set signal handlers
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            # None: the handler was not set from Python; Python's own one raises KeyboardInterrupt
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.default_int_handler)
            self._active = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True


@dataclass(slots=True)
class Reply:
    """What :meth:`ChatSession.send` got: the reply's text, its final output (None when it was
    stopped or refused), and whether Ctrl-C stopped it."""

    text: str
    output: RequestOutput | None
    stopped: bool = False


class ChatSession:
    """One conversation: its history, trimmed to fit the context, and replies streamed to ``out``.

    :param system: the system prompt, kept through every trim.
    :param out: where reply text is streamed; ``err`` gets notes (trims, refusals).
    """

    def __init__(
        self,
        llm: LLM,
        params: SamplingParams,
        system: str | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        self.llm = llm
        self.params = params
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        engine = llm.engine
        # the engine refuses a prompt that leaves no room in the context or in the KV cache
        self.capacity = min(engine.max_model_len, (engine.num_blocks - 1) * engine.block_size)
        room = params.max_tokens if params.max_tokens is not None else _DEFAULT_REPLY_ROOM
        self.reply_room = min(room, self.capacity // 2)

    @property
    def prompt_budget(self) -> int:
        """Prompt tokens a turn may take: the context less the room kept for the reply."""
        return self.capacity - self.reply_room

    def send(self, text: str, prefix: str = "") -> Reply:
        """Add the user's message, trim the history to fit, and stream the reply (after ``prefix``).

        :raises plinth.runtime.engine.InvalidRequest: the message is refused (not valid text, or too
            long even alone); it is not kept.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            prompt = self._fit()
        except BaseException:
            self.messages.pop()
            raise
        self.out.write(prefix)
        shown = ""

        def stream(output: RequestOutput) -> None:
            nonlocal shown
            now = output.outputs[0].text
            self.out.write(now[len(shown) :])
            self.out.flush()
            shown = now
            if flag.hit and not output.finished:
                raise _Stopped

        final: RequestOutput | None = None
        try:
            with _SigintFlag() as flag:
                [final] = self.llm.generate(prompt, self.params, on_output=stream)
        except (_Stopped, KeyboardInterrupt):
            self.out.write(f"\n{STOPPED}\n")
            self.out.flush()
            if shown:
                self.messages.append({"role": "assistant", "content": shown})
            else:
                self.messages.pop()  # nothing was said: as if the message had not been sent
            return Reply(shown, None, stopped=True)
        except BaseException:
            self.messages.pop()
            raise
        reply = final.outputs[0].text
        self.out.write(reply[len(shown) :] + "\n")
        self.out.flush()
        self.messages.append({"role": "assistant", "content": reply})
        return Reply(reply, final)

    def _fit(self) -> list[int]:
        """The prompt of the history, after dropping the oldest exchanges that do not fit.

        :raises InvalidRequest: the newest message does not fit even alone (the history is kept)."""
        from plinth.runtime.engine import InvalidRequest

        first = 1 if self.messages[0]["role"] == "system" else 0
        alone = self.llm.encode_chat([*self.messages[:first], self.messages[-1]])
        if len(alone) > self.prompt_budget:
            raise InvalidRequest(
                f"the message is {len(alone)} tokens with the chat template"
                + (" and the system prompt" if first else "")
                + f"; the context holds {self.capacity}, {self.reply_room} of them kept for the reply: "
                "send a shorter one"
            )
        prompt = self.llm.encode_chat(self.messages)
        dropped = 0
        while len(prompt) > self.prompt_budget:
            # one exchange: the oldest user message and the replies up to the next user message
            end = first + 1
            while end < len(self.messages) - 1 and self.messages[end]["role"] != "user":
                end += 1
            del self.messages[first:end]
            dropped += 1
            prompt = self.llm.encode_chat(self.messages)
        if dropped:
            print(
                f"[the conversation outgrew the context ({self.capacity} tokens): dropped the oldest "
                f"{dropped} exchange{'s' if dropped > 1 else ''}]",
                file=self.err,
            )
        return prompt


def run_interactive(session: ChatSession, read: Callable[[str], str] = input) -> int:
    """The read-reply loop on the terminal; returns the exit status (0)."""
    if sys.stdin.isatty():
        import readline  # noqa: F401 - line editing and history for input()
    interrupted = False  # the last prompt ended with Ctrl-C
    while True:
        try:
            line = read("you> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            if interrupted:
                print()
                return 0
            interrupted = True
            print(f"\n{QUIT_HINT}", file=session.err)
            continue
        interrupted = False
        if not line.strip():
            continue
        if line.strip() in {"/exit", "/quit"}:
            return 0
        try:
            session.send(line, prefix="assistant> ")
        except KeyboardInterrupt:  # between the prompt and the first step: nothing was generated
            print(f"\n{STOPPED}", file=session.out)
        except ValueError as exc:  # refused (InvalidRequest, ChatTemplateError): the session goes on
            print(f"plinth: error: {exc}", file=session.err)
