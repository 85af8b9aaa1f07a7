// The openai npm SDK as an app uses it, in node or in a browser page: a chat, a streamed chat, a
// json_schema answer read with the strict JSON.parse, a forced tool call, the Responses API.
// run(OpenAI, options) returns what each call gave, for the Python test to check.
export async function run(OpenAI, { baseURL, model, apiKey, browser }) {
  const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, dangerouslyAllowBrowser: browser });
  const messages = [{ role: "user", content: "The capital of France is" }];
  const out = {};

  const whole = await client.chat.completions.create({ model, messages, max_tokens: 16, temperature: 0 });
  out.text = whole.choices[0].message.content;

  const stream = await client.chat.completions.create({
    model, messages, max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  out.streamed = "";
  for await (const chunk of stream) {
    if (chunk.choices.length && chunk.choices[0].delta.content) out.streamed += chunk.choices[0].delta.content;
    if (chunk.usage) out.streamUsage = chunk.usage.completion_tokens;
  }

  const schema = {
    type: "object",
    properties: { city: { type: "string" }, country: { type: "string" } },
    required: ["city", "country"],
    additionalProperties: false,
  };
  const json = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "Paris as JSON" }], max_tokens: 120, temperature: 0,
    response_format: { type: "json_schema", json_schema: { name: "place", schema, strict: true } },
  });
  out.jsonFinish = json.choices[0].finish_reason;
  out.parsed = JSON.parse(json.choices[0].message.content);

  const tool = { type: "function", function: { name: "place", parameters: schema } };
  const call = await client.chat.completions.create({
    model, messages: [{ role: "user", content: "Where is Paris?" }], max_tokens: 120, temperature: 0,
    tools: [tool], tool_choice: { type: "function", function: { name: "place" } },
  });
  out.toolArguments = JSON.parse(call.choices[0].message.tool_calls[0].function.arguments);

  const response = await client.responses.create({ model, input: "Hello!", max_output_tokens: 8 });
  out.responseText = response.output_text;
  return out;
}
