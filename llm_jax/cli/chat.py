"""``scripts/generate.py --chat``: a conversation with a chat model, over stdin.

Every turn renders the whole history (system message, user and assistant messages) through the model's
chat template and generates the reply from it, streaming; after each reply one line on stderr says how
much of the context window the conversation now fills. On a terminal the input has a prompt and line
editing; from a pipe each line is one user message, so a conversation can be scripted.
"""

from __future__ import annotations

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
             generation: dict[str, Any], quiet: bool, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
             stderr: TextIO = sys.stderr) -> int:
    """Chat until /exit or the end of input; ``first_messages`` are sent before reading ``stdin``.
    ``generation`` holds the keyword arguments of ``generate_stream`` (sampling, budget, stops)."""
    from llm_jax.chat_template import encode_chat
    from llm_jax.generate import PromptTooLongError, generate_stream

    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer, which --chat needs")
    interactive = stdin.isatty()
    context = model.config.max_seq_len
    start: Messages = ({"role": "system", "content": system},) if system is not None else ()
    messages = start
    if interactive:
        print(f"chatting with {model.path} · context {context} tokens · /help for commands", file=stderr)
    for line in _user_lines(first_messages, stdin, interactive):
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = start
            print("[conversation reset]", file=stderr)
            continue
        if text == "/help":
            print("\n".join(f"{name:8} {what}" for name, what in COMMANDS.items()), file=stderr)
            continue
        if not text:
            continue
        turn = (*messages, {"role": "user", "content": text})
        prompt_ids = encode_chat(model.tokenizer, template.render(turn, add_generation_prompt=True))
        try:
            stream = generate_stream(model, [prompt_ids], **generation)
        except PromptTooLongError:
            print(f"[the conversation ({len(prompt_ids)} tokens) no longer fits the context of {context} tokens: "
                  "/reset to start over]", file=stderr)
            continue
        try:
            for event in stream:
                stdout.write(event.text)
                stdout.flush()
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n[reply interrupted]", file=stderr)  # Ctrl-C stops a reply; Ctrl-C at the prompt leaves
            continue
        stdout.write("\n")
        stdout.flush()
        (reply,) = stream.results
        messages = (*turn, {"role": "assistant", "content": reply.text})
        used = len(reply.prompt_ids) + len(reply.output_ids)
        fields = [f"context {used}/{context} tokens"] + ([] if quiet else metrics_fields(stream.metrics))
        print_status(fields, stderr)
    return 0


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
