"""Chat templates (tokenizer.chat_template) written into the synthetic models.

They render under llama-cpp-python's sandboxed Jinja2ChatFormatter (trim_blocks, lstrip_blocks,
loopcontrols; `raise_exception`, `tojson`, `bos_token`, `eos_token`, `tools` available) and
under Hugging Face transformers. Each is a compact version of the real family's template, so a
server exercises the same prompt structure (roles, tool calls, reasoning channels) as with the
real models.
"""

from __future__ import annotations

# ChatML as Qwen3 writes it: system prompt, <tools> block, <tool_call> JSON in assistant turns,
# consecutive tool results folded into one user turn as <tool_response>, reasoning kept out of
# the history (text up to </think> is dropped), and `enable_thinking=false` pre-fills an empty
# <think></think>.
CHATML = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' or message.role == 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n' if content or not loop.first else '' }}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unsupported role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

# gpt-oss "harmony": a fixed system header (reasoning effort, valid channels), the system
# message as developer instructions with the tool namespace, assistant reasoning on the
# 'analysis' channel (`thinking` / `reasoning_content` field, kept only after the last user
# turn like the real template), answers on 'final', tool calls on 'commentary' ending with
# <|call|>, tool results as functions.<name> messages. Generation starts at '<|start|>assistant'
# and the model chooses the channel; <|return|> ends the answer.
HARMONY = """\
{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n'
    'Knowledge cutoff: 2024-06\\n\\nReasoning: ' + effort + '\\n\\n'
    '# Valid channels: analysis, commentary, final. Channel must be included for every message.' }}
{%- if tools %}
{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- set ns = namespace(last_user=-1, tool_name='tool') %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- set ns.last_user = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- set has_system = messages and messages[0].role in ['system', 'developer'] %}
{%- if has_system or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if has_system %}
{{- '# Instructions\\n\\n' + messages[0].content }}
{%- endif %}
{%- if tools %}
{{- ('\\n\\n' if has_system else '') + '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- '\\n// ' + (fn.description or '') + '\\n' }}
{{- 'type ' + fn.name + ' = (_: ' + (fn.parameters | tojson) + ') => any;\\n' }}
{%- endfor %}
{{- '\\n} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for message in messages %}
{%- if loop.first and has_system %}
{%- elif message.role == 'user' or message.role == 'system' or message.role == 'developer' %}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
{%- elif message.role == 'assistant' %}
{%- set thinking = message.thinking if message.thinking is defined and message.thinking
    else (message.reasoning_content if message.reasoning_content is defined and message.reasoning_content
    else '') %}
{%- if thinking and loop.index0 > ns.last_user %}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' }}
{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- set ns.tool_name = call.name %}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name + ' <|constrain|>json<|message|>' }}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
{{- '<|call|>' }}
{%- endfor %}
{%- elif message.content %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{%- set name = message.name if message.name is defined and message.name else ns.tool_name %}
{{- '<|start|>functions.' + name + ' to=assistant<|channel|>commentary<|message|>' }}
{{- message.content + '<|end|>' }}
{%- else %}
{{- raise_exception('unsupported role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start|>assistant' }}
{%- endif %}
"""

# Mistral/Mixtral [INST]: BOS once, each user turn wrapped in [INST] ... [/INST], each
# assistant turn closed by EOS; a system message is prepended to the next user turn (the
# instruct models have no system role).
MISTRAL = """\
{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- set ns.system = message.content + '\\n\\n' %}
{%- elif message.role == 'user' %}
{{- '[INST] ' + ns.system + message.content + ' [/INST]' }}
{%- set ns.system = '' %}
{%- elif message.role == 'assistant' %}
{{- ' ' + (message.content or '') + eos_token }}
{%- else %}
{{- raise_exception('only system, user and assistant roles are supported, not ' + message.role) }}
{%- endif %}
{%- endfor %}
"""

# Gemma 4: BOS, turns as <|turn>role ... <turn|> with the assistant as 'model', a system turn
# that also declares the tools, tool calls as <|tool_call>call:name{json}<tool_call|> (the real
# template writes the arguments in its own notation, strings in <|"|> quotes) and each
# tool result as <|tool_response>response:name{...}<tool_response|> inside the same model turn
# (the model's next message continues it), reasoning in <|channel>thought ... <channel|> dropped
# from the history, and an empty thought channel pre-filled unless `enable_thinking` is set.
GEMMA4 = """\
{{- bos_token }}
{%- set has_system = messages and messages[0].role in ['system', 'developer'] %}
{%- if has_system or tools %}
{{- '<|turn>system\\n' }}
{%- if has_system %}
{{- messages[0].content | trim }}
{%- endif %}
{%- for tool in tools or [] %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- '<|tool>declaration:' + fn.name + (fn | tojson) + '<tool|>' }}
{%- endfor %}
{{- '<turn|>\\n' }}
{%- endif %}
{%- set ns = namespace(tool_name='tool') %}
{%- for message in messages %}
{%- set next = messages[loop.index0 + 1] if not loop.last else none %}
{%- if loop.first and has_system %}
{%- elif message.role == 'user' or message.role == 'system' or message.role == 'developer' %}
{{- '<|turn>' + message.role + '\\n' + (message.content | trim) + '<turn|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|turn>model\\n' }}
{%- endif %}
{%- set content = message.content or '' %}
{%- if '<channel|>' in content %}
{%- set content = content.split('<channel|>')[-1] %}
{%- endif %}
{{- content | trim }}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- set ns.tool_name = call.name %}
{{- '<|tool_call>call:' + call.name }}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
{{- '<tool_call|>' }}
{%- endfor %}
{%- if not message.tool_calls or next is none or next.role != 'tool' %}
{{- '<turn|>\\n' }}
{%- endif %}
{%- elif message.role == 'tool' %}
{%- set name = message.name if message.name is defined and message.name else ns.tool_name %}
{{- '<|tool_response>response:' + name + '{value:<|"|>' + message.content + '<|"|>}<tool_response|>' }}
{%- if next is not none and next.role != 'tool' and next.role != 'assistant' %}
{{- '<turn|>\\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unsupported role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt and not (messages and messages[-1].role == 'tool') %}
{{- '<|turn>model\\n' }}
{%- if not (enable_thinking is defined and enable_thinking) %}
{{- '<|channel>thought\\n<channel|>' }}
{%- endif %}
{%- endif %}
"""
