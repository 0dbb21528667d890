"""``scripts/generate.py --chat``: a conversation with a chat model, over stdin.

Every turn renders the whole history (system message, user and assistant messages) through the model's
chat template and generates the reply from it, streaming; after each reply one line on stderr says how
much of the context window the conversation now fills. On a terminal the input has a prompt and line
editing; from a pipe each line is one user message, so a conversation can be scripted.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TextIO

from llm_jax.cli.output import metrics_fields, print_status

if TYPE_CHECKING:
    from llm_jax.chat_template import ChatTemplate
    from llm_jax.loading import Model

COMMANDS = {
    "/reset": "forget the conversation (the --system message stays)",
    "/exit": "leave (also /quit, Ctrl-D)",
    "/help": "this list",
}
Messages = tuple[dict[str, str], ...]


def run_chat(model: Model, template: ChatTemplate, *, system: str | None, first_messages: Sequence[str],
             generation: dict[str, Any], quiet: bool, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None) -> int:
    """Chat until /exit or the end of input; ``first_messages`` are sent before reading stdin.
    ``generation`` holds the keyword arguments of ``generate_stream`` (sampling, budget, stops)."""
    stdin = stdin or sys.stdin
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer, which --chat needs")
    session = _Session(model=model, template=template, generation=generation, quiet=quiet,
                       interactive=stdin.isatty(), stdout=stdout or sys.stdout, stderr=stderr or sys.stderr)
    start: Messages = ({"role": "system", "content": system},) if system is not None else ()
    messages = start
    if session.interactive:
        session.note(f"chatting with {model.path} · context {model.config.max_seq_len} tokens · /help for commands")
    for line in _user_lines(first_messages, stdin, session.interactive):
        match line.strip():
            case "/exit" | "/quit":
                break
            case "/reset":
                messages = start
                session.note("[conversation reset]")
            case "/help":
                session.note("\n".join(f"{name:8} {what}" for name, what in COMMANDS.items()))
            case "":
                pass
            case text:
                messages = session.turn(messages, text)
    return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Session:
    """What stays the same from turn to turn: the model, its template, the options, where text goes."""

    model: Model
    template: ChatTemplate
    generation: dict[str, Any]
    quiet: bool
    interactive: bool
    stdout: TextIO
    stderr: TextIO

    def turn(self, messages: Messages, text: str) -> Messages:
        """Stream the reply to user message ``text``; return the conversation with both, or unchanged when
        there is no reply (no room left in the context, or the reply was interrupted)."""
        from llm_jax.chat_template import encode_chat
        from llm_jax.generation import PromptTooLongError, generate_stream

        turn = (*messages, {"role": "user", "content": text})
        prompt_ids = encode_chat(self.model.tokenizer, self.template.render(turn, add_generation_prompt=True))
        context = self.model.config.max_seq_len
        try:
            stream = generate_stream(self.model, [prompt_ids], **self.generation)
        except PromptTooLongError:
            self.note(f"[the conversation ({len(prompt_ids)} tokens) no longer fits the context of {context} "
                      "tokens: /reset to start over]")
            return messages
        try:
            for event in stream:
                self.stdout.write(event.text)
                self.stdout.flush()
        except KeyboardInterrupt:
            if not self.interactive:
                raise
            self.note("\n[reply interrupted]")  # Ctrl-C stops a reply; Ctrl-C at the prompt leaves
            return messages
        self.stdout.write("\n")
        self.stdout.flush()
        (reply,) = stream.results
        used = len(reply.prompt_ids) + len(reply.output_ids)
        print_status([f"context {used}/{context} tokens", *([] if self.quiet else metrics_fields(stream.metrics))],
                     self.stderr)
        return (*turn, {"role": "assistant", "content": reply.text})

    def note(self, text: str) -> None:
        print(text, file=self.stderr, flush=True)


def _user_lines(first: Sequence[str], stdin: TextIO, interactive: bool) -> Iterator[str]:
    yield from first
    if not interactive:
        yield from iter(stdin.readline, "")
        return
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on every platform
        pass
    while True:
        try:
            yield input("> ")
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return
