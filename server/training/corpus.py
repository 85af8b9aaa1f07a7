"""The training corpus, built from Debian packages installed on this machine.

Sources (each redistributable, see docs/training.md for the licences):
- python3.11-doc: the reStructuredText sources of Python's documentation (PSF License),
  cleaned to prose: markup roles unwrapped, directives, code and literal blocks dropped.
- wordnet-base: WordNet 3.0 glosses (WordNet licence), turned into ChatML dialogue turns
  ("What does X mean?" -> the definition and its example), so chat turns get words.
- dict-devil: Ambrose Bierce's The Devil's Dictionary (public domain), as prose and dialogue.

A document goes to the held-out split when the first byte of sha256(its key) is below
HELDOUT_PER_256, so the split is stable whatever else changes. The output is two text files,
documents separated by the <|endoftext|> token's text, plus manifest.json with the sha256 of
every input package file set and of each output, and the packages' versions. Same packages ->
same bytes; MANIFEST (server/training/corpus-manifest.json) is the committed model's.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
WORDNET_DIR = Path("/usr/share/wordnet")
DEVIL_DICT = Path("/usr/share/dictd/devil.dict.dz")
DEVIL_INDEX = Path("/usr/share/dictd/devil.index")
DEBIAN_PACKAGES = ("python3.11-doc", "wordnet-base", "dict-devil")

DOC_SEPARATOR = "<|endoftext|>"
# the manifest of the corpus the committed model was trained on; tests/training checks a build
# against it
MANIFEST = Path(__file__).with_name("corpus-manifest.json")
HELDOUT_PER_256 = 5  # ~2% of documents
SEED = 20261205


@dataclasses.dataclass(frozen=True)
class Document:
    key: str  # stable identity, decides the split
    source: str
    text: str


def chat(user: str, assistant: str) -> str:
    """One ChatML exchange, exactly as the served chat template renders it."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>\n"


# --- Python documentation -------------------------------------------------------------------

_ROLE = re.compile(r":[\w:.+-]+:`([^`]*)`")
_TITLE_TARGET = re.compile(r"^~?!?(.*?)\s*<[^>]*>$")
_LITERAL = re.compile(r"``([^`]*)``")
_LINK = re.compile(r"`([^`<]*?)\s*(<[^>]*>)?`_{1,2}")
_EMPH = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")
_UNDERLINE = re.compile(r"^([=\-~^*#\"'`+.:_])\1{2,}\s*$")
_LETTERS = re.compile(r"[A-Za-z]")


def _unrole(m: re.Match[str]) -> str:
    inner = m.group(1)
    t = _TITLE_TARGET.match(inner)
    if t:
        inner = t.group(1)
    return inner.lstrip("~!")


def _inline(text: str) -> str:
    text = _ROLE.sub(_unrole, text)
    text = _LITERAL.sub(r"\1", text)
    text = _LINK.sub(r"\1", text)
    text = _EMPH.sub(r"\1", text)
    text = text.replace("\\", "")
    return re.sub(r"\s+", " ", text).strip()


def rst_to_prose(rst: str) -> list[str]:
    """The prose paragraphs of one reST file: no directives, code, tables or headings' underlines."""
    paragraphs: list[str] = []
    current: list[str] = []
    skip_indent: int | None = None  # skipping a block indented deeper than this

    def flush() -> None:
        if current:
            para = _inline(" ".join(current))
            current.clear()
            # keep sentences, not headings, index entries or fragments
            if len(para) >= 60 and len(_LETTERS.findall(para)) > 0.7 * len(para) and para[-1] in ".:?!)":
                paragraphs.append(para)

    for raw in rst.splitlines():
        line = raw.rstrip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line or indent > skip_indent:
                continue
            skip_indent = None
        stripped = line.strip()
        if not stripped:
            flush()
            continue
        if stripped.startswith(".."):
            # a directive, comment or target: its indented body is markup or code
            flush()
            skip_indent = indent
            continue
        if _UNDERLINE.match(stripped) or stripped.startswith(("+", "|", ">>>", "...")):
            flush()
            continue
        if stripped.startswith(("* ", "- ", "#. ")) or re.match(r"^\d+\. ", stripped):
            flush()  # a list item starts a paragraph of its own
        if stripped.endswith("::"):
            # a literal block follows; the sentence before it keeps one colon
            current.append(stripped[:-1] if not stripped.endswith(" ::") else stripped[:-3] + ".")
            flush()
            skip_indent = indent
            continue
        current.append(stripped.lstrip("*-# ").strip() if stripped[:2] in ("* ", "- ") else stripped)
    flush()
    return paragraphs


def python_docs(root: Path = PYTHON_DOC_SOURCES) -> Iterator[Document]:
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("whatsnew/changelog", "license")):
            continue  # changelog entries are issue numbers; the licence text is boilerplate
        paras = rst_to_prose(path.read_text(encoding="utf-8"))
        if paras:
            yield Document(f"pydoc:{rel}", "python3.11-doc", "\n\n".join(paras) + "\n")


# --- WordNet --------------------------------------------------------------------------------

_POS = {"noun": "a noun", "verb": "a verb", "adj": "an adjective", "adv": "an adverb"}
_QUESTIONS = (
    'What does "{w}" mean?',
    "What is the meaning of {w}?",
    "Define {w}.",
    "What does the word {w} mean?",
    "Can you tell me what {w} means?",
)


