"""Chat templates plinth supplies itself, for model files that carry none.

A GGUF converted without ``tokenizer.chat_template`` (many Gemma 3 conversions, the 270M checkpoint
plinth tests with among them) would otherwise refuse every chat request. The turn format is the
model family's documented one; the template text is plinth's own.
"""

from __future__ import annotations

GEMMA_END_OF_TURN = "<end_of_turn>"

# Gemma's turn format: <bos>, then "<start_of_turn>{user|model}\n{text}<end_of_turn>\n" per message
# and "<start_of_turn>model\n" as the generation prompt. Gemma has no system role: a system message
# is folded into the first user turn, ahead of its text and a blank line. Texts are trimmed, as in
# Gemma's training data; turns must alternate user/model.
GEMMA_TEMPLATE = """\
{%- macro text_of(message) -%}
  {%- if message['content'] is none -%}
  {%- elif message['content'] is string -%}
    {{- message['content'] | trim -}}
  {%- else -%}
    {%- for part in message['content'] -%}
      {%- if part['type'] != 'text' -%}
        {{- raise_exception("Gemma's chat template takes text only; a " + message['role']
            + " message has a '" + part['type'] + "' part") -}}
      {%- endif -%}
      {{- part['text'] | trim -}}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set turns = messages -%}
{%- set system = '' -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set system = text_of(messages[0]) -%}
  {%- set turns = messages[1:] -%}
  {%- if not turns -%}
    {{- raise_exception("a system message needs a user message after it: "
        + "Gemma folds the system text into the first user turn") -}}
  {%- endif -%}
{%- endif -%}
{%- for message in turns -%}
  {%- set role = 'model' if message['role'] in ('assistant', 'model') else message['role'] -%}
  {%- if role not in ('user', 'model') -%}
    {{- raise_exception("Gemma's chat template takes the roles system (first), user and assistant; got '"
        + message['role'] + "'") -}}
  {%- endif -%}
  {%- if (role == 'user') != (loop.index0 % 2 == 0) -%}
    {{- raise_exception("Gemma's turns must alternate user/assistant, starting with user; message "
        + (loop.index0 + (1 if system else 0)) | string + " is " + message['role']) -}}
  {%- endif -%}
  {{- '<start_of_turn>' + role + '\\n' -}}
  {%- if loop.first and system -%}
    {{- system + '\\n\\n' -}}
  {%- endif -%}
  {{- text_of(message) + '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<start_of_turn>model\\n' -}}
{%- endif -%}
"""

# general.architecture -> the template plinth uses when the file has none
_BUILTIN: dict[str, str] = dict.fromkeys(("gemma", "gemma2", "gemma3"), GEMMA_TEMPLATE)


def builtin_chat_template(architecture: str) -> str | None:
    """plinth's own chat template for a GGUF of ``architecture`` (its ``general.architecture``) that
    carries no ``tokenizer.chat_template``, or None when plinth has none for it.

    Only the Gemma family (gemma, gemma2, gemma3) has one: :data:`GEMMA_TEMPLATE`. A template the
    file does carry always wins over this one.
    """
    return _BUILTIN.get(architecture)
