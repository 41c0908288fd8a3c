"""Models in the local Hugging Face cache, found as mlx-lm's loader finds them (never downloaded)."""

from __future__ import annotations

import pathlib


def is_repo_id(name: str) -> bool:
    """Whether `name` looks like a Hugging Face repo id (org/name)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_hf_cache(repo_id: str) -> pathlib.Path:
    """The snapshot folder of `repo_id` in the local Hugging Face cache (never downloads); ValueError
    naming the id and the cache folder if it is not there."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = pathlib.Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise ValueError(f"model={repo_id!r} is not in the local Hugging Face cache "
                         f"{constants.HF_HUB_CACHE} (set HF_HOME or HF_HUB_CACHE, or download it with "
                         f"`hf download {repo_id}`), nor a local folder with config.json") from exc
    if not (folder / "config.json").is_file():
        raise ValueError(f"model={repo_id!r}: its cached snapshot {folder} has no config.json")
    return folder
