"""POST /v1/responses: OpenAI's Responses API on the chat engine.

The request maps onto the engine's ChatRequest (`prepare_chat` checks and submits it, one engine
path for every API): instructions become a system message, input items messages by one rule per
item type (items.py: calls an assistant's tool calls, their outputs tool messages, reasoning items
its reasoning, built-in and hosted tools' calls tool calls under their tool's name). The answer's
output items: reasoning, a message with one output_text part, one call item per call. Stateless:
nothing is kept, so previous_response_id is refused.

Tools (`Toolbox`): a `namespace` tool's functions are offered under joined names and their calls
come back as the API returns them, a function_call item with `namespace` and `name` apart (what
Codex CLI and the openai SDK dispatch on); a `custom` tool is a function of one string, `input`,
its call a custom_tool_call item; hosted tools (web_search, mcp, ...) are left out, logged once
per type.

A stream sends the events the openai SDK's `responses.stream` accumulates, each with a
sequence_number: response.created, response.in_progress, per output item output_item.added,
content_part.added, the deltas, their .done events and output_item.done, and last
response.completed (response.incomplete when max_output_tokens cut the answer). A call cut short
has no JSON arguments and is left out; a custom call's input is sent whole as its call closes.
"""

from server.http.openai.responses.mapping import Toolbox, to_chat_request
from server.http.openai.responses.protocol import ResponsesRequest
from server.http.openai.responses.route import create_response

__all__ = ["ResponsesRequest", "Toolbox", "create_response", "to_chat_request"]
