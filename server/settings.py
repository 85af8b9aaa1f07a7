"""The settings groups: one source of truth for names, defaults and bounds.

Each field is read, highest priority first, from a command-line flag (pydantic-settings' CLI
source, server/cli/arguments.py), an environment variable (`MOEFLASH_<FIELD>`), its group's table
of a TOML file (`[server]`, `[model]`, ..., see configs/default.toml) and finally the default below.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from server.errors import ConfigError
from server.units import parse_duration, parse_size

if TYPE_CHECKING:
    from streaming_ext import StreamerConfig

ENV_PREFIX = "MOEFLASH_"

# the alias that accepts every model id as the served model (see ModelSettings.alias)
ANY_MODEL = "*"

# the most requests --parallel decodes together (llama.cpp's sequences, a KV stream each)
MAX_PARALLEL = 64
# what --parallel auto chooses at most
AUTO_PARALLEL = 4

# The expert cache's budget: bytes, "all" (every expert: nothing is ever evicted) or "auto" (the
# memory limit minus everything else the process holds, server/loading/budget.py)
Budget = int | Literal["auto", "all"]


def parse_budget(text: str | int) -> Budget:
    """A budget from `6G` / `512M` / a byte count, `all` or `auto`."""
    if isinstance(text, int):
        return parse_size(text)
    word = text.strip().lower()
    if word == "auto":
        return "auto"
    if word == "all":
        return "all"
    return parse_size(text)


def is_loopback_host(host: str) -> bool:
    """Whether a listening address is the loopback only ("localhost" or a loopback IP)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_state_dir() -> Path:
    """$XDG_STATE_HOME/moeflash, else ~/.local/state/moeflash (the XDG base directory rule)."""
    base = os.environ.get("XDG_STATE_HOME")
    return (Path(base) if base else Path.home() / ".local" / "state") / "moeflash"


class Settings(BaseSettings):
    """A group of settings, each field read, highest priority first, from what a command line gave
    (server/cli/arguments.py), the environment (`MOEFLASH_<FIELD>`), the group's table of a TOML
    file (`--config`, the table named by `TABLE`) and the field's default."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")
    TABLE: ClassVar[str]  # the TOML table this group reads

    @classmethod
    def read(
        cls, given: PydanticBaseSettingsSource | Mapping[str, Any] | None = None, config: Path | None = None
    ) -> Self:
        """The settings from `given` (a command line's source, or values by field name, None meaning
        not given) over the environment over `config`'s table over the defaults."""
        if not isinstance(given, PydanticBaseSettingsSource):
            values = {k: v for k, v in (given or {}).items() if v is not None and k in cls.model_fields}
            given = InitSettingsSource(cls, values)
        sources: list[PydanticBaseSettingsSource] = [given, EnvSettingsSource(cls)]
        if config is not None and _table(cls, config):
            sources.append(TomlConfigSettingsSource(cls, toml_file=config, toml_table_header=(cls.TABLE,)))
        try:  # _build_sources: BaseSettings' own argument, unknown to pydantic's mypy plugin
            return cls(_build_sources=(tuple(sources), {}))  # type: ignore[call-arg]
        except ValidationError as exc:
            raise _invalid(exc) from exc


