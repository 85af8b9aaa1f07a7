"""GET /v1/models and /v1/models/{id}: the models served, each with its context length, mode and
expert budget (the budget now: it follows memory pressure from the one chosen at load)."""

from __future__ import annotations

from server.http.protocol import ModelCard, ModelList
from server.http.serving import Ctx, ServeContext, check_model
from server.lifecycle.switching import DirectoryModel, ModelSwitch


def _card(ctx: ServeContext, name: str) -> ModelCard:
    info = ctx.model_info()
    totals = ctx.engine.totals()
    budget = totals.streamer.budget_bytes if totals is not None and totals.streamer is not None else None
    return ModelCard(
        id=name,
        created=info.created,
        context_length=info.n_ctx,
        architecture=info.architecture,
        file_size=info.file_size,
        mode=info.mode,
        budget_bytes=budget if budget is not None else info.budget_bytes,
    )


def _file_card(switch: ModelSwitch, model: DirectoryModel) -> ModelCard:
    # a model of the directory that is not loaded: what its header says, and how it would load
    return ModelCard(
        id=model.name,
        created=model.created,
        context_length=switch.ctx_size,
        architecture=model.architecture,
        file_size=model.size,
        mode=switch.mode,
    )


def _cards(ctx: ServeContext) -> list[ModelCard]:
    switch = ctx.switch
    if switch is None:
        return [_card(ctx, name) for name in ctx.model_info().names]
    loaded = switch.loaded if ctx.engine.model is not None else None
    return [_card(ctx, m.name) if m.name == loaded else _file_card(switch, m) for m in switch.listed()]


async def list_models(ctx: Ctx) -> ModelList:
    """The loaded model, once under each of its names (--alias but '*', then the file stem); with
    --models-dir, every model of the directory."""
    return ModelList(data=_cards(ctx))


async def get_model(model_id: str, ctx: Ctx) -> ModelCard:
    """A served model, if `model_id` is one of its names (any id with --alias '*')."""
    if ctx.switch is not None:
        return next(card for card in _cards(ctx) if card.id == ctx.switch.resolve(model_id).name)
    check_model(ctx.model_info(), model_id)
    return _card(ctx, model_id)
