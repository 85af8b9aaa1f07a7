"""The model routes: /api/tags, /api/show, /api/ps, /api/version, /api/pull and /api/delete.

A model is described from the loaded model when it is the one the engine holds, else from its
GGUF header (serve --models-dir: read at start-up): listing or showing a model never loads it.
/api/ps lists the model while it is loaded, with when its keep_alive runs out. Names are listed
with Ollama's `:latest` tag. /api/pull and /api/delete are closed unless --allow-pull; then,
beyond loopback, they also need an API key.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response, StreamingResponse

from server import __version__
from server.errors import Forbidden, InvalidRequest, NotFound
from server.http.errors import describe
from server.http.ollama.mapping import OLLAMA_DEFAULTS
from server.http.ollama.protocol import (
    Details,
    ModelRequest,
    Running,
    RunningModel,
    Show,
    Status,
    TagModel,
    Tags,
    Version,
)
from server.http.ollama.route import LATEST, served_name
from server.http.serving import NDJSON, Ctx, ServeContext, ndjson_line
from server.lifecycle.switching import DirectoryModel
from server.loading.loader import LoadedModel

# seconds between /api/pull's progress lines
_PROGRESS_S = 0.5
# /api/ps's expires_at for a model kept loaded for as long as the server runs
_NEVER = "2318-01-01T00:00:00Z"


@dataclass(frozen=True)
class _Described:
    """What the model routes say about one model, loaded or not."""

    path: Path
    size: int
    created: int
    metadata: dict[str, Any]
    template: str
    parameter_size: str
    context_length: int
    digest: str

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))


def _typed(value: str) -> object:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value


def _of_loaded(model: LoadedModel) -> _Described:
    n = int(model.llama._model.n_params())
    metadata: dict[str, Any] = {key: _typed(value) for key, value in model.llama.metadata.items()}
    metadata["general.parameter_count"] = n
    info = model.info
    return _Described(
        path=info.path,
        size=info.file_size,
        created=info.created,
        metadata=metadata,
        template=info.chat_template or "",
        parameter_size=f"{n / 1e9:.1f}B" if n >= 10**9 else f"{n / 1e6:.1f}M",
        context_length=info.n_ctx,
        digest=hashlib.sha256(info.fingerprint.encode()).hexdigest(),
    )


def _described(ctx: ServeContext, name: str) -> _Described:
    """The model `name` (a served name): the loaded one, else a model of the directory (or the one
    served, released)."""
    loaded = ctx.engine.model
    if loaded is not None and (ctx.switch is None or ctx.switch.loaded == name):
        return _of_loaded(loaded)
    if ctx.switch is None:
        info = ctx.model_info()
        entry, context_length = DirectoryModel.read(info.path), info.n_ctx
    else:
        entry, context_length = ctx.switch.resolve(name), ctx.switch.ctx_size
    meta = entry.metadata
    identity = f"{entry.path}:{entry.size}:{entry.created}"
    return _Described(
        path=entry.path,
        size=entry.size,
        created=entry.created,
        metadata=meta,
        template=str(meta.get("tokenizer.chat_template", "")),
        parameter_size=str(meta.get("general.size_label", "unknown")),
        context_length=context_length,
        digest=hashlib.sha256(identity.encode()).hexdigest(),
    )


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _listed(name: str) -> str:
    return name if ":" in name else name + LATEST


def _quantization(d: _Described) -> str:
    import gguf

    try:
        file_type = gguf.LlamaFileType(int(d.metadata.get("general.file_type", "")))
    except ValueError:
        return "unknown"
    return file_type.name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _details(d: _Described) -> Details:
    arch = d.architecture
    return Details(
        family=arch, families=[arch], parameter_size=d.parameter_size, quantization_level=_quantization(d)
    )


def _tag(d: _Described, name: str) -> TagModel:
    return TagModel(
        name=_listed(name),
        model=_listed(name),
        modified_at=_iso(d.created),
        size=d.size,
        digest=d.digest,
        details=_details(d),
    )


async def tags(ctx: Ctx) -> Response:
    """GET /api/tags: every model served, under each of its names."""
    return JSONResponse(Tags(models=[_tag(_described(ctx, n), n) for n in ctx.served_names()]).to_json())


async def running(ctx: Ctx) -> Response:
    """GET /api/ps: the loaded model (none while it is released or loading), and when its
    keep_alive runs out (far in the future: never)."""
    model = ctx.engine.model
    if model is None:
        return JSONResponse(Running(models=[]).to_json())
    left = ctx.residency.expires_in()
    expires = _NEVER if left is None else _iso(time.time() + left)
    tag = _tag(_of_loaded(model), ctx.switch.loaded if ctx.switch is not None else model.info.id)
    loaded = RunningModel(
        **tag.model_dump(), expires_at=expires, size_vram=0, context_length=model.info.n_ctx
    )
    return JSONResponse(Running(models=[loaded]).to_json())


async def show(body: Annotated[ModelRequest, Body()], ctx: Ctx) -> Response:
    """POST /api/show: a model's details, GGUF metadata, template and capabilities."""
    ctx.warn_unknown(body.model_extra)
    name = served_name(ctx, body.model_name or "")
    d = _described(ctx, name)
    arch = d.architecture
    info = {k: v for k, v in d.metadata.items() if k.startswith(("general.", f"{arch}."))}
    capabilities = ["completion"]
    if "tools" in d.template:
        capabilities.append("tools")
    if "<think>" in d.template or "<|channel|>" in d.template:
        capabilities.append("thinking")
    o = OLLAMA_DEFAULTS
    parameters = (
        f"temperature {o.temperature}\ntop_k {o.top_k}\ntop_p {o.top_p}\n"
        f"repeat_penalty {o.repeat_penalty}\nnum_ctx {d.context_length}"
    )
    answer = Show(
        modelfile=f"# {_listed(name)}, served by moeflash\nFROM {d.path}\n",
        parameters=parameters,
        template=d.template,
        details=_details(d),
        model_info=info,
        capabilities=capabilities,
        modified_at=_iso(d.created),
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
    for prefix in ("https://huggingface.co/", "https://hf.co/", "huggingface.co/", "hf.co/"):
        name = name.removeprefix(prefix)
    return name.removesuffix(LATEST)


def _files_in_use(ctx: ServeContext) -> set[Path]:
    """The (first) file of the model served (one model), or of the one loaded (--models-dir: the
    others may be deleted; the directory's rescan drops them)."""
    if ctx.switch is None:
        return {ctx.model_info().path.resolve()}
    return {m.path.resolve() for m in ctx.switch.models if m.name == ctx.switch.loaded}


async def pull(body: Annotated[ModelRequest, Body()], ctx: Ctx) -> Response:
    """POST /api/pull: a model from the Hugging Face Hub (as `moeflash pull` does), into
    MOEFLASH_MODELS_DIR or the Hugging Face cache. Streamed, as Ollama streams it: "pulling
    manifest", then each file's bytes as they come ({"status": "pulling sha256:...", "digest",
    "total", "completed"}, at most every _PROGRESS_S), "verifying sha256 digest", "success"."""
    check_pull_allowed(ctx, "/api/pull")
    from server.hub import HubFile, default_storage, hub_api
    from server.hub import pull as hub_pull
    from server.settings import StoreSettings

    ref = _hub_ref(body.model_name or "")
    storage = default_storage(StoreSettings.model_validate({}).models_dir)
    heard: queue.SimpleQueue[Status] = queue.SimpleQueue()

    def report(file: HubFile, done: int) -> None:  # on the pull's thread
        digest = f"sha256:{file.sha256}"
        heard.put(Status(status=f"pulling {digest}", digest=digest, total=file.size, completed=done))

    def run() -> None:
        hub_pull(ref, storage, hub_api(), progress=False, report=report if body.stream else None)

    if not body.stream:
        await run_in_threadpool(run)
        return JSONResponse(Status(status="success").to_json())

    async def lines() -> AsyncIterator[bytes]:
        yield ndjson_line(Status(status="pulling manifest").to_json())
        task = asyncio.ensure_future(run_in_threadpool(run))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_PROGRESS_S)
                latest: dict[str | None, Status] = {}
                while not heard.empty():
                    status = heard.get()
                    latest[status.digest] = status  # the newest count of each file
                for status in latest.values():
                    yield ndjson_line(status.to_json())
            task.result()
            yield ndjson_line(Status(status="verifying sha256 digest").to_json())
            yield ndjson_line(Status(status="success").to_json())
        except Exception as exc:  # noqa: BLE001 - after the 200, a failed pull is a line
            _, error, _ = describe(exc, ctx.engine.queue_full_status, ollama=True)
            yield ndjson_line(error)

    return StreamingResponse(lines(), media_type=NDJSON)


async def delete(body: Annotated[ModelRequest, Body()], ctx: Ctx) -> Response:
    """DELETE /api/delete: a pulled model's files (never the model loaded, or the one served)."""
    check_pull_allowed(ctx, "/api/delete")
    from server.hub import default_storage
    from server.settings import StoreSettings

    name = (body.model_name or "").removesuffix(LATEST)
    storage = default_storage(StoreSettings.model_validate({}).models_dir)
    found = [m for m in storage.models() if m.name == name]
    if not found:
        raise NotFound(f"model '{body.model_name}' not found", param="model", code="model_not_found")
    served = _files_in_use(ctx)
    for model in found:
        if any(p.resolve() in served for p in model.files):
            raise InvalidRequest(
                f"model '{name}' is being served (it is the model loaded): ask for another one, or "
                "stop the server, to delete it",
                param="model",
            )
    for model in found:
        storage.remove(model)
    return Response(status_code=200)
