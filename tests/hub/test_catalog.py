"""Which files `REPO[:QUANT]` names in a repository's tree (server/hub/catalog.py)."""

from __future__ import annotations

import pytest

from server.errors import PullError
from server.hub import HubFile, choose, parse_ref

REPO = "someone/Model-GGUF"


def _files(*paths: str) -> list[HubFile]:
    return [HubFile(p, 10, "0" * 64) for p in paths]


UNSLOTH = _files(
    ".gitattributes",
    "README.md",
    "Model-Q4_K_M.gguf",
    "Model-Q4_K_S.gguf",
    "Model-IQ4_XS.gguf",
    "Model-Q8_0.gguf",
    "mmproj-F16.gguf",
    "BF16/Model-BF16-00001-of-00002.gguf",
    "BF16/Model-BF16-00002-of-00002.gguf",
)


@pytest.mark.parametrize(
    ("quant", "first"),
    [
        pytest.param("Q4_K_M", "Model-Q4_K_M.gguf", id="exact"),
        pytest.param("q4_k_m", "Model-Q4_K_M.gguf", id="any-case"),
        pytest.param("q8_0", "Model-Q8_0.gguf", id="q8_0"),
        pytest.param("iq4_xs", "Model-IQ4_XS.gguf", id="iq4_xs"),
        pytest.param("bf16", "BF16/Model-BF16-00001-of-00002.gguf", id="split-set"),
        pytest.param("Model-Q4_K_S.gguf", "Model-Q4_K_S.gguf", id="file-name"),
        pytest.param(None, "Model-Q4_K_M.gguf", id="default-q4_k_m"),
    ],
)
def test_a_quant_names_one_model(quant: str | None, first: str) -> None:
    assert choose(REPO, quant, UNSLOTH).files[0].path == first


def test_a_split_set_is_taken_whole_in_part_order() -> None:
    model = choose(REPO, "BF16", list(reversed(UNSLOTH)))
    assert [f.path for f in model.files] == [
        "BF16/Model-BF16-00001-of-00002.gguf",
        "BF16/Model-BF16-00002-of-00002.gguf",
    ]
    assert model.name == "Model-BF16"


def test_an_ambiguous_quant_lists_the_candidates() -> None:
    with pytest.raises(PullError, match="ambiguous") as caught:
        choose(REPO, "Q4_K", UNSLOTH)
    assert "Model-Q4_K_M.gguf" in str(caught.value) and "Model-Q4_K_S.gguf" in str(caught.value)
    assert "IQ4_XS" not in str(caught.value)


def test_a_word_never_matches_inside_another() -> None:
    # Q4_XS is no word of Model-IQ4_XS.gguf
    with pytest.raises(PullError, match="no model matching 'Q4_XS'"):
        choose(REPO, "Q4_XS", UNSLOTH)


@pytest.mark.parametrize(
    ("quant", "files", "message"),
    [
        pytest.param("Q2_K", UNSLOTH, "no model matching 'Q2_K'; it holds: ", id="no-such-quant"),
        pytest.param("README.md", UNSLOTH, "README.md is not a GGUF file", id="not-gguf"),
        pytest.param(None, _files("a.safetensors", "config.json"), "holds no GGUF model", id="no-gguf"),
        pytest.param(None, _files("a-Q8_0.gguf", "a-Q6_K.gguf"), "holds 2 models", id="no-default"),
        pytest.param(
            None, _files("x-00001-of-00003.gguf", "x-00003-of-00003.gguf"), "2 of 3 parts", id="broken-set"
        ),
    ],
)
def test_refusals_say_why(quant: str | None, files: list[HubFile], message: str) -> None:
    with pytest.raises(PullError, match=message.replace("(", r"\(").replace(")", r"\)")):
        choose(REPO, quant, files)


@pytest.mark.parametrize(
    ("ref", "parsed"),
    [
        pytest.param("a/b", ("a/b", None), id="repo"),
        pytest.param("a/b:Q4_K_M", ("a/b", "Q4_K_M"), id="repo-quant"),
    ],
)
def test_refs_parse(ref: str, parsed: tuple[str, str | None]) -> None:
    assert parse_ref(ref) == parsed


@pytest.mark.parametrize("ref", ["model", "a/b/c", "../x", "a/", "/b:Q4"])
def test_a_ref_that_is_no_repo_is_refused(ref: str) -> None:
    with pytest.raises(PullError, match="OWNER/NAME"):
        parse_ref(ref)
