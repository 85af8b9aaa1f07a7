"""The /api route handlers: chat and generate on the chat path, the model routes, pull and delete.

/api/chat and /api/generate map their request (mapping.py) onto `prepare_chat`, so everything
that can refuse them does so before the 200, as on the other routes; a raw /api/generate is a
prompt used as it is, as /v1/completions uses it. They answer whole (stream: false) or as
NDJSON, one JSON object a line, the last with done: true and the durations. A stream ends when
its reader leaves (the job is cancelled with it); an error after the 200 is one {"error": ...}
line. A request with no messages (or an empty prompt) loads the model as Ollama does: it is
answered at once with done_reason "load" ("unload" with keep_alive 0). `name:latest` names
the model `name`. /api/pull and /api/delete are closed unless --allow-pull; then, beyond
loopback, they also need an API key.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Protocol

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server import __version__
from server.engine.token_loop import GenerationRequest
from server.errors import Forbidden, InvalidRequest, NotFound
from server.http.completions import TextOutput
from server.http.errors import describe
from server.http.ollama.mapping import (
    OLLAMA_DEFAULTS,
    chat_request,
    check_generate,
    generate_request,
    sampling,
)
from server.http.ollama.output import Collected, created_at, durations, logprobs_out
from server.http.ollama.protocol import (
    ChatLine,
    ChatRequest,
    Details,
    Durations,
    GenerateLine,
    GenerateRequest,
    KeepAlive,
    LogprobOut,
    MessageOut,
    ModelRequest,
    Out,
    Running,
    RunningModel,
    Show,
    Status,
    TagModel,
    Tags,
    ToolCallOut,
    Version,
)
from server.http.serving import (
    Pieces,
    Plan,
    ServeContext,
    check_model,
    check_prompt,
    clamp_max_tokens,
    collect,
    prepare_chat,
    prompt_tokens,
    streamed,
    submit,
)
from server.loading.loader import LoadedModel

NDJSON = "application/x-ndjson"
LATEST = ":latest"
# /api/ps's expires_at for a model kept loaded for as long as the server runs
_NEVER = "2318-01-01T00:00:00Z"


def served_name(model: LoadedModel, requested: str) -> str:
    """The model's name that `requested` means (`name:latest` is `name`); NotFound if none."""
    if requested not in model.info.names and requested.endswith(LATEST):
        base = requested.removesuffix(LATEST)
        if base in model.info.names:
            return base
    check_model(model, requested)
    return requested


def _listed(name: str) -> str:
    return name if ":" in name else name + LATEST


def _unloads(keep_alive: KeepAlive | None) -> bool:
    return keep_alive is not None and str(keep_alive).strip() in ("0", "0.0", "0s", "0m")


def _warn(ctx: ServeContext, body: ChatRequest | GenerateRequest) -> None:
    ctx.warn_unknown(body.model_extra)
    if body.options is not None:
        ctx.warn_unknown({f"options.{k}": v for k, v in (body.options.model_extra or {}).items()})


class _Lines(Protocol):
    """How chat and generate write one line of their answer; `last` set on the done line."""

    def __call__(
        self,
        text: str,
        thinking: str,
        calls: list[ToolCallOut] | None,
        logprobs: list[LogprobOut] | None,
        last: Durations | None,
    ) -> Out: ...


def _chat_lines(model: str) -> _Lines:
    def line(
        text: str,
        thinking: str,
        calls: list[ToolCallOut] | None,
        logprobs: list[LogprobOut] | None,
        last: Durations | None,
    ) -> Out:
        message = MessageOut(content=text, thinking=thinking or None, tool_calls=calls or None)
        done = last.model_dump(exclude_none=True) if last is not None else {}
        return ChatLine(
            model=model,
            created_at=created_at(),
            message=message,
            done=last is not None,
            logprobs=logprobs,
            **done,
        )

    return line


def _generate_lines(model: str) -> _Lines:
    def line(
        text: str,
        thinking: str,
        calls: list[ToolCallOut] | None,
        logprobs: list[LogprobOut] | None,
        last: Durations | None,
    ) -> Out:
        done = last.model_dump(exclude_none=True) if last is not None else {}
        return GenerateLine(
            model=model,
            created_at=created_at(),
            response=text,
            thinking=thinking or None,
            done=last is not None,
            logprobs=logprobs,
            **done,
        )

    return line


