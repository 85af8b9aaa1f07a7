"""`pull`: a GGUF model (a split set whole) from the Hugging Face Hub into a Storage, verified.

It speaks to the Hub through huggingface_hub, which honours HF_ENDPOINT and HF_TOKEN: the model
repository's commit (/api/models/REPO), its tree at that commit (the paginated tree API, which
gives each LFS file's size and sha256), then per file the resolve URL's metadata (a HEAD the Hub
answers with a 302 to its CDN, X-Linked-Size, X-Linked-Etag and X-Repo-Commit) and the bytes
over plain HTTP with `http_get`, from where an earlier, interrupted pull stopped (a Range
request). huggingface_hub's own `hf_hub_download` is not used because it deletes a partial file
when a download fails, so nothing survives an interruption to be resumed, and it checks sizes
only; here the partial file stays until its sha256 is computed and compared with the Hub's. Xet
storage's chunked protocol is not used: Xet-backed files are fetched over the same plain path
(the Hub's resolve URL redirects to a bridge that serves them over HTTP with Range).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import http_get
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # its documented path
from tqdm import tqdm

from server.errors import PullError
from server.hub.catalog import HubFile, HubModel, choose, parse_ref
from server.hub.storage import LocalModel, Storage

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_HASH_CHUNK = 8 << 20  # bytes read per update of the sha256

T = TypeVar("T")


# what a pull reports as it goes, when asked (/api/pull's lines): the file and its bytes so far
Progress = Callable[[HubFile, int], None]


class _Quiet(tqdm):  # type: ignore[type-arg]
    """A progress bar that never shows (`pull --quiet`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "disable": True})


def _reporting(file: HubFile, report: Progress) -> type[tqdm]:  # type: ignore[type-arg]
    """A progress bar class that draws nothing and hands `report` the file's bytes so far."""

    class Reporting(_Quiet):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.done = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            report(file, self.done)
            return None

    return Reporting


def _asking(api: HfApi, repo: str, call: Callable[[], T]) -> T:
    """`call` to the Hub, its failures as PullErrors that say what to do."""
    where = api.endpoint
    try:
        return call()
    except GatedRepoError as exc:
        raise PullError(f"{repo} is gated on {where}: accept its terms there and set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise PullError(f"no model repository {repo} on {where} (a private one needs HF_TOKEN)") from exc
    except RevisionNotFoundError as exc:
        raise PullError(f"{repo} on {where} has no such revision: {exc}") from exc
    except RemoteEntryNotFoundError as exc:
        raise PullError(f"{repo} on {where}: a file of its tree is not there any more: {exc}") from exc
    except httpx2.HTTPError as exc:  # HfHubHTTPError and the transport's errors alike
        raise PullError(f"the Hub at {where} failed for {repo}: {exc}") from exc


def hub_api(endpoint: str | None = None, token: str | None = None) -> HfApi:
    """The client; None takes HF_ENDPOINT / HF_TOKEN (and the token `hf auth login` saved).
    HF_ENDPOINT is read now, not when huggingface_hub was imported (its constant): a server's
    /api/pull follows the environment it runs in."""
    where = endpoint or os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    return HfApi(endpoint=where, token=token)


def resolve(api: HfApi, ref: str) -> tuple[str, str, HubModel]:
    """(repo, commit, model) that `REPO[:QUANT]` names on the Hub now."""
    repo, quant = parse_ref(ref)
    info = _asking(api, repo, lambda: api.model_info(repo))
    commit = info.sha
    if commit is None:
        raise PullError(f"the Hub at {api.endpoint} gave no commit for {repo}")
    tree = _asking(api, repo, lambda: list(api.list_repo_tree(repo, revision=commit, recursive=True)))
    files = [
        HubFile(entry.path, entry.size, entry.lfs.sha256 if entry.lfs is not None else None)
        for entry in tree
        if isinstance(entry, RepoFile)
    ]
    return repo, commit, choose(repo, quant, files)


def sha256_of(path: Path, progress: bool) -> str:
    """The file's sha256 (hex), with a progress bar when `progress`."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with (
        path.open("rb") as fh,
        tqdm(total=size, unit="B", unit_scale=True, desc=f"verify {path.name}", disable=not progress) as bar,
    ):
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


@contextmanager
def _locked_append(path: Path) -> Iterator[BinaryIO]:
    # one pull per partial file: a second one would append the same bytes again
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise PullError(f"another pull is downloading into {path}; wait for it to finish") from exc
        yield fh


def _download(
    api: HfApi, repo: str, commit: str, file: HubFile, out: BinaryIO, progress: bool, report: Progress | None
) -> None:
    have = out.tell()
    if have > file.size:  # not this file's beginning: start again
        out.truncate(0)
        have = 0
    if have == file.size:
        return
    url = hf_hub_url(repo, file.path, revision=commit, endpoint=api.endpoint)
    meta = _asking(api, repo, lambda: get_hf_file_metadata(url, token=api.token))
    if meta.size is not None and meta.size != file.size:
        raise PullError(f"{repo}/{file.path}: the Hub's tree says {file.size} bytes, its file {meta.size}")
    headers = build_hf_headers(token=api.token)
    if urlsplit(meta.location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # the token goes to the Hub, never to its CDN
    if have:
        logger.info("resuming %s at byte %d of %d", file.path, have, file.size)
    _asking(
        api,
        repo,
        lambda: http_get(
            meta.location,
            out,
            resume_size=have,
            headers=headers,
            expected_size=file.size,
            displayed_filename=file.path.rsplit("/", 1)[-1],
            tqdm_class=_reporting(file, report) if report is not None else tqdm if progress else _Quiet,
        ),
    )


def fetch(
    api: HfApi,
    storage: Storage,
    repo: str,
    commit: str,
    file: HubFile,
    progress: bool,
    report: Progress | None = None,
) -> Path:
    """One file of a model, downloaded (or resumed), verified and put in place; its path. `report`,
    if given, hears of its bytes as they come (and no bar is drawn)."""
    if file.sha256 is None:
        raise PullError(f"{repo}/{file.path}: the Hub reports no sha256 for it (not an LFS file)")
    final = storage.destination(repo, commit, file)
    if final.exists():
        if sha256_of(final, progress) == file.sha256:
            return final
        raise PullError(f"{final} exists and is not {repo}/{file.path} (another sha256): remove it first")
    partial = storage.partial(repo, commit, file)
    with _locked_append(partial) as out:
        _download(api, repo, commit, file, out, progress, report)
        out.flush()
        digest = sha256_of(partial, progress)
        if digest != file.sha256:
            partial.unlink()
            raise PullError(
                f"{repo}/{file.path}: the download's sha256 {digest} is not the Hub's {file.sha256}; "
                "it was deleted: pull again"
            )
        with partial.open("rb") as fh:
            magic = fh.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            partial.unlink()
            raise PullError(f"{repo}/{file.path} is not a GGUF file (it starts {magic!r}); it was deleted")
        return storage.place(repo, commit, file)


def pull(
    ref: str, storage: Storage, api: HfApi, *, progress: bool = True, report: Progress | None = None
) -> LocalModel:
    """Pull `REPO[:QUANT]` into `storage`; the model as it is there now. `report` hears of each
    file's bytes as they come (then no bar is drawn)."""
    repo, commit, model = resolve(api, ref)
    logger.info("pulling %s from %s@%s: %s", model.name, repo, commit[:12], model.label)
    paths = tuple(fetch(api, storage, repo, commit, f, progress, report) for f in model.files)
    return LocalModel(model.name, paths, f"{repo}@{commit[:12]}")