class ServerSettings(Settings):
    """HTTP-side settings: binding, security, limits, queueing."""

    TABLE: ClassVar[str] = "server"

    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 serves the LAN")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one)")
    api_key: SecretStr | None = Field(
        None, description="require 'Authorization: Bearer KEY' on every route but /health"
    )
    api_key_file: Path | None = Field(None, description="read the API key from this file")
    insecure_no_key: bool = Field(
        False,
        description="serve beyond loopback without an API key: anyone on the network can use the model",
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="allow browser requests from this origin (repeatable); CORS is off by default",
        json_schema_extra={"flag": "--cors-origin"},
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="extra Host header names accepted while bound to loopback (repeatable)",
        json_schema_extra={"flag": "--allowed-host"},
    )
    max_body_bytes: int = Field(
        4 << 20, ge=1024, le=1 << 30, description="request body cap in bytes (413 above it)"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="prompt-length cap in tokens (default: the context size)"
    )
    max_completion_tokens: int = Field(
        8192, ge=1, le=1 << 20, description="cap on max_tokens / max_completion_tokens"
    )
    max_json_schema_bytes: int = Field(
        65536, ge=256, le=16 << 20, description="cap on a response_format / tool JSON schema"
    )
    max_grammar_compile_ms: int = Field(
        2000, ge=1, le=600_000, description="a grammar taking longer than this to compile is refused"
    )
    max_queue: int = Field(
        128,
        ge=0,
        le=10_000,
        description="requests waiting for a slot (a waiting request holds only its body)",
    )
    queue_full_status: Literal[429, 503] = Field(
        429, description="status when the queue is full (429 or 503)"
    )
    retry_after_s: int = Field(1, ge=0, le=3600, description="Retry-After seconds on 429/503")
    keepalive_s: float = Field(10.0, gt=0, le=600, description="SSE ': ping' keep-alive interval in seconds")
    warm_start: bool = Field(
        True,
        description="streaming: keep the expert cache's hot set in the state directory (saved on shutdown "
        "and every hot_set_save_s) and read it back between requests after a restart",
    )
    state_dir: Path = Field(
        default_factory=_default_state_dir,
        description="where the server keeps what outlives a run: the hot sets of warm start, prompt states "
        "(default: $XDG_STATE_HOME/moeflash, else ~/.local/state/moeflash)",
    )
    hot_set_save_s: float = Field(
        60.0, ge=1, le=86400, description="seconds between saves of the hot set while the cache changes"
    )
    prompt_cache_ram: int | Literal["auto"] = Field(
        "auto",
        description="RAM for the prompt cache, the KV states of recent prompt prefixes restored instead of "
        "prefilled again: a size (512M), auto (one full context's state) or 0 (no prompt cache); taken out "
        "of the expert budget and held from the start",
    )
    prompt_cache_flash: int = Field(
        8 << 30,
        description="flash for prompt states evicted from RAM or kept at shutdown, under the state directory "
        "(a size; 0: none, the prompt cache does not outlive the process)",
    )
    keep_alive: float = Field(
        -1.0,
        description="how long a model stays loaded once idle before its memory is given back (the next "
        "request loads it again): seconds or a duration (30s, 5m, 1h); negative: as long as the server "
        "runs. An Ollama request's keep_alive overrides it",
    )
    allow_pull: bool = Field(
        False,
        description="let the Ollama API's /api/pull and /api/delete download and delete models (into "
        "MOEFLASH_MODELS_DIR, else the Hugging Face cache); beyond loopback only with an API key",
    )

    @field_validator("cors_origins", "allowed_hosts", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        # env vars and TOML strings arrive as "a,b"; lists pass through
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("prompt_cache_ram", mode="before")
    @classmethod
    def _parse_ram(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return parse_size(value) if isinstance(value, str | int) and not isinstance(value, bool) else value

    @field_validator("prompt_cache_flash", mode="before")
    @classmethod
    def _parse_flash(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str | int) and not isinstance(value, bool) else value

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _parse_keep_alive(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str | int | float) else value

    @field_validator("state_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        # TOML and env values may say ~/...
        return value.expanduser()

    @field_validator("queue_full_status", mode="before")
    @classmethod
    def _status_from_text(cls, value: Any) -> Any:
        # flags and env vars are text; the Literal wants the int
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    def resolved_api_key(self) -> str | None:
        """The API key from --api-key or --api-key-file (the file wins; whitespace stripped)."""
        if self.api_key_file is not None:
            try:
                key = self.api_key_file.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"cannot read the API key file {self.api_key_file}: {exc}") from exc
            if not key:
                raise ConfigError(f"the API key file {self.api_key_file} is empty")
            return key
        if self.api_key is not None and self.api_key.get_secret_value():
            return self.api_key.get_secret_value()
        return None

    def is_loopback(self) -> bool:
        """True when bound to a loopback address only (then the Host allow-list applies)."""
        return is_loopback_host(self.host)


class ModelSettings(Settings):
    """Model-side settings: which file, how it is loaded, context size, threads."""

    TABLE: ClassVar[str] = "model"

    model: Path | None = Field(
        None, description="path of the GGUF model (first file of a split)", json_schema_extra={"short": "-m"}
    )
    alias: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="a name clients may ask for the model by (repeatable; the first is its id in the API, "
        "default: the file stem); '*' answers requests naming any other model too (clients that send "
        "side requests to another model, as Claude Code does to a haiku model), echoing the id asked for; "
        "off by default: an unknown id is a 404",
    )
    ctx_size: int = Field(
        4096, ge=64, le=1 << 20, description="context window in tokens", json_schema_extra={"short": "-c"}
    )
    n_batch: int = Field(
        512,
        ge=1,
        le=1 << 16,
        description="tokens per decode step: every running request's next token plus prompt chunks",
    )
    parallel: int | Literal["auto"] = Field(
        "auto",
        description="requests decoded together, each with its full --ctx-size (more wait in the queue): a "
        "number, or auto (as many as the memory holds, at most 4: the extra contexts may take a quarter of "
        "what is left for the expert cache or the weights)",
    )
    threads: int | None = Field(
        None, ge=1, le=1024, description="CPU threads (default: all)", json_schema_extra={"short": "-t"}
    )
    flash_attn: Literal["on", "off"] = Field(
        "off",
        description="flash attention: off, or on (a long context's attention buffers shrink about 6x, but "
        "a prompt's text then depends on how it is batched: prompt cache, other requests); never chosen "
        "by the mode or the memory, so a request gives one text resident or streamed",
    )
    repack: Literal["on", "off"] = Field(
        "on",
        description="llama.cpp's repacked (interleaved) weight layouts where the CPU has them: on "
        "(about 1.5x the prompt speed and up to 1.2x the decode speed with Q4_0 or MXFP4 experts: "
        "docs/performance.md) or off; the same resident and streamed",
    )
    mode: Literal["auto", "resident", "streaming"] = Field(
        "auto",
        description="resident: weights mapped from the file; streaming: experts from flash into a "
        "bounded cache; auto: streaming when the file exceeds 0.6 x the memory this process may use",
    )
    budget: Budget = Field(
        "auto",
        description="RAM for streamed experts: a size (6G, 512M), all (every expert, read once) or auto "
        "(the memory limit minus everything else the process holds)",
    )
    preload: bool = Field(
        False,
        description="read every expert at load (needs --budget all): then it runs like a resident model",
    )
    follow_memory: bool = Field(
        True,
        description="streaming: shrink the expert budget when free memory runs short (cgroup, MemAvailable, "
        "PSI) and grow it back, up to the budget chosen at load, when it returns",
    )
    # --- the expert streamer's options (streaming mode) ---------------------------------
    lanes: int = Field(4, ge=1, le=16, description="parallel read lanes of the expert streamer")
    reader: Literal["direct", "buffered"] = Field(
        "direct", description="expert reads with O_DIRECT (falls back to buffered) or buffered"
    )
    overlap: bool = Field(
        True,
        description="let the matmuls of experts already read run while the rest are read; off: wait for "
        "each layer's reads before its matmuls",
    )
    prefetch: Literal["router", "history", "off"] = Field(
        "router",
        description="read the next layer's predicted experts while this layer computes, predicted by its "
        "router on this layer's input, or by which experts followed this layer's in past tokens (history)",
    )
    cache_policy: Literal["layer", "lru", "none"] = Field("layer", description="expert cache eviction policy")
    chat_template_file: Path | None = Field(
        None, description="Jinja chat template overriding the one in the GGUF metadata"
    )
    # --- other devices (server/rpc) ----------------------------------------------------
    rpc: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="an RPC helper (`moeflash worker` on another device, or an SSH tunnel to one) as "
        "HOST:PORT (repeatable, or comma-separated): the model's last layers run there, whole",
    )
    rpc_optional: bool = Field(
        False,
        description="a --rpc helper that does not answer at a load is left out (its layers run here) "
        "rather than failing the load",
    )
    rpc_layers: Annotated[list[int] | Literal["auto"], NoDecode] = Field(
        "auto",
        description="layers each --rpc helper holds (comma-separated, one per helper), or auto: as many as "
        "each helper's --memory holds, the last layers first",
    )

    @field_validator("rpc", mode="before")
    @classmethod
    def _split_helpers(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        if isinstance(value, list):  # a repeated flag, each maybe a comma list
            return [item.strip() for entry in value for item in str(entry).split(",") if item.strip()]
        return value

    @field_validator("rpc_layers", mode="before")
    @classmethod
    def _split_layers(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            return [item.strip() for item in value.split(",")]
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        return value

    @field_validator("rpc_layers")
    @classmethod
    def _check_layers(cls, value: list[int] | str) -> list[int] | str:
        if isinstance(value, list) and any(n < 0 for n in value):
            raise ValueError("layers cannot be negative")
        return value

    @field_validator("alias", mode="before")
    @classmethod
    def _split_aliases(cls, value: Any) -> Any:
        # env vars and TOML strings arrive as "a,b"; lists pass through
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("alias")
    @classmethod
    def _check_aliases(cls, value: list[str]) -> list[str]:
        for name in value:
            if not 0 < len(name) <= 256:
                raise ValueError(f"an alias must be 1 to 256 characters, got {name!r}")
        return value

    @property
    def any_model(self) -> bool:
        """Whether '*' is among the aliases: requests naming any model id are served."""
        return ANY_MODEL in self.alias

    @property
    def model_aliases(self) -> list[str]:
        """The aliases that name the model ('*' is a rule, never a name /v1/models lists)."""
        return [name for name in self.alias if name != ANY_MODEL]

    @field_validator("flash_attn", mode="before")
    @classmethod
    def _no_automatic_flash_attn(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            raise ValueError(
                "flash_attn is on or off: 'auto' (on when memory ran short) is gone, since it made the "
                "text depend on the memory; the default is off (docs/memory.md)"
            )
        return value

    @field_validator("parallel", mode="before")
    @classmethod
    def _parse_parallel(cls, value: Any) -> Any:
        if isinstance(value, str):
            word = value.strip().lower()
            if word == "auto":
                return "auto"
            if not word.lstrip("-").isdigit():
                raise ValueError(f"parallel must be auto or 1 to {MAX_PARALLEL}, got {value!r}")
            return int(word)
        return value

    @field_validator("parallel")
    @classmethod
    def _check_parallel(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= MAX_PARALLEL:
            raise ValueError(f"parallel must be auto or 1 to {MAX_PARALLEL}, got {value}")
        return value

    @field_validator("prefetch", mode="before")
    @classmethod
    def _prefetch_on_off(cls, value: Any) -> Any:
        # configs and env vars written when prefetch was on/off: true is the router, false off
        if isinstance(value, bool):
            return "router" if value else "off"
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return "router" if value.lower() == "true" else "off"
        return value

    @field_validator("budget", mode="before")
    @classmethod
    def _parse_budget(cls, value: Any) -> Any:
        # flags, env vars and TOML give text ("6G", "all"); a byte count passes through
        return parse_budget(value) if isinstance(value, str | int) and not isinstance(value, bool) else value

    def streamer_config(self) -> StreamerConfig:
        """The expert streamer's levers, as the streamer takes them (built once, here)."""
        from streaming_ext import Policy, Prefetch, Reader, StreamerConfig

        return StreamerConfig(
            lanes=self.lanes,
            reader=Reader[self.reader.upper()],
            overlap=self.overlap,
            policy=Policy[self.cache_policy.upper()],
            prefetch=Prefetch[self.prefetch.upper()],
        )


class RouteTraceSettings(Settings):
    """Routing replayed from or recorded to a route trace (server/loading/route_trace.py): flags of
    `generate` and `bench`, never of `serve`, since replayed routing is not the model's output."""

    TABLE: ClassVar[str] = "route_trace"

    route_trace: Path | None = Field(
        None,
        description="route every token as this *.route.csv trace did (lossy, for benchmarks: the trace's "
        "layers, experts and k must be the model's)",
    )
    record_route_trace: Path | None = Field(
        None, description="write the routing the run used to this file, in the *.route.csv format"
    )
    prefetch_from_trace: bool = Field(
        False,
        description="with --route-trace, streaming: prefetch reads the next layer's experts as the trace "
        "routes them, not as the model's router predicts (the prefetch's upper bound, for benchmarks)",
    )
    prefetch_trace_error: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="with --prefetch-from-trace: the share of each token's predicted experts replaced by "
        "others at random (seeded), emulating a predictor right on the rest (for benchmarks: a wrong guess "
        "costs a read, never a different output)",
    )


class StoreSettings(Settings):
    """The directory of models: where `pull` puts them, `list` and `rm` find them (server/hub)
    and `serve` serves them from, switching between them on request."""

    TABLE: ClassVar[str] = "store"

    models_dir: Path | None = Field(
        None,
        description="a directory of GGUF models: serve serves every one (by file stem, one loaded at a "
        "time, a request for another switching to it); pull, list and rm use it (default for them: the "
        "Hugging Face cache, HF_HUB_CACHE)",
    )

    @field_validator("models_dir")
    @classmethod
    def _expand_home(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None


class WorkerSettings(Settings):
    """`moeflash worker`: an RPC helper lending this device's memory and cores to a main server
    (server/rpc/worker.py). Its own environment prefix, MOEFLASH_WORKER_, keeps a serve's port or
    host from reaching it."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "WORKER_")
    TABLE: ClassVar[str] = "worker"

    host: str = Field(
        "127.0.0.1",
        description="address to listen on; another than the loopback needs --insecure-lan (the RPC "
        "protocol has no authentication: reach a helper across a LAN through an SSH tunnel)",
    )
    port: int = Field(50052, ge=1, le=65535, description="TCP port to listen on")
    threads: int | None = Field(None, ge=1, le=1024, description="CPU threads (default: all)")
    memory: int | None = Field(
        None,
        description="bytes the main server may place here (512M, 6G): the memory reported to it and "
        "enforced (default: what this process may use, less a margin)",
    )
    cache_max: int = Field(
        8 << 30,
        ge=0,
        description="bytes of the tensor cache under the state directory, least recently used evicted "
        "first (0: no cache): a restarted main server does not send those weights again",
    )
    insecure_lan: bool = Field(
        False, description="listen on another address than the loopback, with no authentication"
    )
    state_dir: Path = Field(
        default_factory=_default_state_dir,
        description="where the tensor cache lives, in rpc-cache/ (default: $XDG_STATE_HOME/moeflash, else "
        "~/.local/state/moeflash)",
    )

    @field_validator("memory", "cache_max", mode="before")
    @classmethod
    def _parse_size(cls, value: Any) -> Any:
        return parse_size(value) if isinstance(value, str) else value

    @field_validator("state_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()


GROUPS: tuple[type[Settings], ...] = (
    ServerSettings,
    ModelSettings,
    RouteTraceSettings,
    StoreSettings,
    WorkerSettings,
)


def _table(cls: type[Settings], config: Path) -> bool:
    """Whether `config` has `cls`'s table; a file that cannot be read, a table no group reads or
    a key its group does not have is refused (a misspelt setting is never silently dropped)."""
    try:
        with config.open("rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read the config file {config}: {exc}") from exc
    known = {group.TABLE: group for group in GROUPS}
    unknown = sorted(set(data) - set(known))
    if unknown:
        expected = ", ".join(f"[{table}]" for table in known)
        raise ConfigError(f"{config}: unknown tables {unknown} (expected {expected})")
    for name, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{config}: {name} must be a table ([{name}]), not a value")
        misspelt = sorted(set(values) - set(known[name].model_fields))
        if misspelt:
            raise ConfigError(f"{config}: [{name}] has no setting {', '.join(misspelt)}")
    return cls.TABLE in data


def load_settings(
    cli: dict[str, Any] | None = None, config: Path | None = None
) -> tuple[ServerSettings, ModelSettings]:
    """The server's and the model's settings from values by field name (None: not given), the
    environment and a TOML file."""
    return ServerSettings.read(cli, config), ModelSettings.read(cli, config)


def _invalid(exc: ValidationError) -> ConfigError:
    """A ConfigError naming each invalid setting and why."""
    problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
    return ConfigError(f"invalid settings: {problems}")