def _ndjson(payload: dict[str, object]) -> bytes:
    return (json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


async def _stream(
    ctx: ServeContext, plan: Plan, lines: _Lines, collected: Collected, started_ns: int, top: bool
) -> AsyncIterator[bytes]:
    want_logprobs = plan.job.request.params.logprobs
    try:
        # nothing sets the event: the job ends with the stream (its reader gone, or shutdown)
        async for item in streamed(ctx, plan, anyio.Event()):
            if isinstance(item, Pieces):
                collected.feed(item.pieces)
                text, thinking = collected.take_text()
                lps = logprobs_out(item.logprobs, top) if want_logprobs and item.logprobs else None
                if text or thinking or lps:
                    yield _ndjson(lines(text, thinking, None, lps, None).to_json())
                continue
            calls = collected.tool_calls()
            if calls:
                yield _ndjson(lines("", "", calls, None, None).to_json())
            yield _ndjson(lines("", "", None, None, durations(item.stats, started_ns)).to_json())
    except Exception as exc:  # noqa: BLE001 - after the 200, the worker's failure or the server stopping is a line
        _, body, _ = describe(exc, ctx.engine.queue_full_status, ollama=True)
        yield _ndjson(body)


async def _answer(
    ctx: ServeContext,
    plan: Plan,
    request: Request,
    lines: _Lines,
    *,
    stream: bool,
    think: bool,
    started_ns: int,
) -> Response:
    top = plan.job.request.params.top_logprobs > 0
    collected = Collected(keep_thinking=think)
    if stream:
        return StreamingResponse(_stream(ctx, plan, lines, collected, started_ns, top), media_type=NDJSON)
    pieces, logprobs, finished = await collect(ctx, plan, request)
    collected.feed(pieces)
    text, thinking = collected.take_text()
    lps = logprobs_out(logprobs, top) if plan.job.request.params.logprobs else None
    last = durations(finished.stats, started_ns)
    return JSONResponse(lines(text, thinking, collected.tool_calls(), lps, last).to_json())


def _loaded(lines: _Lines, keep_alive: KeepAlive | None) -> Response:
    reason = "unload" if _unloads(keep_alive) else "load"
    return JSONResponse(lines("", "", None, None, Durations(done_reason=reason)).to_json())


async def chat(ctx: ServeContext, body: ChatRequest, request: Request) -> Response:
    """POST /api/chat."""
    started_ns = time.monotonic_ns()
    _warn(ctx, body)
    name = served_name(ctx.ready_model(), body.model)
    lines = _chat_lines(body.model)
    if not body.messages:
        return _loaded(lines, body.keep_alive)
    plan = await prepare_chat(ctx, chat_request(body, ctx.settings.max_completion_tokens), model_id=name)
    think = body.think is not False
    return await _answer(ctx, plan, request, lines, stream=body.stream, think=think, started_ns=started_ns)


async def generate(ctx: ServeContext, body: GenerateRequest, request: Request) -> Response:
    """POST /api/generate."""
    started_ns = time.monotonic_ns()
    _warn(ctx, body)
    model = ctx.ready_model()
    name = served_name(model, body.model)
    check_generate(body)
    lines = _generate_lines(body.model)
    if not body.prompt:
        return _loaded(lines, body.keep_alive)
    cap = ctx.settings.max_completion_tokens
    if not body.raw:
        plan = await prepare_chat(ctx, generate_request(body, cap), model_id=name)
    else:
        if body.format:
            raise InvalidRequest(
                "format needs the chat template: a raw prompt is not constrained", param="format"
            )
        tokens = await prompt_tokens(model, body.prompt)
        check_prompt(ctx, model, len(tokens), "prompt")
        params = sampling(body.options, cap, body.logprobs, body.top_logprobs)
        params = replace(params, max_tokens=clamp_max_tokens(ctx, model, params.max_tokens, len(tokens)))
        plan = submit(
            ctx,
            model,
            "cmpl-",
            GenerationRequest(tokens, params),
            TextOutput(),
            model_id=name,
            timings=False,
            include_usage=False,
        )
    think = body.think is not False
    return await _answer(ctx, plan, request, lines, stream=body.stream, think=think, started_ns=started_ns)


# ---------------------------------------------------------------------- the model routes


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _quantization(model: LoadedModel) -> str:
    import gguf

    file_type = model.llama.metadata.get("general.file_type")
    try:
        return gguf.LlamaFileType(int(file_type or "")).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return "unknown"


def _parameter_size(model: LoadedModel) -> str:
    n = int(model.llama._model.n_params())
    return f"{n / 1e9:.1f}B" if n >= 10**9 else f"{n / 1e6:.1f}M"


def _details(model: LoadedModel) -> Details:
    arch = model.info.architecture
    return Details(
        family=arch,
        families=[arch],
        parameter_size=_parameter_size(model),
        quantization_level=_quantization(model),
    )


def _tag(model: LoadedModel, name: str) -> TagModel:
    info = model.info
    return TagModel(
        name=_listed(name),
        model=_listed(name),
        modified_at=_iso(info.created),
        size=info.file_size,
        digest=hashlib.sha256(info.fingerprint.encode()).hexdigest(),
        details=_details(model),
    )


async def tags(ctx: ServeContext) -> Response:
    """GET /api/tags: the served model, under each of its names."""
    model = ctx.ready_model()
    return JSONResponse(Tags(models=[_tag(model, name) for name in model.info.names]).to_json())


async def running(ctx: ServeContext) -> Response:
    """GET /api/ps: the loaded model, kept loaded while the server runs."""
    model = ctx.ready_model()
    tag = _tag(model, model.info.id)
    loaded = RunningModel(**tag.model_dump(), expires_at=_NEVER, size_vram=0, context_length=model.info.n_ctx)
    return JSONResponse(Running(models=[loaded]).to_json())


def _typed(value: str) -> object:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


async def show(ctx: ServeContext, body: ModelRequest) -> Response:
    """POST /api/show: the model's details, GGUF metadata, template and capabilities."""
    ctx.warn_unknown(body.model_extra)
    model = ctx.ready_model()
    name = served_name(model, body.model_name or "")
    info = model.info
    arch = info.architecture
    metadata = {
        key: _typed(value)
        for key, value in model.llama.metadata.items()
        if key.startswith(("general.", f"{arch}."))
    }
    metadata["general.parameter_count"] = int(model.llama._model.n_params())
    template = info.chat_template or ""
    capabilities = ["completion"]
    if "tools" in template:
        capabilities.append("tools")
    if ctx.template(model).style != "none":
        capabilities.append("thinking")
    d = OLLAMA_DEFAULTS
    parameters = "\n".join(
        [
            f"temperature {d.temperature}",
            f"top_k {d.top_k}",
            f"top_p {d.top_p}",
            f"repeat_penalty {d.repeat_penalty}",
            f"num_ctx {info.n_ctx}",
        ]
    )
    answer = Show(
        modelfile=f"# {_listed(name)}, served by moeflash\nFROM {info.path}\n",
        parameters=parameters,
        template=template,
        details=_details(model),
        model_info=metadata,
        capabilities=capabilities,
        modified_at=_iso(info.created),
    )
    return JSONResponse(answer.to_json())


async def version() -> Response:
    """GET /api/version: this server's version."""
    return JSONResponse(Version(version=__version__).to_json())


# ---------------------------------------------------------------------- pull and delete


def check_pull_allowed(ctx: ServeContext, route: str) -> None:
    """Forbidden unless --allow-pull, and beyond loopback an API key too."""
    settings = ctx.settings
    if not settings.allow_pull:
        raise Forbidden(
            f"{route} is closed on this server: it is started without --allow-pull", code="pull_disabled"
        )
    if not settings.is_loopback() and settings.resolved_api_key() is None:
        raise Forbidden(
            f"{route} needs an API key when the server is reachable beyond loopback", code="pull_disabled"
        )


def _hub_ref(name: str) -> str:
    for prefix in ("hf.co/", "huggingface.co/", "https://huggingface.co/", "https://hf.co/"):
        name = name.removeprefix(prefix)
    return name.removesuffix(LATEST)


async def pull(ctx: ServeContext, body: ModelRequest) -> Response:
    """POST /api/pull: a model from the Hugging Face Hub (as `moeflash pull` does), into
    MOEFLASH_MODELS_DIR or the Hugging Face cache; `stream` reports it as NDJSON lines."""
    check_pull_allowed(ctx, "/api/pull")
    from server.hub import default_storage, hub_api
    from server.hub import pull as hub_pull
    from server.settings import StoreSettings

    ref = _hub_ref(body.model_name or "")
    storage = default_storage(StoreSettings.model_validate({}).models_dir)

    async def run() -> list[Status]:
        local = await run_in_threadpool(lambda: hub_pull(ref, storage, hub_api(), progress=False))
        done = [
            Status(status=f"pulled {path.name}", total=path.stat().st_size, completed=path.stat().st_size)
            for path in local.files
        ]
        return [*done, Status(status="verifying sha256 digest"), Status(status="success")]

    if not body.stream:
        return JSONResponse((await run())[-1].to_json())

    async def lines() -> AsyncIterator[bytes]:
        yield _ndjson(Status(status="pulling manifest").to_json())
        try:
            for status in await run():
                yield _ndjson(status.to_json())
        except Exception as exc:  # noqa: BLE001 - after the 200, a failed pull is a line
            _, body_, _ = describe(exc, ctx.engine.queue_full_status, ollama=True)
            yield _ndjson(body_)

    return StreamingResponse(lines(), media_type=NDJSON)


async def delete(ctx: ServeContext, body: ModelRequest) -> Response:
    """DELETE /api/delete: a pulled model's files (never the model being served)."""
    check_pull_allowed(ctx, "/api/delete")
    from server.hub import default_storage
    from server.settings import StoreSettings

    name = (body.model_name or "").removesuffix(LATEST)
    storage = default_storage(StoreSettings.model_validate({}).models_dir)
    found = [m for m in storage.models() if m.name == name]
    if not found:
        raise NotFound(f"model '{body.model_name}' not found", param="model", code="model_not_found")
    served = ctx.ready_model().info.path.resolve()
    for model in found:
        if any(p.resolve() == served for p in model.files):
            raise InvalidRequest(
                f"model '{name}' is being served: stop the server to delete it", param="model"
            )
    for model in found:
        storage.remove(model)
    return Response(status_code=200)
