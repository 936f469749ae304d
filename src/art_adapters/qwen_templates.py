"""Chat templates (our own writing) that render exactly Qwen2.5's and Qwen3's chat formats, for the tiny models.

Formats: ChatML turns; tools listed in the system turn; calls as `<tool_call>` JSON; tool results as `<tool_response>`
blocks inside one user turn. Qwen3 adds `<think>` reasoning, kept only for assistant turns after the last real user
query (earlier reasoning is stripped from history), and `enable_thinking=False`, which pre-fills an empty block.
Tool-call arguments given as a dict render as `tojson` (what vLLM passes: it parses the client's JSON string); a
string renders as given.
"""

from __future__ import annotations

_TOOLS_HEADER = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)
# The tools part of the system turn, after the system prompt (if any) and its blank line.
_TOOLS_BLOCK = (
    "{{- '"
    + _TOOLS_HEADER
    + "' }}\n{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n{{- '"
    + _TOOLS_FOOTER
    + "' }}\n"
)
# One call, without the separator before it (Qwen2.5 always writes "\n" first; Qwen3 only between parts).
_CALL_MACRO = """\
{%- macro render_call(call) -%}
{%- if call.function is defined %}{%- set call = call.function %}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string %}{{- call.arguments -}}{%- else %}{{- call.arguments | tojson -}}{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endmacro -%}
"""
_TOOL_TURN = """\
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + text + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
"""

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN25_CHAT_TEMPLATE = (
    _CALL_MACRO
    + """\
{%- set has_system = messages and messages[0].role == 'system' %}
{%- set system_text = messages[0].content if has_system else '"""
    + QWEN25_DEFAULT_SYSTEM
    + """' %}
{%- if tools %}
{{- '<|im_start|>system\\n' + system_text + '\\n\\n' }}
"""
    + _TOOLS_BLOCK
    + """\
{%- else %}
{{- '<|im_start|>system\\n' + system_text + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set text = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or
      (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + text + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if text %}{{- '\\n' + text }}{%- endif %}
{%- for call in message.tool_calls %}{{- '\\n' + render_call(call) }}{%- endfor %}
{{- '<|im_end|>\\n' }}
"""
    + _TOOL_TURN
    + """\
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
)

QWEN3_CHAT_TEMPLATE = (
    _CALL_MACRO
    + """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
"""
    + _TOOLS_BLOCK
    + """\
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{#- The last real user query: reasoning of assistant turns after it stays in history, earlier reasoning goes. #}
{%- set state = namespace(last_query=messages | length - 1, searching=true) %}
{%- for message in messages | reverse %}
{%- set index = messages | length - 1 - loop.index0 %}
{%- if state.searching and message.role == 'user' and message.content is string and
      not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
{%- set state.searching = false %}{%- set state.last_query = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set text = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + text + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if message.reasoning_content is not string and '</think>' in text %}
{%- set reasoning = text.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set text = text.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > state.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + text.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + text }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- if not loop.first or text %}{{- '\\n' }}{%- endif %}
{{- render_call(call) }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
"""
    + _TOOL_TURN
    + """\
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
)

CHAT_TEMPLATES: dict[str, str] = {"qwen2.5": QWEN25_CHAT_TEMPLATE, "qwen3": QWEN3_CHAT_TEMPLATE}