def _gloss(gloss: str) -> tuple[str, list[str]]:
    parts = [p.strip() for p in gloss.split(";")]
    examples = [p.strip('"') for p in parts if p.startswith('"') and p.endswith('"') and len(p) > 2]
    definition = "; ".join(p for p in parts if not p.startswith('"'))
    return definition, examples


def wordnet(root: Path = WORDNET_DIR) -> Iterator[Document]:
    rng = random.Random(SEED)
    for pos, pos_name in _POS.items():
        for line in (root / f"data.{pos}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # licence header
            head, gloss = line.split(" | ", 1)
            fields = head.split()
            n_words = int(fields[3], 16)
            words = [fields[4 + 2 * i].replace("_", " ") for i in range(n_words)]
            words = [re.sub(r"\(\w+\)$", "", w) for w in words]
            definition, examples = _gloss(gloss.strip())
            if not definition:
                continue
            word = words[0]
            answer = f"{word[0].upper()}{word[1:]} is {pos_name}. It means {definition}."
            if len(words) > 1:
                answer += " Other words for it: " + ", ".join(words[1:4]) + "."
            if examples:
                answer += f' For example: "{examples[0]}"'
            question = rng.choice(_QUESTIONS).format(w=word)
            yield Document(f"wordnet:{pos}:{fields[0]}", "wordnet-base", chat(question, answer))


# --- The Devil's Dictionary -----------------------------------------------------------------

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_HEADWORD = re.compile(r"^([A-Z][A-Z' -]*[A-Z]),\s+([a-z. ]+?)\s{1,2}(.*)$", re.DOTALL)


def _b64(s: str) -> int:
    n = 0
    for ch in s:
        n = n * 64 + _B64.index(ch)
    return n


def devils_dictionary(dict_dz: Path = DEVIL_DICT, index: Path = DEVIL_INDEX) -> Iterator[Document]:
    data = gzip.decompress(dict_dz.read_bytes())
    for line in index.read_text(encoding="utf-8").splitlines():
        word, off, size = line.split("\t")
        if word.startswith("00"):
            continue  # dictfmt's own metadata entries
        entry = data[_b64(off) : _b64(off) + _b64(size)].decode("utf-8", "replace").strip()
        m = _HEADWORD.match(entry)
        if not m:
            continue
        headword, definition = m.group(1).title(), m.group(3)
        paras = [re.sub(r"\s+", " ", p).strip() for p in definition.split("\n\n")]
        prose = [p for p in paras if p]
        if not prose:
            continue
        key = f"devil:{word}"
        yield Document(key, "dict-devil", f"{headword}: " + "\n\n".join(prose) + "\n")
        yield Document(key + ":chat", "dict-devil", chat(f"What is {headword.lower()}?", prose[0]))


# --- the build ------------------------------------------------------------------------------


def all_documents() -> Iterator[Document]:
    yield from python_docs()
    yield from wordnet()
    yield from devils_dictionary()


def is_heldout(doc: Document) -> bool:
    return hashlib.sha256(doc.key.encode("utf-8")).digest()[0] < HELDOUT_PER_256


def _sha256_tree(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(p.as_posix().encode("utf-8") + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def input_hashes() -> dict[str, str]:
    """sha256 over each package's input files (names and contents), to pin the corpus's inputs."""
    return {
        "python3.11-doc": _sha256_tree(list(PYTHON_DOC_SOURCES.rglob("*.rst.txt"))),
        "wordnet-base": _sha256_tree([WORDNET_DIR / f"data.{p}" for p in _POS]),
        "dict-devil": _sha256_tree([DEVIL_DICT, DEVIL_INDEX]),
    }


def package_versions() -> dict[str, str]:
    """The installed version of each Debian package the corpus reads."""
    out = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Version}\n", *DEBIAN_PACKAGES],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return dict(line.split(" ", 1) for line in out.splitlines())


def build(out_dir: Path) -> dict[str, object]:
    """Write train.txt, heldout.txt and manifest.json into out_dir; return the manifest."""
    missing = [str(p) for p in (PYTHON_DOC_SOURCES, WORDNET_DIR, DEVIL_DICT) if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"corpus inputs missing: {missing}; apt-get install {' '.join(DEBIAN_PACKAGES)}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    counts: dict[str, dict[str, int]] = {}
    for doc in all_documents():
        split = "heldout" if is_heldout(doc) else "train"
        splits[split].append(doc.text)
        c = counts.setdefault(doc.source, {"train_docs": 0, "heldout_docs": 0, "chars": 0})
        c[f"{split}_docs"] += 1
        c["chars"] += len(doc.text)
    outputs: dict[str, str] = {}
    for split, texts in splits.items():
        # the documents are shuffled with a fixed seed so no source sits at the end of the file
        random.Random(SEED).shuffle(texts)
        body = DOC_SEPARATOR.join(texts).encode("utf-8")
        (out_dir / f"{split}.txt").write_bytes(body)
        outputs[f"{split}.txt"] = hashlib.sha256(body).hexdigest()
    manifest: dict[str, object] = {
        "debian_packages": package_versions(),
        "inputs_sha256": input_hashes(),
        "sources": counts,
        "outputs_sha256": outputs,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str]) -> int:
    """corpus.py DIR: build the corpus into DIR and print its manifest."""
    if len(argv) != 1:
        print("usage: python -m server.training.corpus DIR", file=sys.stderr)
        return 2
    print(json.dumps(build(Path(argv[0])), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
