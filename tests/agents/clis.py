"""The coding-agent CLIs, each run once as README's "Pointing coding agents at the server" says:
with a home of its own under `home`, in the project directory `work`, pointed at `base_url`, and
nothing that phones home (no telemetry, update checks, login or registry look-ups).

The agent tests (test_agents.py), the recording of their request sequences (record.py) and the
Codex loop (codex_loop.py) run them through these functions, so all three run the same command.
The agents' prompts run to 20-40k tokens of the demo vocabulary: Claude Code's and qwen-code's
system prompts are shortened with their own --system-prompt flags, never their tool lists.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.agents.harness import NODE_BIN, SERVED_ID, AgentRun, installed, offline_env, run_agent

PROMPT = "Say hello in one short sentence."
SHORT_SYSTEM_PROMPT = "You are a coding agent. Answer briefly."
AGENT_TIMEOUT_S = 600.0
# qwen-code's exit status when a session used up its --max-session-turns (FatalTurnLimitedError)
QWEN_TURN_LIMIT = 53


def project(directory: Path) -> Path:
    """`directory`, made, as the agent's working directory: a small project of its own."""
    directory.mkdir(parents=True)
    (directory / "hello.py").write_text('print("hello")\n')
    return directory


def codex(base_url: str, work: Path, home: Path, prompt: str = PROMPT) -> AgentRun:
    """`codex exec` with a custom model provider on the Responses API and its default tools."""
    binary = installed(NODE_BIN / "codex")
    codex_home = home / "codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    # nothing that phones home: no update check, no analytics (a custom provider needs no login)
    (codex_home / "config.toml").write_text(
        "check_for_update_on_startup = false\n\n[analytics]\nenabled = false\n"
    )
    env = offline_env(home, CODEX_HOME=str(codex_home))
    provider = f'{{ name = "moeflash", base_url = "{base_url}/v1", wire_api = "responses" }}'
    argv = [
        str(binary),
        "exec",
        "-c",
        f"model_providers.moeflash={provider}",
        "-c",
        "model_provider=moeflash",
        "-m",
        SERVED_ID,
        "--skip-git-repo-check",
        "--color",
        "never",
        prompt,
    ]
    return run_agent(argv, env, work, AGENT_TIMEOUT_S)


def claude_code(base_url: str, work: Path, home: Path, prompt: str = PROMPT) -> AgentRun:
    """`claude -p` with ANTHROPIC_BASE_URL at the server and its default tools (the server needs
    `--alias '*'` for the side requests it sends to a haiku model)."""
    binary = installed(NODE_BIN / "claude")
    env = offline_env(
        home,
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="unused",
        CLAUDE_CONFIG_DIR=str(home / "claude"),
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    argv = [
        str(binary),
        "-p",
        prompt,
        "--model",
        SERVED_ID,
        # the default system prompt adds ~10k tokens; the tools stay the default set
        "--system-prompt",
        SHORT_SYSTEM_PROMPT,
        "--output-format",
        "json",
        "--no-session-persistence",
    ]
    return run_agent(argv, env, work, AGENT_TIMEOUT_S)


def opencode(base_url: str, work: Path, home: Path, prompt: str = PROMPT) -> AgentRun:
    """`opencode run` with a custom OpenAI-compatible provider in OPENCODE_CONFIG_CONTENT."""
    binary = installed(NODE_BIN / "opencode")
    config = {
        "provider": {
            "moeflash": {
                "npm": "@ai-sdk/openai-compatible",
                "options": {"baseURL": f"{base_url}/v1"},
                "models": {SERVED_ID: {}},
            }
        },
        "model": f"moeflash/{SERVED_ID}",
    }
    env = offline_env(
        home,
        OPENCODE_CONFIG_CONTENT=json.dumps(config),
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_CLAUDE_CODE="1",
        # opencode installs its plugin SDK into its config directory in the background; offline
        # that install fails at once (a logged warning) instead of reaching the registry
        npm_config_offline="true",
    )
    return run_agent([str(binary), "run", "--format", "json", prompt], env, work, AGENT_TIMEOUT_S)


def qwen_code(base_url: str, work: Path, home: Path, prompt: str = PROMPT) -> AgentRun:
    """`qwen` (headless) with OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL, at most 4 turns."""
    binary = installed(NODE_BIN / "qwen")
    settings = {
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        # background memory agents: each is one more long prompt to prefill, not the agent's turn
        "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False},
    }
    env = offline_env(home, OPENAI_BASE_URL=f"{base_url}/v1", OPENAI_API_KEY="unused", OPENAI_MODEL=SERVED_ID)
    qwen_dir = Path(env["HOME"]) / ".qwen"
    qwen_dir.mkdir(parents=True, exist_ok=True)
    (qwen_dir / "settings.json").write_text(json.dumps(settings))
    argv = [
        str(binary),
        prompt,
        "--auth-type",
        "openai",
        # the default system prompt adds ~12k tokens; the tools stay the default set
        "--system-prompt",
        SHORT_SYSTEM_PROMPT,
        "--output-format",
        "json",
        "--max-session-turns",
        "4",
    ]
    return run_agent(argv, env, work, AGENT_TIMEOUT_S)
